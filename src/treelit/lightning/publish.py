"""Policy publishing: hand the trainer's weights to the sampler while training runs.

Online RL samples from the policy being trained. Every ``every_n_steps`` optimizer steps
the trainer writes its weights to ``<dir>/step-<N>/`` (a Hugging Face checkpoint: safetensors,
``config.json``, ``generation_config.json``, and the tokenizer files when the run names a
tokenizer directory; treelit's own format for a layer mix no Hugging Face model holds),
then points ``<dir>/latest.json`` at it: ``{"version": N, "path": ..., "time": ...}``.
Version 0 is the initial weights, published before the first step; version N the weights
after optimizer step N. Samplers poll ``latest.json`` (``treelit-rollout`` does) or are told
by an HTTP hook (SGLang's ``/update_weights_from_disk``, a vLLM server route taking
``{"weight_dir"}``), and stamp each rollout with the version they sampled from, which the
rollout data module compares with the trainer's (staleness, see
:mod:`treelit.lightning.rollouts`).

**Atomicity.** A version is written under a hidden temporary name, every file and the
directory are fsync'ed, and the directory is renamed to ``step-<N>`` (atomic within a
filesystem); only then is ``latest.json`` replaced, by writing a temporary file, fsync and
``os.replace``. A reader of ``latest.json`` therefore only ever sees complete checkpoints,
and a trainer killed mid-write (even ``kill -9``) leaves the previous version named by
``latest.json`` intact; the orphaned temporary directory is removed by the next publisher
on the same directory. Old versions beyond ``keep`` are renamed away before being deleted.

**Several processes.** Under FSDP2 each parameter is gathered in turn (a collective every
rank joins), cast to the publish dtype and kept on rank 0 only, which writes; the other
ranks hold one gathered tensor at a time. Peak host memory on rank 0 is therefore the
model once in ``dtype`` (bfloat16: 2 bytes per parameter) plus one parameter in the
training dtype, and the Hugging Face name mapping's copies of the q/k projections. Under
DDP rank 0 writes its own replica. Hooks run on rank 0; with ``required=true`` a hook
failure stops every rank (the ranks agree on it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf

from treelit.models.hf import save_hf_checkpoint

__all__ = ["PolicyPublisher", "PublishPolicy", "HttpHook", "PublishError", "read_latest", "HOOK_PRESETS"]

log = logging.getLogger(__name__)

LATEST = "latest.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
HOOK_PRESETS: Dict[str, Dict[str, Any]] = {
    # SGLang: reload the weights from a directory, tagged with the version
    "sglang": {"path": "/update_weights_from_disk", "body": {"model_path": "{path}", "weight_version": "{version}"}},
    # a vLLM server with a reload route (as prime-rl's): {"weight_dir": DIR}
    "vllm": {"path": "/update_weights", "body": {"weight_dir": "{path}"}},
}
TEMPLATE_KEYS = ("version", "path", "step", "time")


class PublishError(RuntimeError):
    """A required hook failed (``publish.required=true``)."""


def read_latest(directory) -> Optional[Dict[str, Any]]:
    """``latest.json`` of a publish directory, or None before the first publish."""
    try:
        return json.loads((Path(directory) / LATEST).read_text())
    except FileNotFoundError:
        return None


def _fill(template: Any, ctx: Mapping[str, Any]) -> Any:
    """The JSON body: every string of ``template`` formatted with ``ctx`` (results are strings)."""
    if isinstance(template, str):
        return template.format_map(ctx)
    if isinstance(template, Mapping):
        return {str(k): _fill(v, ctx) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return [_fill(v, ctx) for v in template]
    return template


class HttpHook:
    """POST a JSON body to ``url + path`` after each publish. Args: ``url`` (``http://host:port``),
    ``preset`` (``sglang`` | ``vllm``: their ``path`` and ``body``), ``path``, ``body`` (a JSON
    template whose strings may name ``{version}``, ``{path}``, ``{step}``, ``{time}``),
    ``timeout_s`` per attempt, ``retries`` after the first attempt, ``retry_wait_s``, ``headers``."""

    def __init__(self, name: str, url: str, preset: Optional[str] = None, path: Optional[str] = None,
                 body: Any = None, timeout_s: float = 120.0, retries: int = 3, retry_wait_s: float = 1.0,
                 headers: Optional[Mapping[str, str]] = None) -> None:
        where = f"publish.hooks.{name}"
        if preset is not None and preset not in HOOK_PRESETS:
            raise ValueError(f"{where}.preset must be one of {', '.join(HOOK_PRESETS)} or null, got {preset!r}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}.url must be an http:// or https:// address, got {url!r}")
        base = HOOK_PRESETS.get(preset or "", {})
        path = path if path is not None else base.get("path")
        body = body if body is not None else base.get("body")
        if path is None or body is None:
            raise ValueError(f"{where}: give a preset ({', '.join(HOOK_PRESETS)}) or both path and body")
        if float(timeout_s) <= 0 or int(retries) < 0 or float(retry_wait_s) < 0:
            raise ValueError(f"{where}: timeout_s must be > 0, retries and retry_wait_s >= 0")
        try:
            _fill(body, {k: 0 for k in TEMPLATE_KEYS})
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"{where}.body: a template may name only {{{'}, {'.join(TEMPLATE_KEYS)}}} ({exc!r})") from None
        self.name, self.url = name, url.rstrip("/") + "/" + str(path).lstrip("/")
        self.body = body
        self.timeout_s, self.retries, self.retry_wait_s = float(timeout_s), int(retries), float(retry_wait_s)
        self.headers = {"Content-Type": "application/json", **{str(k): str(v) for k, v in (headers or {}).items()}}

    def __call__(self, ctx: Mapping[str, Any]) -> Optional[str]:
        """Send; None on success, else why the last attempt failed."""
        data = json.dumps(_fill(self.body, ctx)).encode()
        why = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.retry_wait_s)
            try:
                req = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    resp.read()
                return None
            except urllib.error.HTTPError as exc:
                why = f"HTTP {exc.code} {exc.reason}"
            except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out
                why = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        return why


@dataclass
class Published:
    version: int
    path: Optional[Path]  # None on ranks other than 0
    seconds: float
    bytes: int
    hook_failures: int


def _fsync(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


def _version_of(name: str) -> Optional[int]:
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


class PolicyPublisher:
    """Writes policy versions into ``directory`` (no Lightning needed; see :class:`PublishPolicy`).

    Args:
        directory: where ``step-<N>/`` and ``latest.json`` go (created if missing).
        dtype: ``bfloat16`` or ``float32``: the dtype of the published weights.
        keep: how many versions to keep (the newest).
        tokenizer: a directory whose tokenizer files are published beside the weights, or None.
        hooks: ``{name: HttpHook options}`` called after each publish.
        required: a failing hook raises :class:`PublishError` (otherwise logged and counted).
    """

    def __init__(self, directory, dtype: str = "bfloat16", keep: int = 3, tokenizer: Optional[str] = None,
                 hooks: Optional[Mapping[str, Any]] = None, required: bool = False,
                 max_shard_bytes: Optional[int] = 5 * 2**30) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"publish.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"publish.keep must be a positive number of versions, got {keep!r}")
        if tokenizer is not None and not Path(str(tokenizer)).is_dir():
            raise ValueError(f"publish.tokenizer: directory {str(tokenizer)!r} does not exist")
        self.directory = Path(directory)
        existing = next((p for p in [self.directory, *self.directory.absolute().parents] if p.exists()), None)
        if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"publish.dir: {str(directory)!r} cannot be written ({existing} is not a writable directory)")
        self.dtype, self.keep = DTYPES[dtype], keep
        self.tokenizer = None if tokenizer is None else Path(str(tokenizer))
        if OmegaConf.is_config(hooks):
            hooks = OmegaConf.to_container(hooks, resolve=True)
        self.hooks: List[HttpHook] = [HttpHook(name, **dict(opts)) for name, opts in (hooks or {}).items() if opts]
        self.required = bool(required)
        self.max_shard_bytes = max_shard_bytes
        self.hook_failures = 0

    # files ---------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the directory and remove what a killed publisher left behind (rank 0)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for p in self.directory.iterdir():
            if not p.name.startswith((".step-", ".trash-", f".{LATEST}.")):
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def versions(self) -> List[int]:
        return sorted(v for v in (_version_of(p.name) for p in self.directory.glob("step-*") if p.is_dir())
                      if v is not None)

    def _gather(self, model: torch.nn.Module, rank0: bool) -> Dict[str, torch.Tensor]:
        """The state dict in the publish dtype on rank 0 (empty elsewhere), one tensor at a time."""
        out: Dict[str, torch.Tensor] = {}
        for k, v in model.state_dict().items():
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()  # a collective: every rank gathers this one
            if rank0:
                v = v.detach()
                out[k] = (v.to(self.dtype) if v.is_floating_point() else v).cpu().clone()
            del v
        return out

    def _write(self, model, sd: Dict[str, torch.Tensor], version: int, step: int) -> Path:
        final = self.directory / f"step-{version}"
        tmp = self.directory / f".step-{version}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        save_hf_checkpoint(model, tmp, state_dict=sd, native_fallback=True, max_shard_bytes=self.max_shard_bytes)
        self._generation_config(tmp)
        if self.tokenizer is not None:
            for name in TOKENIZER_FILES:
                if (self.tokenizer / name).is_file():
                    shutil.copyfile(self.tokenizer / name, tmp / name)
        (tmp / "treelit_publish.json").write_text(json.dumps({"version": version, "step": step}) + "\n")
        _fsync_tree(tmp)
        if final.exists():  # the same version published again (a resumed run): replace it
            trash = self.directory / f".trash-{final.name}-{os.getpid()}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        _fsync(self.directory)
        return final

    def _generation_config(self, path: Path) -> None:
        """Sampling at temperature 1 with no top-k/top-p (what on-policy RL samples); token ids
        from the model's or the tokenizer's generation config when there is one."""
        gen: Dict[str, Any] = {}
        for src in (path / "generation_config.json", (self.tokenizer or path) / "generation_config.json"):
            if src.is_file():
                gen = {k: v for k, v in json.loads(src.read_text()).items() if k.endswith("token_id")}
                break
        gen.update({"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0})
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")

    def _point_latest(self, version: int, final: Path) -> None:
        tmp = self.directory / f".{LATEST}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"version": version, "path": str(final.resolve()), "time": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / LATEST)
        _fsync(self.directory)

    def _prune(self) -> None:
        for v in self.versions()[: -self.keep]:
            old = self.directory / f"step-{v}"
            trash = self.directory / f".trash-{old.name}-{os.getpid()}"
            os.rename(old, trash)
            shutil.rmtree(trash, ignore_errors=True)

    # one version ------------------------------------------------------------------------------------
    def publish(self, model: torch.nn.Module, version: int, step: Optional[int] = None, rank: int = 0) -> Published:
        """Write ``model`` as ``version`` (every rank calls this under FSDP2; rank 0 writes),
        point ``latest.json`` at it, prune, call the hooks."""
        t0 = time.perf_counter()
        step = version if step is None else step
        sd = self._gather(model, rank == 0)
        if rank != 0:
            return Published(version, None, time.perf_counter() - t0, 0, 0)
        final = self._write(model, sd, version, step)
        del sd
        self._point_latest(version, final)
        self._prune()
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        failures = 0
        ctx = {"version": version, "path": str(final.resolve()), "step": step, "time": time.time()}
        for hook in self.hooks:
            why = hook(ctx)
            if why is None:
                continue
            failures += 1
            self.hook_failures += 1
            msg = (f"publish hook {hook.name!r} ({hook.url}) failed for version {version} after "
                   f"{hook.retries + 1} attempts: {why}")
            if self.required:
                raise PublishError(msg + " (publish.required=true)")
            log.warning("%s", msg)
        return Published(version, final, time.perf_counter() - t0, size, failures)


class PublishPolicy(pl.Callback):
    """Lightning callback: publish version 0 before the first step (a resumed run: the
    restored step, unless ``latest.json`` already names it) and, after a step batch whose
    updates reached or passed a multiple of ``every_n_steps``, version N = the optimizer step
    count after it. Logs, every step, the last publish's
    ``publish/seconds`` and ``publish/bytes``, ``publish/version`` and the hook failures so
    far (``publish/hook_failures``). ``version`` is the last published
    version: the trainer's policy version that rollout staleness is measured against."""

    def __init__(self, dir: Optional[str] = None, every_n_steps: int = 1, dtype: str = "bfloat16", keep: int = 3,
                 tokenizer: Optional[str] = None, hooks: Optional[Mapping[str, Any]] = None,
                 required: bool = False) -> None:
        if dir is None:
            raise ValueError("publish.dir is required to publish the policy (null switches publishing off)")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"publish.every_n_steps must be a positive number of optimizer steps, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.publisher = PolicyPublisher(dir, dtype=dtype, keep=keep, tokenizer=tokenizer, hooks=hooks,
                                         required=required)
        self.version: Optional[int] = None
        self.last: Optional[Published] = None

    def _publish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = int(trainer.global_step)
        rank = int(trainer.global_rank)
        failed = None
        try:
            res = self.publisher.publish(pl_module.model, step, step, rank)
        except PublishError as exc:
            failed, res = exc, None
        comm = pl_module._comm() if hasattr(pl_module, "_comm") else None
        if comm is not None and comm.distributed and comm.max(float(failed is not None)) > 0:
            raise failed or PublishError(f"a required publish hook failed on rank 0 for version {step}")
        if failed is not None:
            raise failed
        self.version, self.last = step, res
        if rank == 0:
            log.info("published version %d to %s (%.2fs, %.1f MB)", step, res.path, res.seconds, res.bytes / 1e6)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.publisher.prepare()
        step = int(trainer.global_step)
        latest = read_latest(self.publisher.directory) if trainer.is_global_zero else None
        comm = pl_module._comm() if hasattr(pl_module, "_comm") else None
        have = latest is not None and latest.get("version") == step and Path(latest.get("path", "")).is_dir()
        if comm is not None and comm.distributed:
            have = comm.max(float(have)) > 0  # rank 0 knows; every rank must take the same branch
        if have:
            self.version = step
            return
        self._publish(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)  # a step batch may take several updates (ppo_epochs, ppo_minibatches)
        if self.version is None or step // self.every_n_steps > self.version // self.every_n_steps:
            self._publish(trainer, pl_module)
        if self.last is not None:  # the latest publish's cost, logged with every step (rank 0's)
            pl_module.log_dict({"publish/seconds": self.last.seconds, "publish/bytes": float(self.last.bytes),
                                "publish/version": float(self.version),
                                "publish/hook_failures": float(self.publisher.hook_failures)})
