"""Multimodal mixture-of-experts families in tree mode against transformers, branch by branch.

Qwen3.5-MoE with its vision tower (Gated DeltaNet layers with full attention every 4th layer,
every MLP a mixture of experts beside a gated shared expert), Qwen3-VL-MoE (deepstack features,
interleaved M-RoPE) and GLM-4.5V (a sigmoid router with bias-corrected, group-limited choice, a
shared expert, its first layer dense). Tiny random checkpoints (``vision_oracle``); the loss and
every parameter gradient - language model, experts and routers, projector, vision tower - in
float64 agree to 1e-10 with transformers' float32 upcasts kept in float64 (``KeepFloat64``),
on trees whose branches share image prefixes, whole and cut into partitions.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_hf_vision import _fixed_cases, compare, pool  # noqa: F401 - the pool fixture
from vision_oracle import random_forest

pytest.importorskip("transformers")

NEW = ["qwen3_5_moe", "qwen3_vl_moe", "glm4v_moe"]


@pytest.mark.parametrize("family", NEW)
def test_tree_equals_transformers_branch_by_branch(family, pool, tmp_path_factory):  # noqa: F811
    """Default suite: one case per family (a fork right after a shared image, a second image
    on one branch)."""
    branches, images = _fixed_cases(pool)["fork_after_image"]
    _, ours = compare(family, branches, images, tmp_path_factory)
    assert ours.config.moe["num_experts"] == 8 and ours.config.moe["top_k"] == 2


def test_qwen3_5_moe_checkpoint_has_the_real_layer_pattern(pool, tmp_path_factory):  # noqa: F811
    """The tiny Qwen3.5-MoE: three Gated DeltaNet layers then one full-attention layer, every
    MLP sparse with a shared expert, the tower's merger projecting into the text width."""
    from test_hf_vision import models

    ours, _ = models("qwen3_5_moe", tmp_path_factory)
    text = ours.hf.config.text_config
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    for layer in ours.vision.language_model.layers:
        assert type(layer.mlp).__name__ == "Qwen3_5MoeSparseMoeBlock"
        assert hasattr(layer.mlp, "shared_expert") and hasattr(layer.mlp, "shared_expert_gate")
    assert ours.hf.config.vision_config.out_hidden_size == text.hidden_size


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("case", ["last_shared", "image_ends_shared"])
def test_fixed_cases(family, case, pool, tmp_path_factory):  # noqa: F811
    branches, images = _fixed_cases(pool)[case]
    compare(family, branches, images, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_forests_whole_and_partitioned(family, seed, pool, tmp_path_factory):  # noqa: F811
    rng = np.random.default_rng(seed)
    branches, images = random_forest(rng, [pool["a"], pool["b"], pool["a2"], pool["c"]], n_branches=5)
    compare(family, branches, images, tmp_path_factory, aggregation=("token-mean", "seq-mean-token-mean", "sum")[seed])
    compare(family, branches, images, tmp_path_factory, budget=max(len(b) for b in branches) + 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
def test_segment_backend_and_images_a_few_at_a_time(family, pool, tmp_path_factory):  # noqa: F811
    branches, images = _fixed_cases(pool)["fork_after_image"]
    compare(family, branches, images, tmp_path_factory, attention="segment")
    compare(family, branches, images, tmp_path_factory, per_pass=1)
