"""Tree statistics of a data set of any size, streamed.

:func:`stream_stats` reads the records once, builds each tree as its group completes
(the :class:`~treelit.builders.assemble.Assembler`, as training would), adds up its
flat and tree tokens and lets it go: memory is bounded by the open groups, not by the
data. ``treelit stats`` prints the result, with a progress bar on a terminal.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence, Union

from tqdm import tqdm

from treelit.builders.assemble import Assembler, Limits
from treelit.builders.base import TreeBuilder
from treelit.data.records import DataError, ReadStats
from treelit.data.sources import FileSource
from treelit.tree.images import image_counts

__all__ = ["stream_stats"]


def stream_stats(paths: Union[str, Sequence[str]], builder: TreeBuilder, *, on_error: str = "raise",
                 group_window: int = 100_000, progress: Optional[bool] = None) -> Dict[str, Any]:
    """Statistics of the trees of ``paths`` (files, globs or directories, as ``data=stream`` takes them).

    Returns ``trees``, ``branches``, ``flat_tokens``, ``tree_tokens``, ``por`` (1 - tree/flat),
    ``ideal_speedup`` (flat/tree), ``segments``, ``max_depth``, ``records`` and ``records_skipped``;
    for data with images (a builder with a processor) ``images``, ``distinct_images`` and
    ``shared_images`` (:func:`~treelit.tree.images.image_counts`); for data with recorded MoE routing
    ``routed_branches`` (branches with ``routed_experts``, each decoded and checked as training
    would: a malformed one is an error naming the record), ``moe_layers``, ``top_k`` and
    ``max_expert_id``.
    Groups must lie within ``group_window`` records (and one file). ``progress``: a progress bar
    (default: when stderr is a terminal).
    """
    source = FileSource(paths)
    stats = ReadStats()
    # advantages are not needed to count tokens: the estimator is not run
    asm = Assembler(builder, on_error=on_error, window=int(group_window), stats=stats, name=str(paths),
                    limits=Limits(needs={"advantage": False, "old_logprobs": False, "ref_logprobs": False,
                                         "pairs": False}, keep_routing=True))
    out = {"trees": 0, "branches": 0, "flat_tokens": 0, "tree_tokens": 0, "segments": 0, "max_depth": 0}
    images = {"images": 0, "distinct_images": 0, "shared_images": 0}
    routing = {"routed_branches": 0, "moe_layers": 0, "top_k": 0, "max_expert_id": -1}

    def count(trees) -> None:
        for t in trees:
            s = t.tree.stats()
            out["trees"] += 1
            out["branches"] += s["branches"]
            out["flat_tokens"] += s["flat_tokens"]
            out["tree_tokens"] += s["tree_tokens"]
            out["segments"] += s["segments"]
            out["max_depth"] = max(out["max_depth"], s["depth"])
            for k, v in image_counts(t.tree).items():
                images[k] += v
            tok = getattr(t.tree, "token_routing", None)
            if tok is not None and tok.size:
                routing["moe_layers"], routing["top_k"] = int(tok.shape[1]), int(tok.shape[2])
                routing["max_expert_id"] = max(routing["max_expert_id"], int(tok.max()))

    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=None, unit=" records", disable=not show, file=sys.stderr, dynamic_ncols=True) as bar:
        for shard in range(len(source.shards())):
            for item in source.read(shard):
                bar.update(1)
                if isinstance(item, DataError):
                    asm._fail(item, 1)
                    continue
                stats.read += 1
                branches = item.data.get("branches") if isinstance(item.data, dict) else None
                routing["routed_branches"] += sum(isinstance(b, dict) and b.get("routed_experts") is not None
                                                  for b in (branches if isinstance(branches, list) else ()))
                count(asm.add(item))
                if out["trees"] and bar.n % 1000 == 0:
                    bar.set_postfix(trees=out["trees"], por=f"{1 - out['tree_tokens'] / max(out['flat_tokens'], 1):.3f}")
            count(asm.flush())
    if not out["trees"]:
        raise DataError(f"{paths}: no trees ({stats.skipped} records skipped)")
    flat, tree = out["flat_tokens"], out["tree_tokens"]
    out.update(por=1 - tree / flat, ideal_speedup=flat / tree, records=stats.read, records_skipped=stats.skipped)
    if images["images"]:
        out.update(images)
    if routing["routed_branches"]:
        out.update(routing)
    return out
