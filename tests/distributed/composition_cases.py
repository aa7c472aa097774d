"""One cell of the composition matrix (:mod:`treelit.cli.compositions`): a set of features on a
strategy, run as ``TreeLitModule`` runs a step (the parts' reads before the update, then the
update's gradients), returning the step's loss and every trained parameter's full gradient.

:func:`cell_step` runs on every rank (``harness.launch``) or, for the one-process strategies and
the references, in the test's own process: ``reference="one_process"`` is one unpartitioned
process on the same trees, ``reference="per_branch"`` one process on a forest with each branch
its own tree (no token shared: per-branch training), the reference of the one-process cells.

Models: treelit's decoders (``qwen2_tiny``; ``hybrid_tiny``; ``qwen3_moe_tiny`` for routing
replay and the router loss, with Gated DeltaNet beside attention for ``hybrid``), or, for
``images``, a tiny Qwen2.5-VL (Qwen3.5 for ``hybrid``) through the transformers adapter with its
vision tower, or (``cell["hf"]``) a transformers text checkpoint through the adapter.
Objective: PPO with a critic, else GRPO (``reference_kl``: with a KL penalty to a frozen copy of
the initial model; ``reference_base_kl``, with ``lora``: to the policy with its adapters off); old log-probs recomputed by the policy (``old_logprobs=rollout``); or SFT
(``cell["objective"] = "sft"``: the objective of the transformers oracle).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

import numpy as np
import torch

import treelit
from helpers import tiny_model
from treelit.objectives import make_objective

F64 = torch.float64
GDN = {"head_dim": 8, "num_heads": 2, "num_v_heads": 4, "expand_v": 2.0, "conv_size": 4}
WORLD = {"one_process": 1, "partitioned": 1, "ddp": 2, "fsdp2": 2, "hsdp": 4, "cp": 2, "cp_partitioned": 2,
         "fsdp2_partitioned": 2}
MICRO_TOKENS = 90


def _moe(f) -> bool:
    return bool(f & {"routing_replay", "router_loss"})


# the data ----------------------------------------------------------------------------------------

def _image_pool():
    from vision_oracle import image_processor, processed, random_image

    proc = image_processor()
    rng = np.random.default_rng(0)
    a, b = random_image(rng, 16, 24), random_image(rng, 24, 16)
    return [processed(proc, a, name="a"), processed(proc, b, name="b"), processed(proc, a.copy(), name="a2")]


def records(features, n_trees: int = 4, seed: int = 0, replay=None) -> List[Dict[str, Any]]:
    """Each tree's branches and fields (the trees are built from these, shared or per branch);
    ``replay``: the model's ``(MoE layers, experts, top-k)`` (recorded routing)."""
    f = set(features)
    rng = np.random.default_rng(seed)
    pool = _image_pool() if "images" in f else None
    out = []
    for t in range(n_trees):
        if pool is not None:
            from vision_oracle import random_forest, text_mask

            branches, images = random_forest(rng, pool, n_branches=3 + t % 2)
            masks = [text_mask(b) for b in branches]
        else:
            prefix = [int(x) for x in rng.integers(1, 11, 2 + 2 * t)]
            branches = [prefix + [int(x) for x in rng.integers(1, 11, 2 + (3 * b + t) % 5)] for b in range(2 + t % 3)]
            masks = [[0] * len(prefix) + [1] * (len(b) - len(prefix)) for b in branches]
            images = None
        nb = len(branches)
        rewards = [float(r) for r in rng.normal(0, 1, nb)]
        out.append(dict(branches=branches, masks=masks, images=images, weights=[1.0 + 0.5 * (b % 3) for b in range(nb)],
                        adv=[float(a) for a in rng.normal(0, 1, nb)], rewards=rewards,
                        routing=_routing(branches, replay) if replay is not None else None))
    return out


def _routing(branches, shape):
    from routing_oracle import routing_for

    layers, experts, k = shape
    return [routing_for(b, layers, k, experts) for b in branches]


