"""The option checks and the composition table (:mod:`treelit.cli.compositions`) agree on every
cell: each feature on each strategy, and each pair of features on each strategy, on treelit's own
decoders and on the transformers adapter (``model=hf_auto``), is refused before launch exactly
where the table has a row for it, in one line naming the row's option; every other cell passes.
Validation only (no model is built: the checkpoints are config.json files)."""

from __future__ import annotations

import itertools

import pytest
from omegaconf import OmegaConf

from cli_helpers import quotes_balance
from composition_configs import load_group, cell_config, verdict
from treelit.cli.compositions import (EXCLUSIVE, FEATURES, REFUSALS, STRATEGIES, exclusive, refusal, refusal_table,
                                      refusals)
from treelit.cli.config import ConfigError, validate_config


def cells():
    """Every feature alone and every pair of features (not two values of one option), on every strategy."""
    sets = [(f,) for f in FEATURES] + [p for p in itertools.combinations(FEATURES, 2) if not exclusive(p)]
    return [(s, f) for s in STRATEGIES for f in sets]


def test_the_option_checks_refuse_exactly_what_the_table_lists():
    wrong, refused, expected, checked = [], 0, 0, 0
    for strategy, features in cells():
        for model in ("native", "hf_auto"):
            if model == "native" and "images" in features:
                continue  # (images come with a vision-language checkpoint)
            rows = refusals(features, strategy, model)
            msg = verdict(features, strategy, model)
            checked += 1
            expected += bool(rows)
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
    assert refused == expected and checked > 600, (refused, expected, checked)  # (the table may be empty)


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
    assert refusal(("images", "lora"), "ddp", "hf_auto") is None  # (image_part, cp_images)
    assert refusal(("images", "separate_critic"), "cp_partitioned", "hf_auto") is None
    assert refusal(("routing_replay", "checkpointing"), "fsdp2", "native") is None
    assert refusal(("routing_replay", "checkpointing"), "fsdp2", "hf_auto") is None  # (hf_recompute)
    assert refusal(("images", "routing_replay"), "one_process", "hf_auto") is None
    with pytest.raises(KeyError, match="not in the composition matrix: pictures"):
        refusal(("pictures",), "ddp")
    table = refusal_table()
    assert table.count("\n") == len(REFUSALS) + len(EXCLUSIVE) + 1


def test_router_loss_on_a_model_without_experts_is_refused_naming_the_option():
    """It did nothing before (no MoE layer, no router loss): now one line before launch."""
    cfg = cell_config(("router_loss",), "one_process", "native")
    cfg.model = load_group("model", "qwen2_tiny")
    OmegaConf.update(cfg, "model.router_aux_loss_coef", 0.05, force_add=True)
    with pytest.raises(ConfigError, match=r"^model\.router_aux_loss_coef=0\.05 needs a mixture-of-experts model; "
                                          r"model\.preset=qwen2_tiny has no MoE layers"):
        validate_config(cfg)
    OmegaConf.update(cfg, "model.router_aux_loss_coef", 0.0)
    validate_config(cfg)


def test_the_refusal_table_on_docs_distributed_md_is_the_modules():
    from pathlib import Path

    from treelit.cli.compositions import docs_section

    page = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    assert page == docs_section(page), \
        "docs/distributed.md's refusal table is stale: python -m treelit.cli.compositions --write docs/distributed.md"
    for row in REFUSALS:
        assert row.reason in page and f"`{row.option}`" in page
