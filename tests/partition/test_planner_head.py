"""The memory planner's head term: the head's logits are ``rows x V`` per buffer, ``rows`` the
targets of the rank's largest pass up to a chunk (then the chunks' equal size), so the planner
predicts ``bytes_per_token x chain + head_bytes x rows``, calibrates ``bytes_per_token`` with
that term apart and solves the budget piecewise across the chunk. The buffer count per head
path is measured here on a real step; the fit on a whole run is
``benchmarks/bench_cp_longest.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import treelit
from helpers import tiny_model
from treelit.lightning.planner import MemoryPlanner, head_chunk_rows, head_row_bytes
from treelit.loss.logprobs import default_chunk_rows
from treelit.objectives import make_objective
from treelit.partition.engine import PartitionStats, run_micro_batch
from treelit.utils.memory import LiveBytes

V = 512


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2_5_tiny", torch.float32, vocab_size=V, max_seq_len=256)


def _dim(m) -> int:
    return int(m.tok_embeddings.weight.shape[1])


def test_head_bytes_per_path_and_dtype(model):
    D = _dim(model)
    assert head_row_bytes(model, make_objective("sft")) == 4 * V  # the fused loss: one buffer
    assert head_row_bytes(model, make_objective("ppo")) == 4 * (V + D)  # one buffer + a row of dL/dh
    assert head_row_bytes(model, make_objective("ppo", entropy_coef=0.01)) == 4 * 2 * V  # logits + probabilities
    assert head_row_bytes(model, make_objective("gspo")) == 4 * (V + D)
    m64 = tiny_model("qwen2_5_tiny", torch.float64, vocab_size=V)
    assert head_row_bytes(m64, make_objective("sft")) == 8 * V
    assert head_row_bytes(m64.to(torch.bfloat16), make_objective("sft")) == 4 * V  # half: float32 logits
    assert head_row_bytes(None, make_objective("sft")) == 0.0 and head_row_bytes(model, None) == 0.0
    # the chunk a run uses: one process's default, 1/C of it under context parallelism, or as set
    assert head_chunk_rows(model, None, 1) == default_chunk_rows(V)
    assert head_chunk_rows(model, None, 4) == default_chunk_rows(V) // 4
    assert head_chunk_rows(model, 96, 4) == 96


def _peak(model, obj, batch, chunk_rows):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    live = LiveBytes()
    for t in [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]:
        live.live.setdefault(t.untyped_storage().data_ptr(), 0)  # held before the step
    stats = PartitionStats()
    with live:
        run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=obj.norm_contribution(batch, "token-mean"),
                        chunk_rows=chunk_rows, stats=stats)
    return live.peak, stats


@pytest.mark.parametrize("name,opts", [("sft", {}), ("ppo", {}), ("ppo", {"entropy_coef": 0.01})],
                         ids=["sft-fused", "logprobs", "logprobs-entropy"])
def test_the_head_term_is_what_a_step_holds_per_logits_row(model, name, opts):
    """The step's peak at two chunk sizes differs by ``head_bytes`` per row of the buffer: the
    count of logits-sized buffers at the peak is the code's, not a guess."""
    obj = make_objective(name, **opts)
    L = 161
    g = torch.Generator().manual_seed(3)
    batch = treelit.TokenTree.from_branches([torch.randint(1, V, (L,), generator=g).tolist()], advantages=[0.5],
                                            old_logprobs=[[None] + [-3.0] * (L - 1)]).to_batch()
    (big, stats), (small, _) = _peak(model, obj, batch, 160), _peak(model, obj, batch, 40)
    assert stats.max_pass_targets == L - 1
    planner = MemoryPlanner()
    planner.set_model_terms(model, obj, 160, 1, torch.device("cpu"))
    rows_big = planner.head_rows(L - 1)
    planner.chunk_rows = 40
    rows_small = planner.head_rows(L - 1)
    assert (rows_big, rows_small) == (160, 40)
    # per row: the buffers, and a few of the row's scalars (its maximum, sum, log-sum-exp) beside them
    per_row = (big - small) / (rows_big - rows_small)
    assert head_row_bytes(model, obj) <= per_row <= head_row_bytes(model, obj) + 8 * 4, per_row


def test_pass_targets_are_the_largest_pass_on_the_rank(model):
    """``max_pass_targets``: a pass's targets are its own tokens' (loss-masked ones left out) and
    its child passes' roots; the largest pass's count."""
    obj = make_objective("sft")
    P, A, B = list(range(1, 11)), list(range(20, 30)), list(range(40, 52))
    masks = [[0] * 4 + [1] * 16, [0] * 4 + [1] * 18]  # the prompt's first four tokens are not trained
    batch = treelit.TokenTree.from_branches([P + A, P + B], masks).to_batch()
    _, whole = _peak(model, obj, batch, None)
    assert whole.max_pass_targets == 6 + 10 + 12  # one pass: every trained target
    stats = PartitionStats()
    run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=obj.norm_contribution(batch, "token-mean"),
                    budget_tokens=22, stats=stats)
    assert stats.per_partition == [10, 12, 10]  # the prompt, then each answer
    # the prompt's pass: 6 targets and the answers' first tokens (8); B's: 11; A's: 9
    assert stats.max_pass_targets == 11


