"""LoRA in tree mode (``model.lora.*``, :mod:`treelit.models.lora`).

The reference is transformers + PEFT with no treelit in it: the same checkpoint loaded by
transformers, wrapped with ``peft.get_peft_model`` and the same LoRA config, the adapter
weights copied from treelit's model, then trained branch by branch. The loss and every adapter
gradient agree: float64 <= 1e-10 (transformers' float32 upcasts kept in float64 on both sides),
float32 <= 1e-4; a dense family, a MoE family and two hybrid families (Gated DeltaNet, Mamba2);
unpartitioned and partitioned. The adapters start random (``init: false``): with PEFT's default
(B = 0) the gradients of A are zero and would prove nothing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import example, given, settings

import treelit
from float64_mode import KeepFloat64
from helpers import assert_equivalent, assert_trains, grad_floor, max_rel_grad_diff, negligible_grad
from hf_oracle import hf_branch_loss, hf_router_loss, load_hf_oracle, random_hf_checkpoint
from strategies import examples, forests
from treelit.models.hf_kernels import bind_torch_kernels
from treelit.models.lora import adapters_disabled, apply_lora, lora_options, merged_state_dict, save_adapter

peft = pytest.importorskip("peft")

BASE = dict(vocab_size=12, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64, num_hidden_layers=2)
GDN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_conv_kernel_dim=3)
FAMILIES = {
    "qwen2": ("qwen2", {}),
    "qwen3_moe": ("qwen3_moe", dict(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                    output_router_logits=True, router_aux_loss_coef=0.3)),
    "qwen3_5": ("qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"], **GDN)),
    "nemotron_h": ("nemotron_h", dict(layers_block_type=["mamba", "attention"], ssm_state_size=4, mamba_num_heads=4,
                                      mamba_head_dim=8, n_groups=2, conv_kernel=3, chunk_size=4,
                                      use_conv_bias=True)),
}
HYBRIDS = {"qwen3_5", "nemotron_h"}
LORA = dict(rank=4, alpha=8, target_modules="all-linear", init=False)
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
ONE_TOKEN = ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 7], [1, 2, 3, 4, 8, 9], [1, 2, 3, 4, 8, 10], [3, 5]],
             [[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1], [1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1]],
             [1.0, 0.5, 2.0, 1.0, 1.5, 1.0, 1.0])
_CACHE = {}


def checkpoint(family, tmp_path_factory):
    if family not in _CACHE:
        path = tmp_path_factory.mktemp(f"lora_{family}")
        model_type, cfg = FAMILIES[family]
        random_hf_checkpoint(path, model_type, **dict(BASE, **cfg))
        _CACHE[family] = path
    return _CACHE[family]


def peft_config(opts):
    o = lora_options(opts)
    return peft.LoraConfig(r=o["rank"], lora_alpha=o["alpha"], target_modules=o["target_modules"],
                           use_rslora=o["use_rslora"], init_lora_weights=o["init"],
                           modules_to_save=o["modules_to_save"] or None)


def models(family, dtype, tmp_path_factory, lora=LORA, seed=0):
    """(treelit's model with LoRA, transformers + PEFT with the same adapter weights)."""
    path = checkpoint(family, tmp_path_factory)
    torch.manual_seed(seed)
    ours = treelit.load_hf_model(path, dtype=dtype)
    apply_lora(ours, lora)
    ref = load_hf_oracle(path, dtype=dtype, exact=False).to(dtype)
    if family in HYBRIDS:
        assert bind_torch_kernels(ref) > 0
    ref = peft.get_peft_model(ref, peft_config(lora))
    mine = {n[len("hf."):]: p for n, p in ours.named_parameters() if p.requires_grad}
    theirs = {n[len("base_model.model."):]: p for n, p in ref.named_parameters() if p.requires_grad}
    assert mine.keys() == theirs.keys(), sorted(set(mine) ^ set(theirs))
    with torch.no_grad():
        for k, p in theirs.items():
            p.copy_(mine[k])
    return ours, ref


def exact(dtype):
    return KeepFloat64() if dtype == torch.float64 else contextlib.nullcontext()


def grads(model, prefix):
    out = {n[len(prefix):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


def compare(family, dtype, data, tmp_path_factory, budgets=(None,), aggregation="token-mean", lora=LORA):
    branches, masks, weights = data
    assert_trains(branches, masks, weights)
    ours, ref = models(family, dtype, tmp_path_factory, lora)
    coef = ours.config.moe.get("router_aux_loss_coef", 0.0)
    frozen = [p for p in ours.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    with exact(dtype):
        expected = hf_branch_loss(ref, branches, masks, weights, aggregation)
        if coef:
            expected = expected + coef * hf_router_loss(ref, branches, "micro_batch")
        expected.backward()
        theirs = grads(ref, "base_model.model.")
        assert any(g.abs().max() > 0 for g in theirs.values()), "adapters without gradient prove nothing"
        batch = treelit.TokenTree.from_branches(branches, masks, weights).to_batch()
        for budget in budgets:
            if budget is None:
                loss = treelit.tree_loss(ours, batch, aggregation, "sdpa_dense")
                loss.backward()
                value = loss.item()
            else:
                value = treelit.tree_backward(ours, batch, aggregation, "redundancy_free", budget, attention="sdpa_dense")
            mine = grads(ours, "hf.")
            what = f"{family}/{dtype}/budget={budget}"
            assert mine.keys() == theirs.keys(), what
            assert abs(value - expected.item()) <= TOL[dtype] * abs(expected.item()), (what, value, expected.item())
            err = max_rel_grad_diff(mine, theirs, grad_floor(dtype), negligible_grad(dtype))
            assert err <= TOL[dtype], f"{what}: max relative adapter gradient difference {err:.2e}"
    assert all(p.grad is None for p in frozen), "the frozen base got gradients"


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5",
                                    pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                    pytest.param("nemotron_h", marks=pytest.mark.slow)])
def test_lora_tree_equals_transformers_peft_branch_by_branch(family, tmp_path_factory):
    """Float64, unpartitioned and partitioned (budget 5: many partitions), on the one-token forest."""
    compare(family, torch.float64, ONE_TOKEN, tmp_path_factory, budgets=(None, 6))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=examples(3), deadline=None)
@given(data=forests(max_branches=5, max_len=8, vocab=12))
@example(data=ONE_TOKEN)
def test_lora_hypothesis_forests(family, data, tmp_path_factory):
    compare(family, torch.float64, data, tmp_path_factory, budgets=(None, 8))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_lora_float32_rslora_and_modules_to_save(family, tmp_path_factory):
    """float32 <= 1e-4; rsLoRA scaling; a trained copy of a module (modules_to_save) next to the adapters."""
    lora = dict(LORA, use_rslora=True, target_modules=["q_proj", "v_proj"] if family == "qwen2" else "all-linear",
                modules_to_save=["lm_head"])
    compare(family, torch.float32, ONE_TOKEN, tmp_path_factory, budgets=(None, 6), lora=lora)


def _rl_tree(branches, masks, weights, seed=1):
    gen = torch.Generator().manual_seed(seed)
    per_prefix = {}
    for ids in branches:
        for t in range(1, len(ids)):
            per_prefix.setdefault(tuple(ids[: t + 1]), (-0.2 - torch.rand(1, generator=gen).item(),
                                                        -0.2 - torch.rand(1, generator=gen).item()))
    old = [[None] + [per_prefix[tuple(ids[: t + 1])][0] for t in range(1, len(ids))] for ids in branches]
    ref = [[None] + [per_prefix[tuple(ids[: t + 1])][1] for t in range(1, len(ids))] for ids in branches]
    adv = [float(a) for a in torch.randn(len(branches), generator=gen, dtype=torch.float64)]
    return treelit.TokenTree.from_branches(branches, masks, weights, advantages=adv, old_logprobs=old,
                                           ref_logprobs=ref)


OBJECTIVES = [dict(name="grpo", clip_high=0.28, kl_coef=0.1, kl_estimator="k2"), dict(name="gspo"),
              dict(name="dpo", beta=0.2)]


@pytest.mark.parametrize("objective", [pytest.param(o, marks=() if o["name"] == "grpo" else pytest.mark.slow)
                                       for o in OBJECTIVES], ids=lambda o: o["name"])
@pytest.mark.parametrize("family", ["qwen2", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_lora_rl_objectives_tree_equal_per_branch(family, objective, tmp_path_factory):
    """grpo / gspo / dpo with LoRA: the tree pass (and the partitioned one) equals the objective's
    per-branch form on the same LoRA model, loss and every adapter gradient, float64."""
    from treelit.objectives import make_objective

    ours, _ = models(family, torch.float64, tmp_path_factory)
    branches, masks, weights = ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 2, 6, 8]], [[0, 0, 1, 1]] * 4,
                                [1.0] * 4)
    opts = dict(objective)
    name = opts.pop("name")
    tree = _rl_tree(branches, masks, weights)
    if name == "dpo":
        tree = treelit.TokenTree.from_branches(branches, masks, weights, ref_logprobs=tree_refs(branches),
                                               branch_fields={"pair": [0, 0, 1, 1], "chosen": [True, False, False, True]})
    obj = make_objective(name, **opts)
    with KeepFloat64():
        assert_equivalent(ours, lambda: obj.tree_loss(ours, tree.to_batch(), aggregation="token-mean",
                                                      normalizer=None, attention="sdpa_dense")[0],
                          lambda: obj.linear_loss(ours, tree.to_batch(), aggregation="token-mean",
                                                  normalizer=None)[0],
                          torch.float64, f"{family}/{name}", require_grad=False)
        ours.zero_grad(set_to_none=True)
        # partitioned: the same loss and adapter gradients as the unpartitioned tree
        loss = obj.tree_loss(ours, tree.to_batch(), aggregation="token-mean", normalizer=None,
                             attention="sdpa_dense")[0]
        loss.backward()
        full = grads(ours, "")
        value = treelit.tree_backward(ours, tree.to_batch(), "token-mean", "redundancy_free", 4,
                                      attention="sdpa_dense", objective=obj)
        part = grads(ours, "")
    assert abs(value - loss.item()) <= 1e-10 * abs(loss.item())
    assert max_rel_grad_diff(part, full, grad_floor(torch.float64), negligible_grad(torch.float64)) <= 1e-10


