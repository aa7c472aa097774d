"""LoRA adapters on any treelit model, through PEFT's LoRA layers (``model.lora.*``).

The adapters are injected into the module that holds the projections: the wrapped
transformers ``*ForCausalLM`` of ``model=hf_auto`` (so names, targets and the saved adapter
are exactly PEFT's on that model) or treelit's native decoder. The tree forward calls every
projection as a module, so a wrapped projection computes ``W x + s B A x`` on each tree token
once, as it would on each branch's copy of that token: tree mode stays exact (tested against
transformers + PEFT run branch by branch).

What is refused, with one line before training:

* a rank <= 0, a target name that matches no module, a target that is not a linear or
  embedding layer (convolutions: the tree kernels read their weights directly, so an adapter
  there would be bypassed), the language-model head as a LoRA target (treelit's chunked head
  reads its weight; train it with ``modules_to_save`` instead);
* ``init`` options that rewrite the base weights (PiSSA, OLoRA, CorDA, LoftQ) or need data
  (EVA): the base must stay the checkpoint's for ``reference=base`` and the adapter export;
* dropout > 0 in tree mode (see :func:`check_lora_mode`).

The base weights are frozen (``requires_grad=False``): the optimizer holds the adapters (and
``modules_to_save``) only, and checkpoints hold those and nothing of the base.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
from safetensors.torch import save_file
from torch import nn

__all__ = ["ADAPTER_NAME", "LoraOptions", "apply_lora", "lora_options", "lora_of", "check_lora_mode", "check_reference",
           "adapters_disabled", "trainable_state_dict", "adapter_state_dict", "save_adapter", "merged_state_dict",
           "is_lora_key"]

ADAPTER_NAME = "default"
# PEFT's init_lora_weights values that leave the base weights as they are and need no data
_INITS = {"true": True, "false": False, "gaussian": "gaussian", "orthogonal": "orthogonal"}
_INITS_REFUSED = ("pissa", "olora", "corda", "loftq", "eva")


class LoraOptions(dict):
    """The checked ``model.lora`` options (a dict, so it travels through configs and pickles)."""


def lora_options(lora: Optional[Mapping[str, Any]]) -> Optional[LoraOptions]:
    """``model.lora`` checked: ``None`` when LoRA is off (``rank: null``)."""
    if lora is None:
        return None
    lora = dict(lora)
    rank = lora.get("rank")
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"model.lora.rank must be a positive integer (null: no LoRA), got {rank!r}")
    alpha = lora.get("alpha", 16)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"model.lora.alpha must be a positive number, got {alpha!r}")
    dropout = lora.get("dropout", 0.0) or 0.0
    if not isinstance(dropout, (int, float)) or not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"model.lora.dropout must be in [0, 1), got {dropout!r}")
    targets = lora.get("target_modules", "all-linear")
    if isinstance(targets, str):
        targets = targets if targets == "all-linear" else [targets]
    else:
        targets = [str(t) for t in (targets or [])]
        if not targets:
            raise ValueError("model.lora.target_modules is empty: give module names (e.g. [q_proj,v_proj]) or all-linear")
    init = lora.get("init", True)
    key = str(init).lower()
    if key.startswith(_INITS_REFUSED):
        raise ValueError(f"model.lora.init={init}: this initialisation rewrites the base weights or needs data; "
                         "treelit keeps the base as the checkpoint's (reference=base, adapter export): use one of "
                         "true, false, gaussian, orthogonal")
    if key not in _INITS:
        raise ValueError(f"model.lora.init must be one of true, false, gaussian, orthogonal, got {init!r}")
    save = lora.get("modules_to_save") or []
    save = [save] if isinstance(save, str) else [str(s) for s in save]
    unknown = set(lora) - {"rank", "alpha", "dropout", "target_modules", "use_rslora", "init", "modules_to_save"}
    if unknown:
        raise ValueError(f"model.lora has no option {sorted(unknown)[0]!r} (options: rank, alpha, dropout, "
                         "target_modules, use_rslora, init, modules_to_save)")
    return LoraOptions(rank=int(rank), alpha=float(alpha), dropout=float(dropout), target_modules=targets,
                       use_rslora=bool(lora.get("use_rslora", False)), init=_INITS[key], modules_to_save=save)


def _inner(model: nn.Module) -> nn.Module:
    """The module the adapters go into: a transformers model's ``*ForCausalLM``, else the model."""
    return getattr(model, "hf", model)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _head_and_embedding(model: nn.Module, inner: nn.Module) -> Dict[str, nn.Module]:
    by_id = {id(m): n for n, m in inner.named_modules()}
    out = {}
    for what, mod in (("head", model.output), ("embedding", model.tok_embeddings)):
        if id(mod) in by_id:
            out[what] = by_id[id(mod)]
    return out


