"""The composition matrix, generated from its one table (:mod:`treelit.cli.compositions`): every
feature on every strategy and every pair of features on every strategy, each run held against one
unpartitioned process in float64 (the loss and every trained parameter's gradient, <= 1e-9) and
each one-process run against per-branch training (each branch its own tree, no token shared);
each run trains something. A cell the table refuses is refused before launch, in one line naming
the option (the option checks and the table agree on every cell: tests/cli/test_compositions.py).

The default suite runs an all-pairs cover: per strategy, rows with as many features as the table
lets run together, so that each (feature, strategy) and each pair of features within a strategy
meets in a run or in a refusal. The full product (every cell alone) is ``slow``. When a row of
the table goes, the cells it refused run here with no other edit.

Processes: 2 (DDP, FSDP2, context parallelism C=2, partitioned or not), 4 (HSDP: 2 replicas x 2
shards), 1 (one process, partitioned or not: in the test's own process). Models: treelit's own
decoders, the transformers adapter for images, and for the table's rows that hold on the adapter
only (routing replay with activation checkpointing) their cells on the adapter as well.
"""

from __future__ import annotations

import functools
import itertools
from typing import Dict, FrozenSet, List, Optional, Tuple

import pytest
import torch

from composition_cases import WORLD, cell_step, cell_steps
from harness import launch
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from treelit.cli.compositions import FEATURES, REFUSALS as TABLE, STRATEGIES, exclusive, refusal, refusals

Cell = Tuple[str, FrozenSet[str], str]  # (strategy, features, model path: native | hf_auto)
TOL = 1e-9


def model_path(features) -> str:
    """Where a cell runs by default: images on the transformers adapter, the rest on treelit's decoders."""
    return "hf_auto" if "images" in features else "native"


def refused(strategy: str, features, model: Optional[str] = None) -> bool:
    return refusal(features, strategy, model or model_path(features)) is not None


def adapter_targets(strategy: str) -> List[FrozenSet[str]]:
    """The features of the table's rows that hold on the transformers adapter only (e.g. routing
    replay with activation checkpointing): run, or refused, there as well."""
    return [frozenset(r.features) for r in TABLE if r.model == "hf_auto" and "images" not in r.features
            and (not r.strategies or strategy in r.strategies)]


def pair_targets(strategy: str) -> List[FrozenSet[str]]:
    """What a cover of ``strategy`` must meet: each feature, and each pair not two values of one option."""
    singles = [frozenset({f}) for f in FEATURES]
    pairs = [frozenset(p) for p in itertools.combinations(FEATURES, 2) if not exclusive(p)]
    return singles + pairs


def cover(strategy: str) -> Tuple[List[FrozenSet[str]], List[FrozenSet[str]]]:
    """``(runs, refusals)``: rows that run, each grown greedily from the first target not met yet by
    adding every feature (in the table's order) the table lets run with it; and the targets the
    table refuses (each asserted as its one-line refusal)."""
    runs: List[FrozenSet[str]] = []
    refused_targets = [t for t in pair_targets(strategy) if refused(strategy, t)]
    left = [t for t in pair_targets(strategy) if t not in refused_targets]
    while left:
        row = set(left[0])
        for f in FEATURES:
            grown = row | {f}
            if f not in row and not exclusive(grown) and not refused(strategy, grown):
                row = grown
        runs.append(frozenset(row))
        left = [t for t in left if not t <= row]
    return runs, refused_targets


def _adapter_cells(s: str) -> List[Cell]:
    return [(s, t, "hf_auto") for t in adapter_targets(s)]


def covering_sample() -> Tuple[List[Cell], List[Cell]]:
    runs: List[Cell] = []
    refused_cells: List[Cell] = []
    for s in STRATEGIES:
        r, x = cover(s)
        runs += [(s, f, model_path(f)) for f in r]
        refused_cells += [(s, f, model_path(f)) for f in x]
        for c in _adapter_cells(s):
            (refused_cells if refused(*c) else runs).append(c)
    return runs, refused_cells


def full_product() -> Tuple[List[Cell], List[Cell]]:
    cells = [(s, t, model_path(t)) for s in STRATEGIES for t in pair_targets(s)]
    cells += [c for s in STRATEGIES for c in _adapter_cells(s)]
    return [c for c in cells if not refused(*c)], [c for c in cells if refused(*c)]


def _id(cell: Cell) -> str:
    return f"{cell[0]}-{'+'.join(f for f in FEATURES if f in cell[1])}" + ("-hf_auto" if cell[2] != model_path(
        cell[1]) else "")


# running cells ----------------------------------------------------------------------------------

