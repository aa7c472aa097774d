"""Context parallelism on transformers families through the adapter (``model=hf_auto``):
attention-only checkpoints (Llama; Gemma-3 with sliding and global layers; Qwen3-MoE, with and
without its router loss), the
row split over C gloo processes, unpartitioned and with partitioned passes, equal to one
unpartitioned process in float64 (loss and every parameter gradient, the ranks' gradients
summed; transformers' float32 rounding of norms and RoPE rebound to float64 on both sides, else
a different split flips float32 roundings at 1e-8). The adapter's hybrid (recurrent) families are in ``test_context_parallel.py``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import treelit
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from hf_oracle import make_exact, random_hf_checkpoint
from test_context_parallel import FORK, ONE_TOKEN, _objective, _port, _rl, _tree
from test_cp_partitioned import DEEP
from treelit.partition.context_parallel import cp_micro_batch
from treelit.partition.engine import run_micro_batch
from harness import end_rank  # noqa: E402

pytest.importorskip("transformers")

TINY = dict(vocab_size=12, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
IDS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=1)
FAMILIES = {
    "llama": ("llama", {}),
    "gemma3": ("gemma3_text", dict(sliding_window=3, query_pre_attn_scalar=12,
                                   layer_types=["sliding_attention", "full_attention"], **IDS)),
    "qwen3_moe": ("qwen3_moe", dict(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                    output_router_logits=False)),
    # the router load-balancing loss on (config.json's coefficient, read by the adapter)
    "qwen3_moe_router": ("qwen3_moe", dict(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                           output_router_logits=True, router_aux_loss_coef=0.3)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, (model_type, cfg) in FAMILIES.items():
        path = tmp_path_factory.mktemp(name)
        random_hf_checkpoint(path, model_type, **dict(TINY, **cfg))
        out[name] = str(path)
    return out


def _run(path, forest, objective, budget, group):
    model = treelit.load_hf_model(path, dtype=torch.float64)
    make_exact(model.hf)  # transformers' float32 norms / RoPE / router kept in float64 (on both sides)
    batch = _tree(forest, _rl(objective)).to_batch()
    obj = _objective(objective)
    Z = obj.norm_contribution(batch, "token-mean")
    if group is None:
        res = run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z, attention="sdpa_dense")
        value = res.loss
    elif budget is None:
        value, _, _ = cp_micro_batch(model, obj, batch, group, aggregation="token-mean", normalizer=Z,
                                     attention="sdpa_dense")
    else:
        value = run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z, budget_tokens=budget,
                                attention="sdpa_dense", cp_group=group).loss
    return value, [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _worker(rank, C, port, case, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=C)
    try:
        value, grads = _run(*case, dist.group.WORLD)
        for g in grads:
            dist.all_reduce(g)
        if rank == 0:
            torch.save({"value": value, "grads": [g.clone() for g in grads]}, out)
        dist.barrier()  # every rank done with its messages before the group goes
    finally:
        dist.destroy_process_group()
    end_rank()


def compare(case, C, tmp_path):
    out = tmp_path / f"cp_hf{C}.pt"
    mp.spawn(_worker, args=(C, _port(), case, str(out)), nprocs=C, join=True)
    got = torch.load(out, weights_only=True)
    value, grads = _run(*case, None)
    assert abs(got["value"] - value) <= 1e-9 * abs(value), (got["value"], value)
    assert any(g.abs().max() > 0 for g in grads), "the case must train something"
    names = [str(i) for i in range(len(grads))]
    err = max_rel_grad_diff(dict(zip(names, got["grads"])), dict(zip(names, grads)), grad_floor(torch.float64),
                            negligible_grad(torch.float64))
    assert err <= 1e-9, f"max relative gradient difference {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("C,forest", [(2, ONE_TOKEN), (2, FORK), (4, ONE_TOKEN)], ids=["2-one-token", "2-fork", "4"])
def test_hf_auto_context_parallel_equals_one_process(checkpoints, name, C, forest, tmp_path):
    compare((checkpoints[name], forest, "sft", None), C, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_auto_context_parallel_partitioned_equals_one_process(checkpoints, name, tmp_path):
    compare((checkpoints[name], DEEP, "grpo", 5), 2, tmp_path)