def _resolve_targets(opts: LoraOptions, model: nn.Module, inner: nn.Module) -> List[str]:
    special = _head_and_embedding(model, inner)
    head = special.get("head")
    modules = dict(inner.named_modules())
    if opts["target_modules"] == "all-linear":
        names = sorted({n.split(".")[-1] for n, m in modules.items()
                        if isinstance(m, nn.Linear) and n != head})
        if not names:
            raise ValueError("model.lora.target_modules=all-linear: this model has no linear layer besides its head")
        return names
    wrappable = {n: m for n, m in modules.items() if n != head and isinstance(m, (nn.Linear, nn.Embedding))}
    linear = sorted({n.split(".")[-1] for n, m in wrappable.items() if isinstance(m, nn.Linear)})
    embedding = sorted({n.split(".")[-1] for n, m in wrappable.items() if isinstance(m, nn.Embedding)})
    for t in opts["target_modules"]:
        hits = [(n, m) for n, m in modules.items() if n and _matches(n, t)]
        if not hits:
            also = f"; its embedding: {', '.join(embedding)}" if embedding else ""
            raise ValueError(f"model.lora.target_modules: {t!r} matches no module of this model; its linear layers "
                             f"are named {', '.join(linear)}{also} (the head is trained with model.lora.modules_to_save)")
        for n, m in hits:
            if head is not None and n == head:
                raise ValueError(f"model.lora.target_modules: {t!r} is the language-model head ({n}), which "
                                 "treelit's chunked head reads as a weight: train it with model.lora.modules_to_save")
            if not isinstance(m, (nn.Linear, nn.Embedding)):
                raise ValueError(f"model.lora.target_modules: {t!r} matches {n} ({type(m).__name__}), which LoRA in "
                                 "tree mode cannot wrap (linear and embedding layers only)")
    return list(opts["target_modules"])


def _check_modules_to_save(opts: LoraOptions, model: nn.Module, inner: nn.Module) -> None:
    special = _head_and_embedding(model, inner)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    names = [n for n, _ in inner.named_modules() if n]
    for s in opts["modules_to_save"]:
        hits = [n for n in names if _matches(n, s)]
        if not hits:
            raise ValueError(f"model.lora.modules_to_save: {s!r} matches no module of this model")
        if tied and any(n in special.values() for n in hits):
            raise ValueError(f"model.lora.modules_to_save: {s!r} is the embedding or the head of a model whose "
                             "head is tied to its embeddings; a trained copy of one would untie them")


def apply_lora(model: nn.Module, lora: Optional[Mapping[str, Any]]) -> nn.Module:
    """Inject LoRA adapters (``model.lora`` options) into ``model`` in place and freeze its base;
    returns the model. ``rank: null`` leaves it untouched."""
    opts = lora if isinstance(lora, LoraOptions) else lora_options(lora)
    if opts is None:
        return model
    import peft  # heavy (~2.5 s CPU, it imports transformers): LoRA runs only

    inner = _inner(model)
    if not isinstance(getattr(model, "output", None), nn.Linear) and type(model.output).__name__ != "TiedLinear":
        raise ValueError(f"model.lora: this model's head ({type(model.output).__name__}) is not one LoRA in tree "
                         "mode can leave frozen")
    targets = _resolve_targets(opts, model, inner)
    vision = getattr(model, "vision", None)
    if vision is not None:  # adapters on the language model only: the vision tower stays frozen
        lm = {id(m): n for n, m in inner.named_modules()}[id(vision.language_model)]
        if opts["target_modules"] == "all-linear":
            targets = sorted({n.split(".")[-1] for n, m in vision.language_model.named_modules()
                              if isinstance(m, nn.Linear)})
        targets = rf"{re.escape(lm)}\.(.*\.)?({'|'.join(re.escape(t) for t in targets)})"
    _check_modules_to_save(opts, model, inner)
    cfg = peft.LoraConfig(r=opts["rank"], lora_alpha=opts["alpha"], lora_dropout=opts["dropout"],
                          target_modules=targets, use_rslora=opts["use_rslora"], init_lora_weights=opts["init"],
                          modules_to_save=opts["modules_to_save"] or None, bias="none")
    dtype = next(model.parameters()).dtype
    try:
        peft.inject_adapter_in_model(cfg, inner, adapter_name=ADAPTER_NAME)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"model.lora: PEFT cannot wrap this model's layers: {' '.join(str(exc).split())}") from None
    for name, p in inner.named_parameters():  # the adapters in the model's dtype (PEFT makes them float32)
        if ".lora_" in name and p.dtype != dtype:
            p.data = p.data.to(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_key(name) or _is_saved_copy(name))
    model.treelit_lora = opts
    model.treelit_lora_config = cfg
    return model


def lora_of(model: nn.Module) -> Optional[LoraOptions]:
    """The model's LoRA options, or ``None`` when it has no adapters (FSDP/DDP wrappers looked through)."""
    seen = model
    while seen is not None:
        opts = getattr(seen, "treelit_lora", None)
        if opts is not None:
            return opts
        seen = getattr(seen, "module", None)
    return None


def check_lora_mode(model: nn.Module, mode: str) -> None:
    """LoRA dropout draws one mask per token of the row the layer sees: in tree mode a shared
    token would get one mask for all the branches through it, where per-branch training draws
    one per branch. That is a different (correlated) regulariser, not per-branch training, so
    tree mode refuses it."""
    opts = lora_of(model)
    if opts is not None and opts["dropout"] > 0 and mode == "tree":
        raise ValueError(f"model.lora.dropout={opts['dropout']}: in tree mode a shared token would get one dropout "
                         "mask for every branch through it, which per-branch training does not; set "
                         "model.lora.dropout=0 (or mode=linear)")