def _tree(rec, idx=None) -> treelit.TokenTree:
    pick = (lambda xs: xs) if idx is None else (lambda xs: None if xs is None else [xs[i] for i in idx])
    branches, rewards = pick(rec["branches"]), pick(rec["rewards"])
    fields = {"reward": rewards, "token_rewards": [[0.0] * (len(b) - 1) + [r] for b, r in zip(branches, rewards)]}
    return treelit.TokenTree.from_branches(branches, pick(rec["masks"]), pick(rec["weights"]),
                                           advantages=pick(rec["adv"]), images=pick(rec["images"]),
                                           routed_experts=pick(rec["routing"]), branch_fields=fields)


def trees(recs, per_branch: bool = False) -> List[treelit.TokenTree]:
    if not per_branch:
        return [_tree(r) for r in recs]
    return [_tree(r, [b]) for r in recs for b in range(len(r["branches"]))]


# the model and the module ------------------------------------------------------------------------

def build_model(features, vision_path: Optional[str], seed: int = 0, hf_path: Optional[str] = None):
    """The cell's model: ``vision_path`` (images), ``hf_path`` (a transformers checkpoint through
    the adapter, ``model=hf_auto``) or treelit's own decoder."""
    f = set(features)
    if "images" in f:
        model = treelit.load_hf_model(vision_path, dtype=F64, vision=True)
    elif hf_path is not None:
        model = treelit.load_hf_model(hf_path, dtype=F64, router_loss_set=True)
    elif _moe(f):
        extra = dict(layer_types=["gdn", "attention"], recurrent={"gdn": GDN}) if "hybrid" in f else {}
        model = tiny_model("qwen3_moe_tiny", F64, seed, **extra)
    else:
        model = tiny_model("hybrid_tiny" if "hybrid" in f else "qwen2_tiny", F64, seed)
    from treelit.models.factory import set_moe_routing, set_router_aux_loss

    if _moe(f):  # (the router loss per branch: its micro_batch definition depends on how rows are packed)
        set_router_aux_loss(model, 0.05 if "router_loss" in f else 0.0, "sequence")
    if "routing_replay" in f:
        set_moe_routing(model, "replay")
    model.activation_checkpointing = "checkpointing" in f
    return model


def build_module(features, strategy: str, vision_path: Optional[str], objective: str = "rl",
                 hf_path: Optional[str] = None):
    from treelit.lightning.module import TreeLitModule
    from treelit.models.critic import Critic
    from treelit.models.decoder import output_weight

    f = set(features)
    model = build_model(f, vision_path, hf_path=hf_path)
    if "lora" in f:
        from treelit.models.lora import apply_lora

        torch.manual_seed(2)  # (init=false: both adapter matrices random)
        apply_lora(model, {"rank": 4, "alpha": 8, "init": False})
    kind = "shared" if "shared_critic" in f else "separate" if "separate_critic" in f else None
    critic = None
    if kind is not None:
        trunk = build_model(f - {"lora"}, vision_path, seed=1, hf_path=hf_path) if kind == "separate" else None
        torch.manual_seed(3)
        critic = Critic(kind, output_weight(model).shape[1], trunk, vf_coef=0.7, value_clip=0.05, dtype=F64,
                        init_std=0.3)
    kl = dict(kl_coef=0.1, reference="initial") if "reference_kl" in f else {}
    if "reference_base_kl" in f:  # (LoRA: the reference is the policy with its adapters off)
        kl = dict(kl_coef=0.1, reference="base")
    if objective == "sft":  # (the transformers oracle's objective)
        objective = make_objective("sft")
    elif critic is not None:
        objective = make_objective("ppo", clip_low=0.2, gamma=0.9, lam=0.8, **kl)
    else:
        objective = make_objective("grpo", **kl)
    if kl:  # the frozen copy of the initial model, then the policy moved off it (the KL term trains)
        from vision_cases import nudge_trained

        if kl["reference"] == "initial":
            objective._reference_model(model)
        nudge_trained(model)
    partition = "redundancy_free" if strategy.endswith("partitioned") else "none"
    module = TreeLitModule(model, objective, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), attention="segment",
                           partition=partition, old_logprobs="data" if objective.name == "sft" else "rollout",
                           critic=critic)
    return module, model, critic


