"""Rollout staleness (``data.max_staleness``, ``data.on_stale``): files sampled too many policy
versions behind the trainer are skipped (counted, renamed, never read again, also after a
resume) or refused, exactly as configured; through ``treelit-train`` with publishing on, the
trainer's version is the last published one."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from app_helpers import SMALL
from treelit.data.records import DataError
from treelit.lightning.rollouts import RolloutDirDataModule
from treelit.lightning.staleness import StalenessGate


def records(versions, rng, behaviour=True):
    """One record per entry of ``versions`` (None: no policy_version): 3 completions of a prompt."""
    out = []
    for i, v in enumerate(versions):
        prompt = rng.integers(1, 11, 3).tolist()
        branches = []
        for _ in range(3):
            comp = rng.integers(1, 11, 3).tolist()
            ids = prompt + comp
            old = [None] * 3 + [-0.3 - (hash(tuple(ids[: t + 1])) % 50) / 40 for t in range(3, 6)]
            branches.append({"input_ids": ids, "loss_mask": [0, 0, 0, 1, 1, 1], "advantage": float(rng.normal()),
                             **({"old_logprobs": old} if behaviour else {})})
        rec = {"id": f"r{i}", "branches": branches}
        if v is not None:
            rec["policy_version"] = v
        out.append(rec)
    return out


def write(d, name, recs):
    d.mkdir(exist_ok=True)
    (d / name).write_text("".join(json.dumps(r) + "\n" for r in recs))


def tokens(fresh, one_behind):
    """The per-token metrics of a trained file whose tokens are 0 or 1 versions behind, none dropped."""
    out = {f"staleness/tokens_{k}": 0.0 for k in ("0", "1", "2", "3", "4plus")}
    out.update({"staleness/tokens_0": float(fresh), "staleness/tokens_1": float(one_behind),
                "staleness/tokens_dropped": 0.0, "staleness/branches_dropped": 0.0})
    return out


def module(d, version, **kw):
    dm = RolloutDirDataModule(str(d), timeout_s=2, poll_s=0.01, **kw)
    dm.policy_version = lambda: version[0]  # the trainer's version, set by the test
    dm.setup()
    return dm


def test_stale_files_are_skipped_exactly_as_configured(tmp_path):
    rng = np.random.default_rng(0)
    d = tmp_path / "r"
    write(d, "f0.jsonl", records([0, 0], rng))
    write(d, "f1.jsonl", records([3, 1], rng))  # oldest record: 2 behind at version 3
    write(d, "f2.jsonl", records([2, 3], rng))  # 1 behind
    write(d, "f3.jsonl", records([0], rng))  # 3 behind
    write(d, "f4.jsonl", records([3], rng))
    version = [0]
    dm = module(d, version, max_staleness=1)
    dm.load_step(0)
    assert dm.step_files[0] == "f0.jsonl"
    assert dm.step_metrics == {"rollout/files_skipped_stale": 0.0, "rollout/staleness_max": 0.0,
                               "rollout/staleness_mean": 0.0, **tokens(18, 0)}  # 2 records x 3 branches x 3 tokens
    dm.consumed_steps = 1
    version[0] = 3
    dm.load_step(1)  # f1 is 2 versions behind: skipped; f2 is trained
    assert dm.step_files[1] == "f2.jsonl"
    assert dm.step_metrics == {"rollout/files_skipped_stale": 1.0, "rollout/staleness_max": 1.0,
                               "rollout/staleness_mean": 0.5, **tokens(9, 9)}
    dm.consumed_steps = 2
    state = dm.state_dict()
    assert state["stale"] == {"skipped": {"1": ["f1.jsonl"]}, "files_skipped_stale": 1}
    dm.load_step(2)  # f3 skipped, f4 trained
    assert dm.step_files[2] == "f4.jsonl" and dm.step_metrics["rollout/files_skipped_stale"] == 2
    dm.consumed_steps = 3
    dm.teardown()
    assert sorted(p.name for p in d.iterdir()) == ["f0.jsonl.consumed", "f1.jsonl.stale", "f2.jsonl.consumed",
                                                   "f3.jsonl.stale", "f4.jsonl.consumed"]

    # a resumed run (state after step 2, files not renamed: e.g. mark_consumed=false) never reads f1 again
    d2 = tmp_path / "r2"
    for name in ("f0", "f1", "f2", "f3", "f4"):
        (d2 / f"{name}.jsonl").parent.mkdir(exist_ok=True)
        (d2 / f"{name}.jsonl").write_text((d / f"{name}.jsonl.{'stale' if name in ('f1', 'f3') else 'consumed'}").read_text())
    dm2 = module(d2, version, max_staleness=1, mark_consumed=False)
    dm2.load_state_dict(state)
    assert dm2.step_metrics["rollout/files_skipped_stale"] == 1
    dm2.load_step(2)
    assert dm2.step_files[2] == "f4.jsonl"  # f1 not retried; f3 skipped again (still 3 behind)
    assert dm2.staleness.skipped == {1: ["f1.jsonl"], 2: ["f3.jsonl"]}


def test_without_a_limit_every_file_trains_and_staleness_is_reported(tmp_path):
    rng = np.random.default_rng(1)
    d = tmp_path / "r"
    write(d, "a.jsonl", records([0, 2], rng))
    dm = module(d, [5])
    dm.load_step(0)
    assert dm.step_files[0] == "a.jsonl" and dm.step_metrics["rollout/staleness_max"] == 5.0
    assert dm.step_metrics["rollout/staleness_mean"] == 4.0


def test_on_stale_raise_names_the_file_and_versions(tmp_path):
    rng = np.random.default_rng(2)
    d = tmp_path / "r"
    write(d, "a.jsonl", records([1], rng))
    dm = module(d, [4], max_staleness=2, on_stale="raise")
    with pytest.raises(DataError, match=r"a.jsonl: sampled with policy_version 1, 3 versions behind the trainer's 4 "
                                        r"\(data.max_staleness=2\); data.on_stale=skip skips such files"):
        dm.load_step(0)


def test_unversioned_records_count_as_version_0_with_one_warning(tmp_path, caplog):
    rng = np.random.default_rng(3)
    d = tmp_path / "r"
    write(d, "a.jsonl", records([None, None], rng))
    write(d, "b.jsonl", records([None], rng))
    dm = module(d, [1], max_staleness=1)
    with caplog.at_level(logging.WARNING):
        dm.load_step(0)
        dm.consumed_steps = 1
        dm.load_step(1)
    assert dm.step_metrics["rollout/staleness_max"] == 1.0
    assert caplog.text.count("records without policy_version count as version 0") == 1


def test_bad_versions_and_options(tmp_path):
    rng = np.random.default_rng(4)
    d = tmp_path / "r"
    recs = records([0, 0], rng)
    recs[1]["policy_version"] = "v3"
    write(d, "a.jsonl", recs)
    with pytest.raises(DataError, match=r"a.jsonl:2: policy_version: must be a non-negative integer"):
        module(d, [0]).load_step(0)
    with pytest.raises(ValueError, match="data.max_staleness must be a non-negative number of versions or null"):
        StalenessGate(-1)
    with pytest.raises(ValueError, match="data.on_stale must be 'skip' or 'raise'"):
        StalenessGate(1, "drop")


def test_behaviour_correction_needs_the_samplers_logprobs_in_the_records(tmp_path):
    from treelit.builders.assemble import Limits
    from treelit.objectives import make_objective

    rng = np.random.default_rng(5)
    d = tmp_path / "r"
    write(d, "a.jsonl", records([0], rng, behaviour=False))
    dm = module(d, [0])
    obj = make_objective("grpo", behavior_correction="tis")
    dm.check_against(11, 64, objective=obj)
    assert isinstance(dm.limits, Limits)
    with pytest.raises(DataError, match=r"a.jsonl:1: branches\[0\].old_logprobs: objective=grpo with a behaviour "
                                        r"correction needs the sampler's log-prob for every target token; position 3"):
        dm.load_step(0)


def test_treelit_train_skips_stale_files_against_the_published_version(tmp_path):
    """Publishing every step: the trainer is at version k when it loads the file for step k+1.
    With max_staleness=1 the files 2 or more versions behind are skipped, the others trained
    once each, and the behaviour correction sees the records' log-probs."""
    from treelit.cli.config import compose
    from treelit.cli.train import run
    from treelit.lightning.publish import read_latest

    rng = np.random.default_rng(6)
    d = tmp_path / "r"
    plan = [("s0", [0]), ("s1", [0]), ("s2", [0]), ("s3", [2]), ("s4", [1]), ("s5", [3])]
    for name, versions in plan:
        write(d, f"{name}.jsonl", records(versions, rng))
    pub = tmp_path / "policy"
    cfg = compose([f"output_dir={tmp_path / 'out'}", *SMALL, "data=rollouts", f"data.directory={d}", "data.timeout_s=5",
                   "data.max_staleness=1", "objective=grpo", "objective.behavior_correction=tis",
                   "old_logprobs=rollout", "trainer.max_steps=4", f"publish.dir={pub}", "publish.dtype=float32"])
    summary = run(cfg)
    assert summary["global_step"] == 4
    # step 1 (version 0): s0; step 2 (version 1): s1; step 3 (version 2): s2 is 2 behind -> skipped, s3;
    # step 4 (version 3): s4 is 2 behind -> skipped, s5
    assert sorted(p.name for p in d.iterdir()) == ["s0.jsonl.consumed", "s1.jsonl.consumed", "s2.jsonl.stale",
                                                   "s3.jsonl.consumed", "s4.jsonl.stale", "s5.jsonl.consumed"]
    m = summary["metrics"]
    assert m["rollout/files_skipped_stale"] == 2 and m["rollout/staleness_max"] == 0
    assert read_latest(pub)["version"] == 4 and m["publish/version"] == 4
    for key in ("behavior/ratio_mean", "behavior/ratio_max", "behavior/truncated_frac", "behavior/kl"):
        assert key in m and np.isfinite(m[key]), key
    assert m["behavior/kl"] > 0  # the records' log-probs are not the trainer's
    assert torch.isfinite(torch.tensor(m["loss"]))