def vision_family(features) -> str:
    """The vision-language family of a cell with images: Qwen3.5 (Gated DeltaNet) for ``hybrid``,
    else Qwen2.5-VL; with experts (routing replay, the router loss: refused until a vision family
    with experts is among vision_oracle.FAMILIES) Qwen3.5-MoE / Qwen3-VL-MoE."""
    moe = bool(set(features) & {"routing_replay", "router_loss"})
    if "hybrid" in features:
        return "qwen3_5_moe" if moe else "qwen3_5"
    return "qwen3_vl_moe" if moe else "qwen2_5_vl"


def text_family(features) -> str:
    """The transformers family of a cell without images on ``model=hf_auto``."""
    moe = bool(set(features) & {"routing_replay", "router_loss"})
    return ("qwen3_next" if moe else "qwen3_5_text") if "hybrid" in features else "qwen3_moe" if moe else "qwen2"


TEXT = dict(vocab_size=12, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
_GDN = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=3)
_EXPERTS = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                router_aux_loss_coef=0.0)
TEXT_FAMILIES = {"qwen2": {}, "qwen3_moe": _EXPERTS, "qwen3_5_text": _GDN,
                 "qwen3_next": dict(_GDN, **_EXPERTS, shared_expert_intermediate_size=8)}


class VisionPaths(dict):
    """Tiny random checkpoints (vision families by name; text families as ``text:<family>``),
    written when first asked for."""

    def __init__(self, base) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, family: str) -> str:
        if family.startswith("text:"):
            from hf_oracle import random_hf_checkpoint

            name = family[5:]
            random_hf_checkpoint(self.base / name, name, **TEXT, **TEXT_FAMILIES[name])
            self[family] = str(self.base / name)
        else:
            from vision_oracle import vision_checkpoint

            self[family] = str(vision_checkpoint(self.base / family, family))
        return self[family]


@pytest.fixture(scope="session")
def vision_paths(tmp_path_factory) -> Dict[str, str]:
    return VisionPaths(tmp_path_factory.mktemp("vlm"))


def _spec(cell: Cell, paths: Dict[str, str], reference: Optional[str] = None) -> Dict:
    strategy, features, model = cell
    spec = {"features": sorted(features), "strategy": strategy, "reference": reference}
    if "images" in features:
        spec["vision"] = paths[vision_family(features)]
    elif model == "hf_auto":
        spec["hf"] = paths[f"text:{text_family(features)}"]
    return spec


@functools.lru_cache(maxsize=None)
def _reference(features: FrozenSet[str], kind: str, vision: Optional[str], hf: Optional[str]) -> Dict:
    spec = {"features": sorted(features), "strategy": "one_process", "reference": kind, "vision": vision, "hf": hf}
    return cell_step(0, 1, spec)


def run_cells(cells: List[Cell], paths: Dict[str, str]) -> Dict[Cell, Dict]:
    """Every cell's result: the one-process ones here, the others in one launch per world size."""
    out = {}
    by_world: Dict[int, List[Cell]] = {}
    for c in cells:
        by_world.setdefault(WORLD[c[0]], []).append(c)
    for world, group in sorted(by_world.items()):
        if world == 1:
            for c in group:
                out[c] = cell_step(0, 1, _spec(c, paths))
        else:
            res = launch(cell_steps, world, [_spec(c, paths) for c in group], deadline=600)
            out.update(zip(group, res))
    return out


def check(cell: Cell, got: Dict, paths: Dict[str, str]) -> None:
    """``got`` equals its reference: one unpartitioned process; for the one-process cells, per-branch training."""
    strategy, features, _ = cell
    name = _id(cell)
    assert "error" not in got, f"{name}: failed:\n{got['error']}"
    kind = "per_branch" if strategy == "one_process" else "one_process"
    spec = _spec(cell, paths)
    want = _reference(features, kind, spec.get("vision"), spec.get("hf"))
    assert want["loss"] != 0.0 and any(float(g.abs().max()) > 0 for g in want["grads"].values()), \
        f"{name}: the case trains nothing"
    assert got["grads"].keys() == want["grads"].keys(), f"{name}: {sorted(got['grads'])[:4]}"
    rel = abs(got["loss"] - want["loss"]) / abs(want["loss"])
    assert rel <= TOL, f"{name}: loss {got['loss']!r} vs {kind} {want['loss']!r}"
    err = max_rel_grad_diff(got["grads"], want["grads"], grad_floor(torch.float64), negligible_grad(torch.float64))
    assert err <= TOL, f"{name}: gradient differs from {kind} by {err:.2e} (relative)"
    if strategy.endswith("partitioned"):
        assert got["partitions"] > want["partitions"] * WORLD[strategy], f"{name}: the budget cut nothing"


