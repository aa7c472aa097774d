"""bfloat16 hybrid checkpoints follow transformers: the recurrences' gates (``g``, ``dt`` with its bias,
softplus and limits, ``A``) reach both backends in float32, as transformers computes them and as fla's
and mamba-ssm's kernels accumulate them, and ``ssm=torch`` runs the recurrences in float32 as
transformers' torch functions do.

The end-to-end check: treelit's bf16 tree-mode log-probs differ from transformers' own bf16 per-branch
run (on its torch functions) by no more than transformers' bf16 run differs from float64 (mean
absolute difference over every target of every branch). The gate test pins the cause: the tensors
handed to the scans, in a bf16 model.
"""

from __future__ import annotations

import pytest
import torch

import treelit
from float64_mode import KeepFloat64
from hf_oracle import load_hf_oracle, random_hf_checkpoint
from models.test_hf_hybrid import HYBRID
from treelit.loss.tree import tree_token_logprobs
from treelit.models import hf_kernels
from treelit.models.hf_kernels import bind_torch_kernels


def _branches():
    g = torch.Generator().manual_seed(1)
    first = [1] + torch.randint(2, 64, (30,), generator=g).tolist()
    out = [first] + [first[:12] + torch.randint(2, 64, (k,), generator=g).tolist() for k in (9, 17, 1)]
    return out + [out[1][:25] + [5, 6]]  # (a one-token segment, a branch off a branch)


def _hf_logprobs(model, branches):
    out = []
    with torch.no_grad():
        for br in branches:
            ids = torch.tensor([br])
            logits = model(input_ids=ids).logits[0].double()
            out.append(torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1))
    return torch.cat(out)


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("nemotron_h", marks=pytest.mark.slow),
                                    pytest.param("kimi_linear", marks=pytest.mark.slow)])
def test_bf16_tree_logprobs_are_as_close_to_transformers_bf16_as_it_is_to_float64(family, tmp_path):
    model_type, cfg = HYBRID[family]
    random_hf_checkpoint(tmp_path, model_type, **dict(cfg, vocab_size=64))
    branches = _branches()
    f64 = load_hf_oracle(tmp_path, dtype=torch.float64, exact=False).to(torch.float64)
    bind_torch_kernels(f64)
    with KeepFloat64():
        exact = _hf_logprobs(f64, branches)
    hf16 = load_hf_oracle(tmp_path, dtype=torch.bfloat16, exact=False).to(torch.bfloat16)
    bind_torch_kernels(hf16)
    theirs = _hf_logprobs(hf16, branches)
    ours_model = treelit.load_hf_model(tmp_path, dtype=torch.bfloat16)
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    with torch.no_grad():
        _, lp, _ = tree_token_logprobs(ours_model, batch, "sdpa_dense", select=torch.arange(batch.num_tokens))
    lp = lp.double()
    ours = torch.cat([lp[batch.branch_tokens[batch.branch_ptr[b]:batch.branch_ptr[b + 1]][1:]]
                      for b in range(len(branches))])
    bf16_error = (theirs - exact).abs().mean().item()
    assert bf16_error > 1e-3  # bf16 rounding is visible: the comparison means something
    assert (ours - theirs).abs().mean().item() <= bf16_error


def test_bf16_gates_reach_the_scans_in_float32(tmp_path, monkeypatch):
    """In a bf16 model the Gated DeltaNet decay and the Mamba2 dt / A handed to the scans are float32,
    and dt equals float32 softplus(dt + bias) of the bf16 projection (it was computed in bf16)."""
    seen = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, args)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(hf_kernels, "gdn_chunk", spy("gdn", hf_kernels.gdn_chunk))
    monkeypatch.setattr(hf_kernels, "ssd_chunk", spy("ssd", hf_kernels.ssd_chunk))
    batch = treelit.TokenTree.from_branches(_branches()).to_batch()
    for family in ("qwen3_5", "nemotron_h"):
        model_type, cfg = HYBRID[family]
        path = tmp_path / family
        random_hf_checkpoint(path, model_type, **dict(cfg, vocab_size=64))
        with torch.no_grad():
            treelit.tree_loss(treelit.load_hf_model(path, dtype=torch.bfloat16), batch)
    q, k, v, beta, g = seen["gdn"][:5]
    assert g.dtype == torch.float32 and q.dtype == k.dtype == v.dtype == beta.dtype == torch.float32
    x, dt, A = seen["ssd"][:3]
    assert dt.dtype == A.dtype == torch.float32 and x.dtype == torch.float32
    # dt is not a bf16 value: softplus ran in float32 (bf16 keeps 8 significant bits)
    assert (dt != dt.to(torch.bfloat16).float()).any()
