"""Model construction from configuration (the ``model`` config group)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from treelit.models.config import AUX_DEFINITIONS, ROUTING_MODES
from treelit.models.hf import load_hf_checkpoint
from treelit.models.lora import apply_lora, lora_options
from treelit.models.moe import MoEFeedForward
from treelit.models.registry import build_model

__all__ = ["make_model", "parse_dtype", "set_router_aux_loss", "set_moe_routing", "moe_experts", "moe_routing",
           "replay_shape"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: Any) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def make_model(
    preset: str = "qwen2_5_tiny",
    hf_checkpoint: Optional[str] = None,
    dtype: str = "float32",
    config: Optional[Dict[str, Any]] = None,
    max_seq_len: Optional[int] = None,
    router_aux_loss_coef: Optional[float] = None,
    router_aux_loss: Optional[str] = None,
    activation_checkpointing: bool = False,
    lora: Optional[Dict[str, Any]] = None,
    moe: Optional[Dict[str, Any]] = None,
):
    """Load ``hf_checkpoint`` if given, else build the registered ``preset`` (random init,
    ``config`` overriding its fields). ``max_seq_len`` overrides the context length.

    ``router_aux_loss_coef`` / ``router_aux_loss`` override a mixture-of-experts model's
    router load-balancing loss (coefficient; ``micro_batch`` or ``sequence`` definition);
    by default a checkpoint's own setting applies (on when it has ``output_router_logits``).

    ``activation_checkpointing``: recompute each decoder layer in the backward pass instead of
    keeping its activations (tree mode, partitioned or not, any number of processes; exact).

    ``lora``: the ``model.lora`` options (:mod:`treelit.models.lora`); ``rank: null`` is off.

    ``moe``: the ``model.moe`` options; ``routing``: ``live`` (default) or ``replay`` (see
    :func:`set_moe_routing`)."""
    dt = parse_dtype(dtype)
    lora = lora_options(lora)  # bad options fail before the weights load
    if hf_checkpoint:
        model = load_hf_checkpoint(hf_checkpoint, dtype=dt, max_seq_len=max_seq_len)
    else:
        overrides = dict(config or {})
        if max_seq_len:
            overrides["max_seq_len"] = max_seq_len
        model = build_model(preset, **overrides).to(dt)
    set_router_aux_loss(model, router_aux_loss_coef, router_aux_loss)
    model.activation_checkpointing = bool(activation_checkpointing)
    set_moe_routing(model, moe_routing(moe))
    return apply_lora(model, lora)


def moe_routing(moe: Optional[Dict[str, Any]]) -> str:
    """The ``model.moe.routing`` option of a ``model.moe`` block (unknown keys refused)."""
    moe = dict(moe or {})
    unknown = sorted(set(moe) - {"routing"})
    if unknown:
        raise ValueError(f"model.moe.{unknown[0]}: unknown option (known: routing)")
    routing = moe.get("routing") or "live"
    if routing not in ROUTING_MODES:
        raise ValueError(f"model.moe.routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}")
    return routing


def set_moe_routing(model, routing: str) -> None:
    """``live``: each MoE layer routes by its router's top-k; ``replay``: by the experts recorded in
    the data (``routed_experts``), the combine weights still the current router's (see
    :mod:`treelit.models.moe` and :mod:`treelit.models.hf_replay`). A model without MoE layers
    refuses ``replay``."""
    if routing not in ROUTING_MODES:
        raise ValueError(f"model.moe.routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}")
    cfg = getattr(model, "config", None)
    moe = getattr(cfg, "moe", None)
    if not moe:
        if routing == "replay":
            family = getattr(cfg, "family", None) or type(model).__name__
            name = getattr(cfg, "model_type", family) if family == "hf_auto" else family
            raise ValueError(f"model.moe.routing=replay needs a mixture-of-experts model; this model ({name}) has no "
                             "MoE layers")
        return
    if hasattr(model, "set_routing"):  # the transformers adapter: hooks on its routers
        model.set_routing(routing)
        return
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            m.replay = routing == "replay"
    moe["routing"] = routing


def replay_shape(model):
    """``(MoE layers, experts, top_k)`` a record's ``routed_experts`` must fit under
    ``model.moe.routing=replay``; None when the model routes live."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    if not moe or moe.get("routing") != "replay":
        return None
    if hasattr(model, "set_routing"):
        layers = len(model._replay.routers)
    else:
        layers = sum(isinstance(m, MoEFeedForward) for m in model.modules())
    return (layers, int(moe["num_experts"]), int(moe["top_k"]))


def moe_experts(model) -> Optional[int]:
    """The experts of each MoE layer of ``model`` (None: no MoE layers), whatever its routing mode."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    n = moe.get("num_experts") if moe else None
    return int(n) if n else None


def set_router_aux_loss(model, coef: Optional[float] = None, definition: Optional[str] = None) -> None:
    """Override the router load-balancing loss options of a mixture-of-experts model."""
    if coef is None and definition is None:
        return
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "moe", None):
        raise ValueError("model.router_aux_loss_coef / model.router_aux_loss need a mixture-of-experts model "
                         f"(family qwen3_moe); this model's family is {getattr(cfg, 'family', '?')!r}")
    if coef is not None:
        if float(coef) < 0:
            raise ValueError(f"model.router_aux_loss_coef must be >= 0, got {coef}")
        cfg.moe["router_aux_loss_coef"] = float(coef)
    if definition is not None:
        if definition not in AUX_DEFINITIONS:
            raise ValueError(f"model.router_aux_loss must be one of {', '.join(AUX_DEFINITIONS)}, got {definition!r}")
        cfg.moe["router_aux_loss"] = definition