def check_refused(cell: Cell) -> None:
    from composition_configs import verdict

    strategy, features, model = cell
    options = [r.option for r in refusals(features, strategy, model)]
    msg = verdict(tuple(sorted(features)), strategy, model)
    assert msg is not None and "\n" not in msg and any(o in msg for o in options), (_id(cell), options, msg)


# the default suite: the cover ---------------------------------------------------------------------

RUNS, REFUSALS = covering_sample()


def test_the_sample_covers_every_feature_and_pair_on_every_strategy():
    for s in STRATEGIES:
        met = [f for c, f, _ in RUNS + REFUSALS if c == s]
        for t in pair_targets(s):
            assert any(t <= row for row in met), (s, sorted(t))
    assert len(RUNS) <= 24, len(RUNS)  # a few rows per strategy, not the product
    for s in STRATEGIES:  # the adapter-only rows' cells are met on the adapter
        for t in adapter_targets(s):
            assert (s, t, "hf_auto") in RUNS + REFUSALS, (s, sorted(t))


@pytest.fixture(scope="module")
def sample(vision_paths):
    return run_cells(RUNS, vision_paths)


@pytest.mark.parametrize("cell", RUNS, ids=[_id(c) for c in RUNS])
def test_cell_equals_its_reference(sample, vision_paths, cell):
    check(cell, sample[cell], vision_paths)


@pytest.mark.parametrize("cell", REFUSALS, ids=[_id(c) for c in REFUSALS])
def test_refused_cell_is_refused_in_one_line_naming_the_option(cell):
    check_refused(cell)


# one process with images against transformers, branch by branch -----------------------------------

def transformers_branch_by_branch(features, path: str):
    """The SFT loss and gradients of the cell's trees, each branch through transformers' own
    vision-language model with its own images (``vision_oracle.vlm_branch_loss``), float64 kept."""
    from composition_cases import records
    from float64_mode import KeepFloat64
    from vision_oracle import load_reference, vlm_branch_loss

    recs = records(features)
    ref = load_reference(path)
    with KeepFloat64():
        loss = vlm_branch_loss(ref, *[[x for r in recs for x in r[k]] for k in ("branches", "images", "masks",
                                                                                "weights")], "token-mean")
        loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("strategy", ["one_process", "partitioned"])
@pytest.mark.parametrize("features", [
    ("images", "hybrid", "checkpointing"),  # Qwen3.5: vision tower + Gated DeltaNet, layers recomputed
    pytest.param(("images",), marks=pytest.mark.slow),
    pytest.param(("images", "checkpointing"), marks=pytest.mark.slow),
    pytest.param(("images", "hybrid"), marks=pytest.mark.slow),
], ids="+".join)
def test_one_process_with_images_equals_transformers_branch_by_branch(vision_paths, features, strategy):
    path = vision_paths[vision_family(features)]
    got = cell_step(0, 1, {"features": list(features), "strategy": strategy, "vision": path, "objective": "sft"})
    loss, theirs = transformers_branch_by_branch(features, path)
    ours = {n[len("model.hf."):]: g for n, g in got["grads"].items()}
    assert loss > 0 and ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))[:6]
    assert abs(got["loss"] - loss) <= TOL * loss, (got["loss"], loss)
    err = max_rel_grad_diff(ours, theirs, grad_floor(torch.float64), negligible_grad(torch.float64))
    assert err <= TOL, f"gradient differs from transformers branch by branch by {err:.2e}"


# the full product: every cell alone (slow) ---------------------------------------------------------

PRODUCT_RUNS, PRODUCT_REFUSALS = full_product()


_PRODUCT: Dict[Cell, Dict] = {}


def product_result(cell: Cell, paths: Dict[str, str]) -> Dict:
    """The cell's result; its strategy's cells run together when the first of them is asked for
    (one launch per strategy: ``-k hsdp`` runs HSDP's only)."""
    if cell not in _PRODUCT:
        _PRODUCT.update(run_cells([c for c in PRODUCT_RUNS if c[0] == cell[0]], paths))
    return _PRODUCT[cell]


@pytest.mark.slow
@pytest.mark.parametrize("cell", PRODUCT_RUNS, ids=[_id(c) for c in PRODUCT_RUNS])
def test_every_cell_equals_its_reference(vision_paths, cell):
    check(cell, product_result(cell, vision_paths), vision_paths)


@pytest.mark.slow
@pytest.mark.parametrize("cell", PRODUCT_REFUSALS, ids=[_id(c) for c in PRODUCT_REFUSALS])
def test_every_refused_cell_is_refused(cell):
    check_refused(cell)
