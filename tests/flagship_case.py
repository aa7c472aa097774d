"""The flagship case: a Qwen3.5-MoE-shaped multimodal hybrid trained with everything at once.

The model is ``vision_oracle.vision_checkpoint(path, "qwen3_5_moe")``: Gated DeltaNet layers with
full attention every 4th layer, every MLP a mixture of experts (top-2 of 8) with a gated shared
expert, and a 2-block vision tower. It trains with

* images: GRPO-shaped groups (a prompt with a screenshot, several completions, some showing a
  further screenshot), each distinct image encoded once per micro-batch;
* routing replay: every branch's recorded experts (``routing_oracle.routing_for``, a function of
  the prefix, as a sampler's records are);
* LoRA adapters on the language model, the vision tower trained in full beside them
  (``modules_to_save: [visual]``, PEFT's copy of it), the rest of the base frozen;
* a shared critic (a value head on the policy's trunk) and ``objective=ppo``: GAE advantages per
  (branch, action) whitened over the step, the clipped policy and value losses.

Why PPO and not GRPO: a critic computes the advantages (GAE from the rewards and its values),
and GRPO's advantages are the group-relative rewards; a run takes one or the other
(``critic=shared`` with ``objective=grpo`` is refused in one line). The flagship trains the
GRPO-shaped groups with a shared critic, the critic's values taking the place of the group mean
as the baseline.

:func:`flagship_module` builds the :class:`TreeLitModule`; :func:`run_step` runs one update's
reads (rollout log-probs, the critic's values and GAE) and gradients, as a training step does;
:func:`branch_reference` is the same update branch by branch on transformers (vision_oracle,
routing_oracle, the critic oracle of tests/objectives/test_critic.py; no treelit there).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

import treelit
from float64_mode import KeepFloat64
from vision_oracle import IMAGE, image_processor, processed, random_image, span, text_mask

F64 = torch.float64
MOE_LAYERS, K, E = 4, 2, 8
GAMMA, LAM, CLIP, VCLIP, VF = 0.9, 0.8, 0.2, 0.05, 0.7
LORA = {"rank": 4, "alpha": 8, "init": False, "modules_to_save": ["visual"]}  # the tower trained: PEFT's copy


def critic_oracle():
    """tests/objectives/test_critic.py as a module (its per-branch PPO + GAE reference)."""
    spec = importlib.util.spec_from_file_location(
        "critic_oracle", Path(__file__).resolve().parent / "objectives" / "test_critic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (mod.GAMMA, mod.LAM, mod.CLIP, mod.VCLIP, mod.VF) == (GAMMA, LAM, CLIP, VCLIP, VF)
    return mod


def groups(n_groups: int = 4, completions: int = 3, seed: int = 0):
    """``n_groups`` GRPO-shaped groups: per group ``(branches, images, masks, rewards)``; every
    branch starts with the group's prompt (text, a screenshot, text) and continues with its own
    completion, which may show a further screenshot (an observation: not trained)."""
    rng = np.random.default_rng(seed)
    proc = image_processor()
    shots = [processed(proc, random_image(rng, h, w), name=f"s{i}")
             for i, (h, w) in enumerate([(16, 24), (24, 16), (16, 16), (24, 24), (16, 24)])]
    out = []
    for g in range(n_groups):
        prompt_img = shots[g % 3]  # groups 0 and 3 show the same screenshot
        prompt = [1 + g] + span(prompt_img) + [int(x) for x in rng.integers(1, 30, 2 + g % 2)]
        branches, images, masks = [], [], []
        for c in range(completions):
            tail = [int(x) for x in rng.integers(1, 30, int(rng.integers(2, 5)))]
            ims = [prompt_img]
            if (g + c) % 2 == 0:
                obs = shots[3 + (g + c) % 2]
                tail += span(obs) + [int(x) for x in rng.integers(1, 30, int(rng.integers(1, 4)))]
                ims.append(obs)
            branches.append(prompt + tail)
            images.append(ims)
            masks.append([0] * len(prompt) + text_mask(tail))
        rewards = [float(r) for r in rng.integers(0, 2, completions)]
        if len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        out.append((branches, images, masks, rewards))
    return out


def trees(cases, seed: int = 0) -> List[treelit.TokenTree]:
    """Each group's tree: images, routed experts (every token), rewards."""
    from routing_oracle import routing_for

    out = []
    for branches, images, masks, rewards in cases:
        rec = [routing_for(b, MOE_LAYERS, K, E, seed=seed) for b in branches]
        out.append(treelit.TokenTree.from_branches(
            branches, masks, [1.0] * len(branches), images=images, routed_experts=rec,
            branch_fields={"reward": rewards, "token_rewards": [[0.0] * (len(b) - 1) + [r]
                                                                for b, r in zip(branches, rewards)]}))
    return out


