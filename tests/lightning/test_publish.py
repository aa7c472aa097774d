"""Policy publishing (``publish.*``): layout, versions, atomicity under concurrent readers and
``kill -9``, hooks against a local HTTP server, and the callback inside ``treelit-train``."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import treelit
from app_helpers import SMALL
from helpers import tiny_model
from treelit.lightning.publish import PolicyPublisher, PublishError, read_latest
from hf_oracle import hf_from_pretrained  # noqa: E402

SRC = str(Path(treelit.__file__).resolve().parents[1])


def fill_(model, value: float):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def check_version(latest) -> int:
    """Every file of the checkpoint ``latest`` names is complete and holds its version."""
    path = Path(latest["path"])
    meta = json.loads((path / "treelit_publish.json").read_text())
    assert meta["version"] == latest["version"]
    json.loads((path / "config.json").read_text())
    json.loads((path / "generation_config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    assert sd, "no tensors"
    for k, v in sd.items():
        assert torch.all(v.float() == float(latest["version"] % 200)), f"{k} of version {latest['version']}"
    return len(sd)


def test_layout_versions_dtype_and_keep(tmp_path):
    model = tiny_model("qwen2_tiny", torch.float32)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "x"}')
    (tok / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (tok / "generation_config.json").write_text('{"eos_token_id": 7, "top_k": 20, "temperature": 0.6}')
    pub = PolicyPublisher(tmp_path / "pub", dtype="bfloat16", keep=3, tokenizer=str(tok))
    pub.prepare()
    res = pub.publish(model, 0)
    step0 = tmp_path / "pub" / "step-0"
    assert res.path == step0 and res.bytes == sum(p.stat().st_size for p in step0.iterdir())
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (step0 / name).is_file(), name
    gen = json.loads((step0 / "generation_config.json").read_text())
    assert gen == {"do_sample": True, "eos_token_id": 7, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    latest = read_latest(tmp_path / "pub")
    assert latest["version"] == 0 and latest["path"] == str(step0.resolve()) and latest["time"] <= time.time()
    # the weights: the model's, in bfloat16, loadable by treelit (and by transformers: it is a Qwen2 checkpoint)
    back = treelit.load_hf_checkpoint(step0, dtype=torch.float32)
    for (k, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), k
    from transformers import AutoModelForCausalLM

    hf = hf_from_pretrained(step0)
    assert hf.config.model_type == "qwen2"
    for v in range(1, 6):
        pub.publish(model, v)
    assert pub.versions() == [3, 4, 5] and read_latest(tmp_path / "pub")["version"] == 5
    assert not [p for p in (tmp_path / "pub").iterdir() if p.name.startswith(".")], "temporary files left"
    f32 = PolicyPublisher(tmp_path / "f32", dtype="float32").publish(model, 0)
    assert all(v.dtype == torch.float32 for v in load_file(str(f32.path / "model.safetensors")).values())


def test_hybrid_is_published_in_the_native_format(tmp_path):
    model = tiny_model("hybrid_tiny", torch.float32)
    res = PolicyPublisher(tmp_path / "pub").publish(model, 0)
    assert json.loads((res.path / "config.json").read_text())["model_type"] == "treelit"
    back = treelit.load_hf_checkpoint(res.path, dtype=torch.float32)
    assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in model.parameters())


def test_bad_options_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="publish.dtype must be one of bfloat16, float32"):
        PolicyPublisher(tmp_path, dtype="float16")
    with pytest.raises(ValueError, match="publish.keep must be a positive"):
        PolicyPublisher(tmp_path, keep=0)
    with pytest.raises(ValueError, match=r"publish.hooks.s.preset must be one of sglang, vllm"):
        PolicyPublisher(tmp_path, hooks={"s": {"preset": "tgi", "url": "http://x"}})
    with pytest.raises(ValueError, match=r"publish.hooks.s.url must be an http"):
        PolicyPublisher(tmp_path, hooks={"s": {"preset": "sglang", "url": "localhost:3000"}})
    with pytest.raises(ValueError, match=r"publish.hooks.s.body: a template may name only"):
        PolicyPublisher(tmp_path, hooks={"s": {"url": "http://x", "path": "/r", "body": {"a": "{model}"}}})
    with pytest.raises(ValueError, match="publish.tokenizer: directory"):
        PolicyPublisher(tmp_path, tokenizer=str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"publish.dir: .* cannot be written \(.*file is not a writable directory\)"):
        PolicyPublisher(tmp_path / "file" / "policy")
    from treelit.lightning.publish import PublishPolicy

    with pytest.raises(ValueError, match="publish.every_n_steps must be a positive"):
        PublishPolicy(dir=str(tmp_path), every_n_steps=0)


def test_a_polling_reader_never_sees_a_partial_checkpoint(tmp_path):
    model = tiny_model("qwen2_tiny", torch.float32)
    pub = PolicyPublisher(tmp_path / "pub", dtype="float32", keep=1000)
    pub.prepare()
    pub.publish(fill_(model, 0.0), 0)
    stop = threading.Event()
    seen, errors = [], []

    def reader():
        while not stop.is_set():
            try:
                latest = read_latest(tmp_path / "pub")
                check_version(latest)
                seen.append(latest["version"])
            except Exception as exc:  # a partial file, a missing one, a torn latest.json
                errors.append(repr(exc))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for v in range(1, 41):
            pub.publish(fill_(model, float(v)), v)
    finally:
        stop.set()
        t.join()
    assert not errors, errors[:3]
    assert len(set(seen)) >= 5 and seen == sorted(seen), "the reader followed the versions in order"


KILLED_PUBLISHER = textwrap.dedent('''
    import sys, torch
    sys.path[:0] = [{tests!r}, {src!r}]
    from helpers import tiny_model
    from treelit.lightning.publish import PolicyPublisher, read_latest
    torch.set_num_threads(1)
    model = tiny_model("qwen2_tiny", torch.float32, embed_dim=64, intermediate_dim=256)
    pub = PolicyPublisher({directory!r}, dtype="float32", keep=2)
    pub.prepare()
    latest = read_latest({directory!r})
    v = 0 if latest is None else latest["version"] + 1
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(v % 200))
        pub.publish(model, v)
        v += 1
''')


@pytest.mark.slow  # a fresh Python process per kill (~40 s each on a loaded 2-core machine)
def test_kill_9_during_a_publish_leaves_the_previous_version_loadable(tmp_path):
    directory = tmp_path / "pub"
    script = tmp_path / "publisher.py"
    script.write_text(KILLED_PUBLISHER.format(tests=str(Path(__file__).parents[1]), src=SRC, directory=str(directory)))
    interrupted, last = 0, -1
    for trial in range(3):
        proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            end = time.monotonic() + 120
            while (read_latest(directory) or {}).get("version", -1) <= last + 1:
                assert proc.poll() is None, "the publisher died"
                assert time.monotonic() < end, "no publish within 120 s"
                time.sleep(0.02)
            time.sleep(0.05 + 0.07 * trial)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        interrupted += any(p.name.startswith(".step-") for p in directory.iterdir())
        latest = read_latest(directory)
        assert latest["version"] > last
        check_version(latest)  # complete, loadable, the version it says
        last = latest["version"]
    assert interrupted >= 1, "no kill landed inside a publish (the test did not test anything)"
    PolicyPublisher(directory).prepare()  # the next publisher cleans up what the killed one left
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]


class _Server:
    """A local HTTP server recording every POST (path, JSON body); answers ``codes`` in turn, then 200."""

    def __init__(self, codes=()):
        self.requests, self.codes = [], list(codes)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append((self.path, json.loads(body), self.headers.get("Content-Type")))
                code = outer.codes.pop(0) if outer.codes else 200
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b'{"success": true}')

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_hooks_send_the_documented_bodies(tmp_path):
    server = _Server()
    model = tiny_model("qwen2_tiny", torch.float32)
    try:
        hooks = {"sglang": {"preset": "sglang", "url": server.url},
                 "vllm": {"preset": "vllm", "url": server.url + "/"},
                 "mine": {"url": server.url, "path": "/reload", "body": {"dir": "{path}", "tag": "v{version}",
                                                                        "step": "{step}", "flags": [True, 3]}},
                 "off": None}
        pub = PolicyPublisher(tmp_path / "pub", hooks=hooks)
        res = pub.publish(model, 4)
    finally:
        server.close()
    path = str(res.path.resolve())
    assert server.requests == [
        ("/update_weights_from_disk", {"model_path": path, "weight_version": "4"}, "application/json"),
        ("/update_weights", {"weight_dir": path}, "application/json"),
        ("/reload", {"dir": path, "tag": "v4", "step": "4", "flags": [True, 3]}, "application/json"),
    ]
    assert res.hook_failures == 0


def test_hook_retries_failures_counted_and_required(tmp_path, caplog):
    model = tiny_model("qwen2_tiny", torch.float32)
    server = _Server(codes=[500, 503])
    try:
        pub = PolicyPublisher(tmp_path / "a", hooks={"s": {"preset": "sglang", "url": server.url, "retries": 2,
                                                          "retry_wait_s": 0}})
        assert pub.publish(model, 0).hook_failures == 0  # the third attempt succeeds
        assert len(server.requests) == 3
    finally:
        server.close()
    dead = server.url  # nothing listens there any more
    pub = PolicyPublisher(tmp_path / "b", hooks={"s": {"preset": "vllm", "url": dead, "retries": 1, "retry_wait_s": 0,
                                                      "timeout_s": 2}})
    res = pub.publish(model, 0)
    assert res.hook_failures == 1 and pub.hook_failures == 1
    assert "publish hook 's'" in caplog.text and "after 2 attempts" in caplog.text
    assert read_latest(tmp_path / "b")["version"] == 0  # the version is published all the same
    pub = PolicyPublisher(tmp_path / "c", required=True, hooks={"s": {"preset": "vllm", "url": dead, "retries": 0}})
    with pytest.raises(PublishError, match=r"publish hook 's' .* failed for version 0 .*publish.required=true"):
        pub.publish(model, 0)


def test_treelit_train_publishes_version_0_and_every_n_steps(tmp_path):
    from treelit.cli.config import compose
    from treelit.cli.train import run

    pub = tmp_path / "policy"
    cfg = compose([f"output_dir={tmp_path / 'run'}", *SMALL, "trainer.max_steps=5", f"publish.dir={pub}",
                   "publish.every_n_steps=2", "publish.keep=2", "publish.dtype=float32"])
    summary = run(cfg)
    assert summary["global_step"] == 5
    assert sorted(p.name for p in pub.iterdir()) == ["latest.json", "step-2", "step-4"]
    assert read_latest(pub)["version"] == 4
    assert summary["metrics"]["publish/version"] == 4 and summary["metrics"]["publish/bytes"] > 0
    # version 4 holds the weights after optimizer step 4: a resumed run would train from them
    back = treelit.load_hf_checkpoint(pub / "step-4", dtype=torch.float32)
    assert sum(p.numel() for p in back.parameters()) > 0
    assert compose(["publish.dir=null"]).publish.dir is None
