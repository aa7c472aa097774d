"""Decoders built from torchtune modules, with a forward pass that runs trees.

:class:`TreeDecoder` *is* a torchtune ``TransformerDecoder`` (same modules, same
parameter names as torchtune's own llama3.2 / qwen2 / mistral builders), so
torchtune checkpoints, recipes and its own ``forward`` keep working. What treelit
adds is :meth:`TreeDecoder.tree_hidden_states` (:func:`layers_hidden`), a forward over the
same modules that takes its attention (and recurrent-state routing) from a *sequence context*:

* :class:`~treelit.models.context.CausalContext` - independent causal rows
  (the linearized per-branch baseline);
* :class:`~treelit.models.context.TreeContext` - one DFS-serialized tree row,
  attention restricted to ancestors through a tree attention backend.

The layer arithmetic is written out here (rather than calling torchtune's
``MultiHeadAttention.forward``) for three reasons: the tree backend needs the
post-RoPE, un-expanded K/V; partitioning needs to inject and capture per-layer
K/V; and torchtune's RMSNorm and interleaved RoPE round through float32, which
would make float64 equivalence tests meaningless. For bf16/fp16 inputs the
norm and RoPE are computed in float32 exactly like torchtune does.

What the loss and partition passes call on a model (:func:`~treelit.models.forward.decoder_hidden`,
:func:`~treelit.models.forward.in_forward`, :func:`~treelit.models.forward.output_weight`) lives
in :mod:`treelit.models.forward`, which imports no torchtune (a transformers model's run never
loads it); they are re-exported here.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)

from treelit.models.config import DecoderConfig
from treelit.models.context import CausalContext
from treelit.models.forward import decoder_hidden, in_forward, output_weight
from treelit.models.moe import MoEFeedForward, record_pass
from treelit.models.rope import TreeRoPE, rotate
from treelit.ssm.layers import build_recurrent_layer
from treelit.utils.blocks import call_block
from treelit.utils.numerics import compute_dtype as _compute_dtype
from treelit.utils.numerics import equal_blocks
from treelit.utils.numerics import rms_norm

__all__ = ["TreeDecoder", "build_decoder", "decoder_hidden", "in_forward", "layers_hidden", "output_weight",
           "rope_style_of"]


class TreeDecoder(TransformerDecoder):
    """A torchtune ``TransformerDecoder`` that knows its :class:`DecoderConfig`."""

    def __init__(self, config: DecoderConfig) -> None:
        c = config
        rope = _make_rope(c)
        layers = nn.ModuleList()
        for i in range(c.num_layers):
            kind = c.layer_type(i)
            if kind == "attention":
                layers.append(_attention_layer(c, rope, i))
            else:
                layers.append(build_recurrent_layer(c, kind, i))
        tok = nn.Embedding(c.vocab_size, c.embed_dim)
        output = TiedLinear(tok) if c.tie_word_embeddings else nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        super().__init__(
            tok_embeddings=tok,
            layers=layers,
            max_seq_len=c.max_seq_len,
            num_heads=c.num_heads,
            head_dim=c.head_dim,
            norm=RMSNorm(c.embed_dim, eps=c.norm_eps),
            output=output,
        )
        self.config = c
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Hugging Face-style init: N(0, std) for linear and embedding weights, zero biases,
        unit norm scales. (torchtune leaves embeddings at N(0, 1), which makes tied heads
        produce huge logits.)"""
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=std)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.scale)
            elif hasattr(mod, "reset_tree_parameters"):
                mod.reset_tree_parameters(std)

    @property
    def vocab_size(self) -> int:
        return self.tok_embeddings.num_embeddings

    def tree_hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> torch.Tensor:
        """Final-norm hidden states ``[B, L, D]`` (:func:`layers_hidden`; see
        :func:`treelit.models.forward.decoder_hidden`)."""
        return layers_hidden(self, input_ids, position_ids, ctx)

    def forward(self, tokens=None, *, treelit_fn=None, **kwargs):
        """torchtune's forward, or - with ``treelit_fn`` - ``treelit_fn(self)`` run *inside* this
        module's forward. treelit's tree and per-branch passes go through here so that wrappers
        hooked on the forward (FSDP2's unshard/reshard and gradient reduction) see them.

        torchtune's arithmetic does not cover every model treelit builds (it normalises q/k
        after RoPE where Qwen3 does before, and knows no sliding window): those models compute
        ``tokens [B, L]`` -> logits with treelit's own causal forward, and refuse torchtune's
        extra arguments (masks, KV-cache positions)."""
        if treelit_fn is not None:
            return treelit_fn(self)
        c = self.config
        if c.qk_norm or c.sliding_window is not None:
            if kwargs:
                raise NotImplementedError(
                    f"torchtune's forward arguments {sorted(kwargs)} are not supported for this model "
                    "(q/k norms or sliding windows); call it with token ids only")
            B, L = tokens.shape
            pos = torch.arange(L, device=tokens.device).expand(B, L)
            return self.output(layers_hidden(self, tokens, pos, CausalContext()))
        return super().forward(tokens, **kwargs)