def tree_refs(branches, seed=3):
    gen = torch.Generator().manual_seed(seed)
    per_prefix = {}
    for ids in branches:
        for t in range(1, len(ids)):
            per_prefix.setdefault(tuple(ids[: t + 1]), -0.3 - torch.rand(1, generator=gen).item())
    return [[None] + [per_prefix[tuple(ids[: t + 1])] for t in range(1, len(ids))] for ids in branches]


def test_native_model_lora_tree_equals_per_branch():
    """treelit's native decoders (torchtune modules, Gated DeltaNet and Mamba2 layers) take the same
    PEFT layers: tree mode equals per-branch mode on the LoRA model, every adapter gradient."""
    from helpers import tiny_model

    for name in ("qwen2_5_tiny", "hybrid_tiny"):
        model = apply_lora(tiny_model(name, torch.float64), LORA)
        branches, masks, weights = ONE_TOKEN
        tree = treelit.TokenTree.from_branches(branches, masks, weights)
        assert_equivalent(model, lambda: treelit.tree_loss(model, tree, "token-mean", "sdpa_dense"),
                          lambda: treelit.linear_loss(model, branches, masks, weights, "token-mean"),
                          torch.float64, name)
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_reference_base_equals_a_separate_frozen_base(tmp_path_factory):
    """``objective.reference=base``: the KL term's reference log-probs come from the same model with
    its adapters off, and equal those of a separate copy of the base (no adapters), tree and
    partitioned."""
    from treelit.objectives import make_objective

    ours, _ = models("qwen2", torch.float64, tmp_path_factory)
    base = treelit.load_hf_model(checkpoint("qwen2", tmp_path_factory), dtype=torch.float64)
    branches, masks, weights = ONE_TOKEN
    tree = _rl_tree(branches, masks, weights)
    with_base = make_objective("grpo", kl_coef=0.2, reference="base")
    initial = make_objective("grpo", kl_coef=0.2, reference="initial")
    initial._ref_model = base  # the separate frozen base (no adapters)
    out = {}
    for key, obj in (("base", with_base), ("copy", initial)):
        loss = obj.tree_loss(ours, tree.to_batch(), aggregation="token-mean", normalizer=None, attention="sdpa_dense")[0]
        loss.backward()
        out[key] = (loss.item(), grads(ours, ""))
        value = treelit.tree_backward(ours, tree.to_batch(), "token-mean", "redundancy_free", 6,
                                      attention="sdpa_dense", objective=obj)
        out[key + "_part"] = (value, grads(ours, ""))
    for k in ("base", "base_part"):
        ref = out["copy" + k[4:]]
        assert abs(out[k][0] - ref[0]) <= 1e-12 * abs(ref[0]), k
        assert max_rel_grad_diff(out[k][1], ref[1], 1e-12, 0.0) <= 1e-12, k
    # and the adapters change the policy, so the KL term is not zero
    with torch.no_grad(), adapters_disabled(ours):
        b = ours(torch.tensor([branches[0]]))
    a = ours(torch.tensor([branches[0]]))
    assert (a - b).abs().max() > 1e-3


