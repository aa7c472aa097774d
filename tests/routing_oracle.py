"""Per-branch training with a replayed MoE routing, written without treelit.

The reference is transformers' own model run branch by branch, each MoE block's router
replaced (on this one instance, test-only) by one that returns the given experts: logits as
the router computes them, the softmax over all experts (float64 for a float64 model, as
``hf_oracle.make_exact`` does for the live router), the probabilities read at the given
experts and renormalised when the config says ``norm_topk_prob``. The rest of the block (the
experts, a shared expert and its sigmoid gate) is transformers' own code. Sigmoid routers
(GLM-4.5 / DeepSeek-V3: ``e_score_correction_bias``, which only ever picks experts) read their
sigmoid scores at the given experts, renormalise them and scale by ``routed_scaling_factor``. The router loss is
the Switch balance loss from its definition, with the indicators of the given experts.

Routing is drawn as a function of the prefix (``routing_for``), as a deterministic sampler's
would be, so branches sharing a prefix share its routing; it is random, not the router's own
top-k, so replay visibly changes the result.
"""

from __future__ import annotations

import contextlib
import types
from typing import List, Sequence

import numpy as np
import torch

from hf_oracle import load_hf_oracle  # noqa: F401  (re-exported for the tests)


def routing_for(tokens: Sequence[int], layers: int, k: int, experts: int, seed: int = 0) -> np.ndarray:
    """``[len(tokens), layers, k]`` expert ids, a function of each token's prefix."""
    out = []
    for t in range(len(tokens)):
        rng = np.random.default_rng([seed, 7919, *(int(x) for x in tokens[: t + 1])])
        out.append([sorted(rng.choice(experts, k, replace=False).tolist()) for _ in range(layers)])
    return np.array(out, dtype=np.int64).reshape(len(tokens), layers, k)


def per_branch_records(branches: Sequence[Sequence[int]], records: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Each branch's routing over all its tokens: its own record, and for a token it did not
    record (its final one, records one token short) the record of any branch through the same
    prefix that did (the same token, run on the same prefix); ``-1`` (the live router) where none did."""
    seen = {}
    for b, r in zip(branches, records):
        for t in range(len(r)):
            seen.setdefault(tuple(int(x) for x in b[: t + 1]), r[t])
    out = []
    for b, r in zip(branches, records):
        rows = [r[t] if t < len(r) else seen.get(tuple(int(x) for x in b[: t + 1]), np.full(r.shape[1:], -1))
                for t in range(len(b))]
        out.append(np.stack(rows).astype(np.int64))
    return out


def hf_routers(hf_model) -> List[torch.nn.Module]:
    """The MoE blocks' routers (``mlp.gate``) of a transformers model, in layer order."""
    out = []
    base = hf_model.model
    for layer in getattr(base, "language_model", base).layers:  # a vision-language model: its text model
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            out.append(gate)
    return out


def _replay_forward(experts: torch.Tensor, sigmoid: bool = False):
    if sigmoid:  # DeepSeek-V3 / GLM-4.5 routers: sigmoid scores (their bias only ever picks experts)
        def forward_sigmoid(self, hidden_states):
            h = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(h.type(torch.float32), self.weight.type(torch.float32))
            scores = logits.sigmoid()
            w = scores.gather(1, experts)
            if self.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, w * self.routed_scaling_factor, experts
        return forward_sigmoid

    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h, self.weight)
        probs = torch.softmax(logits, dim=-1)
        idx = experts
        if (idx < 0).any():  # not recorded: the router's own top-k
            idx = torch.where(idx[:, :1] >= 0, idx, torch.topk(probs, self.top_k, dim=-1).indices)
        w = probs.gather(1, idx)
        if getattr(self, "norm_topk_prob", True):  # Qwen3.5-MoE / Qwen3-VL-MoE routers always renormalise
            w = w / w.sum(dim=-1, keepdim=True)
        return logits, w.to(logits.dtype), idx
    return forward


