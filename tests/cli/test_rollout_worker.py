"""``treelit-rollout``, the reference sampler: the log-probs it records are the published
policy's own, records follow the documented contract, it waits for the version its
staleness bound needs and resumes after the files already written; the reward registry."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_model
from treelit.cli.rollout import _args, next_step, read_prompts, run
from treelit.lightning.publish import PolicyPublisher
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden, output_weight
from treelit.registry import RegistryError
from treelit.rl.rewards import even_tokens, resolve_reward


def logprobs(model, ids):
    x = torch.tensor([ids])
    h = decoder_hidden(model, x, torch.arange(len(ids))[None], CausalContext())[0]
    lp = torch.log_softmax((h @ output_weight(model).t()).double(), -1)[:-1]
    return lp.gather(1, x[0, 1:, None]).squeeze(1)


def prompts_file(tmp_path, extra=None):
    path = tmp_path / "prompts.jsonl"
    recs = [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [4, 5], **(extra or {})}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def worker(tmp_path, *more):
    return _args(["--publish-dir", str(tmp_path / "policy"), "--prompts", str(prompts_file(tmp_path)),
                  "--out", str(tmp_path / "out"), "--n", "3", "--max-new-tokens", "4", "--reward", "even_tokens",
                  "--timeout-s", "1", "--poll-s", "0.05", *more])


@pytest.mark.parametrize("family", ["qwen2_tiny", "hybrid_tiny"])  # transformers, and treelit's own format
def test_records_carry_the_published_policys_logprobs(tmp_path, family):
    model = tiny_model(family, torch.float32)
    PolicyPublisher(tmp_path / "policy", dtype="float32").publish(model, 0)
    assert run(worker(tmp_path, "--steps", "1")) == 0
    recs = [json.loads(line) for line in (tmp_path / "out" / "step-000000.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a@0", "b@0"] and all(r["policy_version"] == 0 for r in recs)
    for r, prompt in zip(recs, ([1, 2, 3], [4, 5])):
        assert len(r["branches"]) == 3
        for br in r["branches"]:
            ids, P = br["input_ids"], len(prompt)
            assert ids[:P] == prompt and len(ids) == P + 4 and br["group"] == r["id"]
            assert br["loss_mask"] == [0] * P + [1] * 4
            assert br["old_logprobs"][:P] == [None] * P
            assert br["reward"] == even_tokens(prompt, ids[P:])
            ref = logprobs(model, ids)[P - 1:]
            assert torch.allclose(torch.tensor(br["old_logprobs"][P:], dtype=torch.float64), ref, atol=2e-5), family


def test_waits_for_the_version_and_resumes_after_its_files(tmp_path):
    model = tiny_model("qwen2_tiny", torch.float32)
    pub = PolicyPublisher(tmp_path / "policy", dtype="float32")
    pub.publish(model, 0)
    with pytest.raises(TimeoutError, match="no policy version >= 1"):  # synchronous: step 1 needs version 1
        run(worker(tmp_path, "--steps", "3"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step-000000.jsonl"]
    assert run(worker(tmp_path, "--steps", "2", "--max-staleness", "1")) == 0  # one version ahead is allowed
    assert json.loads((tmp_path / "out" / "step-000001.jsonl").read_text().splitlines()[0])["policy_version"] == 0
    (tmp_path / "out" / "step-000001.jsonl").rename(tmp_path / "out" / "step-000001.jsonl.consumed")
    assert next_step(tmp_path / "out") == 2
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    pub.publish(model, 2)
    assert run(worker(tmp_path, "--steps", "3")) == 0
    rec = json.loads((tmp_path / "out" / "step-000002.jsonl").read_text().splitlines()[0])
    assert rec["policy_version"] == 2  # the newer weights were loaded
    ids = rec["branches"][0]["input_ids"]
    assert torch.allclose(torch.tensor(rec["branches"][0]["old_logprobs"][3:], dtype=torch.float64),
                          logprobs(model, ids)[2:], atol=2e-5)


def test_a_rerun_in_a_used_folder_says_what_it_found_and_why_it_stops(tmp_path, capsys):
    """The files of an earlier run (consumed by its trainer) cover --steps: one error line naming
    them, exit 1 (before: exit 0 at once, silently); a larger --steps continues after them and
    says so."""
    from treelit.cli.rollout import main

    out = tmp_path / "out"
    out.mkdir()
    for i in range(3):
        (out / f"step-{i:06d}.jsonl.consumed").write_text("{}\n")
    argv = ["--publish-dir", str(tmp_path / "policy"), "--prompts", str(prompts_file(tmp_path)), "--out", str(out),
            "--reward", "even_tokens", "--timeout-s", "0.2", "--poll-s", "0.05"]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--steps", "3"])
    err = capsys.readouterr().err
    assert stop.value.code == 1
    assert err == (f"error: --out {out} already holds the files of steps 0-2 (3 taken by a trainer, 0 waiting), so "
                   "--steps 3 leaves nothing to sample (an earlier run's?). For a new run give an empty --out (and "
                   "the trainer a new publish.dir and data.directory); to go on with that run, a larger --steps\n")
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--steps", "4"])
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 1  # no policy version to sample from (none published here)
    assert err[0] == (f"treelit-rollout: --out {out} holds the files of steps 0-2 (3 taken by a trainer, 0 waiting): "
                      "continuing at step 3")
    assert err[1].startswith("error: ") and "no policy version >= 3" in err[1]


def test_rewards_prompts_and_arguments(tmp_path):
    assert resolve_reward("even_tokens") is even_tokens
    assert resolve_reward("treelit.rl.rewards:even_tokens") is even_tokens
    assert resolve_reward("sum_digits")([3, 4], [7], answer=7) == 1.0
    assert resolve_reward("sum_digits")([3, 4], [6], answer=7) == 0.0
    with pytest.raises(RegistryError, match=r"unknown reward 'even'; known reward names: .*even_tokens"):
        resolve_reward("even")
    with pytest.raises(ValueError, match="cannot import 'nope' from module 'treelit.rl.rewards'"):
        resolve_reward("treelit.rl.rewards:nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "input_ids": [1]}\n{"id": "b", "text": "hi"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a prompt record needs 'input_ids'"):
        read_prompts(str(bad))
    assert len(read_prompts("rl_online_prompts.jsonl")) == 16  # the bundled toy prompts, by name
    with pytest.raises(SystemExit):
        _args(["--publish-dir", "p", "--prompts", "f", "--out", "o", "--reward", "even_tokens", "--steps", "0"])


def test_prompt_fields_reach_the_reward(tmp_path):
    seen = []
    import sys
    import types

    mod = types.ModuleType("t29_reward")
    mod.score = lambda prompt_ids, completion_ids, **rec: seen.append(rec) or 1.0
    sys.modules["t29_reward"] = mod
    PolicyPublisher(tmp_path / "policy").publish(tiny_model("qwen2_tiny", torch.float32), 0)
    a = _args(["--publish-dir", str(tmp_path / "policy"), "--prompts", str(prompts_file(tmp_path, {"answer": 9})),
               "--out", str(tmp_path / "out"), "--n", "2", "--max-new-tokens", "2", "--reward", "t29_reward:score",
               "--steps", "1"])
    assert run(a) == 0
    assert seen[:2] == [{}, {}] and seen[2:] == [{"answer": 9}, {"answer": 9}]


def test_treelit_list_says_how_a_reward_is_chosen(capsys):
    from treelit.cli.main import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "reward  (select with treelit-rollout --reward NAME)" in out and "  even_tokens " in out


@pytest.mark.parametrize("engine", ["auto", "treelit"])  # transformers (KV cache), treelit's decoder
def test_replay_records_the_routing_the_sampler_used(tmp_path, engine):
    """A policy published under model.moe.routing=replay: each branch carries routed_experts for all
    its tokens but the last, the experts the published model's router picks for them (recomputed
    here over the whole branch), and the trainer's checks accept the file."""
    from treelit.builders.assemble import Limits
    from treelit.builders.groups import GroupsBuilder
    from treelit.lightning.data import build_trees
    from treelit.models.factory import replay_shape, set_moe_routing
    from treelit.models.moe import route
    from treelit.tree.routing import decode_routing

    model = tiny_model("qwen3_moe_tiny", torch.float64, vocab_size=16)
    set_moe_routing(model, "replay")
    PolicyPublisher(tmp_path / "policy", dtype="float64").publish(model, 0)
    assert json.loads((tmp_path / "policy" / "latest.json").read_text())["moe_routing"] == "replay"
    assert run(worker(tmp_path, "--steps", "1", "--dtype", "float64", "--engine", engine)) == 0
    path = tmp_path / "out" / "step-000000.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    set_moe_routing(model, "live")
    for br in (b for r in recs for b in r["branches"]):
        ids = br["input_ids"]
        got = decode_routing(br["routed_experts"])
        assert got.shape == (len(ids) - 1, 2, 2)
        ctx = CausalContext()
        with torch.no_grad():
            decoder_hidden(model, torch.tensor([ids]), torch.arange(len(ids))[None], ctx)
        own = torch.stack([route(ctx.router_logits[i], 2, False)[1].sort(-1).values for i in sorted(ctx.router_logits)], 1)
        assert (own[:-1].numpy() == got).all()
    set_moe_routing(model, "replay")
    trees = build_trees(str(path), GroupsBuilder(advantage="grpo"),
                        limits=Limits(16, 64, needs={"advantage": True, "old_logprobs": True}, routing=replay_shape(model)))
    assert trees and all(t.tree.token_routing is not None for t in trees)
