"""Two and four CPU processes (gloo): FSDP2 per block with partitioning and the memory planner
gives one process's loss and gradients, for sft, grpo, gspo and dpo, on attention and hybrid
models, with ranks that hold different trees (different numbers of partitions, empty passes)
and different memory limits; DDP likewise; an out-of-memory error on one rank makes every
rank retry with a smaller budget. One launch runs several cases (process start-up dominates).
"""

from __future__ import annotations

import pytest
import torch

from cases import exact_steps
from harness import launch
from helpers import tol


def check(res, spec, world):
    dtype = spec.get("dtype", torch.float64)
    what = f"{spec['objective']}/{spec['family']}/{dtype}/{world} ranks"
    rel = abs(res["loss"] - res["ref_loss"]) / max(abs(res["ref_loss"]), 1e-30)
    if spec.get("mp"):  # bfloat16 parameters in the passes (8-bit mantissa): close, not exact
        assert rel <= 2e-2, f"{what}: loss {res['loss']} vs one process {res['ref_loss']}"
        assert res["grad_err_global"] <= 5e-2, f"{what}: gradient differs by {res['grad_err_global']:.2e} overall"
        assert res["grad_err"] > 1e-6, f"{what}: bfloat16 passes gave float32 gradients: the policy did not apply"
        return
    assert rel <= tol(dtype), f"{what}: loss {res['loss']} vs one process {res['ref_loss']}"
    assert res["grad_err"] <= tol(dtype), f"{what}: gradient differs by {res['grad_err']:.2e} (relative)"
    assert res["grad_scale"] > 0, f"{what}: nothing trained"
    assert sum(res["token_forwards"]) == res["tree_tokens"], f"{what}: every tree token forwarded once"
    assert len(set(res["budget"])) == 1, f"{what}: ranks planned with different budgets {res['budget']}"
    if "oom_rank_above" not in spec:
        # the planner's budget: the smallest rank's; 1000 bytes per token and the head's logits row
        # (a tiny vocabulary: every target is a row, far below a chunk)
        assert res["head_bytes"] >= 11 * 4 and res["chunk_rows"] > min(spec["limits"]) / 1000
        expected = int(min(spec["limits"]) / (1000 + res["head_bytes"]))
        assert res["budget"][0] == expected, f"{what}: budget {res['budget'][0]}, expected {expected}"


TWO = [
    dict(family="qwen2_tiny", objective="sft", limits=[60000, 600000], checkpointing=True),
    dict(family="hybrid_tiny", objective="grpo", data="rl", rollout=True, limits=[500000, 45000],
         aggregation="seq-mean-token-mean"),
    dict(family="qwen2_tiny", objective="gspo", data="rl", options=dict(clip_low=0.5, clip_high=0.5),
         limits=[40000, 90000]),
    dict(family="hybrid_tiny", objective="dpo", data="dpo", options=dict(beta=0.5), limits=[70000, 50000],
         checkpointing=True),
    dict(family="hybrid_tiny", objective="sft", dtype=torch.float32, limits=[50000, 50000],
         aggregation="seq-mean-token-sum"),
    dict(family="qwen2_tiny", objective="grpo", data="rl", dtype=torch.float32, limits=[45000, 80000],
         checkpointing=True, options=dict(kl_coef=0.1, reference="initial", entropy_coef=0.01)),
    dict(family="hybrid_tiny", objective="gspo", data="rl", sharded=False, options=dict(clip_low=0.5, clip_high=0.5),
         limits=[45000, 60000]),
    # 1000 bytes per token and 88 per row of logits: a budget of 115, halved to 60 after the error
    dict(family="qwen2_tiny", objective="sft", limits=[126000, 126000], oom_rank_above=(1, 60)),
    dict(family="qwen2_tiny", objective="sft", dtype=torch.float32, limits=[60000, 60000],
         mp=("bfloat16", "float32")),  # trainer=fsdp2's mixed precision policy
    # experts no token of a rank reached are reduced as zeros; the router loss per branch
    # (``sequence``: the ``micro_batch`` definition depends on how trees are grouped into micro-batches)
    dict(family="qwen3_moe_tiny", objective="grpo", data="rl", rollout=True, router_coef=0.05,
         router_definition="sequence", limits=[45000, 70000], checkpointing=True),
    # MoE routing replay: every pass routes by the trees' routed_experts (2 MoE layers, top-2 of 8)
    dict(family="qwen3_moe_tiny", objective="grpo", data="rl", rollout=True, router_coef=0.05,
         router_definition="sequence", limits=[45000, 70000], replay=(2, 2, 8)),
    dict(mismatch=True),  # last: it leaves a broken process group behind
]
ADAPTER = dict(objective="sft", limits=[50000, 80000], router_coef=0.05,
               router_definition="sequence")  # + family="hf:<dir>" (qwen3_moe)



