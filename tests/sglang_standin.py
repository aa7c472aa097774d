"""A local stand-in for an SGLang server, for the recipe tests: the few routes of SGLang's native
HTTP API that an online RL loop uses, served with transformers on the CPU.

    python tests/sglang_standin.py --model-path DIR [--host 127.0.0.1] [--port 30000] [--log calls.jsonl]

* ``GET /health``: 200 once the model is loaded.
* ``GET /model_info`` and ``GET /get_weight_version``: ``{"weight_version": ...}`` (``"default"``
  until the first update, as SGLang's ``--weight-version`` default), ``/model_info`` with
  ``model_path`` too.
* ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"}``: loads the Hugging Face
  checkpoint at ``model_path`` (generation waits meanwhile) and answers ``{"success", "message"}``.
* ``POST /generate`` ``{"input_ids": [...] or [[...], ...], "sampling_params": {"temperature",
  "max_new_tokens", "n", "top_p", "top_k", "ignore_eos"}, "return_logprob"}``: samples from the
  loaded model (top-p / top-k other than off are refused) and answers as SGLang does, one object
  per completion (a list for a batch or ``n`` > 1) with ``output_ids`` and ``meta_info``
  (``weight_version``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens`` and, with
  ``return_logprob``, ``output_token_logprobs``: ``[logprob, token_id, null]`` per generated token).

With ``--log`` every update request is appended to that file as one JSON line
(``{"route", "body", "success"}``), so a test can check which versions it was told about.
"""

from __future__ import annotations

import argparse
import http.server
import json
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch


class Engine:
    """The loaded model, its weight version and the sampling."""

    def __init__(self, model_path: str) -> None:
        self.lock = threading.Lock()
        self.model_path, self.version = "", "default"
        self.model, self.eos = None, None
        self.load(model_path)

    def load(self, model_path: str) -> None:
        from transformers import AutoModelForCausalLM

        from treelit.models.hf_kernels import no_hub_kernels

        path = Path(model_path)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False,
                                                     **no_hub_kernels()).eval()
        gen = path / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        self.model, self.model_path = model, str(path)
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    @torch.no_grad()
    def generate(self, prompts: List[List[int]], params: Dict[str, Any], logprobs: bool) -> List[Dict[str, Any]]:
        temperature = float(params.get("temperature", 1.0))
        if params.get("top_p", 1.0) != 1.0 or params.get("top_k", -1) not in (-1, 0, None) or temperature <= 0:
            raise ValueError("the stand-in samples at a temperature > 0 without top-p / top-k only")
        n, steps = int(params.get("n", 1)), int(params.get("max_new_tokens", 128))
        stop = set() if params.get("ignore_eos") else self.eos
        outs = []
        for prompt in prompts:
            for _ in range(n):
                ids, toks, lps, reason = list(prompt), [], [], {"type": "length", "length": steps}
                for _ in range(steps):
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].double() / temperature
                    logp = torch.log_softmax(logits, -1)
                    tok = int(torch.multinomial(logp.exp(), 1))
                    ids.append(tok)
                    toks.append(tok)
                    lps.append(float(logp[tok]))
                    if tok in stop:
                        reason = {"type": "stop", "matched": tok}
                        break
                meta = {"id": f"r{len(outs)}", "finish_reason": reason, "prompt_tokens": len(prompt),
                        "completion_tokens": len(toks), "weight_version": self.version}
                if logprobs:
                    meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, toks)]
                outs.append({"text": "", "output_ids": toks, "meta_info": meta})
        return outs


def serve(model_path: str, host: str, port: int, log: Optional[str]) -> http.server.ThreadingHTTPServer:
    engine = Engine(model_path)

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._answer(200, {})
            elif self.path in ("/model_info", "/get_weight_version"):
                info = {"weight_version": engine.version}
                if self.path == "/model_info":
                    info.update(model_path=engine.model_path, is_generation=True)
                self._answer(200, info)
            else:
                self._answer(404, {"error": f"no route {self.path}"})

        def do_POST(self):  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except json.JSONDecodeError as exc:
                return self._answer(400, {"error": f"invalid JSON: {exc}"})
            if self.path == "/update_weights_from_disk":
                with engine.lock:
                    try:
                        engine.load(body["model_path"])
                        if body.get("weight_version") is not None:
                            engine.version = str(body["weight_version"])
                        ok, msg = True, "Succeeded to update model weights."
                    except Exception as exc:  # noqa: BLE001 - SGLang answers a failed load, it does not crash
                        ok, msg = False, f"Failed to update weights: {exc}"
                if log:
                    with open(log, "a") as f:
                        f.write(json.dumps({"route": self.path, "body": body, "success": ok}) + "\n")
                return self._answer(200 if ok else 400, {"success": ok, "message": msg, "num_paused_requests": 0})
            if self.path == "/generate":
                ids = body.get("input_ids")
                batch = bool(ids) and isinstance(ids[0], list)
                try:
                    with engine.lock:
                        outs = engine.generate(ids if batch else [ids], body.get("sampling_params") or {},
                                               bool(body.get("return_logprob")))
                except (ValueError, TypeError, IndexError) as exc:
                    return self._answer(400, {"error": str(exc)})
                return self._answer(200, outs if batch or len(outs) > 1 else outs[0])
            self._answer(404, {"error": f"no route {self.path}"})

        def log_message(self, *args):
            pass

    return http.server.ThreadingHTTPServer((host, port), Handler)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--log", default=None, help="append each weight update request here (JSON lines)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    server = serve(a.model_path, a.host, a.port, a.log)
    print(f"serving on http://{a.host}:{a.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