@contextlib.contextmanager
def replayed(hf_model, experts: np.ndarray):
    """Within the block, router i returns experts ``experts[:, i]`` (``[T, layers, k]`` for the
    T tokens of the one causal row the model runs)."""
    routers = hf_routers(hf_model)
    assert len(routers) == experts.shape[1], (len(routers), experts.shape)
    saved = [r.__dict__.get("forward") for r in routers]
    for i, r in enumerate(routers):
        sigmoid = hasattr(r, "e_score_correction_bias")
        assert not sigmoid or (experts >= 0).all(), "the sigmoid oracle takes full records"
        r.forward = types.MethodType(_replay_forward(torch.from_numpy(np.ascontiguousarray(experts[:, i])), sigmoid), r)
    try:
        yield
    finally:
        for r, f in zip(routers, saved):
            if f is None:
                del r.forward
            else:
                r.forward = f


def balance_loss(logits: Sequence[torch.Tensor], experts: Sequence[torch.Tensor], num_experts: int) -> torch.Tensor:
    """``E * sum_e f_e P_e`` over the rows of ``logits`` (per MoE layer ``[T, E]``), f the share of
    the given experts (per layer ``[T, k]``), P the mean router probability, pooled over layers."""
    f = P = 0.0
    T = logits[0].shape[0]
    for x, idx in zip(logits, experts):
        p = torch.softmax(x, dim=-1)
        f = f + torch.zeros_like(p).scatter_(1, idx, 1.0).sum(0)
        P = P + p.sum(0)
    total = T * len(logits)
    return num_experts * ((f / total) * (P / total)).sum()


def replay_branch_loss(hf_model, branches, masks, weights, routing, aggregation: str = "token-mean",
                       router=None, inputs=None) -> torch.Tensor:
    """Per-branch loss (and, with ``router=(definition, coef)``, coef x the router loss) of the
    transformers model with branch b's routing ``routing[b]`` replayed (``inputs(b, ids)``: branch
    b's further forward arguments, e.g. its images)."""
    total, n_targets, n_seq = 0.0, 0, 0
    cfg = getattr(hf_model.config, "text_config", None) or hf_model.config
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    per_branch = []
    for b, (br, m, w, r) in enumerate(zip(branches, masks, weights, routing)):
        ids = torch.tensor([list(br)])
        with replayed(hf_model, r):
            out = hf_model(input_ids=ids, output_router_logits=router is not None,
                           **(inputs(b, ids) if inputs is not None else {}))
        logp = torch.log_softmax(out.logits[0], -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        mask = torch.tensor([float(v) for v in m[1:]], dtype=logp.dtype)
        n = int(mask.sum().item())
        n_targets += n
        n_seq += int(n > 0)
        s = -(logp * mask).sum() * w
        total = total + (s / n if aggregation == "seq-mean-token-mean" and n > 0 else s)
        if router is not None:
            logits = list(out.router_logits)
            given = [torch.from_numpy(np.ascontiguousarray(r[:, i])) for i in range(r.shape[1])]
            # a token without a record counts with the experts the router chose for it
            used = [torch.where(g[:, :1] >= 0, g, torch.topk(lg, g.shape[1], dim=-1).indices)
                    for lg, g in zip(logits, given)]
            per_branch.append((logits, used))
    Z = {"token-mean": n_targets, "seq-mean-token-mean": n_seq, "seq-mean-token-sum": n_seq, "sum": 1}[aggregation]
    loss = total / Z
    if router is not None:
        definition, coef = router
        if definition == "sequence":
            aux = sum(balance_loss(lg, ex, E) for lg, ex in per_branch) / len(per_branch)
        else:  # every (branch, position) of the micro-batch pooled
            layers = len(per_branch[0][0])
            aux = balance_loss([torch.cat([lg[i] for lg, _ in per_branch]) for i in range(layers)],
                               [torch.cat([ex[i] for _, ex in per_branch]) for i in range(layers)], E)
        loss = loss + coef * aux
    return loss
