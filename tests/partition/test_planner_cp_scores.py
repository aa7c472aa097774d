"""The memory planner's attention-score term under context parallelism: a rank's queries
attend to the path keys it receives, and off CPU the segment backend's math path holds one
layer's float32 scores of those pairs per query head (four such tensors in the backward
pass), so the planner predicts
``bytes_per_token x chain + score_bytes x queries x received keys``; it calibrates
``bytes_per_token`` with that term apart and picks the budget that fits the last rank of a
chain (``b`` queries, ``(C - 1) b`` received keys). Arithmetic only: the measured fit is
``benchmarks/bench_cp_longest.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import treelit
from helpers import tiny_model
from treelit.lightning.planner import MemoryPlanner
from treelit.partition.context_parallel import cp_split, score_pair_bytes


def test_score_bytes_per_head_off_cpu_and_none_on_cpu():
    m = tiny_model("qwen2_5_tiny", torch.float32)
    heads = m.config.num_heads
    assert heads > 1
    assert score_pair_bytes(m, torch.device("cuda")) == 16 * heads  # 4 float32 tensors per head
    assert score_pair_bytes(m, torch.device("cpu")) == 0.0  # blockwise kernels
    assert score_pair_bytes(None, torch.device("cuda")) == 0.0


@pytest.mark.parametrize("C", [2, 4])
def test_prediction_grows_with_received_keys_as_the_formula_says(C):
    """On one branch split over C ranks, rank r's pairs are its queries x the ancestors of its
    first token; the prediction is the per-token term plus ``score_bytes`` per pair, so a rank
    further down the branch (more received keys) is predicted higher by exactly that much."""
    m = tiny_model("qwen2_5_tiny", torch.float32)
    L = 48
    batch = treelit.TokenTree.from_branches([list(range(3, 3 + L))]).to_batch()
    planner = MemoryPlanner(margin=1.0, initial_bytes_per_token=1000.0)
    planner.score_bytes = score_pair_bytes(m, torch.device("cuda"))
    assert planner.score_bytes > 0
    plans = [cp_split(batch, C, r, m) for r in range(C)]
    for r, plan in enumerate(plans):
        assert len(plan.path) == plan.start  # one branch: every token before the range is an ancestor
        pairs = plan.size * len(plan.path)
        per_token = planner.predicted_peak(L / C)
        assert planner.predicted_peak(L / C, pairs) - per_token == pytest.approx(planner.score_bytes * pairs)
    assert len(plans[0].path) == 0 and len(plans[-1].path) > 0
    # one more received key on a range of q queries adds q x score_bytes
    q, R = plans[-1].size, len(plans[-1].path)
    grow = planner.predicted_peak(L / C, q * (R + 1)) - planner.predicted_peak(L / C, q * R)
    assert grow == pytest.approx(q * planner.score_bytes) and grow > 0


class CPRank:
    """What the planner reads from a module of a context-parallel group of C ranks (CPU)."""

    device = torch.device("cpu")
    budget_tokens = None
    last_partition_stats = None

    def __init__(self, model, C: int) -> None:
        self.model, self.C = model, C

    def _cp_degree(self) -> int:
        return self.C

    def _comm(self):
        return SimpleNamespace(rank=0, min=lambda v: v, max=lambda v: v)

    def log_dict(self, metrics) -> None:
        self.logged = metrics


def test_calibration_sets_the_scores_term_apart_and_the_budget_fits_the_last_rank(monkeypatch):
    """A step whose peak is ``A x chain + s x pairs`` calibrates exactly ``A`` per token (a
    per-token model alone would take ``A + s x pairs / chain``), and the next budget ``b`` is the
    largest with ``A b + s b (C - 1) b`` within the memory (the longest branch caps the keys)."""
    import treelit.lightning.planner as planner_module

    m = tiny_model("qwen2_5_tiny", torch.float32)
    C, A = 4, 5000.0
    s = score_pair_bytes(m, torch.device("cuda"))
    # (the memory is simulated on CPU; the scores' term is the math path's, as off CPU)
    monkeypatch.setattr(planner_module, "score_pair_bytes", lambda model, device: score_pair_bytes(model, "cuda"))
    limit = 64 * 2**20
    planner = MemoryPlanner(memory_limit_bytes=limit, fraction=1.0, margin=1.0, initial_bytes_per_token=A,
                            measure_cpu=False)
    module = CPRank(m, C)
    planner.score_bytes = s  # (as the step's start sets them)
    b0 = planner.tokens_for(limit, C)
    longest = (C - 1) * b0 + 1  # between (C - 1) b and C b: the budget trains it and the keys are not capped
    batch = SimpleNamespace(micro_batches=[SimpleNamespace(position_ids=torch.arange(longest))])
    planner.on_train_batch_start(None, module, batch, 0)
    b = module.budget_tokens
    assert planner.score_bytes == s and (C - 1) * b <= longest <= C * b
    assert A * b + s * b * (C - 1) * b <= limit < A * (b + 1) + s * (b + 1) * (C - 1) * (b + 1)
    assert b < limit / A  # the per-token model alone would plan more
    # a step measured at this budget: the last rank's pairs b x (C - 1) b
    chain, pairs = b, b * (C - 1) * b
    planner._tracker = SimpleNamespace(peak=A * chain + s * pairs, __exit__=lambda *a: None)
    module.last_partition_stats = SimpleNamespace(max_chain_tokens=chain, cp_score_pairs=pairs)
    planner.on_train_batch_end(SimpleNamespace(global_step=1), module, None, batch, 0)
    assert planner.bytes_per_token == pytest.approx(A)
    assert planner.history[-1]["score_pairs"] == pairs
    # a short longest branch caps the received keys: the budget is then linear in the memory
    short = 200
    cap_b = planner.tokens_for(limit, C, short)
    assert (C - 1) * cap_b > short
    assert cap_b == int(limit / (A + s * short))
    assert planner.tokens_for(limit, 1, short) == int(limit / A)  # one rank: no scores' term


def test_on_cpu_the_planner_keeps_the_per_token_model_under_cp():
    m = tiny_model("qwen2_5_tiny", torch.float32)
    planner = MemoryPlanner(memory_limit_bytes=2**26, fraction=1.0, margin=1.0, initial_bytes_per_token=5000.0,
                            measure_cpu=False)
    module = CPRank(m, 4)
    batch = SimpleNamespace(micro_batches=[SimpleNamespace(position_ids=torch.arange(100))])
    planner.on_train_batch_start(None, module, batch, 0)
    assert planner.score_bytes == 0.0 and module.budget_tokens == int(2**26 / 5000.0)
