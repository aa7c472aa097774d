"""The option checks and the composition table (:mod:`treelit.cli.compositions`) agree on every
cell: each feature on each strategy, and each pair of features on each strategy, on treelit's own
decoders and on the transformers adapter (``model=hf_auto``), is refused before launch exactly
where the table has a row for it, in one line naming the row's option; every other cell passes.
Validation only (no model is built: the checkpoints are config.json files)."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest
from omegaconf import OmegaConf

from cli_helpers import quotes_balance
from treelit.cli.compositions import (EXCLUSIVE, FEATURES, REFUSALS, STRATEGIES, exclusive, refusal, refusal_table,
                                      refusals)
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


def _load(group: str, name: str):
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
        cfg.model = _load("model", "hf_auto")
        kind = ("qwen3_5" if "hybrid" in f else "qwen2_5_vl") if "images" in f else \
            ("qwen3_next" if "hybrid" in f else "qwen3_moe") if moe else ("qwen3_5_text" if "hybrid" in f else "qwen2")
        cfg.model.hf_checkpoint = checkpoint(kind, moe and "images" not in f, "images" in f)
        cfg.model.vision = "images" in f
    else:
        cfg.model = _load("model", "qwen3_moe_tiny" if moe else "hybrid_tiny" if "hybrid" in f else "qwen2_tiny")
        if moe and "hybrid" in f:
            OmegaConf.update(cfg, "model.config.layer_types", ["gdn", "attention"], force_add=True)
            OmegaConf.update(cfg, "model.config.recurrent", {"gdn": _GDN}, force_add=True)
    critic = "shared" if "shared_critic" in f else "separate" if "separate_critic" in f else "none"
    rl = critic != "none" or "reference_kl" in f
    objective = "ppo" if critic != "none" else "grpo" if rl else "sft"
    cfg.partition = _load("partition", "redundancy_free" if strategy.endswith("partitioned") else "none")
    cfg.critic = _load("critic", critic)
    cfg.objective = _load("objective", objective)
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


def cells():
    """Every feature alone and every pair of features (not two values of one option), on every strategy."""
    sets = [(f,) for f in FEATURES] + [p for p in itertools.combinations(FEATURES, 2) if not exclusive(p)]
    return [(s, f) for s in STRATEGIES for f in sets]


def test_the_option_checks_refuse_exactly_what_the_table_lists():
    wrong, refused = [], 0
    for strategy, features in cells():
        for model in ("native", "hf_auto"):
            if model == "native" and "images" in features:
                continue  # (images come with a vision-language checkpoint)
            rows = refusals(features, strategy, model)
            msg = verdict(features, strategy, model)
            name = f"{' + '.join(features)} on {strategy} ({model})"
            if rows and msg is None:
                wrong.append(f"{name}: the table refuses it ({rows[0].option}), the option checks pass it")
            elif msg is not None and not rows:
                wrong.append(f"{name}: refused ({msg}), but the table has no row for it")
            elif msg is not None and ("\n" in msg or not any(r.option in msg for r in rows)
                                      or not quotes_balance(msg)):
                wrong.append(f"{name}: the refusal names none of {[r.option for r in rows]} in one line: {msg!r}")
            refused += msg is not None
    assert not wrong, f"{len(wrong)}:\n" + "\n".join(wrong[:30])
    assert refused > 0


def test_every_row_refuses_some_cell_and_names_known_features():
    for row in REFUSALS:
        assert all(f in FEATURES for f in row.features) and all(s in STRATEGIES for s in row.strategies), row
        assert row.reason and row.option, row
        hit = [(s, f) for s, f in cells() if row in refusals(f, s, row.model or "hf_auto")]
        assert hit, f"{row}: covers no cell of the matrix"
    assert all(len(p) == 2 for p in EXCLUSIVE)


def test_lookups():
    assert refusal(("images",), "one_process", "hf_auto") is None
    assert refusal(("images",), "partitioned", "hf_auto") is None
    assert refusal(("images", "lora"), "ddp", "hf_auto").option == "model.vision=true"
    assert refusal(("routing_replay", "checkpointing"), "fsdp2", "native") is None
    assert refusal(("routing_replay", "checkpointing"), "fsdp2", "hf_auto") is not None
    with pytest.raises(KeyError, match="not in the composition matrix: pictures"):
        refusal(("pictures",), "ddp")
    table = refusal_table()
    assert table.count("\n") == len(REFUSALS) + len(EXCLUSIVE) + 1


def test_router_loss_on_a_model_without_experts_is_refused_naming_the_option():
    """It did nothing before (no MoE layer, no router loss): now one line before launch."""
    cfg = cell_config(("router_loss",), "one_process", "native")
    cfg.model = _load("model", "qwen2_tiny")
    OmegaConf.update(cfg, "model.router_aux_loss_coef", 0.05, force_add=True)
    with pytest.raises(ConfigError, match=r"^model\.router_aux_loss_coef=0\.05 needs a mixture-of-experts model; "
                                          r"model\.preset=qwen2_tiny has no MoE layers"):
        validate_config(cfg)
    OmegaConf.update(cfg, "model.router_aux_loss_coef", 0.0)
    validate_config(cfg)
