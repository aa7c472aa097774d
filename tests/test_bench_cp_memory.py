"""``bench_cp_memory.py`` and ``bench_cp_longest.py`` on a tiny tree: every share is reported, the
ranks' summed gradients are one process's, a rank's activations are below one process's, and the
longest branch the planner's arithmetic accepts grows with C."""

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_cp_longest  # noqa: E402
import bench_cp_memory  # noqa: E402

TINY = dict(layers=2, dim=32, heads=4, kv_heads=2, intermediate=64, vocab=256, attention="segment")


@pytest.mark.slow
def test_memory_shares_and_gradients():
    args = argparse.Namespace(worlds=[2], models=["attention", "hybrid"], partitioned=[False, True], prefix=48,
                              branches=3, branch_len=24, **TINY)
    res = bench_cp_memory.run(args)
    assert len(res["rows"]) == 8  # (two models x two modes x C = 1, 2)
    for r in res["rows"]:
        assert r["weights"] > 0 and r["optimizer"] == 2 * r["gradients"] > 0
        assert all(x["activations"] > 0 for x in r["ranks"])
        if r["world"] == 2:
            assert r["max_rel_grad_diff_vs_one"] < 1e-4
            assert r["activations_max_over_one"] < 1.0
            assert r["ranks"][1]["received_forward"] > 0
    assert "activations" in bench_cp_memory.table(res)


@pytest.mark.slow
def test_longest_branch_grows_with_c():
    args = argparse.Namespace(worlds=[1, 2], model="attention", budget_mib=1.0, calibrate=32, prefix=0,
                              branch_len=2048, **TINY)
    res = bench_cp_longest.run(args)
    one, two = res["rows"]
    assert two["longest"] > one["longest"] > 32
    assert two["max_rel_grad_diff_vs_one"] < 1e-4
    assert all(x["peak"] > 0 and x["predicted"] > 0 for r in res["rows"] for x in r["ranks"])
