"""The ``model`` group's options judged before launch: the MoE routing mode and the vision tower.

These were once judged where the model is built (``set_moe_routing``, ``make_hf_model``, the run's
check of a model with its vision tower), 20 s and more into a run that loads a real checkpoint,
although none of them needs the weights: the routing mode is a word, whether a model has experts
is in its preset's defaults or its ``config.json``, and what a vision run cannot combine with is
in the rest of the config. So each is one ``error:`` line here, before the model loads (the same
checks still stand where the model is built, for models made from Python).

Whether a model has MoE layers is only refused here when it plainly has none: a preset whose
defaults and ``model.config`` name no experts, or a checkpoint whose ``config.json`` (or its
``text_config``) has no key about experts at all. Anything less sure is left to the model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from omegaconf import DictConfig

from treelit.cli.errors import ConfigError

__all__ = ["check_model_options", "check_vision_options", "has_moe_layers"]


def check_model_options(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` (one line) for the first bad ``model.moe`` / ``model.vision`` setting."""
    model = cfg.get("model") or {}
    if not hasattr(model, "get"):
        return
    _check_routing(model)
    _check_router_loss(model)
    check_vision_options(cfg)


# routing -------------------------------------------------------------------------------------------

def _check_routing(model: Any) -> None:
    from treelit.models.config import ROUTING_MODES

    moe = model.get("moe") or {}
    if not hasattr(moe, "keys"):
        raise ConfigError(f"model.moe must be a group of options (routing: {' or '.join(ROUTING_MODES)}), got {moe!r}")
    unknown = sorted(str(k) for k in moe.keys() if k != "routing")
    if unknown:
        raise ConfigError(f"model.moe.{unknown[0]}: no such option (the options under model.moe are: routing)")
    routing = moe.get("routing") or "live"
    if routing not in ROUTING_MODES:
        raise ConfigError(f"model.moe.routing={routing}: not a routing mode; use {' or '.join(ROUTING_MODES)} "
                          "(replay: the experts the sampler recorded in routed_experts)")
    if routing != "replay":
        return
    name, moe_layers = has_moe_layers(model)
    if moe_layers is False:
        raise ConfigError(f"model.moe.routing=replay needs a mixture-of-experts model; {name} has no MoE layers: "
                          "use model.moe.routing=live, or a MoE model (model=qwen3_moe_tiny, or a checkpoint with "
                          "experts)")


def _check_router_loss(model: Any) -> None:
    """A router loss coefficient on a model that plainly has no experts would do nothing: refused
    (docs/distributed.md, "What does not combine": no vision family treelit loads has experts)."""
    coef = model.get("router_aux_loss_coef")
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef <= 0:
        return
    name, moe_layers = has_moe_layers(model)
    if moe_layers is False:
        raise ConfigError(f"model.router_aux_loss_coef={coef} needs a mixture-of-experts model; {name} has no MoE "
                          "layers: set model.router_aux_loss_coef=null (or 0), or use a MoE model")


