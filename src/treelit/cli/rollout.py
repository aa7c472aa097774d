"""``treelit-rollout``: a reference sampler worker that closes the online RL loop on one machine.

    treelit-rollout --publish-dir P --prompts F --out D --n N --max-new-tokens T \\
        --reward NAME|module:function --steps K --max-staleness S

For users without an inference server, and for the tests. For step i (0-based) it waits
until the policy the trainer published (``P/latest.json``) is recent enough: version
>= (i - S) x ``--versions-per-step`` (the trainer's version when it takes file i, one
version per file by default: ``ppo_epochs=1 ppo_minibatches=1 publish.every_n_steps=1``).
``S=0`` is synchronous (file i is sampled from the weights after i files); ``S=k`` lets the
sampler run up to k versions ahead of training. It (re)loads the newest version, samples
``--n`` completions per prompt at temperature 1 (no top-k/top-p), records each sampled
token's log-prob, scores each completion with the reward (:mod:`treelit.rl.rewards`), and
writes ``D/step-<i>.jsonl`` (under a temporary name, then renamed): one record per prompt,
``{"id", "policy_version", "branches": [{"input_ids", "loss_mask", "old_logprobs", "reward",
"group"}]}``, the prompt masked out and its log-probs null. A mixture-of-experts policy published
by a trainer with ``model.moe.routing=replay`` (``latest.json`` says ``"moe_routing": "replay"``;
``--record-routing`` forces it) also gets each branch's ``routed_experts``: the experts every MoE
layer sent each token to while sampling, all tokens but the final one (never run), compact form. Restarted, it continues after
the files already in ``D`` (consumed or skipped ones included), and says so on stderr; when
they already cover ``--steps`` it stops with one ``error:`` line (exit 1) naming them. Prompts: JSONL records
``{"id", "input_ids"}`` or ``{"id", "messages"}`` (rendered with the published tokenizer's
chat template; a bundled file may be named alone); their other fields go to the reward
function as keywords. A vision-language checkpoint also takes prompts with images (raw records
with ``images``, or chat image parts), sampled with its image processor and written with the
images under ``D/images/`` (:mod:`treelit.cli.rollout_images`). A per-step JSON line on stdout
says the version, the mean reward and the seconds spent waiting for a version, loading it and sampling.

Hugging Face checkpoints are sampled with transformers (one forward per token, KV cache);
a checkpoint in treelit's own format (a layer mix no Hugging Face model holds), or any checkpoint
with ``--engine treelit``, with treelit's decoder, recomputing the prefix for every token (small
models only; the trainer's own numerics). A LoRA
adapter (the trainer's ``publish.lora=adapter``: ``latest.json`` says ``"kind": "lora_adapter"``
and its ``"base"``, or ``--base DIR``) is sampled as base + adapter: the base checkpoint is
loaded once, PEFT's LoRA layers are put into it, and each new version's adapter weights are
read into them (``adapter_config.json`` as JSON, ``adapter_model.safetensors`` as tensors:
nothing in the folder is run, and the folder must be a ``step-<N>`` directory of
``--publish-dir``). The tokenizer and the end-of-sequence token then come from the base.

Before a version is loaded its files are checked against the manifest the trainer wrote into
it (size and SHA-256 of each, :mod:`treelit.utils.integrity`): a file cut short or altered is
one ``error:`` line naming it (exit 1), not an error from inside safetensors. A version
published before manifests existed is read unchecked.

With ``--partial`` (:mod:`treelit.cli.rollout_partial`) a new version does not wait for the
file being sampled: unfinished generations continue under it, and each token records the
version that sampled it (``policy_versions``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from safetensors import safe_open

from treelit.cli.args import OneLineParser
from treelit.cli.rollout_images import ImagePrompts, check_routing, has_images, load_vision_model, vision_config
from treelit.utils.integrity import verify

__all__ = ["main", "Sampler", "read_prompts", "next_step", "first_step"]

ADAPTER_KIND = "lora_adapter"  # as treelit.lightning.publish writes it (not imported: --help pays for no torch)
# LoRA config fields whose values only describe the adapter's layers; any other field that is set
# (layer replication, LoftQ / EVA / CorDA / Arrow initialisation, Megatron layers) is refused
_LORA_FIELDS = {"r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "fan_in_fan_out", "bias",
                "use_rslora", "modules_to_save", "layers_to_transform", "layers_pattern", "rank_pattern",
                "alpha_pattern", "use_dora", "lora_bias", "target_parameters", "trainable_token_indices",
                "ensure_weight_tying"}
_LORA_IGNORED = {"peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                 "inference_mode", "init_lora_weights", "megatron_core", "runtime_config"}


def read_prompts(path: str, tokenizer_dir: Optional[Path] = None, images=None) -> List[Dict[str, Any]]:
    """``[{"id", "input_ids", **fields}]`` from a prompt JSONL file (chat messages rendered; records
    with images read by ``images``, a :class:`~treelit.cli.rollout_images.ImagePrompts`)."""
    out, tok = [], None
    if not os.path.exists(path):
        from treelit.cli.config import ConfigError, bundled_path

        try:
            path = bundled_path(path)  # a file shipped with treelit, by name
        except ConfigError:
            raise ValueError(f"--prompts: no file {path!r} (nor a bundled one of that name)") from None
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or ("input_ids" not in rec and "messages" not in rec):
                raise ValueError(f"{path}:{n}: a prompt record needs 'input_ids' (token ids) or 'messages'")
            if has_images(rec):
                if images is None:
                    raise ValueError(f"{path}:{n}: a prompt with images needs a vision-language checkpoint")
                if "messages" in rec and tok is None and tokenizer_dir is not None:
                    from transformers import AutoTokenizer  # heavy (~1.5 s CPU): chat prompts only

                    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
                images.prepare(rec, path, f"{path}:{n}", tok)
            elif "messages" in rec:
                if tok is None:
                    if tokenizer_dir is None:
                        raise ValueError(f"{path}:{n}: chat messages need a tokenizer in the published checkpoint")
                    from transformers import AutoTokenizer  # heavy (~1.5 s CPU): chat prompts only

                    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)  # never its own code
                ids = tok.apply_chat_template(rec.pop("messages"), add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
                rec["input_ids"] = list(ids)
            ids = rec["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{path}:{n}: input_ids must be a non-empty list of token ids")
            rec.setdefault("id", f"p{n}")
            out.append(rec)
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


class Sampler:
    """The newest published policy, sampled at temperature 1 with per-token log-probs."""

    def __init__(self, publish_dir: str, dtype: str = "float32", base: Optional[str] = None,
                 engine: str = "auto") -> None:
        import torch  # cli: treelit-rollout --help pays for no torch

        self.dir = Path(publish_dir)
        self.dtype = getattr(torch, dtype)
        self.base_override = base
        self.engine = engine  # auto: transformers for Hugging Face checkpoints; treelit: treelit's decoder
        self.version: Optional[int] = None
        self.path: Optional[Path] = None
        self.tokenizer_dir: Optional[Path] = None  # the published checkpoint, or an adapter's base
        self.model = None
        self.native = False
        self.eos: Optional[int] = None
        self._peft = None  # base + LoRA layers (adapters): the PEFT model the weights are read into
        self._peft_key: Optional[Tuple[str, str]] = None  # (base, adapter config) it was built for
        self.images: Optional[ImagePrompts] = None  # a vision-language policy's image processor
        self.image_root: Optional[str] = None
        self._image_inputs: Optional[Dict[str, Any]] = None  # the next first forward's pixel inputs

    def latest(self) -> Optional[Dict[str, Any]]:
        from treelit.lightning.publish import read_latest

        return read_latest(self.dir)

    def load(self, latest: Dict[str, Any]) -> None:
        if latest.get("kind") == ADAPTER_KIND:
            path, config = self._load_adapter(latest)
        else:
            path = config = Path(latest["path"])
            verify(path, f"published version {latest['version']}")
            cfg = json.loads((path / "config.json").read_text())
            self.native = cfg.get("model_type") == "treelit" or self.engine == "treelit"
            if vision_config(cfg):  # transformers with the tower; the image processor published beside it
                if self.engine == "treelit":
                    raise ValueError(f"{path}: --engine treelit: a vision-language checkpoint "
                                     f"({cfg.get('model_type')}) is sampled with transformers (--engine auto)")
                self.native, self.model = False, load_vision_model(path, self.dtype)
                self.images = self.images or ImagePrompts(path, self.image_root)
            elif self.native:
                import treelit

                self.model = treelit.load_hf_checkpoint(path, dtype=self.dtype).eval()
            else:
                self.model = self._transformers(path)
        gen = config / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.version, self.path, self.tokenizer_dir = int(latest["version"]), path, config
        self.model.requires_grad_(False)  # sampling builds no graph (and leaves the caller's grad mode alone)

    def _transformers(self, path: Path):
        from transformers import AutoModelForCausalLM  # heavy (~1.5 s CPU): transformers checkpoints only
        from transformers.utils import logging as hf_logging  # as above

        hf_logging.disable_progress_bar()  # one "Loading weights" bar per version otherwise
        from treelit.models.hf_kernels import no_hub_kernels  # as above

        kw = no_hub_kernels()
        if json.loads((Path(path) / "config.json").read_text()).get("num_experts_per_tok"):
            kw["experts_implementation"] = "eager"  # MoE: grouped_mm has no float64 / CPU-portable kernel
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype, trust_remote_code=False,
                                                    local_files_only=True, **kw).eval()

    def _load_adapter(self, latest: Dict[str, Any]) -> Tuple[Path, Path]:
        """Base + the published adapter; returns (the adapter folder, the base checkpoint)."""
        from treelit.utils.paths import confined

        where = str(self.dir / "latest.json")
        name = Path(str(latest.get("path", ""))).name  # read from this publish directory, whatever the path says
        if not (name.startswith("step-") and name[5:].isdigit()):
            raise ValueError(f"{where}: the adapter {latest.get('path')!r} is not a step-<N> directory")
        path = confined(self.dir, name, where, resolve=True)
        verify(path, f"published version {latest.get('version')}")
        weights = confined(path, "adapter_model.safetensors", where, resolve=True)
        if not weights.is_file():
            raise ValueError(f"{path}: no adapter_model.safetensors (only safetensors adapters are read)")
        base = self.base_override or latest.get("base")
        if not base or not Path(str(base)).is_dir():
            raise ValueError(f"{self.dir / 'latest.json'}: the adapter's base {base!r} is not a directory here: "
                             "give the base checkpoint with --base DIR")
        base = Path(str(base))
        raw = json.loads(confined(path, "adapter_config.json", where, resolve=True).read_text())
        key = (str(base.resolve()), json.dumps(self._lora_config(raw, path), sort_keys=True, default=str))
        if self._peft_key != key:  # the base once; again only if the adapter's layers change
            import peft  # heavy (~1 s): adapters only (imported by _lora_config already)

            cfg = json.loads((base / "config.json").read_text())
            if cfg.get("model_type") == "treelit":
                raise ValueError(f"{base}: an adapter's base must be a Hugging Face checkpoint (this one is in "
                                 "treelit's own format)")
            if vision_config(cfg):
                raise ValueError(f"{base}: an adapter on a vision-language base is not sampled yet "
                                 "(publish with publish.lora=merged)")
            self._peft_key = None
            self._peft = peft.get_peft_model(self._transformers(base), peft.LoraConfig(**json.loads(key[1])))
            for p in self._peft.parameters():  # the adapters in the sampling dtype (PEFT makes them float32)
                if p.is_floating_point() and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
            self._peft_key = key
        from peft.utils import set_peft_model_state_dict  # peft: adapters only (imported above)

        with safe_open(str(weights), framework="pt") as f:  # tensors only, never a pickle
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        try:
            result = set_peft_model_state_dict(self._peft, tensors)
        except RuntimeError as exc:  # a tensor of the wrong shape
            why = " ".join(str(exc).split())[:300]
            raise ValueError(f"{weights}: the adapter does not fit its base ({why})") from None
        missing = [k for k in getattr(result, "missing_keys", []) if ".lora_" in k or ".modules_to_save." in k]
        unknown = list(getattr(result, "unexpected_keys", []))
        if missing or unknown:
            raise ValueError(f"{weights}: the adapter does not fit its config and base "
                             f"({'no ' + missing[0] if missing else 'unknown ' + unknown[0]})")
        self.native = False
        self.model = self._peft.get_base_model().eval()  # the base with the LoRA layers in it
        return path, base

    @staticmethod
    def _lora_config(raw: Dict[str, Any], path: Path) -> Dict[str, Any]:
        """The adapter config's fields that describe its layers (others refused when set)."""
        import peft  # heavy (~1 s): adapters only

        if not isinstance(raw, dict) or str(raw.get("peft_type", "LORA")).upper() != "LORA":
            raise ValueError(f"{path}/adapter_config.json: not a LoRA adapter config")
        defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(peft.LoraConfig)}
        known = _LORA_FIELDS | _LORA_IGNORED
        odd = sorted(k for k, v in raw.items() if k not in known and v not in (None, False, [], {}, defaults.get(k)))
        if odd:
            raise ValueError(f"{path}/adapter_config.json: {odd[0]} is set, which "
                             "treelit-rollout does not load (plain LoRA layers only)")
        out = {k: v for k, v in raw.items() if k in _LORA_FIELDS}
        out.update(init_lora_weights=True, inference_mode=True)  # the weights are read in right after
        return out

    def _logits(self, ids, past):
        import torch  # cli: treelit-rollout --help pays for no torch

        with torch.no_grad():
            return self._next_logits(ids, past)

    # routing (MoE models, recorded for routing replay) ---------------------------------------------
    def start_routing(self) -> None:
        """Record, from now on, the experts every MoE layer sends each token it runs to."""
        self._routing_steps: List[Any] = []  # per forward: [rows, new tokens, MoE layers, k]
        if self.native:
            return
        from treelit.models.hf_replay import router_modules  # torch: only when routing is recorded

        routers = router_modules(self.model)
        if not routers:
            raise ValueError(f"{self.path}: --record-routing: the model has no mixture-of-experts routers")
        self._captured: List[Any] = []

        def hook(module, args, output):
            self._captured.append(next(o for o in output if hasattr(o, "dtype") and not o.is_floating_point()))

        self._hooks = [r.register_forward_hook(hook) for r in routers]

    def stop_routing(self) -> None:
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []

    def _record_routing(self, rows: int, new: int, ctx=None) -> None:
        import torch  # cli: treelit-rollout --help pays for no torch

        if ctx is not None:  # treelit's decoder: router logits of every position, this step's last `new`
            from treelit.models.moe import route

            k = int(self.model.config.moe["top_k"])
            per = [route(ctx.router_logits[i], k, False)[1] for i in sorted(ctx.router_logits)]
        else:
            per, self._captured = self._captured, []
        layers = [x.reshape(rows, -1, x.shape[-1])[:, -new:] for x in per]
        self._routing_steps.append(torch.stack(layers, 2).cpu())

    def routing(self):
        """``[rows, tokens run, MoE layers, k]`` recorded since :meth:`start_routing`."""
        import torch  # cli: treelit-rollout --help pays for no torch

        return torch.cat(self._routing_steps, 1).numpy()

    def _next_logits(self, ids, past):
        if self.native:
            import torch  # cli: treelit-rollout --help pays for no torch

            from treelit.models.context import CausalContext
            from treelit.models.decoder import decoder_hidden, output_weight

            pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
            ctx = CausalContext()
            h = decoder_hidden(self.model, ids, pos, ctx)
            if getattr(self, "_routing_steps", None) is not None:
                self._record_routing(ids.shape[0], ids.shape[1] if past is None else 1, ctx)
            return (h[:, -1] @ output_weight(self.model).t()), True
        # transformers >= 5.2x names the cache argument ``cache`` (``past_key_values`` before)
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        pixels = self._image_inputs if past is None else None
        out = self.model(input_ids=ids if past is None else ids[:, -1:], use_cache=True, **{name: past},
                         **(pixels or {}))
        if getattr(self, "_routing_steps", None) is not None:
            self._record_routing(ids.shape[0], ids.shape[1] if past is None else 1)
        return out.logits[:, -1], (out.cache if hasattr(out, "cache") else out.past_key_values)

    def sample(self, prompt: List[int], n: int, max_new_tokens: int, generator,
               record_routing: bool = False, vision=None) -> List[Tuple[List[int], List[float], Any]]:
        """``n`` completions of ``prompt``: (token ids, their log-probs, the routing or None), each
        cut after EOS. ``record_routing``: the experts each MoE layer sent each token it ran to,
        ``[len(prompt) + len(completion) - 1, MoE layers, k]`` (the final token is never run).
        ``vision``: the prompt's images (a :class:`~treelit.cli.rollout_images.VisionPrompt`)."""
        import torch  # cli: treelit-rollout --help pays for no torch

        self._vision = vision
        if record_routing:
            self.start_routing()
        try:
            out = self._sample(prompt, n, max_new_tokens, generator)
            routing = self.routing() if record_routing else None
        finally:
            self.stop_routing()
            self._routing_steps = None
            self._vision = self._image_inputs = None
        return [(t, lp, None if routing is None else routing[i, : len(prompt) + len(t) - 1])
                for i, (t, lp) in enumerate(out)]

    def _sample(self, prompt: List[int], n: int, max_new_tokens: int, generator) -> List[Tuple[List[int], List[float]]]:
        import torch  # cli: treelit-rollout --help pays for no torch

        vision = getattr(self, "_vision", None)
        ids = torch.tensor([prompt if vision is None else vision.ids] * n)  # image tokens expanded
        self._image_inputs = None if vision is None else vision.model_inputs(n, self.model, ids)
        past, toks, lps = None, [], []
        done = torch.zeros(n, dtype=torch.bool)
        for _ in range(max_new_tokens):
            logits, past = self._logits(ids, past)
            if self.images is not None:  # an image placeholder is never sampled (rollout_images)
                logits = logits.double().index_fill(-1, torch.tensor(self.images.never), float("-inf"))
            logp = torch.log_softmax(logits.double(), -1)
            nxt = torch.multinomial(logp.exp(), 1, generator=generator)
            toks.append(nxt[:, 0])
            lps.append(logp.gather(1, nxt)[:, 0])
            ids = torch.cat([ids, nxt], 1)
            if self.eos is not None:
                done |= nxt[:, 0] == self.eos
                if bool(done.all()):
                    break
        T, L = torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()
        out = []
        for t, lp in zip(T, L):
            k = t.index(self.eos) + 1 if self.eos is not None and self.eos in t else len(t)
            out.append((t[:k], lp[:k]))
        return out


