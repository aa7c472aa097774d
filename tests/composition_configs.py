"""The composed config of a cell of the composition matrix (:mod:`treelit.cli.compositions`):
features on a strategy, on treelit's own decoders (``native``) or the transformers adapter
(``hf_auto``, its checkpoint a config.json only), and the option checks' verdict on it (None: it
passes; else the one-line refusal). Validation only: nothing is built."""

from __future__ import annotations

import copy
import functools
import json
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

from omegaconf import OmegaConf

from treelit.cli.config import CONF_DIR, ConfigError, compose, validate_config

_GDN = {"head_dim": 8, "num_heads": 2, "num_v_heads": 4, "expand_v": 2.0, "conv_size": 4}


@functools.lru_cache(maxsize=None)
def checkpoint(model_type: str, experts: bool, vision: bool) -> str:
    """A folder with a config.json only (nothing is loaded)."""
    folder = Path(tempfile.mkdtemp(prefix=f"treelit-{model_type}-"))
    data: Dict = {"model_type": model_type}
    if experts:
        data.update(num_experts=4, num_experts_per_tok=2)
    if vision:
        data["vision_config"] = {"depth": 1}
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder)


_TRAINERS: Dict[str, object] = {}


def load_group(group: str, name: str):
    return OmegaConf.load(Path(CONF_DIR) / group / f"{name}.yaml")


def cell_config(features: Tuple[str, ...], strategy: str, model: str):
    """The composed config of ``features`` on ``strategy`` (``model``: ``native`` or ``hf_auto``)."""
    f = set(features)
    trainer = {"one_process": "cpu", "partitioned": "cpu", "ddp": "ddp_cpu"}.get(strategy, "fsdp2_cpu")
    if trainer not in _TRAINERS:
        _TRAINERS[trainer] = compose([f"trainer={trainer}"])
    cfg = copy.deepcopy(_TRAINERS[trainer])
    moe = bool(f & {"routing_replay", "router_loss"})
    if model == "hf_auto":
        cfg.model = load_group("model", "hf_auto")
        if "images" in f:  # the vision families, with experts where the cell routes them
            kind = ("qwen3_5_moe" if moe else "qwen3_5") if "hybrid" in f else ("qwen3_vl_moe" if moe else "qwen2_5_vl")
        else:
            kind = ("qwen3_next" if "hybrid" in f else "qwen3_moe") if moe else ("qwen3_5_text" if "hybrid" in f else "qwen2")
        cfg.model.hf_checkpoint = checkpoint(kind, moe, "images" in f)
        cfg.model.vision = "images" in f
    else:
        cfg.model = load_group("model", "qwen3_moe_tiny" if moe else "hybrid_tiny" if "hybrid" in f else "qwen2_tiny")
        if moe and "hybrid" in f:
            OmegaConf.update(cfg, "model.config.layer_types", ["gdn", "attention"], force_add=True)
            OmegaConf.update(cfg, "model.config.recurrent", {"gdn": _GDN}, force_add=True)
    critic = "shared" if "shared_critic" in f else "separate" if "separate_critic" in f else "none"
    rl = critic != "none" or "reference_kl" in f
    objective = "ppo" if critic != "none" else "grpo" if rl else "sft"
    cfg.partition = load_group("partition", "redundancy_free" if strategy.endswith("partitioned") else "none")
    cfg.critic = load_group("critic", critic)
    cfg.objective = load_group("objective", objective)
    values = {
        "model.moe.routing": "replay" if "routing_replay" in f else "live",
        "model.router_aux_loss_coef": 0.05 if "router_loss" in f else None,
        "model.lora.rank": 4 if "lora" in f else None,
        "model.activation_checkpointing": "checkpointing" in f,
    }
    if trainer != "cpu":
        values["trainer.devices"] = 4 if strategy == "hsdp" else 2
    if strategy in ("cp", "cp_partitioned"):
        values["trainer.strategy.context_parallel_degree"] = 2
    if strategy == "hsdp":
        values["trainer.strategy.replicate_degree"] = 2
    if "reference_kl" in f:
        values.update({"objective.kl_coef": 0.1, "objective.reference": "initial"})
    if critic == "separate":
        values["critic.model"] = "policy"
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def verdict(features, strategy, model) -> Optional[str]:
    try:
        validate_config(cell_config(tuple(features), strategy, model))
    except (ConfigError, KeyError) as exc:
        return str(exc.args[0] if isinstance(exc, KeyError) else exc)
    return None
