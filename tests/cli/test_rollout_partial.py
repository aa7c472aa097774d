"""``treelit-rollout --partial``: a version published while generations are unfinished is
loaded between two tokens and the generations continue under it; each token records the
version that sampled it and that version's log-prob; short groups are written while long
ones go on into later files; the trainer trains such files under every staleness policy."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_model
from treelit.cli.rollout import Sampler, _args, read_prompts, run
from treelit.cli.rollout_partial import run_partial
from treelit.lightning.publish import PolicyPublisher
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden, output_weight


def logprobs(model, ids):
    x = torch.tensor([ids])
    h = decoder_hidden(model, x, torch.arange(len(ids))[None], CausalContext())[0]
    lp = torch.log_softmax((h @ output_weight(model).t()).double(), -1)[:-1]
    return lp.gather(1, x[0, 1:, None]).squeeze(1)


def prompts_file(tmp_path, k=3):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{j}", "input_ids": [1 + j, 2, 3]}) + "\n" for j in range(k)))
    return path


def args(tmp_path, *more):
    return _args(["--publish-dir", str(tmp_path / "policy"), "--prompts", str(prompts_file(tmp_path)),
                  "--out", str(tmp_path / "out"), "--n", "2", "--reward", "even_tokens", "--timeout-s", "5",
                  "--poll-s", "0.01", "--partial", "--prompts-per-step", "2", *more])


def files(out):
    return [[json.loads(line) for line in p.read_text().splitlines()] for p in sorted(out.glob("step-*.jsonl"))]


def simulated_trainer(tmp_path, family="qwen2_tiny", **kw):
    """Publishes version i+1 (other weights) as soon as file i is written, as a trainer that
    takes file i at version i and publishes after each step would; returns the models by version."""
    models = [tiny_model(family, torch.float32, seed=0, **kw)]
    pub = PolicyPublisher(tmp_path / "policy", dtype="float32", keep=10)
    pub.publish(models[0], 0)
    seen = []

    def log(stats):
        seen.append(stats)
        models.append(tiny_model(family, torch.float32, seed=len(models), **kw))
        pub.publish(models[-1], len(models) - 1)

    log.stats = seen  # each file's stats line
    return models, log


def long_first(group, row):
    """The first group's completions are long (8 tokens), every other one is short (2)."""
    return 8 if group.serial == 0 else 2


@pytest.mark.parametrize("family", ["qwen2_tiny", "hybrid_tiny"])  # transformers, and treelit's own format
def test_versions_change_mid_branch_and_each_token_has_its_versions_logprob(tmp_path, family):
    models, log = simulated_trainer(tmp_path, family)
    a = args(tmp_path, "--steps", "3", "--max-new-tokens", "8", "--max-staleness", "0")
    (tmp_path / "out").mkdir()
    assert run_partial(a, 0, Sampler, read_prompts, stop_at=long_first, log=log) == 0
    recs = files(tmp_path / "out")
    assert len(recs) == 3 and all(len(f) == 2 for f in recs)
    assert [r["id"] for r in recs[0]] == ["p1@1", "p2@2"]  # the short groups are written first
    assert "p0@0" in [r["id"] for r in recs[1]]  # the long one lands in a later file
    mixed = 0
    for i, f in enumerate(recs):
        for r in f:
            for br in r["branches"]:
                vs = br["policy_versions"]
                assert vs[:3] == [None] * 3 and all(v is not None and v <= i for v in vs[3:])  # none from the future
                assert vs[3:] == sorted(vs[3:]) and r["policy_version"] == min(vs[3:])
                mixed += len(set(vs[3:])) > 1
                for t in range(3, len(vs)):  # each token's log-prob is its own version's
                    with torch.no_grad():
                        ref = logprobs(models[vs[t]], br["input_ids"][: t + 1])[-1]
                    assert abs(br["old_logprobs"][t] - float(ref)) < 2e-5, (family, t)
    assert mixed == 2  # both completions of the long group: head under version 0, tail under version 1
    stats = log.stats
    assert [s["versions"] for s in stats] == [[0, 0], [0, 1], [1, 2]]
    assert [s["switches"] for s in stats] == [0, 1, 0]  # version 1 loaded while the long group was unfinished


def test_partial_flag_runs_from_the_command_line_and_refuses_routing(tmp_path, capsys):
    PolicyPublisher(tmp_path / "policy", dtype="float32").publish(tiny_model("qwen2_tiny", torch.float32), 0)
    assert run(args(tmp_path, "--steps", "2", "--max-new-tokens", "3", "--max-staleness", "1")) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert line["step"] == 1 and line["versions"] == [0, 0] and line["completions"] == 4
    recs = files(tmp_path / "out")
    assert [len(r["branches"][0]["policy_versions"]) for r in recs[1]] == [6, 6]
    with pytest.raises(ValueError, match="--record-routing: routing is not recorded with --partial"):
        run(args(tmp_path, "--steps", "3", "--record-routing"))


