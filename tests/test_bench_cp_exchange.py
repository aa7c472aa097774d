"""``bench_cp_exchange.py``: the three ways of exchanging one layer's ancestor K/V under context
parallelism (treelit's point-to-point path rows, all-gather, ring) give every rank the same rows
and every owner the same gradient, and send the bytes the plan implies."""

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_cp_exchange as bench  # noqa: E402
from treelit.partition.context_parallel import cp_plan  # noqa: E402

TINY = ["--prefix", "8", "--branches", "3", "--branch-len", "8", "--head-dim", "4", "--costs", "uniform"]


def _plans(shape, C):
    args = argparse.Namespace(prefix=8, branches=3, branch_len=8, costs="uniform")
    batch = bench.tree(shape, args)
    c = bench.costs(batch, args)
    return [cp_plan(batch, C, r, c) for r in range(C)]


@pytest.mark.parametrize("C", [2, 3, 4])
@pytest.mark.parametrize("shape", ["branches", "path"])
def test_byte_arithmetic(shape, C):
    plans = _plans(shape, C)
    rb = 2 * 2 * 4 * 4  # 2 KV heads x (4 + 4) x float32
    want = bench.expected_bytes(plans, rb)
    sizes = [e - s for s, e in plans[0].ranges]
    total = {m: sum(f + b for f, b in want[m]) for m in bench.METHODS}
    # every path row crosses once each way (p2p); the ring carries whole blocks over every hop up to
    # the last rank; all-gather sends every (padded) block to every other rank
    assert total["p2p"] == 2 * rb * sum(len(p.path) for p in plans)
    assert total["ring"] == 2 * rb * sum(sizes[o] * (C - 1 - o) for o in range(C))
    assert total["allgather"] == 2 * rb * C * (C - 1) * max(sizes)
    assert 0 < total["p2p"] <= total["ring"] <= total["allgather"]
    for m in ("p2p", "ring"):  # no rank sends more than under all-gather
        assert max(max(fb) for fb in want[m]) <= want["allgather"][0][0]
    if shape == "path":  # each range's path is the whole row before it: the ring carries nothing extra
        assert total["ring"] == total["p2p"]
        assert [len(p.path) for p in plans] == [s for s, _ in plans[0].ranges]
    else:
        assert total["p2p"] < total["ring"]
    if C == 2:  # rank 0 sends rank 1's path rows, or its whole range, or the padded longest range
        path1 = len(plans[1].path) * rb
        assert [want[m][0][0] for m in bench.METHODS] == [path1, max(sizes) * rb, sizes[0] * rb]
        assert [want[m][1][1] for m in bench.METHODS] == [path1, max(sizes) * rb, sizes[0] * rb]


def test_the_three_exchanges_agree_at_two_ranks(tmp_path):
    out = tmp_path / "cpx.json"
    result = bench.main(["--worlds", "2", "--repeats", "2", "--warmup", "0", "--dtypes", "float32", *TINY,
                         "--json", str(out)])
    assert out.exists()
    rows = result["rows"]
    assert {(r["tree"], r["method"]) for r in rows} == {(t, m) for t in ("branches", "path") for m in bench.METHODS}
    for r in rows:
        # the worker asserted, on every rank: float64 rows and gradients equal to the whole-row
        # reference for every method, and the counted bytes equal to expected_bytes
        assert r["exact_float64"] and r["world"] == 2 and len(r["seconds"]) == 2
        plans = _plans(r["tree"], 2)
        want = bench.expected_bytes(plans, r["row_bytes"])[r["method"]]
        assert r["sent_forward_bytes"] == [f for f, _ in want]
        assert r["sent_backward_bytes"] == [b for _, b in want]
    by = {(r["tree"], r["method"]): r for r in rows}
    for t in ("branches", "path"):
        assert by[t, "p2p"]["sent_total"] <= by[t, "ring"]["sent_total"] <= by[t, "allgather"]["sent_total"]
    assert "float64 check exact" in bench.table(result)