def _planner(A, H, c):
    p = MemoryPlanner(margin=1.0, initial_bytes_per_token=A)
    p.head_bytes, p.chunk_rows = float(H), c
    return p


def _largest_fitting(p, cap):
    return max(b for b in range(int(cap / p.bytes_per_token) + 2) if p.predicted_peak(b, 0, b) <= cap)


def test_budget_across_the_chunk_boundary():
    """Below the chunk every target is a row (``(A + H) b``); one target past it the rows fall to
    two chunks of half the size, so a memory that cannot hold a full chunk's budget may hold a
    larger one: the budget is the largest that fits, not the per-token solution."""
    A, H, c = 1000.0, 4000.0, 64
    p = _planner(A, H, c)
    assert p.head_rows(40) == 40 and p.head_rows(64) == 64 and p.head_rows(65) == 33 and p.head_rows(1000) == 63
    assert p.predicted_peak(40, 0, 40) == (A + H) * 40
    assert p.predicted_peak(65, 0, 65) == A * 65 + H * 33
    assert p.predicted_peak(65, 0, 65) > (A + H) * 30
    assert p.tokens_for((A + H) * 30) == 30  # below the chunk: linear in A + H
    # (A + H) 64 = 320k does not fit, 65 tokens in two chunks of 33 rows (197k) does, and so on up
    cap = 300_000.0
    b = p.tokens_for(cap)
    assert b > c and b == _largest_fitting(p, cap)
    assert int(cap / (A + H)) < c  # the model without chunks would stop below the chunk
    # every memory around the boundaries plans the largest budget that fits
    for cap in [A * k + H * r for k in range(30, 400, 7) for r in (0, 20, 33, 64)]:
        assert p.tokens_for(cap) == _largest_fitting(p, cap), cap
    # the margin divides the memory; without a head term the budget is the per-token one
    assert _planner(A, H, c).tokens_for(cap * 1.1) == p.tokens_for(cap * 1.1)
    assert _planner(A, 0.0, c).tokens_for(cap) == int(cap / A)


class Rank:
    """What the planner reads from a module (one process on CPU)."""

    device = torch.device("cpu")
    budget_tokens = None
    last_partition_stats = None

    def __init__(self, model, objective, chunk_rows=None) -> None:
        self.model, self.objective, self.chunk_rows = model, objective, chunk_rows

    def _comm(self):
        return SimpleNamespace(rank=0, min=lambda v: v, max=lambda v: v)

    def log_dict(self, metrics) -> None:
        self.logged = metrics


@pytest.mark.parametrize("targets", [50, 200], ids=["below-chunk", "above-chunk"])
def test_calibration_sets_the_head_term_apart(model, targets):
    """A step whose peak is ``A x chain + head_bytes x rows`` calibrates exactly ``A`` per token
    (the per-token model alone would take ``A + head_bytes x rows / chain``)."""
    A, c = 3000.0, 64
    planner = MemoryPlanner(memory_limit_bytes=2**24, fraction=1.0, margin=1.0, initial_bytes_per_token=A,
                            measure_cpu=False)
    module = Rank(model, make_objective("sft"), chunk_rows=c)
    batch = SimpleNamespace(micro_batches=[SimpleNamespace(position_ids=torch.arange(40))])
    planner.on_train_batch_start(None, module, batch, 0)
    assert planner.head_bytes == 4 * V and planner.chunk_rows == c
    rows = {50: 50, 200: 50}[targets]  # 200 targets: four chunks of 50
    assert planner.head_rows(targets) == rows
    chain = 400
    planner._tracker = SimpleNamespace(peak=A * chain + 4 * V * rows, __exit__=lambda *a: None)
    module.last_partition_stats = SimpleNamespace(max_chain_tokens=chain, cp_score_pairs=0, max_pass_targets=targets)
    planner.on_train_batch_end(SimpleNamespace(global_step=1), module, None, batch, 0)
    assert planner.bytes_per_token == pytest.approx(A)
    assert planner.history[-1]["head_rows"] == rows
    # the next budget is the largest whose prediction (head included) fits
    planner.on_train_batch_start(None, module, batch, 1)
    b = module.budget_tokens
    assert b == _largest_fitting(planner, 2**24) and b < 2**24 / A
