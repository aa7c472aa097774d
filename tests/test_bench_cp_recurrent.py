"""``bench_cp_recurrent.py`` on a tiny tree: both hand-offs timed in the same processes, bitwise
the same gradients, and the sends waited on where posted (before) or at the pass's end (after)."""

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_cp_recurrent  # noqa: E402


@pytest.mark.slow
def test_both_hand_offs_timed_with_the_same_gradients():
    args = argparse.Namespace(worlds=[1, 2], partitioned=[False, True], layers=4, dim=32, heads=4, kv_heads=2,
                              intermediate=64, vocab=256, prefix=48, branches=3, branch_len=24, attention="segment",
                              warmup=1, repeats=2)
    res = bench_cp_recurrent.run(args)
    assert [(r["partitioned"], r["world"]) for r in res["rows"]] == [(False, 1), (False, 2), (True, 1), (True, 2)]
    for r in res["rows"]:
        assert r["same_gradients"] and r["before"]["seconds"] > 0 and r["after"]["seconds"] > 0
        assert len(r["before"]["rounds"]) == len(r["after"]["rounds"]) == 2
        if r["world"] == 2:  # sends in flight drained at the end of a pass only after the change
            assert "drain" in r["after"]["waits"] and "drain" not in r["before"]["waits"]
            assert r["before"]["waits"]["states"] >= 0 and r["before"]["waits"]["rows"] >= 0
        else:
            assert r["before"]["waits"] == r["after"]["waits"] == {}
    assert "after/before" in bench_cp_recurrent.table(res)
