"""Worker for the multi-process tests of images (run on every rank by harness.launch).

:func:`vision_step` computes one update's loss and gradients the way ``TreeLitModule`` does on
several ranks (DDP, FSDP2 or HSDP; partitioned or not; LoRA, a frozen tower, a critic) on a tiny
vision-language checkpoint, where some ranks' rows show images and at least one rank's show
none, and, on rank 0, the same update on one process with the library's unpartitioned tree loss
(each row encoding its own images) on an unsharded copy of the model; it returns both.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch

import treelit
from helpers import grad_floor, max_rel_grad_diff, negligible_grad

F64 = torch.float64
EMPTY = treelit.TokenTree.from_branches([[0, 0]], loss_masks=[[0, 0]])


def vision_trees(seed: int = 0, rewards: bool = False) -> Dict[str, treelit.TokenTree]:
    """Trees with images (``img0``: a and b; ``img1``: a again and c) and without (``txt0..3``);
    each branch with an advantage, or with ``rewards`` a reward (PPO with a critic)."""
    from vision_oracle import image_processor, processed, random_image, span, text_mask

    proc = image_processor()
    rng = np.random.default_rng(seed)
    a, b, c = (processed(proc, random_image(rng, h, w), name=n) for n, (h, w) in
               zip("abc", [(16, 24), (24, 16), (16, 16)]))
    out = {
        "img0": ([[1] + span(a) + [3, 4, 5, 6, 7], [1] + span(a) + [6, 7, 2, 9], [1] + span(a) + [3, 8] + span(b) + [9]],
                 [[a], [a], [a, b]]),
        "img1": ([[2, 5] + span(c) + [4, 4, 9], [2, 5] + span(c) + [7] + span(a) + [3], [2, 6, 8]], [[c], [c, a], []]),
    }
    def tree(branches, masks, weights=None, images=None):
        draws = [float(x) for x in rng.normal(0, 1, len(branches))]
        kw = dict(branch_fields={"reward": draws}) if rewards else dict(advantages=draws)
        return treelit.TokenTree.from_branches(branches, masks, weights, images=images, **kw)

    trees = {}
    for name, (branches, images) in out.items():
        trees[name] = tree(branches, [text_mask(br) for br in branches], [1.0 + 0.5 * i for i in range(len(branches))],
                           images)
    for t in range(4):
        prefix = [int(x) for x in rng.integers(1, 30, 3 + t)]
        branches = [prefix + [int(x) for x in rng.integers(1, 30, 2 + (b + t) % 4)] for b in range(2 + t % 2)]
        trees[f"txt{t}"] = tree(branches, [[0] * len(prefix) + [1] * (len(br) - len(prefix)) for br in branches])
    return trees


def build(spec: Dict[str, Any]):
    from treelit.models.hf_adapter import load_hf_model

    lora = spec.get("lora")  # LoRA on the language model, the tower "trained" (PEFT's copy) or "frozen"
    model = load_hf_model(spec["path"], dtype=F64, vision=True, freeze_vision=bool(spec.get("freeze")) or lora == "frozen")
    if lora:
        from treelit.models.lora import apply_lora

        torch.manual_seed(0)
        apply_lora(model, {"rank": 4, "alpha": 8, "init": False,
                           "modules_to_save": ["visual"] if lora == "trained" else []})
    return model


def build_critic(spec: Dict[str, Any]):
    """``critic``: ``shared`` (a head on the policy) or ``separate`` (its own vision model, ``critic_path``)."""
    from treelit.models.critic import Critic
    from treelit.models.hf_adapter import load_hf_model

    kind = spec["critic"]
    trunk = load_hf_model(spec["critic_path"], dtype=F64, vision=True) if kind == "separate" else None
    torch.manual_seed(0)
    return Critic(kind, 32, trunk, vf_coef=0.7, value_clip=0.05, dtype=F64, init_std=0.3)


def _module(spec, model, world, critic=None, partition=None):
    from torch.distributed.device_mesh import init_device_mesh

    from treelit.lightning.module import TreeLitModule
    from treelit.objectives import make_objective

    name = spec.get("objective", "sft")
    objective = make_objective(name, gamma=0.9, lam=0.8) if critic is not None else make_objective(name, **kl(spec))
    moved_off_reference(spec, objective, model)
    module = TreeLitModule(model, objective, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), attention="sdpa_dense",
                           partition=partition or spec.get("partition", "none"), budget_tokens=spec.get("budget"),
                           old_logprobs="rollout" if name != "sft" else "data", critic=critic)
    strategy = spec["strategy"] if partition is None else "one"
    if strategy == "hsdp":
        from treelit.utils.distributed import hsdp_mesh

        module._device_mesh = hsdp_mesh(2, world)
        module.configure_model()
    elif strategy == "fsdp2":
        module._device_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        module.configure_model()
    return module


def kl(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``kl``: a KL penalty to a frozen copy of the initial model (``reference=initial``), the
    copy's tower sharded like the policy's."""
    return dict(kl_coef=0.1, reference="initial") if spec.get("kl") else {}


