"""The model group's options judged before the model loads (``treelit.cli.model_option_checks``).

Each case was once judged after the model was built - 22 to 27 s into a run on a real checkpoint:
a routing mode that is not one (its message also lost its closing quote), ``model.moe.routing=replay``
on a model without experts, and ``model.vision=true`` with context parallelism or ``verify_every``."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from cli_helpers import TINY, cli_cmd, cli_env, quotes_balance
from treelit.cli.config import ConfigError, compose, validate_config


def _checkpoint(folder, **config) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def vl(tmp_path) -> str:
    return _checkpoint(tmp_path / "vl", model_type="qwen2_5_vl", vision_config={"depth": 1})


@pytest.fixture
def text(tmp_path) -> str:
    return _checkpoint(tmp_path / "text", model_type="qwen2", vocab_size=64)


@pytest.fixture
def moe(tmp_path) -> str:
    return _checkpoint(tmp_path / "moe", model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2)


def _refusal(overrides, vl=None, text=None, moe=None) -> str:
    overrides = [o.format(vl=vl, text=text, moe=moe) for o in overrides]
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        validate_config(compose(overrides))
    assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert "\n" not in msg and quotes_balance(msg), msg
    return msg


@pytest.mark.parametrize("overrides,expected", [
    (["model.moe.routing=replayed"], r"^model.moe.routing=replayed: not a routing mode; use live or replay"),
    (["model.moe.routing=replay"], r"model.moe.routing=replay needs a mixture-of-experts model; "
                                   r"model.preset=qwen2_5_tiny has no MoE layers: use model.moe.routing=live"),
    (["model=qwen3_moe_tiny", "+model.config.moe=null", "model.moe.routing=replay"],
     r"model.preset=qwen3_moe_tiny has no MoE layers"),
    (["model=hf_auto", "model.hf_checkpoint={text}", "model.moe.routing=replay"],
     r"model.moe.routing=replay needs a mixture-of-experts model; the checkpoint .*text' \(qwen2\) has no MoE"),
    (["model=hf_auto", "model.hf_checkpoint={text}", "model.vision=true"],
     r"model.hf_checkpoint: .*config key 'model_type' = 'qwen2': model.vision=true runs the vision families"),
    (["model=hf_auto", "model.hf_checkpoint={vl}", "model.freeze_vision=true"],
     r"^model.freeze_vision=true needs model.vision=true"),
    (["model=hf_auto", "model.hf_checkpoint={vl}", "model.vision=true", "model.vision_images_per_pass=-1"],
     r"model.vision_images_per_pass must be an integer >= 0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_model_option_is_one_line_at_validation(overrides, expected, vl, text, moe):
    assert re.search(expected, _refusal(overrides, vl, text, moe))


@pytest.mark.parametrize("overrides", [
    ["model=qwen3_moe_tiny", "model.moe.routing=replay"],
    ["model=hf_auto", "model.hf_checkpoint={moe}", "model.moe.routing=replay"],
    # recomputed layers replay their pass's records (once refused here)
    ["model=hf_auto", "model.hf_checkpoint={moe}", "model.moe.routing=replay", "model.activation_checkpointing=true"],
    ["model=hf_auto", "model.hf_checkpoint={vl}", "model.vision=true", "model.freeze_vision=true",
     "critic=shared", "objective=ppo", "tree_builder.advantage=null"],
    ["model=hf_auto", "model.hf_checkpoint={vl}", "model.vision=true", "trainer=ddp_cpu", "trainer.devices=2"],
    ["model=hf_auto", "model.hf_checkpoint={vl}", "model.vision=true", "trainer=fsdp2_cpu", "trainer.devices=2"],
    ["model=hf_auto", "model.hf_checkpoint={vl}", "model.vision=true", "verify_every=3"],
    ["model=hf_auto", "model.hf_checkpoint={vl}", "model.vision=true", "mode=linear"],
    ["model=hf_auto", "model.hf_checkpoint={vl}", "model.vision=true", "critic=separate", "critic.model=policy",
     "objective=ppo", "tree_builder.advantage=null"],
], ids=lambda v: " ".join(v))
def test_good_model_options_pass(overrides, vl, moe):
    validate_config(compose([o.format(vl=vl, moe=moe) for o in overrides]))


def test_a_bad_routing_mode_is_refused_before_the_model_is_built(tmp_path):
    """One ``error:`` line with both its quotes, before the data is read (no ``data:`` line) and
    before any model is built - where it was once found, the message lost its closing quote."""
    out = tmp_path / "run"
    res = subprocess.run(cli_cmd(*TINY, "logger=none", "model.moe.routing=replayed", f"output_dir={out}"),
                         cwd=str(tmp_path), env=cli_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "model.moe.routing=replayed: not a routing mode" in errors[0], res.stderr
    assert quotes_balance(errors[0])
    assert "data:" not in res.stderr + res.stdout and not (out / "config.yaml").exists()


def test_a_value_error_found_while_building_keeps_its_quotes():
    from treelit.cli.console import SetupError
    from treelit.cli.train import _setup_errors

    with pytest.raises(SetupError) as info:
        with _setup_errors():
            raise ValueError("model.x must be one of a, b, got 'c'")
    assert str(info.value) == "model.x must be one of a, b, got 'c'"
    with pytest.raises(SetupError) as info:
        with _setup_errors():
            raise KeyError("no such thing 'k'")
    assert str(info.value) == "no such thing 'k'"


@pytest.fixture
def gemma3(tmp_path) -> str:
    return _checkpoint(tmp_path / "gemma3", model_type="gemma3", vision_config={"image_size": 16},
                       text_config={"model_type": "gemma3_text"})


@pytest.mark.parametrize("overrides,expected", [
    (["attention=segment"], r"^attention=segment with a Gemma-3 checkpoint \(model.vision=true\): segment plans "
                            r"attention from the tree's causal structure"),
    ([], r"^attention=auto with a Gemma-3 checkpoint \(model.vision=true\): on CPU auto picks segment"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_gemma3_needs_a_backend_that_takes_image_blocks(overrides, expected, gemma3):
    """Gemma-3's image blocks attend both ways: a backend that cannot express it is refused by
    name before the model loads; sdpa_dense passes."""
    base = ["model=hf_auto", f"model.hf_checkpoint={gemma3}", "model.vision=true"]
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        validate_config(compose(base + overrides))
    assert time.monotonic() - t0 < 5 and "\n" not in str(info.value)
    assert re.search(expected, str(info.value)), str(info.value)
    validate_config(compose(base + ["attention=sdpa_dense"]))


def test_gemma3_image_blocks_are_not_split_over_ranks(gemma3):
    from omegaconf import OmegaConf

    from treelit.cli.model_option_checks import _check_image_blocks

    cfg = OmegaConf.create({"attention": {"name": "sdpa_dense"},
                            "trainer": {"strategy": {"context_parallel_degree": 2}}})
    with pytest.raises(ConfigError, match="context_parallel_degree=2 with a Gemma-3 checkpoint .*split over ranks"):
        _check_image_blocks(cfg)