def test_export_loads_with_peft_and_merged_weights_with_transformers(tmp_path, tmp_path_factory):
    """The adapter folder loads with ``PeftModel.from_pretrained(base, DIR)`` and gives treelit's
    logits (float64, 1e-10); the merged weights load as a plain checkpoint and give them too."""
    from treelit.models.hf import save_hf_checkpoint

    path = checkpoint("qwen2", tmp_path_factory)
    ours, _ = models("qwen2", torch.float64, tmp_path_factory,
                     lora=dict(LORA, target_modules=["q_proj", "o_proj", "down_proj"], modules_to_save=["lm_head"]))
    save_adapter(ours, tmp_path / "adapter", base_model=str(path))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        with KeepFloat64():
            expected = ours(ids)
        base = load_hf_oracle(path, dtype=torch.float64, exact=True)
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
        with KeepFloat64():
            got = loaded(input_ids=ids).logits
        assert (got - expected).abs().max().item() <= 1e-10 * expected.abs().max().item()
        sd = merged_state_dict(ours, ours.state_dict())
        assert not any("lora" in k or "base_layer" in k or "modules_to_save" in k for k in sd)
        merged = treelit.load_hf_model(path, dtype=torch.float64)
        merged.load_state_dict(sd)
        save_hf_checkpoint(merged, tmp_path / "merged")
        back = load_hf_oracle(tmp_path / "merged", dtype=torch.float64, exact=True)
        with KeepFloat64():
            got = back(input_ids=ids).logits
        assert (got - expected).abs().max().item() <= 1e-10 * expected.abs().max().item()


