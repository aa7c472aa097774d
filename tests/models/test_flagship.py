"""The flagship on one process (tests/flagship_case.py): a Qwen3.5-MoE-shaped multimodal hybrid
with images, routing replay, LoRA on the language model (the tower trained in full beside the
adapters) and a shared critic (PPO with GAE on
GRPO-shaped groups), through the module's step - rollout log-probs, the critic's values, the
step-global advantages, the gradients - equals transformers branch by branch with the same
images, routes, adapters and value head: loss and every trained gradient, float64 <= 1e-10,
whole rows and partitioned."""

from __future__ import annotations

import pytest
import torch

from flagship_case import branch_reference, flagship_module, groups, run_step, trained_grads, trees
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from vision_oracle import vision_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("peft")

F64 = torch.float64


@pytest.fixture(scope="module")
def flagship(tmp_path_factory):
    return vision_checkpoint(tmp_path_factory.mktemp("flagship"), "qwen3_5_moe")


@pytest.mark.parametrize("partition", ["none", pytest.param("redundancy_free", marks=pytest.mark.slow)])
def test_flagship_step_equals_transformers_branch_by_branch(flagship, partition):
    from treelit.lightning.image_part import ImageEncoder
    from treelit.lightning.parts import RoutingReplay, ValueHead

    cases = groups()
    micro = [t.to_batch() for t in trees(cases)]
    budget = max(len(b) for c in cases for b in c[0]) + 1 if partition != "none" else None
    module = flagship_module(flagship, partition, budget)
    kinds = {type(p) for p in module.parts}
    assert {ImageEncoder, RoutingReplay, ValueHead} <= kinds
    with KeepFloat64():
        out = run_step(module, micro)
        mine = trained_grads(module)
    expected, theirs = branch_reference(flagship, cases, module.model, module.critic)
    if partition != "none":
        assert module.last_partition_stats.partitions > len(micro), "the budget cut nothing"
    assert mine and all(".lora_" in k or "visual.modules_to_save" in k or k.startswith("critic.") for k in mine)
    assert any("visual.modules_to_save" in k for k in mine)  # the tower trains
    assert mine.keys() == theirs.keys(), sorted(set(mine) ^ set(theirs))
    assert any("linear_attn" in k for k in mine) and any("self_attn" in k for k in mine)
    assert abs(out["loss"] - expected.item()) <= 1e-10 * abs(expected.item()), (out["loss"], expected.item())
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10


def test_the_example_checkpoint_has_the_flagship_layer_pattern():
    """examples/tiny_flagship.py (the recipe's checkpoint) writes the shape tested here: the same
    layer types, experts, shared expert and tower depth as ``vision_checkpoint(.., "qwen3_5_moe")``."""
    import importlib.util
    from pathlib import Path

    from vision_oracle import FAMILIES

    spec = importlib.util.spec_from_file_location(
        "tiny_flagship", Path(__file__).resolve().parents[2] / "examples" / "tiny_flagship.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    import transformers

    text, vision = FAMILIES["qwen3_5_moe"]
    tested = transformers.AutoConfig.for_model("qwen3_5_moe", text_config=dict(text), vision_config=dict(vision))
    assert ex.TEXT["layer_types"] == tested.text_config.layer_types  # (the config's own pattern there)
    for key in ("num_hidden_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "hidden_size", "linear_num_value_heads"):
        assert ex.TEXT[key] == text[key], key
    assert ex.TEXT["layer_types"][3::4] == ["full_attention"] and "linear_attention" in ex.TEXT["layer_types"]
    for key in ("depth", "patch_size", "spatial_merge_size", "out_hidden_size"):
        assert ex.VISION[key] == vision[key], key


def test_the_flagship_experiment_composes_and_a_critic_with_grpo_is_refused():
    from treelit.cli.config import ConfigError, check_critic_config, compose
    from treelit.cli.model_option_checks import check_vision_options

    cfg = compose(["experiment=flagship", "model.hf_checkpoint=ckpt", "data.train_path=groups.jsonl"])
    assert cfg.model.vision and cfg.model.moe.routing == "replay" and cfg.model.lora.rank
    assert cfg.critic.kind == "shared" and cfg.objective.name == "ppo" and cfg.tree_builder.advantage is None
    assert cfg.tree_builder.processor_path == "ckpt"
    check_critic_config(cfg)
    check_vision_options(cfg)
    with pytest.raises(ConfigError, match="critic=shared trains with objective=ppo"):
        check_critic_config(compose(["experiment=flagship", "model.hf_checkpoint=ckpt", "objective=grpo",
                                     "data.train_path=groups.jsonl"]))