def partial_files(tmp_path):
    """Three files from a run where version 1 lands while the long group is half done."""
    _, log = simulated_trainer(tmp_path, vocab_size=16)
    a = args(tmp_path, "--steps", "3", "--max-new-tokens", "8", "--max-staleness", "0")
    (tmp_path / "out").mkdir()
    run_partial(a, 0, Sampler, read_prompts, stop_at=long_first, log=log)
    return tmp_path / "out"


def train_on(tmp_path, out, policy, max_staleness):
    from treelit.cli.config import compose
    from treelit.cli.train import run as train

    cfg = compose(["experiment=rl_online", f"rl_dir={tmp_path / 'rl'}", f"data.directory={out}", "logger=none",
                   "callbacks.checkpoint=null", "trainer.enable_progress_bar=false", "callbacks.progress=null",
                   f"output_dir={tmp_path / 'train'}", "trainer.max_steps=3", "data.timeout_s=10",
                   f"data.max_staleness={max_staleness}", f"data.staleness_policy={policy}", "publish.dtype=float32"])
    return train(cfg)


# the last file (read at version 2): one group sampled under version 1 (2 x 2 tokens), one under 2
EXPECTED = {("skip_file", 1): (4, 4, 0, 0), ("drop_tokens", 0): (4, 4, 4, 0), ("drop_branch", 0): (4, 4, 4, 2),
            ("drop_tokens", 2): (4, 4, 0, 0)}


def check_trained(out, summary, policy, max_staleness):
    assert summary["global_step"] == 3
    assert sorted(p.name for p in out.iterdir()) == [f"step-{i:06d}.jsonl.consumed" for i in range(3)]  # none skipped
    m = summary["metrics"]
    assert torch.isfinite(torch.tensor(m["loss"]))
    got = tuple(int(m[f"staleness/{k}"]) for k in ("tokens_0", "tokens_1", "tokens_dropped", "branches_dropped"))
    assert got == EXPECTED[policy, max_staleness], got


def test_the_trainer_trains_partial_rollouts_dropping_stale_tokens(tmp_path):
    """Trained at max_staleness=0 with drop_tokens: tokens a version behind leave the loss, the
    rest of their branches trains."""
    out = partial_files(tmp_path)
    check_trained(out, train_on(tmp_path, out, "drop_tokens", 0), "drop_tokens", 0)


@pytest.mark.slow
@pytest.mark.parametrize("policy, max_staleness", [("skip_file", 1), ("drop_branch", 0), ("drop_tokens", 2)])
def test_the_trainer_trains_partial_rollouts_under_each_policy(tmp_path, policy, max_staleness):
    out = partial_files(tmp_path)
    check_trained(out, train_on(tmp_path, out, policy, max_staleness), policy, max_staleness)


@pytest.mark.parametrize("bad, says", [
    (lambda vs: vs[:-1], r"branches\[0\]\.policy_versions: must be a list of \d+ versions \(one per token"),
    (lambda vs: vs[:-1] + [5], r"branches\[0\]\.policy_versions\[\d+\]: version 5 is newer than the trainer's policy "
                               r"version 0 \(a version in the future"),
])
def test_a_bad_version_list_is_one_error_line_naming_file_and_line(tmp_path, cli_main, capsys, bad, says):
    """A partial-rollout file edited to hold a version list of the wrong length, or a version the
    trainer has not published: treelit-train stops with one error line naming file:line and field."""
    import re

    out = partial_files(tmp_path)
    path = out / "step-000000.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    recs[0]["branches"][0]["policy_versions"] = bad(recs[0]["branches"][0]["policy_versions"])
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code = cli_main("experiment=rl_online", f"rl_dir={tmp_path / 'rl'}", f"data.directory={out}", "logger=none",
                    "callbacks.checkpoint=null", "trainer.enable_progress_bar=false", "callbacks.progress=null",
                    f"output_dir={tmp_path / 'train'}", "trainer.max_steps=3", "data.timeout_s=10",
                    "data.staleness_policy=drop_tokens")
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(err) == 1, err
    assert re.search(re.escape(f"{path}:1: ") + says, err[0]), err[0]


def test_length_buckets_trade_padding_against_forwards():
    from treelit.cli.rollout_partial import length_buckets

    assert length_buckets([5, 5, 5]) == [[0, 1, 2]]  # one length: one forward
    assert sorted(map(sorted, length_buckets([10, 12, 11], fixed=256))) == [[0, 1, 2]]  # close: padded together
    assert sorted(map(sorted, length_buckets([100, 4, 4, 100], fixed=8))) == [[0, 3], [1, 2]]  # far apart: two
    runs = length_buckets([7, 3, 9, 3, 50], fixed=20)
    assert sorted(j for r in runs for j in r) == list(range(5))
