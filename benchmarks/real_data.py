"""Benchmark cases from the real tau-bench airline trajectories (bundled, MIT licence).

Conversations are tokenized with the real Qwen2 BPE (built offline) by treelit's
``chat`` builder, one tree per task (its 4 trials), per-call export: every model call
is a branch trained on its own output, as agent frameworks export them.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from agentic import Case  # noqa: E402

QWEN_VOCAB = 151936


def tau_bench_case(task: int = 0, max_calls: int = 6, export: str = "per_call") -> Case:
    """Task ``task``'s 4 trials, keeping each trial's first ``max_calls`` model calls."""
    from treelit.builders.chat import ChatBuilder
    from treelit.cli.config import bundled_path
    from treelit.data.records import read_records
    from treelit.data.tokenizers import qwen_tokenizer_dir

    builder = ChatBuilder(qwen_tokenizer_dir(), export=export, group_key=None)
    recs = [r for r in read_records(bundled_path("tau_bench_airline/gpt-4o-airline.json.gz"), validate=None)
            if r.data["task_id"] == task]
    branches, masks = [], []
    for r in recs:
        for ids, mask in builder.branches_of(r.data["traj"], r.source)[:max_calls]:
            branches.append(ids)
            masks.append(mask)
    return Case(f"tau_bench_t{task}", branches, masks)