def build_decoder(config: Optional[DecoderConfig] = None, **overrides) -> TreeDecoder:
    """Build a randomly initialised :class:`TreeDecoder` from a config (or keyword overrides)."""
    if config is None:
        config = DecoderConfig(**overrides)
    elif overrides:
        config = DecoderConfig(**{**config.to_dict(), **overrides})
    return TreeDecoder(config)


def _make_rope(c: DecoderConfig) -> nn.Module:
    return TreeRoPE(c.head_dim, c.rope_base, c.rope_style, c.rope_scaling, max_positions=c.max_seq_len)


def _attention_layer(c: DecoderConfig, rope: nn.Module, index: int) -> TransformerSelfAttentionLayer:
    hd, bias = c.head_dim, bool(c.qkv_bias)
    attn = MultiHeadAttention(
        embed_dim=c.embed_dim,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=hd,
        q_proj=nn.Linear(c.embed_dim, c.num_heads * hd, bias=bias),
        k_proj=nn.Linear(c.embed_dim, c.num_kv_heads * hd, bias=bias),
        v_proj=nn.Linear(c.embed_dim, c.num_kv_heads * hd, bias=bias),
        output_proj=nn.Linear(c.num_heads * hd, c.embed_dim, bias=False),
        pos_embeddings=rope,
        q_norm=RMSNorm(hd, eps=c.norm_eps) if c.qk_norm else None,
        k_norm=RMSNorm(hd, eps=c.norm_eps) if c.qk_norm else None,
        max_seq_len=c.max_seq_len,
    )
    attn.sliding_window = c.window(index)  # tokens a query sees (itself included); None: all ancestors
    if c.is_moe_layer(index):
        m = c.moe
        mlp = MoEFeedForward(c.embed_dim, int(m["intermediate_dim"]), int(m["num_experts"]), int(m["top_k"]),
                             bool(m["norm_topk_prob"]), moe_index=sum(c.is_moe_layer(j) for j in range(index)),
                             replay=m.get("routing") == "replay")
    else:
        mlp = FeedForward(
            gate_proj=nn.Linear(c.embed_dim, c.intermediate_dim, bias=False),
            down_proj=nn.Linear(c.intermediate_dim, c.embed_dim, bias=False),
            up_proj=nn.Linear(c.embed_dim, c.intermediate_dim, bias=False),
        )
    return TransformerSelfAttentionLayer(
        attn=attn,
        mlp=mlp,
        sa_norm=RMSNorm(c.embed_dim, eps=c.norm_eps),
        mlp_norm=RMSNorm(c.embed_dim, eps=c.norm_eps),
    )


# ---------------------------------------------------------------------------------------
# numerics shared by every layer


def rope_style_of(rope: nn.Module) -> str:
    if isinstance(rope, TreeRoPE):
        return rope.style
    if isinstance(rope, Qwen2RotaryPositionalEmbeddings):
        return "half"
    if isinstance(rope, (RotaryPositionalEmbeddings, Llama3ScaledRoPE)):
        return "interleaved"
    raise TypeError(f"unsupported positional embedding module {type(rope).__name__}")


