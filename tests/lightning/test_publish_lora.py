"""Publishing a LoRA policy (``publish.lora``): ``adapter`` writes only the PEFT adapter folder at
each version, which PEFT and ``treelit-rollout`` load onto the base checkpoint to the trainer's
logits (float64, 1e-10); ``merged`` writes full weights equal to base + adapter; the hook presets
that load an adapter into a running vLLM / SGLang server; bad options are one line before
training; and the online loop with ``publish.lora=adapter`` closes (``-m slow``)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import treelit
from app_helpers import SMALL
from float64_mode import KeepFloat64
from hf_oracle import load_hf_oracle, make_exact, random_hf_checkpoint
from treelit.lightning.publish import PolicyPublisher, read_latest

peft = pytest.importorskip("peft")

CONFIG = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=64, num_hidden_layers=2, tie_word_embeddings=False)
LORA = dict(rank=4, alpha=8, init=False)
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "treelit-manifest.json", "treelit_publish.json"]
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 9, 11]])
TREE = ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7]], [[0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]], [1.0, 1.0, 1.0])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("publish_lora_base")
    random_hf_checkpoint(path, "qwen2", **CONFIG)
    return path


def lora_model(base, **lora):
    from treelit.models.hf_adapter import make_hf_model

    torch.manual_seed(1)
    return make_hf_model(str(base), dtype="float64", lora=dict(LORA, **lora))


def sgd_step(model, lr=0.5):
    """One optimizer step on a small tree (the adapters move; the base is frozen)."""
    loss = treelit.tree_loss(model, treelit.TokenTree.from_branches(*TREE), "token-mean", "sdpa_dense")
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
                p.grad = None


def logits(model):
    """The logits of ``IDS``, float64 throughout: a treelit model's or a transformers / PEFT one's."""
    with torch.no_grad(), KeepFloat64():
        return model(IDS) if hasattr(model, "tok_embeddings") else model(input_ids=IDS).logits


@pytest.fixture(autouse=True)
def grad_mode():
    """treelit-rollout's sampler switches autograd off for its process: on again for the next test."""
    with torch.enable_grad():
        yield


def assert_same(got, expected, what):
    err = (got - expected).abs().max().item()
    assert err <= 1e-10 * expected.abs().max().item(), f"{what}: max logit difference {err:.2e}"


