"""``bench_step.py --tree-steps``: several tree steps per repetition, around the per-branch
step, so that both modes sample the machine over a similar stretch of time."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

from bench_step import tree_steps_per_rep  # noqa: E402


def test_auto_matches_the_per_branch_step_and_is_capped():
    assert tree_steps_per_rep("auto", 2.0, 9.1) == 5  # 4.55 tree steps last one per-branch step
    assert tree_steps_per_rep("auto", 2.0, 1.0) == 1  # never fewer than one
    assert tree_steps_per_rep("auto", 1.0, 100.0) == 8  # at most the cap
    assert tree_steps_per_rep("auto", 1.0, 100.0, cap=20) == 20
    assert tree_steps_per_rep("3", 1.0, 100.0) == 3  # a fixed count ignores the timings


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match="--tree-steps"):
        tree_steps_per_rep(bad, 1.0, 1.0)


def run(tmp_path, *extra):
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(BENCH, "bench_step.py"), "--quick", "--scale", "0.01", "--cases", "multi_turn",
           "--no-peer", "--no-memory", "--preset", "head_heavy", "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return proc, out


def test_each_repetition_times_k_tree_steps_and_reports_their_mean(tmp_path):
    proc, out = run(tmp_path, "--reps", "2", "--tree-steps", "3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    r = data["cases"][0]
    assert data["env"]["tree_steps"] == "3" and r["tree_steps_per_rep"] == 3
    steps = r["tree_step_times_s"]
    assert len(steps) == 6 and len(r["times_s"]["tree"]) == 2 and len(r["times_s"]["linear"]) == 2
    assert r["times_s"]["tree"] == pytest.approx([sum(steps[:3]) / 3, sum(steps[3:]) / 3])
    assert r["efficiency"] == pytest.approx(r["time_linear_s"] / r["time_tree_s"] / r["ideal_compute"])
    # each repetition's own ratio, in order, and the table's range column
    assert r["efficiency_reps"] == pytest.approx([lin / tr / r["ideal_compute"]
                                                  for lin, tr in zip(r["times_s"]["linear"], r["times_s"]["tree"])])
    lo, hi = min(r["efficiency_reps"]), max(r["efficiency_reps"])
    assert f"{lo:.2f}-{hi:.2f}" in proc.stdout
    assert r["max_rel_grad_diff"] < 1e-3


def test_bad_tree_steps_fail_before_any_work(tmp_path):
    proc, out = run(tmp_path, "--tree-steps", "0")
    assert proc.returncode == 2 and "--tree-steps must be 'auto' or >= 1" in proc.stderr
    assert not out.exists()


# --schedule interleave: the per-branch step in pieces, a tree step between them

import torch  # noqa: E402

import treelit  # noqa: E402
from bench_models import attention_model, branch_targets  # noqa: E402
from bench_step import grads_of, make_any_case, stashed_grads, step_pieces  # noqa: E402
from treelit.loss.linear import linear_micro_batches  # noqa: E402


def test_pieces_are_consecutive_runs_of_whole_micro_batches():
    lengths = [5, 9, 3, 9, 12, 7, 7, 1, 30, 4, 8, 8, 2]
    groups = linear_micro_batches(lengths, 24)
    for k in (1, 2, 3, 4, 100):
        pieces = step_pieces(lengths, 24, k)
        assert 1 <= len(pieces) <= min(k, len(groups))
        assert sum(pieces, []) == sum(groups, [])  # every branch once, in the step's order
        for p in pieces:  # each piece regroups into exactly its own micro-batches
            assert sum(linear_micro_batches([lengths[i] for i in p], 24), []) == list(range(len(p)))
            assert [[p[j] for j in g] for g in linear_micro_batches([lengths[i] for i in p], 24)] == \
                [g for g in groups if set(g) <= set(p)]
    assert len(step_pieces([10] * 40, 20, 4)) == 4  # equal micro-batches: equal pieces
    assert [len(p) for p in step_pieces([10] * 40, 20, 4)] == [10, 10, 10, 10]
    with pytest.raises(ValueError, match="piece"):
        step_pieces(lengths, 24, 0)


def test_pieces_with_tree_steps_between_accumulate_the_steps_gradients():
    model = attention_model(dim=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=128, max_seq_len=512)
    case = make_any_case("multi_turn", seed=0, vocab=128, scale=0.02, mask_mode="all")
    micro = 96
    assert len(linear_micro_batches([len(b) for b in case.branches], micro)) >= 3
    model.zero_grad(set_to_none=True)
    full = treelit.linear_backward(model, case.branches, case.masks, max_tokens=micro)
    want = grads_of(model)
    assert want and all(g.abs().sum() > 0 for g in want.values())  # the step trains every parameter
    batch = treelit.TokenTree.from_branches(case.branches, case.masks).to_batch()
    Z = treelit.Branches.build(case.branches, case.masks).normalizer("token-mean")
    model.zero_grad(set_to_none=True)
    total = 0.0
    pieces = step_pieces([len(b) for b in case.branches], micro, 3)
    assert len(pieces) == 3
    for piece in pieces:
        with stashed_grads(model):  # a tree step of the same model in between
            treelit.tree_loss(model, batch, "token-mean").backward()
            assert all(p.grad is not None for p in model.parameters())
        total += treelit.linear_backward(model, [case.branches[i] for i in piece], [case.masks[i] for i in piece],
                                         normalizer=Z, max_tokens=micro)
    got = grads_of(model)
    assert total == pytest.approx(full, rel=1e-6)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-9, msg=n)


def test_peer_pieces_accumulate_the_steps_gradients():
    from hf_peer import load_peer, peer_step

    model = attention_model(dim=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=128, max_seq_len=512)
    peer = load_peer(model)
    case = make_any_case("tool_fanout", seed=1, vocab=128, scale=0.02, mask_mode="assistant")
    micro = 96
    peer.zero_grad(set_to_none=True)
    full = peer_step(peer, case.branches, case.masks, micro)
    want = grads_of(peer)
    assert want and all(g.abs().sum() > 0 for g in want.values())
    n_items = branch_targets(case.masks)
    peer.zero_grad(set_to_none=True)
    total = 0.0
    for piece in step_pieces([len(b) for b in case.branches], micro, 3):
        total += peer_step(peer, [case.branches[i] for i in piece], [case.masks[i] for i in piece], micro,
                           n_items=n_items)
    assert total == pytest.approx(full, rel=1e-6)
    for n, p in peer.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-9, msg=n)


def test_interleave_times_a_tree_step_around_every_piece(tmp_path):
    proc, out = run(tmp_path, "--reps", "2", "--tree-steps", "3", "--schedule", "interleave")
    assert proc.returncode == 0, proc.stderr
    assert "schedule=interleave" in proc.stdout
    data = json.loads(out.read_text())
    r = data["cases"][0]
    assert data["env"]["schedule"] == "interleave"
    n = r["schedule_pieces"]
    assert 2 <= n <= 3  # the per-branch step really is cut (multi_turn at this size: 3 pieces)
    steps, pieces = r["tree_step_times_s"], r["piece_times_s"]["linear"]
    assert len(steps) == 2 * (n + 1) and [len(p) for p in pieces] == [n, n]
    assert r["times_s"]["tree"] == pytest.approx([sum(steps[: n + 1]) / (n + 1), sum(steps[n + 1:]) / (n + 1)])
    assert r["times_s"]["linear"] == pytest.approx([sum(p) for p in pieces])
    assert r["efficiency"] == pytest.approx(r["time_linear_s"] / r["time_tree_s"] / r["ideal_compute"])
    assert r["max_rel_grad_diff"] < 1e-3