def next_step(out: Path) -> int:
    """The first step without a file in ``out`` (consumed or skipped files count)."""
    steps = [int(p.name[5:].split(".")[0]) for p in out.glob("step-*.jsonl*") if p.name[5:].split(".")[0].isdigit()]
    return max(steps) + 1 if steps else 0


def parser() -> OneLineParser:
    """``treelit-rollout``'s flags (the configuration reference lists them from here)."""
    p = OneLineParser(prog="treelit-rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--publish-dir", required=True, help="the trainer's publish.dir (latest.json)")
    p.add_argument("--prompts", required=True, help="JSONL of {id, input_ids} or {id, messages}")
    p.add_argument("--out", required=True, help="the trainer's data.directory")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (a group)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="the longest completion, in tokens")
    p.add_argument("--reward", required=True, help="a reward name (treelit list) or module:function")
    p.add_argument("--steps", type=int, required=True, help="files to write (training steps)")
    p.add_argument("--max-staleness", type=int, default=0, help="versions the sampler may run ahead (0: synchronous)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="prompts per file (default: all)")
    p.add_argument("--versions-per-step", type=int, default=1, help="policy versions the trainer publishes per file")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long to wait for a version")
    p.add_argument("--poll-s", type=float, default=0.1, help="seconds between looks at latest.json")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"],
                   help="the dtype the policy is loaded in")
    p.add_argument("--base", default=None, help="a LoRA adapter's base checkpoint (default: latest.json's)")
    p.add_argument("--engine", default="auto", choices=["auto", "treelit"],
                   help="auto: transformers for Hugging Face checkpoints (KV cache); treelit: treelit's own decoder "
                        "for any checkpoint it loads (the trainer's numerics; recomputes the prefix: small models)")
    p.add_argument("--partial", action="store_true",
                   help="partial rollouts: unfinished generations continue under each new version (tokens stamped "
                        "with their version, policy_versions); done groups are written, long ones land in later files")
    p.add_argument("--image-root", default=None,
                   help="a folder prompt images may also be read from (besides the prompts file's folder)")
    p.add_argument("--record-routing", action="store_true",
                   help="write each branch's routed_experts (MoE models; on by itself when the trainer "
                        "publishes with model.moe.routing=replay)")
    return p