def _mesh(module, strategy: str, world: int) -> int:
    """The strategy's device mesh and context-parallel group; returns C."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    C = 2 if strategy in ("cp", "cp_partitioned") else 1
    if C > 1:
        group, _ = dist.new_subgroups(group_size=C)
        module._cp_group = group
    if strategy == "hsdp":
        from treelit.utils.distributed import hsdp_mesh

        module._device_mesh = hsdp_mesh(2, world)
    elif strategy != "ddp":
        module._device_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    module.configure_model()
    return C


def _exact(cell):
    if cell.get("vision") or cell.get("hf"):  # transformers' float32 upcasts kept in float64
        from float64_mode import KeepFloat64

        return KeepFloat64()
    return contextlib.nullcontext()


# one step ----------------------------------------------------------------------------------------

def cell_step(rank: int, world: int, cell: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The cell's step (see the module docs): ``{"loss", "grads": {name: full gradient},
    "partitions", "token_forwards", "tree_tokens"}`` on rank 0 (None on the others)."""
    from cases import rank_micro_batches
    from treelit.utils.distributed import Collectives, gather_full

    features, strategy = frozenset(cell["features"]), cell["strategy"]
    reference = cell.get("reference")
    # (built outside KeepFloat64, as transformers' reference is: RoPE's inverse frequencies in float32)
    module, model, critic = build_module(features, "one_process" if reference else strategy, cell.get("vision"),
                                         cell.get("objective", "rl"), cell.get("hf"))
    from treelit.models.factory import replay_shape

    recs = records(features, seed=cell.get("seed", 0), replay=replay_shape(model))
    forest = trees(recs, per_branch=reference == "per_branch")
    if module.partition != "none":  # passes of the longest path's length (over C ranks): every tree is cut
        longest = max(len(b) for r in recs for b in r["branches"])
        module.budget_tokens = -(-longest // 2) + 1 if strategy == "cp_partitioned" else longest + 1
    with _exact(cell):
        if world > 1:
            C = _mesh(module, strategy, world)
            micro = rank_micro_batches(forest, rank // C, world // C, cell.get("micro_tokens", MICRO_TOKENS))
        else:
            micro = treelit.pack_trees(forest, cell.get("micro_tokens", MICRO_TOKENS))
        for part in module.parts:  # before the update: rollout log-probs, the critic's values and advantages
            part.before_updates(module.executor, micro, module._read_step())
        out = module.compute_gradients(micro)
        comm = Collectives()
        loss = comm.sum(out["loss"])
        named = [(f"model.{n}", p) for n, p in model.named_parameters() if p.requires_grad]
        if critic is not None:
            named += [(f"critic.{n}", p) for n, p in critic.named_parameters() if p.requires_grad]
        grads = {n: (gather_full(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype))
                 .detach().clone() for n, p in named}
        counts = comm.sum_vector([out["partitions"], out["token_forwards"], sum(not mb.num_targets for mb in micro)])
    if rank != 0:
        return None
    return {"loss": loss, "grads": grads, "partitions": float(counts[0]), "token_forwards": float(counts[1]),
            "padding": int(counts[2]),  # padding micro-batches (no targets), over every rank
            "tree_tokens": sum(t.to_batch().num_tokens for t in forest)}


def cell_steps(rank: int, world: int, cells: List[Dict[str, Any]]) -> List[Any]:
    """:func:`cell_step` for each cell, in one launch (process start-up dominates); a cell that
    fails returns its error (so that one launch reports every cell)."""
    import traceback

    out = []
    for cell in cells:
        try:
            out.append(cell_step(rank, world, cell))
        except Exception:  # noqa: BLE001 - reported by the test, per cell
            out.append({"error": traceback.format_exc()})
    return out
