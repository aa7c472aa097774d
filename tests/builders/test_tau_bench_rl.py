"""RL on the real tau-bench airline trajectories: advantages from the trials' rewards, per task,
each conversation counted once; and the ``tau_bench_grpo`` experiment trains through treelit-train."""

from __future__ import annotations

import numpy as np
import pytest

from treelit.builders.chat import ChatBuilder
from treelit.cli.config import bundled_path
from treelit.data.records import read_records

TAU = "tau_bench_airline/gpt-4o-airline.json.gz"


@pytest.fixture(scope="module")
def tok():
    from treelit.builders.chat import load_tokenizer
    from treelit.data.tokenizers import qwen_tokenizer_dir

    return load_tokenizer(qwen_tokenizer_dir())


@pytest.mark.parametrize("export", ["trajectory", "per_call"])
def test_grpo_advantages_on_tau_bench_follow_the_trials_rewards(tok, export):
    recs = [r for r in read_records(bundled_path(TAU), validate=None) if r.data["task_id"] in (0, 1, 2, 3, 4, 5)]
    trees = ChatBuilder(tokenizer=tok, export=export, group_key="task_id", advantage="grpo")(recs)
    by_source = {r.source: r.data for r in recs}
    assert len(trees) == 6
    informative = 0
    for t in trees:
        rewards = np.array([by_source[s]["reward"] for s in t.sources], dtype=np.float64)
        assert len(rewards) == 4  # four trials per task
        expect = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
        adv_of = dict(zip(t.sources, expect))
        got = t.tree.branch_adv
        records = t.tree.branch_fields["record"]  # the record id, here its source (no 'id' field)
        assert np.allclose(got, [adv_of[r] for r in records], rtol=0, atol=1e-12)
        n_calls = [sum(m["role"] == "assistant" for m in by_source[s]["traj"]) for s in t.sources]
        assert t.tree.num_branches == (4 if export == "trajectory" else sum(n_calls))
        informative += int(np.ptp(rewards) > 0)
    assert informative >= 2  # tasks whose trials disagree give a signal


@pytest.mark.slow
def test_tau_bench_grpo_experiment_trains(tmp_path):
    from app_helpers import SMALL
    from treelit.cli.config import compose
    from treelit.cli.train import run

    cfg = compose([f"output_dir={tmp_path / 'run'}", "experiment=tau_bench_grpo", *SMALL, "trainer.max_steps=2",
                   "callbacks.reward_margin=null", "data.max_trees=6", "data.shuffle=false",
                   "data.micro_batches_per_step=6"])
    summary = run(cfg)
    m = summary["metrics"]
    assert summary["global_step"] == 2 and np.isfinite(m["loss"]) and m["adv_std"] > 0, m