def test_each_adapter_version_loads_with_peft_and_in_treelit_rollout_to_the_trainers_logits(tmp_path, base):
    from treelit.cli.rollout import Sampler

    model = lora_model(base, modules_to_save=["lm_head"])
    pub = PolicyPublisher(tmp_path / "pub", dtype="float64", keep=10, lora="adapter")
    pub.prepare()
    expected = {}
    for version in range(3):
        if version:
            sgd_step(model)
        res = pub.publish(model, version, step=version)
        expected[version] = logits(model)
        assert sorted(p.name for p in res.path.iterdir()) == ADAPTER_FILES  # no weights of the base
        assert json.loads((res.path / "treelit_publish.json").read_text()) == {
            "version": version, "step": version, "kind": "lora_adapter", "base": str(base.resolve())}
        latest = read_latest(tmp_path / "pub")
        assert (latest["version"], latest["path"], latest["kind"], latest["base"]) == (
            version, str(res.path.resolve()), "lora_adapter", str(base.resolve()))
        config = json.loads((res.path / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == LORA["rank"]
    assert (expected[2] - expected[0]).abs().max() > 1e-3, "training must move the adapters"
    # PEFT, as a sampler server would: the base checkpoint, then each version's adapter folder on it
    for version in range(3):
        ref = load_hf_oracle(base, dtype=torch.float64, exact=True)
        loaded = peft.PeftModel.from_pretrained(ref, str(tmp_path / "pub" / f"step-{version}"))
        assert_same(logits(loaded), expected[version], f"PEFT, version {version}")
    # treelit-rollout's sampler: the base loaded once, each version's adapter read into it
    sampler, built = Sampler(str(tmp_path / "pub"), "float64"), None
    for version in range(3):
        sampler.load({"version": version, "path": str(tmp_path / "pub" / f"step-{version}"),
                      "kind": "lora_adapter", "base": str(base)})
        if built is None:
            built = sampler._peft
            make_exact(sampler.model)  # float64 throughout, as the oracle
        assert sampler._peft is built, "the base is loaded once"
        assert sampler.tokenizer_dir == base and sampler.version == version
        assert_same(logits(sampler.model), expected[version], f"treelit-rollout, version {version}")


def test_merged_publish_is_base_plus_adapter(tmp_path, base):
    model = lora_model(base)
    sgd_step(model)
    ref = peft.PeftModel.from_pretrained(load_hf_oracle(base, dtype=torch.float64, exact=True),
                                         str(PolicyPublisher(tmp_path / "a", dtype="float64", lora="adapter")
                                             .publish(model, 0).path))
    res = PolicyPublisher(tmp_path / "m", dtype="float64", lora="merged").publish(model, 0)
    assert "kind" not in read_latest(tmp_path / "m")  # a plain checkpoint, as without LoRA
    weights = load_file(str(res.path / "model.safetensors"))
    assert weights.keys() == load_file(str(base / "model.safetensors")).keys()  # the base's own names
    merged = load_hf_oracle(res.path, dtype=torch.float64, exact=True)
    assert_same(logits(merged), logits(ref), "merged vs PEFT base + adapter")
    assert_same(logits(merged), logits(model), "merged vs the trainer")
    # bfloat16: merged in the training dtype, then cast once
    from treelit.models.lora import merged_state_dict

    exact = merged_state_dict(model, model.state_dict())
    bf16 = load_file(str(PolicyPublisher(tmp_path / "b").publish(model, 0).path / "model.safetensors"))
    for k, v in bf16.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, exact["hf." + k].to(torch.bfloat16)), k


def test_merged_publish_of_a_native_lora_model(tmp_path):
    from helpers import tiny_model
    from treelit.models.lora import apply_lora

    model = apply_lora(tiny_model("qwen2_5_tiny", torch.float64, vocab_size=16), LORA)
    sgd_step(model)
    res = PolicyPublisher(tmp_path / "pub", dtype="float64").publish(model, 0)
    back = treelit.load_hf_checkpoint(res.path, dtype=torch.float64)
    assert_same(logits(back), logits(model), "merged native model")


class _Recorder:
    """A local HTTP server that records each POST's path and JSON body and answers 200."""

    def __init__(self):
        self.calls = []
        calls = self.calls

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                calls.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_lora_hook_presets_send_the_adapter_with_its_version_in_its_name(tmp_path, base):
    server = _Recorder()
    try:
        pub = PolicyPublisher(tmp_path / "pub", lora="adapter", hooks={
            "vllm": {"preset": "vllm_lora", "url": server.url}, "sglang": {"preset": "sglang_lora", "url": server.url}})
        res = pub.publish(lora_model(base), 7)
    finally:
        server.close()
    path = str(res.path.resolve())
    assert server.calls == [("/v1/load_lora_adapter", {"lora_name": "policy-v7", "lora_path": path}),
                            ("/load_lora_adapter", {"lora_name": "policy-v7", "lora_path": path})]
    assert res.hook_failures == 0


def test_bad_options_are_one_line(tmp_path, base):
    from helpers import tiny_model
    from treelit.models.lora import apply_lora

    cases = [
        (dict(lora="both"), None, "publish.lora must be adapter (the LoRA adapter only) or merged"),
        (dict(lora="adapter"), tiny_model("qwen2_5_tiny", torch.float32),
         "publish.lora=adapter publishes the LoRA adapter, and this model has none: set model.lora.rank"),
        (dict(lora="adapter"), apply_lora(tiny_model("qwen2_5_tiny", torch.float32), LORA),
         "publish.lora=adapter needs model=hf_auto"),
        (dict(lora="adapter", hooks={"s": {"preset": "sglang", "url": "http://x"}}), None,
         "publish.hooks.s.preset=sglang reloads full weights, but publish.lora=adapter publishes adapters only: "
         "use preset sglang_lora"),
        (dict(hooks={"v": {"preset": "vllm_lora", "url": "http://x"}}), None,
         "publish.hooks.v.preset=vllm_lora loads a LoRA adapter, but publish.lora=merged publishes full weights: "
         "use preset vllm"),
    ]
    for options, model, message in cases:
        with pytest.raises(ValueError) as err:
            pub = PolicyPublisher(tmp_path / "pub", **options)
            pub.publish(model, 0)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "pub").exists() or not list((tmp_path / "pub").glob("step-*"))