def moved_off_reference(spec, objective, model) -> None:
    """With ``kl``: the reference copy made, then the policy moved off it (the KL term trains)."""
    if not spec.get("kl"):
        return
    objective._reference_model(model)
    nudge_trained(model)


def nudge_trained(model, seed: int = 5, scale: float = 0.05) -> None:
    """Every trained parameter moved by ``scale`` x a seeded normal draw (off its reference)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def vision_step(rank: int, world: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    trees = vision_trees(rewards=bool(spec.get("critic")))
    shares: List[List[str]] = spec["shares"]
    n = max(len(s) for s in shares)
    micro = [trees[name].to_batch() for name in shares[rank]] + [EMPTY.to_batch() for _ in range(n - len(shares[rank]))]
    model = build(spec)
    critic = build_critic(spec) if spec.get("critic") else None
    module = _module(spec, model, world, critic)
    # FSDP2 / HSDP: the tower sharded per block like the decoder (each block a unit of its own)
    from torch.distributed.fsdp import FSDPModule

    from treelit.models.hf_vision import tower_blocks

    tower_units = [isinstance(b, FSDPModule) for b in tower_blocks(model.vision.visual)]
    ref_tower = module.objective._ref_model.vision if spec.get("kl") else None
    out = _update(module, micro)
    ref_encoded = ref_tower.images_encoded if ref_tower is not None else None
    from treelit.utils.distributed import Collectives

    loss = Collectives().sum(out["loss"])
    grads = _gathered(model, critic)
    partitions = Collectives().gather_lists([int(out["partitions"])])
    if rank != 0:
        return None
    every = [trees[name] for s in shares for name in s]
    ref_loss, ref_grads = reference(spec, every) if critic is None else one_process(spec, every)
    # a parameter no pass reached (a separate critic's unused language-model head): FSDP2 reduces it as
    # zeros, one process leaves it without a gradient
    extra = sorted(set(grads) - set(ref_grads))
    ref_grads.update({k: torch.zeros_like(grads[k]) for k in extra})
    return {"loss": loss, "ref_loss": ref_loss, "keys": sorted(grads), "ref_keys": sorted(ref_grads),
            "extra_nonzero": [k for k in extra if bool(grads[k].any())],
            "grad_err": max_rel_grad_diff(grads, ref_grads, grad_floor(F64), negligible_grad(F64)),
            "tower_norm": sum(float(g.norm()) for k, g in grads.items() if "visual" in k),
            "partitions": [p[0] for p in partitions], "tower_units": tower_units, "ref_encoded": ref_encoded}


def _update(module, micro):
    """One update as the step runs it: the parts' reads before it (rollout log-probs, a critic's
    values and advantages), then the gradients."""
    for part in module.parts:
        part.before_updates(module.executor, micro, module._read_step())
    return module.compute_gradients(micro)


def _gathered(model, critic) -> Dict[str, torch.Tensor]:
    from treelit.utils.distributed import gather_full

    named = list(model.named_parameters()) + ([("critic." + k, p) for k, p in critic.named_parameters()]
                                              if critic is not None else [])
    return {k: gather_full(p.grad).detach().clone() for k, p in named if p.grad is not None}


def one_process(spec: Dict[str, Any], trees) -> "tuple[float, Dict[str, torch.Tensor]]":
    """The update on one process: the module unpartitioned and unsharded, every row (a critic's
    advantages whitened over all of them)."""
    from treelit.utils.distributed import Collectives

    model, critic = build(spec), build_critic(spec)
    module = _module(spec, model, 1, critic, partition="none")
    module._comm = lambda: Collectives(1)  # (rank 0 alone: no collective)
    out = _update(module, [t.to_batch() for t in trees])
    return out["loss"], _gathered(model, critic)


def reference(spec: Dict[str, Any], trees) -> "tuple[float, Dict[str, torch.Tensor]]":
    """The update on one process: the library's unpartitioned tree loss over every row."""
    from treelit.loss.tree import tree_token_logprobs
    from treelit.objectives import make_objective

    model = build(spec)
    obj = make_objective(spec.get("objective", "sft"), **kl(spec))
    moved_off_reference(spec, obj, model)
    micro = [t.to_batch() for t in trees]
    Z = treelit.global_normalizer(micro, "token-mean", objective=obj)
    total = 0.0
    for mb in micro:
        if spec.get("objective", "sft") != "sft":
            with torch.no_grad():
                sel, lp, _ = tree_token_logprobs(model, mb, "sdpa_dense")
            old = torch.full((mb.num_tokens,), float("nan"), dtype=F64)
            old[sel] = lp.double()
            mb.token_old_logp, mb.branch_old_logp = old, old[mb.branch_tokens]
        loss = treelit.tree_loss(model, mb, "token-mean", "sdpa_dense", normalizer=Z, objective=obj)
        loss.backward()
        total += float(loss.detach())
    return total, {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def vision_steps(rank: int, world: int, specs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [vision_step(rank, world, spec) for spec in specs]
