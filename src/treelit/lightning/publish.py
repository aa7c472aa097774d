"""Policy publishing: hand the trainer's weights to the sampler while training runs.

Online RL samples from the policy being trained. Every ``every_n_steps`` optimizer steps
the trainer writes its weights to ``<dir>/step-<N>/`` (a Hugging Face checkpoint: safetensors,
``config.json``, ``generation_config.json``, and the tokenizer files (and a vision checkpoint's
image processor config) when the run names a tokenizer directory; treelit's own format for a
layer mix no Hugging Face model holds), then points ``<dir>/latest.json`` at it:
``{"version": N, "path": ..., "time": ...}``.

**LoRA** (``model.lora.rank``). ``lora="merged"`` publishes the full weights with the adapters
merged in (``W + s B A``), under the base model's own names: the same checkpoint format as
without LoRA. ``lora="adapter"`` publishes only the adapter, as the PEFT folder
(``adapter_config.json``, ``adapter_model.safetensors``) that vLLM, SGLang and
``peft.PeftModel.from_pretrained(base, DIR)`` load onto the base checkpoint; ``latest.json``
then also says ``"kind": "lora_adapter"`` and ``"base"`` (the base checkpoint), so a sampler
loads the base once and each new adapter onto it. A mixture-of-experts policy trained with
``model.moe.routing=replay`` adds ``"moe_routing": "replay"``: samplers should then return the
experts they route each token to (``routed_experts``; ``treelit-rollout`` records them).
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
on the same directory. Old versions beyond ``keep`` are renamed away before being deleted;
the version ``latest.json`` names is never one of them.

**Versions only go forward.** ``latest.json`` never moves to a lower version: a publish below
the version it names is refused (:class:`PublishError`), which is what a new run in an earlier
run's folder would do (``treelit-train`` refuses such a run before the model loads:
:mod:`treelit.cli.rerun`). The one exception is a run resumed from a checkpoint older than the
newest version (``rewind``): the steps after that checkpoint are trained again, so the
versions published from them are removed once ``latest.json`` names the resumed step.
Each version holds a manifest (``treelit-manifest.json``: the size and SHA-256 of every file,
:mod:`treelit.utils.integrity`), written last, which ``treelit-rollout`` checks before it loads
the version. The output layer is left out only when it is the input embedding (tied); a
version whose files lack a separate head is refused (:mod:`treelit.lightning.publish_check`).
A write that fails for want of space (a full disk, the file-size limit) removes
the temporary directory and leaves ``latest.json`` on the previous version; with
``required=false`` the run goes on (a warning naming the version and the bytes it needed;
``publish/write_failures`` counts them), with ``required=true`` every rank stops.

**Several processes.** Under FSDP2 each parameter is gathered in turn (a collective every
rank joins), cast to the publish dtype and kept on rank 0 only, which writes; the other
ranks hold one gathered tensor at a time. Peak host memory on rank 0 is therefore the
model once in ``dtype`` (bfloat16: 2 bytes per parameter) plus one parameter in the
training dtype, and the Hugging Face name mapping's copies of the q/k projections. With
LoRA, ``adapter`` gathers the trained tensors only (the frozen base is never gathered) and
``merged`` merges each layer's adapter into its weight as the layer arrives, in the
training dtype, before the cast. Under
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

from treelit.lightning.faults import hold_launched_ranks
from treelit.lightning.publish_check import check_head_written
from treelit.models.factory import replay_shape
from treelit.models.hf import save_hf_checkpoint
from treelit.models.lora import is_lora_key, lora_of, merged_state_dict, save_adapter
from treelit.utils.integrity import FULL, WriteFailed, disk_full, fmt_bytes, remove_path, write_manifest

__all__ = ["PolicyPublisher", "PublishPolicy", "HttpHook", "PublishError", "read_latest", "HOOK_PRESETS"]

log = logging.getLogger(__name__)

LATEST = "latest.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
LORA_MODES = ("adapter", "merged")
ADAPTER_KIND = "lora_adapter"  # latest.json's "kind" when a version is a LoRA adapter
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "preprocessor_config.json", "processor_config.json")  # (a vision checkpoint's image processor)
HOOK_PRESETS: Dict[str, Dict[str, Any]] = {
    # SGLang: reload the weights from a directory, tagged with the version
    "sglang": {"path": "/update_weights_from_disk", "body": {"model_path": "{path}", "weight_version": "{version}"}},
    # a vLLM server with a reload route (as prime-rl's): {"weight_dir": DIR}
    "vllm": {"path": "/update_weights", "body": {"weight_dir": "{path}"}},
    # publish.lora=adapter: load the version's adapter under a name that carries the version
    # (SGLang started with --enable-lora; vLLM with --enable-lora and
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); requests then name the adapter (``policy-v<N>``)
    "sglang_lora": {"path": "/load_lora_adapter", "body": {"lora_name": "policy-v{version}", "lora_path": "{path}"}},
    "vllm_lora": {"path": "/v1/load_lora_adapter", "body": {"lora_name": "policy-v{version}", "lora_path": "{path}"}},
}
ADAPTER_PRESETS = ("sglang_lora", "vllm_lora")
TEMPLATE_KEYS = ("version", "path", "step", "time")


class PublishError(RuntimeError):
    """A required hook failed, or a version could not be written (``publish.required=true``)."""


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
    ``preset`` (``sglang`` | ``vllm`` | ``sglang_lora`` | ``vllm_lora``: their ``path`` and ``body``),
    ``path``, ``body`` (a JSON template whose strings may name ``{version}``, ``{path}``, ``{step}``,
    ``{time}``),
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
        self.preset = preset
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


def _trained_key(name: str) -> bool:
    """A LoRA model's state-dict entry that training changes (an adapter, a ``modules_to_save`` copy)."""
    return is_lora_key(name) or ".modules_to_save." in name