def _limits(budgets, head_bytes):
    """Memory limits whose planner budgets are ``budgets`` tokens: 1000 bytes per token and the
    head's row of logits per target (:func:`~treelit.lightning.planner.head_row_bytes` of the
    case's model and objective; half a token's bytes of slack)."""
    return [b * (1000 + head_bytes) + (1000 + head_bytes) // 2 for b in budgets]


FOUR = [  # (vocabulary 11: rows of 88 bytes in float64 (sft), 344 (log-probs, dim 32), 172 in float32)
    dict(family="hybrid_tiny", objective="sft", limits=_limits([90, 40, 70, 300], 88), n_trees=8, micro_tokens=120),
    dict(family="qwen2_tiny", objective="gspo", data="rl", options=dict(clip_low=0.5, clip_high=0.5), n_trees=8,
         limits=_limits([50, 50, 35, 80], 344), checkpointing=True),
    dict(family="hybrid_tiny", objective="dpo", data="dpo", options=dict(beta=0.3, loss="ipo"), n_trees=8,
         limits=_limits([45, 90, 60, 45], 344)),
    dict(family="qwen2_tiny", objective="grpo", data="rl", rollout=True, dtype=torch.float32, n_trees=8,
         limits=_limits([60, 36, 36, 200], 172)),
]


@pytest.fixture(scope="module")
def adapter_checkpoint(tmp_path_factory):
    """A random transformers Qwen3-MoE checkpoint (run through ``model=hf_auto``'s adapter)."""
    from hf_oracle import random_hf_checkpoint

    path = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    random_hf_checkpoint(path, "qwen3_moe", vocab_size=12, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, output_router_logits=True)
    return path


@pytest.fixture(scope="module")
def two_ranks(adapter_checkpoint):
    specs = TWO[:-1] + [dict(ADAPTER, family=f"hf:{adapter_checkpoint}"), TWO[-1]]
    out = launch(exact_steps, 2, specs, deadline=600)
    return out[:-2] + [out[-1]], out[-2]


EXACT = [i for i, s in enumerate(TWO) if not s.get("mismatch")]


@pytest.mark.parametrize("i", EXACT, ids=[f"{TWO[i]['objective']}-{TWO[i]['family']}-{i}" for i in EXACT])
def test_two_ranks_equal_one_process(two_ranks, i):
    check(two_ranks[0][i], TWO[i], 2)


def test_transformers_adapter_with_router_loss_equals_one_process(two_ranks):
    """model=hf_auto (transformers' own Qwen3-MoE layers, sharded per block) with its router loss."""
    check(two_ranks[1], dict(ADAPTER, family="hf_auto qwen3_moe"), 2)


def test_a_collective_mismatch_fails_naming_the_step(two_ranks):
    err = two_ranks[0][-1]["error"]
    assert err is not None, "the mismatched collective did not fail"
    assert err.startswith("step 0 (data step 7), rank 0 of 2: a collective failed or timed out"), err


def test_ranks_ran_different_numbers_of_partitions(two_ranks):
    res = two_ranks[0][0]
    assert res["partitions"][0] != res["partitions"][1], res
    assert max(res["empty_passes"]) > 0, "the rank with fewer passes ran empty ones"
    assert res["budget"][0] < res["longest"] * 3, "the budget is tight enough to cut trees"


def test_out_of_memory_on_one_rank_retries_on_every_rank(two_ranks):
    res = two_ranks[0][7]
    assert "oom_rank_above" in TWO[7]
    assert int(126000 / (1000 + res["head_bytes"])) == 115  # the budget before the error
    assert res["budget"] == [60, 60], f"both ranks retried with the halved budget: {res['budget']}"


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(FOUR)), ids=[f"{s['objective']}-{s['family']}-{i}" for i, s in enumerate(FOUR)])
def test_four_ranks_equal_one_process_all(four_ranks_all, i):
    check(four_ranks_all[i], FOUR[i], 4)


@pytest.fixture(scope="module")
def four_ranks_all():
    return launch(exact_steps, 4, FOUR, deadline=900)


def test_four_ranks_equal_one_process():
    """The default suite's four-process case (the others are marked slow)."""
    res = launch(exact_steps, 4, FOUR[:1], deadline=600)
    check(res[0], FOUR[0], 4)
    assert len(set(res[0]["partitions"])) > 1, res[0]


@pytest.mark.slow
def test_transformers_adapter_with_routing_replay_equals_one_process(adapter_checkpoint):
    """model=hf_auto with routing replay (hooks on transformers' routers) under FSDP2, router loss on."""
    spec = dict(ADAPTER, family=f"hf:{adapter_checkpoint}", replay=(2, 2, 4))
    check(launch(exact_steps, 2, [spec], deadline=600)[0], dict(spec, family="hf_auto qwen3_moe replay"), 2)