def apply_rope(rope: nn.Module, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` by positions ``pos [B, L]`` using ``rope``'s frequencies.

    Angles are formed in float64 from the module's ``theta`` so that float64 models are
    exact; the rotation runs in the input's precision (float32 for half types). The
    arithmetic is :func:`treelit.models.rope.rotate`; this picks the layout of ``rope``'s type.
    """
    return rotate(rope, x, pos, rope_style_of(rope))


def attention_inputs(attn: MultiHeadAttention, x: torch.Tensor, pos):
    """``(q, k, v)`` of ``x [B, L, D]`` as ``[B, heads, L, head_dim]``: the projections, the per-head
    RMSNorm of q and k (Qwen3) and RoPE at positions ``pos``."""
    B, L, _ = x.shape
    hd = attn.head_dim
    q = attn.q_proj(x).view(B, L, attn.num_heads, hd)
    k = attn.k_proj(x).view(B, L, attn.num_kv_heads, hd)
    v = attn.v_proj(x).view(B, L, attn.num_kv_heads, hd)
    if attn.q_norm is not None:  # per-head RMSNorm before RoPE (Qwen3)
        q = rms_norm(attn.q_norm, q)
    if attn.k_norm is not None:
        k = rms_norm(attn.k_norm, k)
    if attn.pos_embeddings is not None:
        q = apply_rope(attn.pos_embeddings, q, pos)
        k = apply_rope(attn.pos_embeddings, k, pos)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _attention_block(layer: TransformerSelfAttentionLayer, idx: int, x: torch.Tensor, pos, ctx) -> torch.Tensor:
    attn: MultiHeadAttention = layer.attn
    B, L, _ = x.shape
    o = ctx.attention(idx, *attention_inputs(attn, x, pos), window=getattr(attn, "sliding_window", None))
    return attn.output_proj(o.transpose(1, 2).reshape(B, L, attn.num_heads * attn.head_dim))


class _EmbedIntoBuffer(torch.autograd.Function):
    """Embedding lookup whose weight gradient is added into a shared buffer (no dense
    ``[V, D]`` gradient per pass; see ``ctx.embedding_grad_accumulator``)."""

    @staticmethod
    def forward(ctx, weight, ids, buffer):
        ctx.save_for_backward(ids)
        ctx.buffer = buffer
        return weight[ids]

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        ctx.buffer.index_add_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]).to(ctx.buffer.dtype))
        return None, None, None


def _embed(model, input_ids, ctx):
    buf = getattr(ctx, "embedding_grad_accumulator", None)
    if buf is not None and model.tok_embeddings.weight.requires_grad:
        return _EmbedIntoBuffer.apply(model.tok_embeddings.weight, input_ids, buf)
    return model.tok_embeddings(input_ids)


def layers_hidden(model: TransformerDecoder, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> torch.Tensor:
    """Final-norm hidden states ``[B, L, D]`` of a torchtune decoder ``model`` over ``input_ids [B, L]``,
    computed over its modules.

    ``ctx`` decides what each token sees (see :mod:`treelit.models.context`).
    Layers that are not torchtune self-attention layers must provide
    ``tree_forward(x, layer_index, ctx)`` (treelit's recurrent layers do).
    Each layer runs through its module call (:func:`~treelit.utils.blocks.call_block`), so
    hooks on it (FSDP2's per-block unshard/reshard and gradient reduction) see the pass;
    ``model.activation_checkpointing`` recomputes each layer in the backward;
    ``model.compiled_layers`` (:mod:`treelit.models.compiled`) runs attention layers compiled. Callers go
    through :func:`treelit.models.forward.decoder_hidden` (a model that runs its own layers,
    the transformers adapter, provides ``tree_hidden_states``).
    """
    ckpt = bool(getattr(model, "activation_checkpointing", False))
    guard = getattr(ctx, "oom_guard", None)
    h = _embed(model, input_ids, ctx)
    block = getattr(model, "mlp_token_block", None)
    extra = {} if block is None else {"mlp_block": block}  # None: _layer_forward's own default
    compiled = getattr(model, "compiled_layers", None)  # compile=true (treelit.models.compiled)
    for i, layer in enumerate(model.layers):
        if compiled is not None and compiled.takes(layer, ctx):
            body = functools.partial(compiled.forward, layer, i, position_ids, ctx)
        else:
            body = functools.partial(_layer_forward, layer, i, position_ids, ctx, **extra)
        h = call_block(layer, body, h, checkpoint=ckpt, oom_guard=guard)
    record_pass(model, ctx)  # router logits to an open router-loss collection, if any
    return rms_norm(model.norm, h)


# On CPU the MLP runs on blocks of tokens whose [tokens, intermediate] activations stay within
# 32 MiB. glibc maps every larger allocation afresh and unmaps it when freed (32 MiB is the
# most its adaptive threshold reaches), so each such activation of a long tree row costs a
# page fault per 4 KiB on every use (grpo_64x256 in benchmarks/bench_step.py: 4,614 tokens
# x 2,816 x 4 bytes = 52 MB). Smaller activations come from the heap; splitting them further
# only adds calls (per-branch micro-batches of ~1,950 tokens in 975-token blocks: 4% slower).
MLP_BLOCK_BYTES_CPU = 32 * 2**20


def mlp_rows_per_block(setting, tokens: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per MLP block for ``tokens`` rows (``tokens``: no blocking).

    ``setting`` is the model's ``mlp_token_block``: ``None`` (the default) blocks on CPU only,
    with each ``[block, intermediate]`` activation at most :data:`MLP_BLOCK_BYTES_CPU` and the
    blocks of equal size; ``0`` never blocks; a positive integer is the block size on any
    device. The MLP is per token, so every setting computes the same function."""
    if setting is None:
        if device.type != "cpu":
            return tokens
        cap = max(1, MLP_BLOCK_BYTES_CPU // max(1, intermediate * dtype.itemsize))
    else:
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
            raise ValueError(f"mlp_token_block must be None, 0 or a positive number of tokens, got {setting!r}")
        if setting == 0:
            return tokens
        cap = setting
    return equal_blocks(tokens, cap)


def _mlp(mlp: nn.Module, x: torch.Tensor, setting) -> torch.Tensor:
    """``mlp(x)`` over ``x [B, L, D]``, on blocks of tokens (:func:`mlp_rows_per_block`)."""
    B, L, D = x.shape
    w1 = getattr(mlp, "w1", None)
    intermediate = getattr(w1, "out_features", 4 * D)
    rows = mlp_rows_per_block(setting, B * L, intermediate, x.dtype, x.device)
    if rows >= B * L:
        return mlp(x)
    flat = x.reshape(B * L, D)
    return torch.cat([mlp(part) for part in flat.split(rows)]).view(B, L, -1)


def _layer_forward(layer: nn.Module, i: int, position_ids: torch.Tensor, ctx, h: torch.Tensor,
                   mlp_block=None) -> torch.Tensor:
    """Layer ``i`` over ``h [B, L, D]`` (run as the layer's forward by ``call_block``);
    ``mlp_block``: the model's ``mlp_token_block`` (:func:`mlp_rows_per_block`)."""
    if hasattr(layer, "tree_forward"):
        return layer.tree_forward(h, i, ctx)
    if isinstance(layer, TransformerSelfAttentionLayer):
        a = _attention_block(layer, i, rms_norm(layer.sa_norm, h), position_ids, ctx)
        h = h + layer.sa_scale(a)
        x = rms_norm(layer.mlp_norm, h)
        if isinstance(layer.mlp, MoEFeedForward):  # the router loss reads the logits from ctx
            replay = ctx.replay_experts(layer.mlp.moe_index, layer.mlp.top_k) if layer.mlp.replay else None
            m, logits = layer.mlp.route(x, replay)
            ctx.record_router(i, logits, replay)
            return h + layer.mlp_scale(m)
        return h + layer.mlp_scale(_mlp(layer.mlp, x, mlp_block))
    raise TypeError(f"layer {i} ({type(layer).__name__}) cannot run in tree mode")