def test_treelit_train_refuses_publish_lora_adapter_without_lora_before_training(tmp_path, cli_main, capsys):
    status = cli_main("logger=none", "data.max_trees=4", f"output_dir={tmp_path / 'out'}",
                      f"publish.dir={tmp_path / 'policy'}", "publish.lora=adapter")
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: publish.lora=adapter publishes the LoRA adapter"), err
    assert not list((tmp_path / "policy").glob("step-*")) if (tmp_path / "policy").exists() else True


RUN = [o for o in SMALL if not o.startswith("model.")] + [
    "model=hf_auto", "model.lora.rank=8", "publish.lora=adapter", "publish.keep=10", "data=jsonl"]


def test_treelit_train_publishes_only_adapters_and_treelit_rollout_samples_base_plus_adapter(tmp_path, base,
                                                                                             one_tree_jsonl):
    """A run with ``publish.lora=adapter``: versions 0..3 are adapter folders (small), each a
    different adapter; ``treelit-rollout`` samples the newest as base + adapter, and the log-probs
    it records are those of PEFT's base + adapter."""
    from treelit.cli.config import compose
    from treelit.cli.rollout import _args, run as rollout
    from treelit.cli.train import run

    pub = tmp_path / "policy"
    summary = run(compose([f"output_dir={tmp_path / 'run'}", f"model.hf_checkpoint={base}", *RUN,
                           f"data.train_path={one_tree_jsonl}", "trainer.max_steps=3", "optimizer.lr=0.05",
                           f"publish.dir={pub}"]))
    assert summary["global_step"] == 3 and summary["metrics"]["publish/version"] == 3
    assert sorted(p.name for p in pub.iterdir()) == ["latest.json", "step-0", "step-1", "step-2", "step-3"]
    adapters = []
    for v in range(4):
        assert sorted(p.name for p in (pub / f"step-{v}").iterdir()) == ADAPTER_FILES, v
        adapters.append(load_file(str(pub / f"step-{v}" / "adapter_model.safetensors")))
    assert all(".lora_" in k for k in adapters[0])
    assert any(not torch.equal(adapters[0][k], adapters[3][k]) for k in adapters[0]), "the adapters must train"
    size = sum(p.stat().st_size for p in (pub / "step-3").iterdir())
    assert summary["metrics"]["publish/bytes"] == size < (base / "model.safetensors").stat().st_size / 2
    latest = read_latest(pub)
    assert latest["kind"] == "lora_adapter" and latest["base"] == str(base.resolve())

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "input_ids": [3, 1, 4]}) + "\n")
    args = _args(["--publish-dir", str(pub), "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--n", "2",
                  "--max-new-tokens", "4", "--reward", "even_tokens", "--steps", "1", "--max-staleness", "3",
                  "--dtype", "float64"])
    assert rollout(args) == 0
    rec = json.loads((tmp_path / "out" / "step-000000.jsonl").read_text())
    assert rec["policy_version"] == 3
    ref = peft.PeftModel.from_pretrained(load_hf_oracle(base, dtype=torch.float64, exact=False),
                                         str(pub / "step-3"))
    for br in rec["branches"]:
        ids = torch.tensor([br["input_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=ids).logits[0].double(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        got = torch.tensor(br["old_logprobs"][3:], dtype=torch.float64)
        assert torch.allclose(got, lp[2:], atol=1e-9), (got, lp[2:])


def test_treelit_rollout_reads_adapters_from_its_publish_dir_only(tmp_path, base):
    from treelit.cli.rollout import Sampler
    from treelit.utils.integrity import write_manifest

    pub = tmp_path / "pub"
    PolicyPublisher(pub, lora="adapter").publish(lora_model(base), 0)
    sampler = Sampler(str(pub))
    bad = [({"path": "/elsewhere/model"}, "is not a step-<N> directory"),
           ({"path": str(pub / "step-1")}, "no adapter_model.safetensors"),
           ({"path": str(pub / "step-0"), "base": str(tmp_path / "nothing")}, "give the base checkpoint with --base")]
    (pub / "step-1").mkdir()
    (pub / "step-1" / "adapter_model.bin").write_bytes(b"pickle")
    for extra, message in bad:
        latest = {"version": 0, "kind": "lora_adapter", "base": str(base), **extra}
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            sampler.load(latest)
    cfg = json.loads((pub / "step-0" / "adapter_config.json").read_text())
    (pub / "step-0" / "adapter_config.json").write_text(json.dumps(dict(cfg, megatron_config={"x": 1})))
    write_manifest(pub / "step-0")  # a version written this way, not one altered after its manifest
    with pytest.raises(ValueError, match="megatron_config is set, which treelit-rollout does not load"):
        sampler.load({"version": 0, "kind": "lora_adapter", "base": str(base), "path": str(pub / "step-0")})


EXE = str(Path(sys.executable).with_name("treelit-train"))
STEPS = 30


def _wait(cond, procs, what, timeout=900):
    end = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() in (None, 0), f"{what}: a process failed ({p.args[:3]}): {p.returncode}"
        assert time.monotonic() < end, f"{what}: timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_the_online_loop_with_adapters_closes_and_publishes_only_adapters(tmp_path):
    """``treelit-train experiment=rl_online`` on a transformers model with LoRA and
    ``publish.lora=adapter``, ``treelit-rollout`` sampling base + adapter: the mean reward rises,
    and every version the trainer published is an adapter folder."""
    base = tmp_path / "base"
    random_hf_checkpoint(base, "qwen2", std=0.1, **dict(CONFIG, hidden_size=64, intermediate_size=128))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    rl, seen = tmp_path / "rl", {}
    train = [EXE, "experiment=rl_online", f"rl_dir={rl}", "logger=none", f"trainer.max_steps={STEPS}",
             "trainer.enable_progress_bar=false", "callbacks.progress=null", "callbacks.checkpoint=null",
             "model=hf_auto", "~model.config", f"model.hf_checkpoint={base}", "model.lora.rank=8",
             "model.lora.alpha=32", "optimizer.lr=0.05", "publish.lora=adapter", f"output_dir={tmp_path / 'out'}"]
    work = [sys.executable, "-m", "treelit.cli.rollout", "--publish-dir", str(rl / "policy"), "--out",
            str(rl / "rollouts"), "--prompts", "rl_online_prompts.jsonl", "--reward", "even_tokens", "--n", "8",
            "--max-new-tokens", "6", "--steps", str(STEPS), "--max-staleness", "1"]
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("train", "work")}
    trainer = subprocess.Popen(train, cwd=tmp_path, env=env, stdout=logs["train"], stderr=subprocess.STDOUT)
    worker = subprocess.Popen(work, cwd=tmp_path, env=env, stdout=logs["work"], stderr=subprocess.STDOUT)

    def versions():  # every version directory the trainer published, as it appears (keep=3 prunes)
        for d in (rl / "policy").glob("step-*"):
            try:
                seen.setdefault(d.name, sorted(p.name for p in d.iterdir()))
            except FileNotFoundError:  # pruned meanwhile
                pass
        return trainer.poll() is not None

    try:
        _wait(versions, [trainer, worker], "training")
        assert trainer.wait() == 0, (tmp_path / "train.log").read_text()[-3000:]
        assert worker.wait(timeout=300) == 0, (tmp_path / "work.log").read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            if p.poll() is None:
                p.kill()
    assert len(seen) >= STEPS // 2, sorted(seen)
    assert all(files == ADAPTER_FILES for files in seen.values()), seen
    latest = read_latest(rl / "policy")
    assert latest["version"] == STEPS and latest["kind"] == "lora_adapter"
    rewards = []
    for i in range(STEPS):
        lines = (rl / "rollouts" / f"step-{i:06d}.jsonl.consumed").read_text().splitlines()
        recs = [json.loads(line) for line in lines]
        rewards.append(sum(b["reward"] for r in recs for b in r["branches"]) / sum(len(r["branches"]) for r in recs))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"mean reward: first 5 files {first:.3f}, last 5 files {last:.3f}")
    assert last > first + 0.1, rewards
