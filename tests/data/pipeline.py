"""The data path of ``treelit-train`` without a model: read, build, check against a model's
limits and an objective, pack every tree into one step (what the first steps would do)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from treelit.builders.base import make_tree_builder
from treelit.lightning.data import TreeDataModule
from treelit.objectives import make_objective
from treelit.tree.batch import TreeBatch

VOCAB = 600
MAX_LEN = 96


def write(path: Path, records: List[Any], fmt: Optional[str] = None) -> Path:
    """Write records as JSONL (default), ``.json``, ``.jsonl.gz`` or ``.parquet`` (by suffix)."""
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    elif name.endswith(".json"):
        path.write_text(json.dumps(records))
    elif name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run(path, builder: str = "sequences", on_error: str = "raise", objective: str = "sft",
        builder_options: Optional[Dict[str, Any]] = None, objective_options: Optional[Dict[str, Any]] = None,
        tokenizer=None, vocab: int = VOCAB, max_len: int = MAX_LEN) -> TreeDataModule:
    opts = dict(builder_options or {})
    if builder == "chat":
        opts.setdefault("tokenizer", tokenizer)
    dm = TreeDataModule(str(path), tree_builder=make_tree_builder(builder, **opts), on_error=on_error, shuffle=False)
    dm.check_against(vocab, max_len, objective=make_objective(objective, **(objective_options or {})))
    TreeBatch.pack(dm._batches)  # every tree packs with every other (the steps would)
    return dm


def branches_of(dm: TreeDataModule) -> List[List[int]]:
    return [br for t in dm.trees for br in t.tree.branches()]


def shard_records(n_files=4, per_file=30, seed=0):
    """Token records with contiguous groups of 1-3 records (rewards, old log-probs) per file."""
    rng = np.random.default_rng(seed)
    files = []
    for f in range(n_files):
        recs, g = [], 0
        while len(recs) < per_file:
            prompt = rng.integers(1, 60, int(rng.integers(2, 7))).tolist()
            key = f"f{f}g{g}" if g % 2 or f == 2 else g + 1000 * f  # string and integer keys (Parquet: one type)
            for _ in range(int(rng.integers(1, 4))):
                branches = []
                for _ in range(int(rng.integers(1, 3))):
                    ids = prompt + rng.integers(1, 60, int(rng.integers(1, 6))).tolist()
                    branches.append({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt)),
                                     "reward": float(rng.integers(2)), "group": key})
                recs.append({"id": f"{f}-{len(recs)}", "branches": branches})
            g += 1
        files.append(recs)
    return files
