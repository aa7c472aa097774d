"""treelit-train on checkpoints written by transformers: Qwen3 and Qwen3-MoE (router loss on).

One SGD step of ``treelit-train model.hf_checkpoint=DIR`` equals the same step taken by hand
on the transformers model (per-branch loss from the definition, plus the router loss over
the micro-batch's branches for the MoE; gradient clipped to norm 1), and the exported
checkpoint loads back in transformers with the logits of treelit's model.
"""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from app_helpers import SMALL
from hf_oracle import hf_branch_loss, hf_router_loss, load_hf_oracle, random_hf_checkpoint
from treelit.cli.config import compose
from treelit.cli.train import run
from hf_oracle import hf_from_pretrained  # noqa: E402

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MODELS = {
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                    norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.1)),
}
BRANCHES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 3, 4]]
MASKS = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
WEIGHTS = [1.0, 2.0, 1.0]


def write_record(tmp_path):
    """The test forest as one JSONL record."""
    data = tmp_path / "data.jsonl"
    rec = {"id": "t0", "branches": [{"input_ids": b, "loss_mask": m, "weight": w}
                                    for b, m, w in zip(BRANCHES, MASKS, WEIGHTS)]}
    data.write_text(json.dumps(rec) + "\n")
    return data


def transformers_sgd_step(ckpt, with_router_loss):
    """The training step by hand in transformers (float32 as trained): per-branch loss, plus the
    router loss (coef 0.1) over the branches, gradient clipped to norm 1, SGD at lr 0.5."""
    hf = load_hf_oracle(ckpt, dtype=torch.float32, exact=False)
    loss = hf_branch_loss(hf, BRANCHES, MASKS, WEIGHTS, "token-mean")
    if with_router_loss:
        loss = loss + 0.1 * hf_router_loss(hf, BRANCHES, "micro_batch")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    with torch.no_grad():
        for p in hf.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    return hf


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_step_on_a_transformers_checkpoint_and_export(tmp_path, name):
    model_type, extra = MODELS[name]
    ckpt = tmp_path / "ckpt"
    random_hf_checkpoint(ckpt, model_type, std=0.1, **TINY, **extra)
    data = write_record(tmp_path)
    out = tmp_path / "run"
    cfg = compose([f"output_dir={out}", *SMALL, f"model.hf_checkpoint={ckpt}", "data=jsonl",
                   f"data.train_path={data}", "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=1"])
    summary = run(cfg)
    assert summary["global_step"] == 1
    if name == "qwen3_moe":
        assert "router_aux_loss" in summary["metrics"]

    # the same step by hand, on the transformers model (float32 as trained)
    hf = transformers_sgd_step(ckpt, with_router_loss=name == "qwen3_moe")
    exported = out / "hf_checkpoint"
    trained = load_hf_oracle(exported, dtype=torch.float32, exact=False)
    before = load_hf_oracle(ckpt, dtype=torch.float32, exact=False).state_dict()
    theirs, ours = hf.state_dict(), trained.state_dict()
    assert theirs.keys() == ours.keys()
    moved = max((ours[k] - before[k]).abs().max().item() for k in ours)
    assert moved > 1e-4, "the step must change the weights"
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=2e-4, atol=2e-6, msg=k)

    # the export: transformers' logits == treelit's on the same checkpoint
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    native = treelit.load_hf_checkpoint(exported)
    with torch.no_grad():
        torch.testing.assert_close(native(ids), trained(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("definition", ["micro_batch", "sequence"])
def test_router_loss_accumulates_exactly_in_the_trainer(tmp_path, definition):
    """Several micro-batches per step (and partitions): one SGD step of a Qwen3-MoE model with the
    router loss on is the same in tree mode, per-branch mode and partitioned tree mode."""
    data = tmp_path / "data.jsonl"
    trees = [[[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]], [[2, 9, 10, 3], [2, 9, 4]], [[5, 6, 7, 8, 9, 10, 11], [5, 6, 1]]]
    data.write_text("".join(json.dumps({"id": f"t{i}", "branches": [{"input_ids": b} for b in t]}) + "\n"
                            for i, t in enumerate(trees)))
    common = [*SMALL, "model=qwen3_moe_tiny", "model.config.vocab_size=16", "model.router_aux_loss_coef=0.5",
              f"model.router_aux_loss={definition}", "model.dtype=float64", "data=jsonl", f"data.train_path={data}",
              "data.micro_batch_tokens=10", "data.micro_batches_per_step=3", "optimizer=sgd", "optimizer.lr=0.5",
              "trainer.max_steps=1", "grad_clip=0"]
    runs = {"tree": [], "linear": ["mode=linear"], "partitioned": ["partition=redundancy_free",
                                                                   "partition.budget_tokens=7"]}
    states = {}
    for name, extra in runs.items():
        out = tmp_path / name
        summary = run(compose([f"output_dir={out}", *common, *extra]))
        assert summary["metrics"]["router_aux_loss"] > 0
        states[name] = treelit.load_hf_checkpoint(out / "hf_checkpoint", dtype=torch.float64).state_dict()
    for name in ("linear", "partitioned"):
        for k, v in states["tree"].items():
            torch.testing.assert_close(states[name][k], v, rtol=1e-9, atol=1e-12, msg=f"{name}: {k}")


ADAPTER = {
    "gemma3": ("gemma3_text", dict(sliding_window=3, query_pre_attn_scalar=12, pad_token_id=0, eos_token_id=1,
                                   bos_token_id=1, layer_types=["sliding_attention", "full_attention"])),
    "qwen3_moe": MODELS["qwen3_moe"],
}


@pytest.mark.parametrize("name", sorted(ADAPTER))
def test_hf_auto_trains_and_exports_what_transformers_loads(tmp_path, name):
    """model=hf_auto: one SGD step equals the same step by hand in transformers; the export is the
    trained weights, loaded by transformers unchanged."""
    model_type, extra = ADAPTER[name]
    ckpt = tmp_path / "ckpt"
    random_hf_checkpoint(ckpt, model_type, std=0.1, **TINY, **extra)
    data = write_record(tmp_path)
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", *[o for o in SMALL if not o.startswith("model.")], "model=hf_auto",
                 f"model.hf_checkpoint={ckpt}", "data=jsonl", f"data.train_path={data}", "optimizer=sgd",
                 "optimizer.lr=0.5", "trainer.max_steps=1"]
    summary = run(compose(overrides))
    assert summary["global_step"] == 1

    hf = transformers_sgd_step(ckpt, with_router_loss=name == "qwen3_moe")
    exported = hf_from_pretrained(out / "hf_checkpoint", dtype=torch.float32)
    adapted = treelit.load_hf_model(out / "hf_checkpoint")
    theirs, ours = hf.state_dict(), exported.state_dict()
    assert theirs.keys() == ours.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=2e-4, atol=2e-6, msg=k)
        assert torch.equal(ours[k], adapted.hf.state_dict()[k]), k  # loaded back unchanged