@pytest.mark.parametrize("lora,message", [
    (dict(rank=0), "model.lora.rank must be a positive integer"),
    (dict(rank=-2), "model.lora.rank must be a positive integer"),
    (dict(rank=4, target_modules=["qq_proj"]), "'qq_proj' matches no module of this model; its linear layers"),
    (dict(rank=4, target_modules=["lm_head"]), "is the language-model head"),
    (dict(rank=4, target_modules=["input_layernorm"]), "which LoRA in tree mode cannot wrap"),
    (dict(rank=4, init="pissa"), "rewrites the base weights or needs data"),
    (dict(rank=4, init="kaiming"), "model.lora.init must be one of"),
    (dict(rank=4, ranks=3), "model.lora has no option 'ranks'"),
    (dict(rank=4, modules_to_save=["nothing_here"]), "modules_to_save: 'nothing_here' matches no module"),
])
def test_bad_lora_options_are_one_line_errors(lora, message, tmp_path_factory):
    path = checkpoint("qwen2", tmp_path_factory)
    from treelit.models.hf_adapter import make_hf_model

    with pytest.raises(ValueError) as err:
        make_hf_model(str(path), dtype="float64", lora=lora)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_target_matching_nothing_lists_only_what_can_be_targeted(tmp_path_factory):
    """The head is refused as a target: the list of linear layers leaves it out, and the embedding
    is named as an embedding, not as a linear layer."""
    from treelit.models.hf_adapter import make_hf_model

    with pytest.raises(ValueError) as err:
        make_hf_model(str(checkpoint("qwen2", tmp_path_factory)), dtype="float64",
                      lora=dict(rank=4, target_modules=["qq_proj"]))
    msg = str(err.value)
    linear = msg.split("its linear layers are named ")[1].split(";")[0]
    assert "q_proj" in linear and "lm_head" not in linear and "embed_tokens" not in linear, msg
    assert "lm_head" not in msg and "its embedding: embed_tokens" in msg, msg


def test_conv_layers_of_a_hybrid_are_refused(tmp_path_factory):
    """A short convolution's weight is read by the tree kernels: an adapter there would be bypassed."""
    from treelit.models.hf_adapter import make_hf_model

    with pytest.raises(ValueError, match="conv1d .*Conv1d.*cannot wrap"):
        make_hf_model(str(checkpoint("qwen3_5", tmp_path_factory)), dtype="float64",
                      lora=dict(rank=4, target_modules=["conv1d"]))


def test_dropout_is_refused_in_tree_mode_only():
    from helpers import tiny_model
    from treelit.models.lora import check_lora_mode

    model = apply_lora(tiny_model("qwen2_5_tiny", torch.float64), dict(LORA, dropout=0.1))
    check_lora_mode(model, "linear")
    with pytest.raises(ValueError, match="model.lora.dropout=0.1: in tree mode a shared token"):
        check_lora_mode(model, "tree")


def test_activation_checkpointing_with_lora_keeps_the_gradients(tmp_path_factory):
    """transformers' per-layer recomputation with PEFT layers inside: the same loss and adapter
    gradients as without it, and still none on the frozen base."""
    ours, _ = models("qwen3_5", torch.float64, tmp_path_factory)
    batch = treelit.TokenTree.from_branches(*ONE_TOKEN).to_batch()
    out = {}
    # (no KeepFloat64 here: the recomputation runs in autograd's thread, outside a function mode;
    # both passes round transformers' float32 upcasts alike)
    for on in (False, True):
        ours.activation_checkpointing = on
        loss = treelit.tree_loss(ours, batch, "token-mean", "sdpa_dense")
        loss.backward()
        out[on] = (loss.item(), grads(ours, ""))
    ours.activation_checkpointing = False
    assert abs(out[True][0] - out[False][0]) <= 1e-12 * abs(out[False][0])
    assert max_rel_grad_diff(out[True][1], out[False][1], 1e-12, 0.0) <= 1e-12
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)