def has_moe_layers(model: Any) -> "tuple[str, Optional[bool]]":
    """``(how the model is named, True / False / None)``: whether the model group ``model`` builds
    a model with MoE layers (None: not known without building it)."""
    ckpt = model.get("hf_checkpoint")
    if ckpt and ckpt != "???":
        conf = Path(str(ckpt)) / "config.json"
        try:
            data = json.loads(conf.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return f"the checkpoint {str(ckpt)!r}", None
        parts = [data] + [v for k, v in data.items() if k == "text_config" and isinstance(v, dict)]
        experts = any("expert" in str(k).lower() for part in parts for k in part)
        return f"the checkpoint {str(ckpt)!r} ({data.get('model_type', 'unknown model_type')})", experts
    preset = model.get("preset")
    if not preset:
        return "the model", None
    from treelit.models.registry import MODELS

    try:
        make = MODELS.get(str(preset))
    except KeyError:  # an unknown preset: named where the model is built, with the known ones
        return f"model.preset={preset}", None
    defaults = getattr(make, "defaults", None)
    if defaults is None:  # a plugin's preset: its defaults are not known without building it
        return f"model.preset={preset}", None
    overrides = model.get("config") or {}
    moe = overrides.get("moe", defaults.get("moe")) if hasattr(overrides, "get") else defaults.get("moe")
    return f"model.preset={preset}", bool(moe)


# the vision tower ---------------------------------------------------------------------------------

def check_vision_options(cfg: DictConfig) -> None:
    """What a model with its vision tower (``model.vision=true``) does not run, refused by option: a
    separate critic without a tower of its own, and LoRA's trained copy of the tower with a frozen
    tower. And the tower's own options without it. (DDP, FSDP2, HSDP and context parallelism run
    images: the step's image encoder, :mod:`treelit.lightning.image_part`, and
    :mod:`treelit.partition.cp_images`; ``mode=linear`` and ``verify_every``: the per-branch
    baseline encodes each branch's own images.)"""
    model = cfg.get("model") or {}
    vision = model.get("vision", False)
    if not vision:
        for key in ("freeze_vision", "vision_images_per_pass"):
            value = model.get(key)
            if value:
                shown = str(value).lower() if isinstance(value, bool) else value
                raise ConfigError(f"model.{key}={shown} needs model.vision=true (a checkpoint loaded with "
                                  "its vision tower)")
        return
    if vision is not True:
        raise ConfigError(f"model.vision must be true or false, got {vision!r}")
    per_pass = model.get("vision_images_per_pass", 0)
    if not (isinstance(per_pass, int) and not isinstance(per_pass, bool) and per_pass >= 0):
        raise ConfigError(f"model.vision_images_per_pass must be an integer >= 0 (0: all images at once), "
                          f"got {per_pass!r}")
    lora = model.get("lora") or {}
    saved = list(lora.get("modules_to_save") or []) if hasattr(lora, "get") and lora.get("rank") else []
    if model.get("freeze_vision") and any(str(m).split(".")[-1] == "visual" for m in saved):
        raise ConfigError(f"model.freeze_vision=true with model.lora.modules_to_save={saved}: the one freezes the vision "
                          "tower, the other trains a copy of it in full; drop one")
    critic = (cfg.get("critic") or {}).get("kind", "none")
    critic_model = (cfg.get("critic") or {}).get("model")
    if critic == "separate" and critic_model not in (None, "policy"):  # its own model must see the images
        raise ConfigError(f"critic.model={critic_model} with model.vision=true: critic=separate reads the images "
                          "through a vision tower of its own; use critic.model=policy (a copy of the policy's model "
                          "config, its tower included)")
    _check_vision_checkpoint(model, cfg)


def _check_vision_checkpoint(model: Any, cfg: Any) -> None:
    """The checkpoint's ``config.json`` names a vision family with its tower (read, not loaded)."""
    ckpt = model.get("hf_checkpoint")
    if not ckpt or ckpt == "???":
        return
    conf = Path(str(ckpt)) / "config.json"
    try:
        data = json.loads(conf.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # (a missing or broken config.json: its own line, check_input_files)
        return
    if not isinstance(data, dict):
        return
    from treelit.models.errors import CheckpointError
    from treelit.models.hf_vision import check_vision_config

    try:
        check_vision_config(SimpleNamespace(**data), f"model.hf_checkpoint: {conf}")
    except CheckpointError as exc:
        said = str(exc)
        raise ConfigError(said if "model.vision=true" in said else f"{said} (model.vision=true)") from None
    if data.get("model_type") == "gemma3":
        _check_image_blocks(cfg)


def _check_image_blocks(cfg: Any) -> None:
    """Gemma-3's language model attends bidirectionally inside each image block: a backend that
    takes any visibility interval (``bidirectional_blocks``: sdpa_dense, flex), and whole blocks
    in one process."""
    att = str((cfg.get("attention") or {}).get("name", "auto"))
    tr = cfg.get("trainer") or {}
    what = "with a Gemma-3 checkpoint (model.vision=true)"
    if att == "auto":
        if str(tr.get("accelerator", "cpu")) in ("gpu", "cuda"):
            return  # auto picks flex on CUDA
        raise ConfigError(f"attention=auto {what}: on CPU auto picks segment for rows over 512 tokens, which cannot "
                          "attend bidirectionally inside an image block; set attention=sdpa_dense (attention=flex "
                          "on CUDA)")
    from treelit.attention.base import ATTENTION

    try:
        backend = ATTENTION.get(att)
    except KeyError:  # an unknown backend: named where the backend is built, with the known ones
        return
    if not getattr(backend, "bidirectional_blocks", False):
        raise ConfigError(f"attention={att} {what}: {att} plans attention from the tree's causal structure and cannot "
                          "attend bidirectionally inside an image block; use attention=sdpa_dense or attention=flex")
    strategy = tr.get("strategy")
    cp = strategy.get("context_parallel_degree", 1) if hasattr(strategy, "get") else 1
    if isinstance(cp, int) and cp > 1:
        raise ConfigError(f"trainer.strategy.context_parallel_degree={cp} {what}: an image block split over ranks "
                          "would need the keys of later ranks (its tokens see each other both ways)")

