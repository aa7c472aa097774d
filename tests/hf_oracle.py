"""``transformers`` as an independent float64 oracle, run branch by branch.

transformers computes RMSNorm and rotary embeddings through float32 even in a float64
model, which limits any comparison to ~1e-7. For the strict checks, this module rebinds
(test-only, on one model instance) every RMSNorm to compute in the input's precision and
every rotary embedding to form its angles and cos/sin in float64 from the model's own
inverse frequencies. Nothing else of transformers' modelling code is touched.

``hf_branch_loss`` is per-branch training written from the definition: each branch is
its own causal sequence through the transformers model, token t is predicted from
position t-1, and the aggregation's normaliser is counted here.
"""

from __future__ import annotations

import types
from typing import Dict, Optional, Sequence

import torch


def _rms_forward_exact(self, x):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if getattr(self, "_treelit_offset", False):  # Gemma: (1 + w)
        return y * (1.0 + self.weight.to(x.dtype))
    return self.weight.to(x.dtype) * y


def _rope_forward_exact(self, x, position_ids, layer_type=None, **kwargs):
    if layer_type is not None and hasattr(self, f"{layer_type}_inv_freq"):  # Gemma 3: one RoPE per layer type
        inv = getattr(self, f"{layer_type}_inv_freq")
        scaling = getattr(self, f"{layer_type}_attention_scaling", 1.0)
    else:
        inv = self.inv_freq
        scaling = getattr(self, "attention_scaling", 1.0)
    freqs = position_ids[..., None].to(torch.float64) * inv.to(device=x.device, dtype=torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def _router_forward_exact(self, hidden_states):
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(h, self.weight)
    probs = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


def make_exact(hf_model):
    """Rebind the model's RMSNorms and rotary embeddings to keep float64 (in place); returns it."""
    seen_norm = seen_rope = 0
    for mod in hf_model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm"):
            if "Gemma" in name:
                mod._treelit_offset = True
            mod.forward = types.MethodType(_rms_forward_exact, mod)
            seen_norm += 1
        elif name.endswith("RotaryEmbedding"):
            mod.forward = types.MethodType(_rope_forward_exact, mod)
            seen_rope += 1
        elif name.endswith("TopKRouter"):  # MoE router: softmax through float32
            mod.forward = types.MethodType(_router_forward_exact, mod)
    assert seen_norm and seen_rope, "no RMSNorm / rotary embedding found to rebind"
    return hf_model


def no_hub_kernels() -> dict:
    """``from_pretrained`` keywords for transformers >= 5.25, which kernelizes by default (and without
    the ``kernels`` package refuses to load at all unless told not to)."""
    import transformers

    return {"use_kernels": False} if hasattr(transformers.PreTrainedModel, "set_use_kernels") else {}


def hf_from_pretrained(path, **kwargs):
    """``transformers.AutoModelForCausalLM.from_pretrained`` without hub kernels."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, **{**no_hub_kernels(), **kwargs})


def load_hf_oracle(path, dtype=torch.float64, exact: Optional[bool] = None, **kwargs):
    """The checkpoint at ``path`` as a transformers model (sdpa attention), rebound to stay in
    float64 when ``exact`` (default: for float64)."""
    import transformers

    kwargs.setdefault("attn_implementation", "sdpa")
    if hasattr(transformers.PreTrainedModel, "set_use_kernels"):  # 5.25+: no hub kernels (they fetch code)
        kwargs.setdefault("use_kernels", False)
    cfg = transformers.AutoConfig.from_pretrained(path)
    if getattr(cfg, "num_experts_per_tok", None):  # MoE: grouped_mm has no float64 kernel
        kwargs.setdefault("experts_implementation", "eager")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if exact if exact is not None else dtype == torch.float64:
        make_exact(model)
    return model


def hf_branch_loss(hf_model, branches: Sequence[Sequence[int]], masks: Sequence[Sequence[int]],
                   weights: Sequence[float], aggregation: str, inputs=None) -> torch.Tensor:
    """Per-branch loss from the definition, one branch at a time (``inputs(b, ids)``: branch b's
    further forward arguments, e.g. its images)."""
    total = 0.0
    n_targets = n_seq = 0
    for b, (br, m, w) in enumerate(zip(branches, masks, weights)):
        ids = torch.tensor([list(br)])
        out = hf_model(input_ids=ids, **(inputs(b, ids) if inputs is not None else {}))
        logits = out.logits[0]
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        mask = torch.tensor([float(v) for v in m[1:]], dtype=logits.dtype)
        n = int(mask.sum().item())
        n_targets += n
        n_seq += int(n > 0)
        s = -(logp * mask).sum() * w
        total = total + (s / n if aggregation == "seq-mean-token-mean" and n > 0 else s)
    Z = {"token-mean": n_targets, "seq-mean-token-mean": n_seq, "seq-mean-token-sum": n_seq, "sum": 1}[aggregation]
    return total / Z


def hf_grads(hf_model, tied: bool) -> Dict[str, torch.Tensor]:
    """Parameter gradients under the checkpoint's names (transformers 5 keeps MoE experts fused
    in memory, ``mlp.experts.gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``; checkpoints
    name each expert's projections)."""
    out = {}
    for n, p in hf_model.named_parameters():
        if p.grad is None:
            continue
        if n.endswith("mlp.experts.gate_up_proj"):
            base, inter = n[: -len("gate_up_proj")], p.grad.shape[1] // 2
            for e in range(p.grad.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = p.grad[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = p.grad[e, inter:]
        elif n.endswith("mlp.experts.down_proj"):
            base = n[: -len("down_proj")]
            for e in range(p.grad.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = p.grad[e]
        else:
            out[n] = p.grad
    if tied:
        out.pop("lm_head.weight", None)
    return out


def random_hf_checkpoint(path, model_type: str, seed: int = 0, std: float = 0.3, **config):
    """Write a transformers model of ``model_type`` (tiny config ``config``) with every parameter
    random (norm weights around 1) as a float64 checkpoint at ``path``; returns the config dict."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.2 * r if "norm" in name and p.ndim == 1 else std * r)
    model.save_pretrained(path)
    return cfg.to_dict()


def tree_vs_hf(path, branches, masks, weights, aggregation="token-mean", attention="auto", dtype=torch.float64,
               partition_budget=None, hf_kwargs=None, router=None):
    """Tree-mode loss/gradients of treelit's model loaded from ``path`` vs the transformers model
    from the same checkpoint trained branch by branch. Returns (loss rel diff, max grad rel diff,
    treelit loss); every parameter gradient is compared (under treelit's names). ``router``:
    ``(definition, coef)`` adds the router load-balancing loss on both sides."""
    import treelit
    from treelit.models.hf import hf_to_tune_state_dict

    ours = treelit.load_hf_checkpoint(path, dtype=dtype)
    hf = load_hf_oracle(path, dtype=dtype, **(hf_kwargs or {}))
    if router is not None:
        from treelit.models.factory import set_router_aux_loss

        set_router_aux_loss(ours, router[1], router[0])
    tree = treelit.TokenTree.from_branches(branches, masks, weights)
    if partition_budget is not None:
        # tree_backward returns a Python float (float64); torch.tensor would round it to float32
        loss = torch.tensor(treelit.tree_backward(ours, tree, aggregation, "redundancy_free", partition_budget,
                                                  attention=attention), dtype=torch.float64)
    else:
        loss = treelit.tree_loss(ours, tree, aggregation, attention)
        loss.backward()
    ref = hf_branch_loss(hf, branches, masks, weights, aggregation)
    if router is not None:
        ref = ref + router[1] * hf_router_loss(hf, branches, router[0])
    ref.backward()
    # compared under treelit's names (transformers' own names may be fused in memory, e.g. MoE experts)
    ours_g = {n: p.grad for n, p in ours.named_parameters()}
    theirs = hf_to_tune_state_dict(hf_grads(hf, ours.config.tie_word_embeddings), ours.config)
    assert ours_g.keys() == theirs.keys(), sorted(set(ours_g) ^ set(theirs))
    scale = max(g.double().norm().item() for g in theirs.values())
    # per-parameter relative difference, floored at 1e-6 of the largest gradient
    worst = 0.0
    for k in theirs:
        d = (ours_g[k].double() - theirs[k].double()).norm().item()
        n = max(theirs[k].double().norm().item(), 1e-6 * scale)
        worst = max(worst, d / n)
    loss_diff = abs(loss.item() - ref.item()) / max(abs(ref.item()), 1e-30)
    assert ref.item() != 0.0 and scale > 0, "vacuous comparison: zero loss or zero gradients"
    return loss_diff, worst, loss.item()


def balance_loss(router_logits, num_experts: int, top_k: int, mask=None) -> torch.Tensor:
    """The Switch-style load-balancing loss from its definition (in the logits' precision):
    ``E * sum_e f_e P_e`` with f (top-k assignment share) and P (mean router probability)
    pooled over the layers and the real tokens (``mask [T]``, 1 = real)."""
    T = router_logits[0].shape[0]
    w = torch.ones(T, dtype=router_logits[0].dtype) if mask is None else mask.to(router_logits[0].dtype)
    f = P = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)
        _, idx = torch.topk(probs, top_k, dim=-1)
        m = torch.zeros_like(probs).scatter_(1, idx, 1.0)
        f = f + (m * w[:, None]).sum(0)
        P = P + (probs * w[:, None]).sum(0)
    total = w.sum() * len(router_logits)
    return num_experts * ((f / total) * (P / total)).sum()


def hf_router_loss(hf_model, branches, definition: str) -> torch.Tensor:
    """The router loss of the transformers model, from the definition: ``micro_batch`` over all
    branches run as one right-padded batch (padding masked), ``sequence`` as the mean over
    branches of each branch's own."""
    cfg = hf_model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    if definition == "sequence":
        losses = [balance_loss(hf_model(input_ids=torch.tensor([list(b)]), output_router_logits=True).router_logits,
                               E, k) for b in branches]
        return sum(losses) / len(losses)
    L = max(len(b) for b in branches)
    ids = torch.zeros(len(branches), L, dtype=torch.long)
    att = torch.zeros(len(branches), L, dtype=torch.long)
    for r, b in enumerate(branches):
        ids[r, : len(b)] = torch.tensor(list(b))
        att[r, : len(b)] = 1
    out = hf_model(input_ids=ids, attention_mask=att, output_router_logits=True)
    return balance_loss(out.router_logits, E, k, att.reshape(-1))