_LORA_PARTS = (".base_layer.", ".lora_", ".original_module.", ".modules_to_save.")


def _lora_owner(name: str) -> Optional[str]:
    """The LoRA-wrapped module a state-dict entry belongs to (None: an entry of no wrapped module)."""
    for part in _LORA_PARTS:
        if part in name:
            return name.split(part, 1)[0]
    return None


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
        tokenizer: a directory whose tokenizer (and image processor) files are published beside the
            weights, or None.
        hooks: ``{name: HttpHook options}`` called after each publish.
        required: a failing hook raises :class:`PublishError` (otherwise logged and counted).
        lora: for a model with LoRA adapters, ``merged`` (full weights, adapters merged in) or
            ``adapter`` (the PEFT adapter folder only; needs LoRA on a ``model=hf_auto`` model).
        base: the base checkpoint an adapter applies to, named in ``latest.json`` and the
            adapter's config (default: the directory the transformers model was loaded from).
    """

    def __init__(self, directory, dtype: str = "bfloat16", keep: int = 3, tokenizer: Optional[str] = None,
                 hooks: Optional[Mapping[str, Any]] = None, required: bool = False,
                 max_shard_bytes: Optional[int] = 5 * 2**30, lora: str = "merged",
                 base: Optional[str] = None) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"publish.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if lora not in LORA_MODES:
            raise ValueError(f"publish.lora must be adapter (the LoRA adapter only) or merged (full weights), "
                             f"got {lora!r}")
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
        for hook in self.hooks:  # a preset that reloads full weights cannot take an adapter, nor the reverse
            if hook.preset is None or (hook.preset in ADAPTER_PRESETS) == (lora == "adapter"):
                continue
            better = hook.preset + "_lora" if lora == "adapter" else hook.preset[: -len("_lora")]
            what = "loads a LoRA adapter" if lora == "merged" else "reloads full weights"
            raise ValueError(f"publish.hooks.{hook.name}.preset={hook.preset} {what}, but publish.lora={lora} "
                             f"publishes {'full weights' if lora == 'merged' else 'adapters only'}: use "
                             f"preset {better}")
        self.lora = lora
        self.base = None if base is None else str(base)
        self.required = bool(required)
        self.max_shard_bytes = max_shard_bytes
        self.hook_failures = 0
        self.write_failures = 0  # versions not written for want of space (required=false)

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

    def check(self, model: torch.nn.Module) -> None:
        """Refuse, in one line, a model this publisher cannot publish as configured."""
        if self.lora != "adapter":
            return
        if lora_of(model) is None:
            raise ValueError("publish.lora=adapter publishes the LoRA adapter, and this model has none: set "
                             "model.lora.rank (or publish.lora=merged for the full weights)")
        if getattr(model, "hf", None) is None:
            raise ValueError("publish.lora=adapter needs model=hf_auto: the adapter of treelit's own decoder is "
                             "named after its modules, which no sampler maps onto a Hugging Face base; use "
                             "model=hf_auto or publish.lora=merged")
        if not self._base(model):
            raise ValueError("publish.lora=adapter: samplers need the base checkpoint the adapter applies to; set "
                             "publish.base=DIR (default: model.hf_checkpoint)")

    def _base(self, model: torch.nn.Module) -> Optional[str]:
        base = self.base or getattr(getattr(model, "hf", None), "name_or_path", None) or None
        if base is not None and Path(base).is_dir():
            base = str(Path(base).resolve())
        return base

    def _gather(self, model: torch.nn.Module, rank0: bool) -> Dict[str, torch.Tensor]:
        """The state dict in the publish dtype on rank 0 (empty elsewhere), one tensor at a time.
        With LoRA: the trained tensors only (``adapter``), or every adapter merged into its
        layer's weight in the training dtype before the cast (``merged``), one layer at a time."""
        lora = lora_of(model) is not None
        adapter_only = lora and self.lora == "adapter"
        out: Dict[str, torch.Tensor] = {}
        layer: Dict[str, torch.Tensor] = {}  # the LoRA layer being gathered (merged), training dtype
        owner: Optional[str] = None
        done = set()

        def cast(v: torch.Tensor) -> torch.Tensor:
            return v.to(self.dtype) if v.is_floating_point() else v

        def merge_layer() -> None:
            if layer:
                out.update((k, cast(v)) for k, v in merged_state_dict(model, layer).items())
                layer.clear()
                done.add(owner)

        for k, v in model.state_dict().items():
            if adapter_only and not _trained_key(k):
                continue  # every rank skips the same keys: the frozen base is not gathered
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()  # a collective: every rank gathers this one
            if rank0:
                v = v.detach()
                mine = _lora_owner(k) if lora and not adapter_only else None
                if mine != owner:
                    merge_layer()
                    owner = mine
                if mine is None:
                    out[k] = cast(v).cpu().clone()
                elif mine in done:
                    raise RuntimeError(f"publish: the state dict entries of LoRA layer {mine} are not together")
                else:
                    layer[k] = v.cpu().clone()
            del v
        merge_layer()
        return out

    def _adapter(self, model) -> bool:
        return self.lora == "adapter" and lora_of(model) is not None

    def _write(self, model, sd: Dict[str, torch.Tensor], version: int, step: int) -> Path:
        final = self.directory / f"step-{version}"
        tmp = self.directory / f".step-{version}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        meta: Dict[str, Any] = {"version": version, "step": step}
        try:
            if self._adapter(model):  # the adapter folder only: the sampler has the base and its tokenizer
                base = self._base(model)
                save_adapter(model, tmp, sd, base_model=base)
                meta.update(kind=ADAPTER_KIND, base=base)
            else:
                save_hf_checkpoint(model, tmp, state_dict=sd, native_fallback=True,
                                   max_shard_bytes=self.max_shard_bytes)
                try:  # a separate output layer the files lack: the sampler would load another head
                    check_head_written(model, sd, tmp, f"version {version} ({final})")
                except ValueError as exc:
                    raise PublishError(str(exc)) from None
                self._generation_config(tmp)
                if self.tokenizer is not None:
                    for name in TOKENIZER_FILES:
                        if (self.tokenizer / name).is_file():
                            shutil.copyfile(self.tokenizer / name, tmp / name)
            (tmp / "treelit_publish.json").write_text(json.dumps(meta) + "\n")
            write_manifest(tmp)  # every file fsync'ed, then the manifest, last
        except Exception as exc:
            remove_path(tmp)
            code = disk_full(exc)
            if code is None:
                raise
            needed = sum(v.numel() * v.element_size() for v in sd.values())
            raise self._failed(version, final, FULL[code], needed, code) from None
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

    def _failed(self, version: int, final: Path, why: str, needed: Optional[int], code: int) -> WriteFailed:
        latest = read_latest(self.directory)
        kept = (f"{LATEST} still names version {latest.get('version')}" if latest else "no version was published before")
        return WriteFailed(f"publish: version {version} ({final}) not written: {why}; it needs about "
                           f"{fmt_bytes(needed)}; its partial files were removed and {kept}", code, final, needed)

    def _point_latest(self, version: int, final: Path, extra: Optional[Mapping[str, Any]] = None) -> None:
        tmp = self.directory / f".{LATEST}.tmp-{os.getpid()}"
        text = json.dumps({"version": version, "path": str(final.resolve()), "time": time.time(), **(extra or {})})
        try:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except Exception as exc:  # the version was never named: it goes too
            remove_path(tmp)
            code = disk_full(exc)
            if code is None:
                raise
            remove_path(final)
            raise self._failed(version, final, f"{LATEST} could not be updated: {FULL[code]}", len(text),
                               code) from None
        os.replace(tmp, self.directory / LATEST)
        _fsync(self.directory)

    def _remove(self, version: int) -> None:
        old = self.directory / f"step-{version}"
        trash = self.directory / f".trash-{old.name}-{os.getpid()}"
        os.rename(old, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _prune(self) -> None:
        """Keep the ``keep`` newest versions up to the one ``latest.json`` names (that one
        always); a version above it is not this publisher's to judge (see :meth:`drop_newer`)."""
        named = self.latest_version()
        if named is None:
            return
        for v in [v for v in self.versions() if v <= named][: -self.keep]:
            if v != named:
                self._remove(v)

    def latest_version(self) -> Optional[int]:
        """The version ``latest.json`` names (None: none, or not a number)."""
        try:
            v = (read_latest(self.directory) or {}).get("version")
        except (OSError, ValueError):
            return None
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def drop_newer(self, version: int) -> List[int]:
        """Remove the versions above ``version`` (a run resumed from an older checkpoint trains
        their steps again); only once ``latest.json`` names ``version`` or below. Returns them."""
        named = self.latest_version()
        if named is None or named > version:
            raise PublishError(f"publish: versions above {version} are kept while {LATEST} names version {named}")
        newer = [v for v in self.versions() if v > version]
        for v in newer:
            self._remove(v)
        if newer:
            _fsync(self.directory)
        return newer

    # one version ------------------------------------------------------------------------------------
    def publish(self, model: torch.nn.Module, version: int, step: Optional[int] = None, rank: int = 0,
                rewind: bool = False) -> Published:
        """Write ``model`` as ``version`` (every rank calls this under FSDP2; rank 0 writes),
        point ``latest.json`` at it, prune, call the hooks. A version below the one
        ``latest.json`` names is refused, unless ``rewind`` (a run resumed from an older
        checkpoint): the versions above it are then removed once ``latest.json`` names it."""
        t0 = time.perf_counter()
        step = version if step is None else step
        self.check(model)
        named = self.latest_version() if rank == 0 else None
        backwards = named is not None and named > version and not rewind
        sd = self._gather(model, rank == 0 and not backwards)
        if rank != 0:
            return Published(version, None, time.perf_counter() - t0, 0, 0)
        if backwards:
            raise PublishError(f"publish: version {version} is below version {named}, which {self.directory / LATEST} "
                               "names: versions only go forward (an earlier run's folder? resume that run, or "
                               "publish into a new or empty publish.dir)")
        final = self._write(model, sd, version, step)
        del sd
        extra = {"kind": ADAPTER_KIND, "base": self._base(model)} if self._adapter(model) else {}
        if replay_shape(model) is not None:  # samplers record the routing they use (treelit-rollout does)
            extra["moe_routing"] = "replay"
        self._point_latest(version, final, extra or None)
        if rewind:
            dropped = self.drop_newer(version)
            if dropped:
                log.info("publish: resumed at step %d: removed the versions published after that checkpoint (%s; "
                         "their steps are trained again); %s names version %d", version,
                         ", ".join(map(str, dropped)), LATEST, version)
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
    restored step, unless ``latest.json`` already names it; versions published after the
    checkpoint it resumes from are removed) and, after a step batch whose
    updates reached or passed a multiple of ``every_n_steps``, version N = the optimizer step
    count after it. Logs, every step, the last publish's
    ``publish/seconds`` and ``publish/bytes``, ``publish/version``, the hook failures so
    far (``publish/hook_failures``) and the versions not written for want of space
    (``publish/write_failures``, ``required=false``). ``version`` is the last published
    version: the trainer's policy version that rollout staleness is measured against."""

    def __init__(self, dir: Optional[str] = None, every_n_steps: int = 1, dtype: str = "bfloat16", keep: int = 3,
                 tokenizer: Optional[str] = None, hooks: Optional[Mapping[str, Any]] = None,
                 required: bool = False, lora: str = "merged", base: Optional[str] = None) -> None:
        if dir is None:
            raise ValueError("publish.dir is required to publish the policy (null switches publishing off)")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"publish.every_n_steps must be a positive number of optimizer steps, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.publisher = PolicyPublisher(dir, dtype=dtype, keep=keep, tokenizer=tokenizer, hooks=hooks,
                                         required=required, lora=lora, base=base)
        self.version: Optional[int] = None
        self.last: Optional[Published] = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.publisher.check(pl_module.model)  # before training: publish.lora=adapter on a model without LoRA

    def _publish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rewind: bool = False) -> None:
        step = int(trainer.global_step)
        rank = int(trainer.global_rank)
        failed = None
        try:
            res = self.publisher.publish(pl_module.model, step, step, rank, rewind=rewind)
        except PublishError as exc:
            failed, res = exc, None
        except WriteFailed as exc:  # rank 0 could not write the version: latest.json names the previous one
            if self.publisher.required:
                failed, res = WriteFailed(f"{exc} (publish.required=true)", exc.errno, exc.path, exc.needed), None
            else:
                self.publisher.write_failures += 1
                log.warning("%s; training goes on (publish.required=false)", exc)
                res = None
        comm = pl_module._comm() if hasattr(pl_module, "_comm") else None
        if comm is not None and comm.distributed and comm.max(float(failed is not None)) > 0:
            failed = failed or PublishError(f"a required publish of version {step} failed on rank 0 (its hook, or "
                                            "writing it: see rank 0's line)")
            failed.agreed = True  # every rank stops; rank 0's line reports it (treelit.lightning.faults)
            hold_launched_ranks(trainer)
            raise failed
        if failed is not None:
            raise failed
        if res is None:
            return  # not published: the next step tries again
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
        resumed = trainer.ckpt_path is not None or step > 0  # versions above this step are retrained
        if have:
            self.version = step
            if trainer.is_global_zero and resumed:
                dropped = self.publisher.drop_newer(step)
                if dropped:
                    log.info("publish: resumed at step %d: removed the versions published after that checkpoint "
                             "(%s; their steps are trained again)", step, ", ".join(map(str, dropped)))
            return
        self._publish(trainer, pl_module, rewind=resumed)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)  # a step batch may take several updates (ppo_epochs, ppo_minibatches)
        if self.version is None or step // self.every_n_steps > self.version // self.every_n_steps:
            self._publish(trainer, pl_module)
        if self.last is not None:  # the latest publish's cost, logged with every step (rank 0's)
            pl_module.log_dict({"publish/seconds": self.last.seconds, "publish/bytes": float(self.last.bytes),
                                "publish/version": float(self.version)})
        pl_module.log_dict({"publish/hook_failures": float(self.publisher.hook_failures),
                            "publish/write_failures": float(self.publisher.write_failures)})