def flagship_model(path, lora: bool = True):
    """The policy: the checkpoint with its tower, routing replayed, LoRA on the language model and
    the tower trained (``lora=False``: every parameter trains)."""
    from treelit.models.factory import set_moe_routing
    from treelit.models.lora import apply_lora

    model = treelit.load_hf_model(str(path), dtype=F64, vision=True)
    set_moe_routing(model, "replay")
    if lora:
        torch.manual_seed(0)
        apply_lora(model, LORA)
    return model


def flagship_critic(model):
    from treelit.models.critic import Critic

    torch.manual_seed(1)
    return Critic("shared", model.hf.lm_head.weight.shape[1], None, vf_coef=VF, value_clip=VCLIP, dtype=F64,
                  init_std=0.3)


def flagship_module(path, partition: str = "none", budget: int = None):
    from treelit.lightning.module import TreeLitModule
    from treelit.objectives import make_objective

    model = flagship_model(path)
    return TreeLitModule(model, make_objective("ppo", clip_low=CLIP, gamma=GAMMA, lam=LAM),
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.0), attention="sdpa_dense",
                         old_logprobs="rollout", critic=flagship_critic(model), partition=partition,
                         budget_tokens=budget)


def run_step(module, micro) -> Dict[str, Any]:
    """One update as a training step runs it: the parts' reads before the update (the policy's
    rollout log-probs, the critic's values and the step-global GAE), then the gradients."""
    for part in module.parts:
        part.before_updates(module.executor, micro, module._read_step())
    return module.compute_gradients(micro)


def trained_grads(module, strip: str = "") -> Dict[str, torch.Tensor]:
    """The gradients of what trains (the adapters, the tower's copy and the value head), by name."""
    from treelit.utils.distributed import gather_full

    out = {}
    for n, p in module.named_parameters():
        if p.requires_grad and p.grad is not None:
            out[n.replace(strip, "")] = gather_full(p.grad).detach().clone()
    return out


def branch_reference(path, cases, policy, critic, seed: int = 0):
    """The update's loss, branch by branch on transformers (called outside ``KeepFloat64``: the
    reference loads outside it and runs inside it): each branch with its images and its
    recorded experts replayed, the same LoRA adapters (PEFT) and value head; returns (loss,
    {name: gradient}) with the policy's names as ``hf.<transformers name>``."""
    import peft

    from routing_oracle import replayed, routing_for
    from vision_oracle import load_reference

    C = critic_oracle()
    hf = load_reference(path)
    peft.inject_adapter_in_model(policy.treelit_lora_config, hf, adapter_name="default")
    hf.load_state_dict({k[len("hf."):]: v for k, v in policy.state_dict().items()}, strict=True)
    hf.to(F64)
    for n, p in hf.named_parameters():
        p.requires_grad_(".lora_" in n or ".modules_to_save." in n)
    branches = [b for c in cases for b in c[0]]
    images = [ims for c in cases for ims in c[1]]
    masks = [m for c in cases for m in c[2]]
    rewards = [[0.0] * (len(b) - 1) + [r] for c in cases for b, r in zip(c[0], c[3])]
    of = {tuple(b): (ims, routing_for(b, MOE_LAYERS, K, E, seed=seed)) for b, ims in zip(branches, images)}

    def hidden(model, ids):  # transformers' final hidden states of one branch, its images and routes
        x = torch.tensor([list(ids)])
        ims, routes = of[tuple(ids)]
        hf.model.rope_deltas = None
        with replayed(hf, routes):
            return hf.model(input_ids=x, pixel_values=torch.cat([i.pixel_values for i in ims]),
                            image_grid_thw=torch.tensor([list(i.grid_thw) for i in ims]),
                            mm_token_type_ids=(x == IMAGE).int()).last_hidden_state[0]

    C._hidden = hidden
    C.output_weight = lambda m: hf.lm_head.weight
    with KeepFloat64():  # (transformers' float32 upcasts kept in float64; the model loaded outside it)
        with torch.no_grad():
            old = [C.ref_branch(hf, critic, ids) for ids in branches]
        old_lp, old_v = [lp for lp, _ in old], [v.tolist() for _, v in old]
        for m in (hf, critic):
            m.zero_grad(set_to_none=True)
        loss = C.reference(hf, critic, branches, masks, [1.0] * len(branches), rewards, old_lp, old_v, "token-mean")
        loss.backward()
    grads = {f"model.hf.{n}": p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    grads.update({f"critic.{n}": p.grad.detach().clone() for n, p in critic.named_parameters()})
    critic.zero_grad(set_to_none=True)
    return loss, grads