def check_reference(model: nn.Module, objective) -> None:
    """``objective.reference=base`` needs adapters to switch off."""
    if getattr(objective, "reference", None) == "base" and lora_of(model) is None:
        raise ValueError("objective.reference=base is the model with its LoRA adapters off, and this model has "
                         "none: set model.lora.rank (or objective.reference=initial for a frozen copy)")


def is_lora_key(name: str) -> bool:
    """A parameter / state-dict name of an adapter weight."""
    return ".lora_" in name


def _is_saved_copy(name: str) -> bool:
    return ".modules_to_save." in name


def trainable_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The entries of a state dict that training changes: adapters and ``modules_to_save`` copies."""
    return {k: v for k, v in sd.items() if is_lora_key(k) or _is_saved_copy(k)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model (adapters and ``modules_to_save`` copies bypassed) inside the context.
    Only the layers' disable flag changes: no parameter's ``requires_grad``, so sharded (FSDP2)
    parameters are left as they are."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # heavy (imports transformers): LoRA runs only
    from peft.utils.other import AuxiliaryTrainingWrapper  # as above

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    if not layers:
        raise ValueError("objective.reference=base needs LoRA adapters (model.lora.rank): without them the base "
                         "is the policy itself")
    before = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield model
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def _strip(name: str) -> str:
    return name[len("hf."):] if name.startswith("hf.") else name


def adapter_state_dict(model: nn.Module, sd: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """The adapter weights under the names PEFT saves (``base_model.model.<module>.lora_A.weight``,
    ``...modules_to_save`` as the module's own weights), from ``sd`` (a gathered full state dict)
    or the model's."""
    sd = sd if sd is not None else model.state_dict()
    out = {}
    for k, v in sd.items():
        name = _strip(k)
        if is_lora_key(name):
            name = name.replace(f".{ADAPTER_NAME}.", ".")
        elif _is_saved_copy(name):
            name = name.replace(f".modules_to_save.{ADAPTER_NAME}.", ".")
        else:
            continue
        out["base_model.model." + name] = v.detach().cpu().contiguous()
    return out


def save_adapter(model: nn.Module, path: Union[str, os.PathLike], sd: Optional[Mapping[str, torch.Tensor]] = None,
                 dtype: Optional[torch.dtype] = None, base_model: Optional[str] = None) -> Path:
    """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained(base, path)`` loads, and ``AutoPeftModelForCausalLM`` (which
    reads the base from the config: ``base_model``, absolute when it is a local folder, so the
    folder loads from any working directory without asking the hub; ``task_type`` CAUSAL_LM), and
    vLLM's and SGLang's LoRA loaders."""
    cfg = getattr(model, "treelit_lora_config", None)
    if cfg is None:
        raise ValueError("this model has no LoRA adapters to save")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = adapter_state_dict(model, sd)
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    save_file(weights, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    if base_model is not None and Path(base_model).is_dir():  # as typed, relative to the run's folder
        base_model = str(Path(base_model).resolve())
    config["base_model_name_or_path"] = base_model
    config["task_type"] = config.get("task_type") or "CAUSAL_LM"
    config["inference_mode"] = True
    for k, v in list(config.items()):
        if isinstance(v, set):
            config[k] = sorted(v)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return path


def merged_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The base model's state dict (its own names) with every adapter merged into its weight
    (``W + s B A``; embeddings ``W + s (B A)^T``) and ``modules_to_save`` copies in place of
    the originals."""
    cfg = getattr(model, "treelit_lora_config", None)
    if cfg is None:
        return dict(sd)
    r, alpha = cfg.r, cfg.lora_alpha
    scale = alpha / (r ** 0.5) if cfg.use_rslora else alpha / r
    out: Dict[str, torch.Tensor] = {}
    lora: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        if is_lora_key(k):
            owner, rest = k.split(".lora_", 1)
            lora.setdefault(owner, {})[rest.split(".")[0]] = v
        elif _is_saved_copy(k):
            continue
        elif ".base_layer." in k:
            out[k.replace(".base_layer.", ".")] = v
        elif ".original_module." in k:
            saved = k.replace(".original_module.", f".modules_to_save.{ADAPTER_NAME}.")
            out[k.replace(".original_module.", ".")] = sd.get(saved, v)
        else:
            out[k] = v
    for owner, parts in lora.items():
        key = owner + ".weight"
        w = out[key]
        if "A" in parts:
            delta = (parts["B"].double() @ parts["A"].double()) * scale
        else:  # embedding: lora_embedding_A [r, V], lora_embedding_B [D, r]
            delta = (parts["embedding_B"].double() @ parts["embedding_A"].double()).T * scale
        out[key] = (w.double() + delta).to(w.dtype)
    return out


def target_names(model: nn.Module) -> Sequence[str]:
    """The names of the modules that carry adapters (for messages and the docs)."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # heavy (imports transformers): LoRA runs only

    return [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