def _args(argv):
    p = parser()
    a = p.parse_args(argv)
    for name in ("n", "max_new_tokens", "steps", "versions_per_step"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.max_staleness < 0:
        p.error("--max-staleness must be >= 0")
    return a


def first_step(out: Path, steps: int) -> int:
    """The step to sample first, after the files already in ``out``; says on stderr what it
    found there, and refuses (ValueError) when they leave nothing of ``--steps`` to sample."""
    from treelit.utils.rl_folders import rollout_files

    start = next_step(out)
    if start >= steps:
        raise ValueError(f"--out {out} already holds the files of {rollout_files(out)}, so --steps {steps} leaves "
                         "nothing to sample (an earlier run's?). For a new run give an empty --out (and the trainer "
                         "a new publish.dir and data.directory); to go on with that run, a larger --steps")
    if start:
        print(f"treelit-rollout: --out {out} holds the files of {rollout_files(out)}: continuing at step {start}",
              file=sys.stderr, flush=True)
    return start


def run(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = first_step(out, a.steps)  # before torch: a rerun in a used folder is one line, at once
    if a.partial:
        from treelit.cli.rollout_partial import run_partial

        return run_partial(a, start, Sampler, read_prompts)

    import torch  # cli: treelit-rollout --help pays for no torch

    from treelit.rl.rewards import resolve_reward
    from treelit.tree.routing import encode_routing

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    reward = resolve_reward(a.reward)
    sampler = Sampler(a.publish_dir, a.dtype, a.base, a.engine)
    sampler.image_root = a.image_root
    prompts = None
    for i in range(start, a.steps):
        t0 = time.monotonic()
        need = max(0, (i - a.max_staleness) * a.versions_per_step)
        while True:
            latest = sampler.latest()
            if latest is not None and latest["version"] >= need:
                break
            if time.monotonic() - t0 > a.timeout_s:
                raise TimeoutError(f"{a.publish_dir}: no policy version >= {need} within --timeout-s={a.timeout_s:g}s")
            time.sleep(a.poll_s)
        t_wait = time.monotonic()
        if latest["version"] != sampler.version:
            sampler.load(latest)
        if prompts is None:
            prompts = read_prompts(a.prompts, sampler.tokenizer_dir, sampler.images)
        t1 = time.monotonic()
        B = a.prompts_per_step or len(prompts)
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + i)
        records, rewards = [], []
        for j in range(B):
            rec = dict(prompts[(i * B + j) % len(prompts)])
            prompt, vision = rec.pop("input_ids"), rec.pop("_vision", None)
            pid = str(rec.get("id"))
            fields = {k: v for k, v in rec.items() if k != "id"}
            key = f"{pid}@{i}"
            branches = []
            record = a.record_routing or latest.get("moe_routing") == "replay"
            check_routing(vision, record)
            for comp, lps, routed in sampler.sample(prompt, a.n, a.max_new_tokens, gen, record_routing=record,
                                                    vision=vision):
                r = float(reward(prompt_ids=list(prompt), completion_ids=comp, **fields))
                rewards.append(r)
                branches.append({"input_ids": prompt + comp, "loss_mask": [0] * len(prompt) + [1] * len(comp),
                                 "old_logprobs": [None] * len(prompt) + lps, "reward": r, "group": key})
                if routed is not None:
                    branches[-1]["routed_experts"] = encode_routing(routed)
                if vision is not None:  # the images, written into --out (before the file that names them)
                    branches[-1]["images"] = sampler.images.store(out, vision)
            records.append({"id": key, "policy_version": sampler.version, "branches": branches})
        name = f"step-{i:06d}.jsonl"
        tmp = out / f".{name}.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, out / name)
        print(json.dumps({"step": i, "policy_version": sampler.version, "reward_mean": sum(rewards) / len(rewards),
                          "wait_s": round(t_wait - t0, 4), "load_s": round(t1 - t_wait, 4),
                          "sample_s": round(time.monotonic() - t1, 4)}), flush=True)
    return 0


def main(argv=None) -> None:
    a = _args(argv)
    try:
        sys.exit(run(a))
    except (ValueError, KeyError, FileNotFoundError, TimeoutError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
