"""The peer baseline: the same weights in ``transformers``, trained branch by branch.

This is the loop users run today without treelit: each branch is its own sequence,
branches sorted by length go into right-padded micro-batches (attention mask on the
padding, labels ``-100`` wherever the loss mask is off or there is padding), and every
micro-batch runs ``model(input_ids, attention_mask, labels, num_items_in_batch)`` and
backward, so the accumulated loss is the token mean over the whole step. No treelit code
runs in the step.
"""

from __future__ import annotations

import tempfile
from typing import Dict, List, Optional, Sequence

import torch

import treelit
from treelit.models.hf import tune_to_hf_state_dict


def load_peer(model: treelit.TreeDecoder, dtype=torch.float32):
    """``model``'s weights as a transformers ``AutoModelForCausalLM`` (sdpa attention)."""
    import transformers

    with tempfile.TemporaryDirectory() as d:
        treelit.save_hf_checkpoint(model, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa")
    hf.train()
    return hf


def padded_micro_batches(lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """Branch indices sorted by length, grouped so that rows x longest <= max_tokens."""
    groups: List[List[int]] = [[]]
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups[-1] and (len(groups[-1]) + 1) * lengths[i] > max_tokens:
            groups.append([])
        groups[-1].append(i)
    return groups


def peer_step(hf, branches: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], max_tokens: int,
              n_items: Optional[int] = None) -> float:
    """One token-mean training step (forward + backward, gradients accumulated); returns the loss.
    ``n_items``: the step's target count (default: these branches'), so that a step run in
    parts over subsets of its branches accumulates the same gradients as one call."""
    if n_items is None:
        from bench_models import branch_targets

        n_items = branch_targets(masks)
    total = 0.0
    for group in padded_micro_batches([len(b) for b in branches], max_tokens):
        L = max(len(branches[i]) for i in group)
        ids = torch.zeros(len(group), L, dtype=torch.long)
        attn = torch.zeros(len(group), L, dtype=torch.long)
        labels = torch.full((len(group), L), -100, dtype=torch.long)
        for r, i in enumerate(group):
            n = len(branches[i])
            ids[r, :n] = torch.tensor(branches[i])
            attn[r, :n] = 1
            on = torch.tensor([bool(v) for v in masks[i]])
            on[0] = False  # nothing predicts a sequence's first token
            labels[r, :n] = torch.where(on, ids[r, :n], torch.full_like(ids[r, :n], -100))
        out = hf(input_ids=ids, attention_mask=attn, labels=labels, num_items_in_batch=n_items)
        out.loss.backward()
        total += float(out.loss.detach())
    return total


def grad_diff(model: treelit.TreeDecoder, tree_grads: Dict[str, torch.Tensor], peer_grads: Dict[str, torch.Tensor]) -> float:
    """Largest relative difference between treelit's gradients and the peer's (by HF name)."""
    ours = tune_to_hf_state_dict(tree_grads, model.config)
    theirs = peer_grads
    if model.config.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    return max(((ours[k] - theirs[k]).norm() / theirs[k].norm().clamp_min(1e-30)).item() for k in theirs)
