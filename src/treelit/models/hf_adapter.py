"""Any attention-only ``transformers`` causal LM in tree mode, without copying its modelling code.

transformers lets a library register an attention function (``AttentionInterface``); a
model loaded with ``attn_implementation="treelit"`` calls it in every attention layer with
the layer's post-RoPE queries and un-expanded keys/values ``[B, H, S, D]``, its scaling,
its sliding window, and any extra keyword handed to the model's forward. The adapter
hands the tree context through that keyword (``treelit_ctx``), so the registered function
simply asks the context to attend (:meth:`TreeContext.attention`): the same backends,
windows in depth units, external ancestor K/V and K/V capture for partitioning, GQA
without expanding K/V. Everything else - norms, RoPE, MLPs, MoE routing - is the family's
own code, run on depth positions. The forward always passes an explicit 4D placeholder
mask, so transformers never builds a mask or infers packed sequences from the position
resets a tree has; the attention function ignores it.

:class:`HFTreeModel` wraps the model so that treelit's entry points (``tree_loss``,
``linear_loss``, ``tree_backward``, the objectives, the trainer) run it like a native
decoder: the base model runs to its final hidden states and log-probs go through
treelit's chunked head (never the full ``[N, V]`` logits). For MoE families the router
logits come back from the base model and the router loss is treelit's tree-exact one
(:mod:`treelit.loss.router`), never transformers' own function on the tree row; it is the
Switch loss over softmax probabilities, so a router that picks experts by bias-corrected
sigmoid scores (Nemotron-H, Kimi-Linear: :func:`bias_routed`) refuses it rather than get a loss
of another routing.

Hybrid families (Gated DeltaNet, Kimi Delta Attention, Mamba2 and short-convolution layers;
``hf_kernels.HYBRID_FAMILIES``) run their recurrent layers through treelit's tree kernels,
bound per layer instance by :mod:`treelit.models.hf_kernels`; a Qwen3.5 checkpoint with a
vision tower loads its text model, as ``AutoModelForCausalLM`` does.

What cannot run exactly is refused at load time, naming the config key: other recurrent or
linear-attention families, sequence-length-dependent RoPE, attention sinks, logit
soft-capping, dropout, encoder-decoder and other multimodal models.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Union

import torch
from torch import nn

from treelit.models.config import LENGTH_DEPENDENT_ROPE
from treelit.models.context import CausalContext
from treelit.models.errors import CheckpointError
from treelit.models.factory import moe_routing, parse_dtype, set_moe_routing, set_router_aux_loss
from treelit.models.hf import read_config_json
from treelit.models.hf_files import check_weight_shapes, weight_files
from treelit.models.hf_kernels import HYBRID_FAMILIES, bind_tree_kernels, check_bound, no_hub_kernels
from treelit.models.hf_vision import VisionInputs, check_vision_config, tower_blocks, vision_inputs
from treelit.models.lora import apply_lora, lora_options
from treelit.models.hf_recompute import checkpoint_contexts
from treelit.models.hf_replay import ReplayBinding
from treelit.models.moe import record_pass

__all__ = ["ATTENTION_NAME", "HFTreeModel", "load_hf_model", "make_hf_model", "check_adapter_config"]

ATTENTION_NAME = "treelit"
_REGISTERED = False


def _treelit_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       sliding_window=None, **kwargs):
    """The attention function transformers calls in every layer (``[B, H, S, D]`` in, ``[B, S, H, D]`` out)."""
    ctx = kwargs.get("treelit_ctx")
    if ctx is None:
        raise RuntimeError("a model loaded with attn_implementation='treelit' runs inside treelit's passes only "
                           "(treelit.tree_loss, linear_loss, ...); load it with 'sdpa' for other uses")
    if dropout:
        raise ValueError(f"attention dropout {dropout} cannot run in tree mode")
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit soft-capping cannot run in tree mode")
    D = query.shape[-1]
    if scaling is not None and scaling != 1.0 / math.sqrt(D):
        query = query * (scaling * math.sqrt(D))  # the backends scale by 1/sqrt(D)
    out = ctx.attention(module.layer_idx, query, key, value, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface  # optional and heavy (~1.5 s CPU): Hugging Face paths only

        AttentionInterface.register(ATTENTION_NAME, _treelit_attention)
        _REGISTERED = True


# -- what the adapter refuses ----------------------------------------------------------------------
_RECURRENT_TYPES = {"linear_attention", "mamba", "mamba2", "gated_deltanet", "recurrent", "conv", "hybrid"}
_HYBRID_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid", "mlp", "moe"}


# multimodal checkpoints whose text model transformers' AutoModelForCausalLM loads on its own
_TEXT_MODEL_OF = {"qwen3_5", "qwen3_5_moe"}


def causal_lm_config(cfg):
    """The config of the model ``AutoModelForCausalLM`` builds from ``cfg``: the text model's for
    the multimodal checkpoints in ``_TEXT_MODEL_OF`` (their vision tower is not loaded)."""
    if getattr(cfg, "model_type", "") in _TEXT_MODEL_OF and getattr(cfg, "text_config", None) is not None:
        return cfg.text_config
    return cfg


def check_adapter_config(cfg, where: str = "config.json") -> None:
    """Raise :class:`~treelit.models.hf.CheckpointError` naming the key for what the adapter
    cannot run exactly."""
    cfg = causal_lm_config(cfg)

    def refuse(key, why):
        raise CheckpointError(f"{where}: config key {key!r} = {getattr(cfg, key, None)!r}: {why}")

    if getattr(cfg, "is_encoder_decoder", False):
        refuse("is_encoder_decoder", "encoder-decoder models are not supported (decoder-only causal LMs)")
    for key in ("vision_config", "audio_config", "text_config"):
        if getattr(cfg, key, None) is not None:
            refuse(key, "multimodal models are not supported; load the text model's checkpoint")
    mt = getattr(cfg, "model_type", "")
    hybrid = mt in HYBRID_FAMILIES  # recurrent layers through treelit's tree kernels (hf_kernels)
    if not hybrid and mt in ("mamba", "mamba2", "gated_deltanet", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2",
                             "bamba", "falcon_h1", "granitemoehybrid", "qwen3_next", "qwen3_5", "qwen3_5_text",
                             "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid", "nemotron_h", "kimi_linear", "lfm2",
                             "lfm2_moe", "recurrent_gemma", "xlstm"):
        refuse("model_type", "recurrent / linear-attention layers of this family have no tree-exact kernels yet "
                             f"(the adapter runs {sorted(HYBRID_FAMILIES)}; fla's Gated DeltaNet / Mamba2 "
                             "checkpoints load with treelit.load_hf_checkpoint)")
    types = set(getattr(cfg, "layer_types", None) or [])
    if types & _RECURRENT_TYPES and not hybrid:
        refuse("layer_types", "recurrent / linear-attention layers need treelit's native decoders")
    unknown = types - {"full_attention", "sliding_attention"} - (_HYBRID_LAYER_TYPES if hybrid else set())
    if unknown:
        refuse("layer_types", f"layer types {sorted(unknown)} are not supported")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    params = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    for p in params:
        kind = p.get("rope_type", p.get("type"))
        if kind in LENGTH_DEPENDENT_ROPE:
            refuse("rope_parameters", f"rope type {kind!r} depends on the sequence length: a tree and its branches "
                                      "would get different frequencies")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            refuse(key, "logit soft-capping is not implemented by treelit's attention backends / chunked head")
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
        if float(getattr(cfg, key, 0.0) or 0.0) > 0:
            refuse(key, "dropout draws one mask per tree token where per-branch training draws one per branch")
    if getattr(cfg, "use_bidirectional_attention", False):
        refuse("use_bidirectional_attention", "bidirectional attention is not causal")
    if mt in ("gpt_oss",) or getattr(cfg, "attention_sinks", None):
        refuse("model_type", "attention sinks are not implemented by treelit's attention backends")


@dataclass
class AdapterConfig:
    """What treelit's code reads of a model's config, for an adapted transformers model (its
    windows, RoPE and everything else are the transformers model's own)."""

    model_type: str
    vocab_size: int
    max_seq_len: int
    tie_word_embeddings: bool
    moe: Dict[str, Any] = field(default_factory=dict)  # the router loss options (MoE families)
    family: str = "hf_auto"

    def to_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _moe_options(cfg) -> Dict[str, Any]:
    k = getattr(cfg, "num_experts_per_tok", None)
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not k or not E:
        return {}
    coef = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    return {"num_experts": int(E), "top_k": int(k),
            "router_aux_loss_coef": coef if getattr(cfg, "output_router_logits", False) else 0.0,
            "router_aux_loss": "micro_batch", "routing": "live"}


def bias_routed(hf_model: nn.Module) -> Optional[str]:
    """Why treelit's router loss does not fit this model's routing, or None: a router that picks
    its experts by bias-corrected scores (``e_score_correction_bias``: the sigmoid routers of
    Nemotron-H, Kimi-Linear, DeepSeek-V3 and their kin, balanced without an auxiliary loss).
    treelit's router loss is the Switch load-balancing loss - the experts' share of each token's
    top-k of the softmax probabilities, times their mean probability - which is not a loss of
    that routing, and transformers defines none for it."""
    for mod in hf_model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            return (f"{type(mod).__name__} picks experts by bias-corrected scores (e_score_correction_bias); "
                    "treelit's router loss (the Switch load-balancing loss over softmax probabilities and their "
                    "top-k) is not a loss of this routing, and transformers defines none for it: set it to 0")
    return None


def head_is_embedding(hf_model: nn.Module) -> bool:
    """Whether the model's output layer is its input embedding (one tensor): what transformers
    actually tied, not what a config flag says. A vision-language config can say tied in its
    ``text_config`` (Qwen3-VL-MoE's text config defaults to it) while transformers ties by the
    top-level flag, and does not tie a checkpoint whose head and embedding differ."""
    head, emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    return head is not None and emb is not None and head.weight is emb.weight


class HFTreeModel(nn.Module):
    """A transformers causal LM (``attn_implementation="treelit"``) that treelit's passes run.

    ``hf`` is the wrapped ``*ForCausalLM``; its parameters keep transformers' names under
    the ``hf.`` prefix. ``tok_embeddings``, ``layers``, ``output`` and ``max_seq_len`` are
    what treelit's code reads of a decoder.
    """

    def __init__(self, hf_model: nn.Module, vision: Optional[VisionInputs] = None) -> None:
        super().__init__()
        self.hf = hf_model
        self.vision = vision  # a vision-language model's image inputs (treelit.models.hf_vision)
        cfg = hf_model.config if vision is None else hf_model.config.text_config
        self.config = AdapterConfig(
            model_type=cfg.model_type, vocab_size=int(cfg.vocab_size),
            max_seq_len=int(getattr(cfg, "max_position_embeddings", 0) or 2**31),
            tie_word_embeddings=head_is_embedding(hf_model), moe=_moe_options(cfg))
        self.activation_checkpointing = False
        self._checkpointing_on = False
        self._placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
        # the logit scaling the family's *ForCausalLM applies after its head (Granite: / logits_scaling,
        # Falcon-H1: * lm_head_multiplier), folded into the hidden states treelit's chunked head reads
        self._head_scale = (float(getattr(cfg, "lm_head_multiplier", 1.0) or 1.0)
                            / float(getattr(cfg, "logits_scaling", 1.0) or 1.0))
        self.hf.train()  # from_pretrained returns eval mode; dropout is refused, so the mode changes nothing
        self._router_refusal = bias_routed(hf_model) if self.config.moe else None
        # the layers bind_tree_kernels bound (checked before each tree forward: still bound?)
        self._bound_layers = [m for m in hf_model.modules() if hasattr(m, "_treelit_forward")]
        self._replay: Optional[ReplayBinding] = None  # moe.routing=replay: hooks on the routers

    def set_routing(self, routing: str) -> None:
        """``live`` (the routers' own top-k) or ``replay`` (each pass's recorded experts)."""
        if routing == "replay" and self._replay is None:
            self._replay = ReplayBinding(self.hf, self.config.moe["num_experts"], self.config.moe["top_k"])
        elif routing == "live" and self._replay is not None:
            self._replay.remove()
            self._replay = None
        self.config.moe["routing"] = routing

    @property
    def base(self) -> nn.Module:
        if self.vision is not None:
            return self.vision.language_model
        return self.hf.get_decoder() if hasattr(self.hf, "get_decoder") else self.hf.model

    @property
    def tok_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    @property
    def output(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    @property
    def layers(self) -> nn.ModuleList:
        return self.base.layers

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def fsdp_blocks(self) -> list:
        """FSDP2's units (:func:`~treelit.utils.distributed.shard_model`): the decoder's layers and,
        with a vision tower, the tower's blocks, sharded alike (docs/distributed.md, "Images")."""
        blocks = list(self.layers)
        if self.vision is not None:
            blocks += tower_blocks(self.vision.visual)
        return blocks

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def tree_hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> torch.Tensor:
        """Final-norm hidden states ``[B, L, D]`` (see :func:`treelit.models.decoder.decoder_hidden`)."""
        if self.activation_checkpointing != self._checkpointing_on:  # transformers' own, per layer
            # transformers 5.x names it activation_checkpointing_*; older releases gradient_checkpointing_*
            kind = "activation" if hasattr(self.hf, "activation_checkpointing_enable") else "gradient"
            if self.activation_checkpointing:  # a recomputed layer sees its forward's pass (hf_recompute)
                getattr(self.hf, f"{kind}_checkpointing_enable")(
                    {"use_reentrant": False, "context_fn": self._recompute_contexts})
            else:
                getattr(self.hf, f"{kind}_checkpointing_disable")()
            self._checkpointing_on = self.activation_checkpointing
        if self._router_refusal and self.config.moe.get("router_aux_loss_coef", 0.0) > 0:
            raise ValueError(f"router_aux_loss_coef = {self.config.moe['router_aux_loss_coef']}: "
                             f"{self._router_refusal}")
        check_bound(self._bound_layers)
        kw = {"output_router_logits": True} if self.config.moe else {}
        replay = self._replay
        if replay is not None:
            replay.ctx = ctx
        kw.update(self._base_inputs(input_ids, position_ids, ctx))
        try:
            out = self.base(use_cache=False, attention_mask=self._placeholder_mask.to(input_ids.device),
                            treelit_ctx=ctx, **kw)
        finally:
            if replay is not None:
                replay.unwind()
                replay.ctx = None
        logits = getattr(out, "router_logits", None)
        if self.config.moe and logits:
            k = self.config.moe["top_k"]
            for i, x in enumerate(logits):
                ctx.record_router(i, x, ctx.replay_experts(i, k) if replay is not None else None)
            record_pass(self, ctx)
        if self._head_scale != 1.0:  # logits = lm_head(h) * scale, and the head is linear without bias
            return out.last_hidden_state * self._head_scale
        return out.last_hidden_state

    def _recompute_contexts(self):
        """The checkpoint's ``context_fn`` (a bound method: a deep copy of the model binds its own)."""
        return checkpoint_contexts(self._replay)

    def _base_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> Dict[str, Any]:
        """What the base model reads besides the mask and the tree context (a vision model
        adds its image embeddings and multimodal positions: :mod:`treelit.models.hf_vision`)."""
        if self.vision is not None:
            return self.vision.base_inputs(input_ids, position_ids, ctx)
        return {"input_ids": input_ids, "position_ids": position_ids}

    def forward(self, tokens=None, *, treelit_fn=None, **kwargs):
        """``treelit_fn(self)`` run inside this module's forward (treelit's passes; hooks on the
        module see them), or logits ``[B, L, V]`` of causal rows ``tokens [B, L]``."""
        if treelit_fn is not None:
            return treelit_fn(self)
        B, L = tokens.shape
        pos = torch.arange(L, device=tokens.device).expand(B, L)
        return self.output(self.tree_hidden_states(tokens, pos, CausalContext()))

    def save_pretrained(self, path: Union[str, os.PathLike], state_dict: Optional[Dict[str, torch.Tensor]] = None,
                        max_shard_size: Union[int, str] = "5GB") -> Path:
        """The wrapped model's checkpoint (transformers' own format and names)."""
        if state_dict is not None:
            state_dict = {k[len("hf."):] if k.startswith("hf.") else k: v for k, v in state_dict.items()}
            if self.config.tie_word_embeddings:
                # a tied head is the embedding: transformers writes it once only when the two entries share
                # storage, which a cast (publish dtype) or a cloned (gathered) state dict no longer does
                names = {id(m): n for n, m in self.hf.named_modules(remove_duplicate=False)}
                head, emb = names.get(id(self.output)), names.get(id(self.tok_embeddings))
                if head is not None and emb is not None and head != emb and f"{emb}.weight" in state_dict:
                    state_dict.pop(f"{head}.weight", None)
        self.hf.save_pretrained(str(path), state_dict=state_dict, max_shard_size=max_shard_size)
        for f in Path(path).glob("*.safetensors"):
            os.chmod(f, 0o666 & ~_umask())
        return Path(path)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


@contextlib.contextmanager
def _quiet_fla_import() -> Iterator[None]:
    """transformers' hybrid families (Qwen3.5, Qwen3-Next, ...) import fla when it is installed (the
    ``test`` extra installs it: its naive recurrences are test oracles), and fla, imported on a
    machine without a Triton backend, warns "Triton is not supported on current platform, roll back
    to CPU". treelit runs those layers through its own tree kernels (:mod:`treelit.models.hf_kernels`;
    fla's only with ``ssm=fla`` on CUDA, where the warning does not arise), so nothing rolls back:
    that one warning is dropped, others pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        yield


def load_hf_model(path: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = torch.float32,
                  device: Union[str, torch.device] = "cpu", router_loss_set: bool = False, vision: bool = False,
                  freeze_vision: bool = False, vision_images_per_pass: int = 0) -> HFTreeModel:
    """A Hugging Face checkpoint directory as an :class:`HFTreeModel` (any attention-only
    ``AutoModelForCausalLM`` family). Same conventions as :func:`treelit.load_hf_checkpoint`.
    ``router_loss_set``: the caller sets the router loss itself (``model.router_aux_loss_coef``), so
    config.json's is not checked here. ``vision``: load a vision-language checkpoint with its
    vision tower (:class:`~treelit.models.hf_vision.VisionInputs`; ``freeze_vision``: the
    tower does not train; ``vision_images_per_pass``: the tower runs that many images at a time,
    recomputed in the backward, 0: all at once); without it such a checkpoint loads its text model
    or is refused."""
    import transformers  # optional and heavy (~1.5 s CPU): Hugging Face paths only

    path = Path(path)
    raw, cfg_file = read_config_json(path)
    from huggingface_hub.errors import StrictDataclassError  # with transformers (HF paths): its validators raise it

    try:  # never the checkpoint's own Python code (auto_map)
        cfg = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError, StrictDataclassError) as exc:
        if "trust_remote_code" in str(exc):
            raise CheckpointError(f"{cfg_file}: the checkpoint needs its own Python code (auto_map); treelit never "
                                  "runs code from a checkpoint (trust_remote_code=False)") from None
        raise CheckpointError(f"{cfg_file}: {' '.join(str(exc).split())}") from None
    if vision:
        check_vision_config(cfg, str(cfg_file))
        check_adapter_config(cfg.text_config, str(cfg_file))
    else:
        check_adapter_config(cfg, str(cfg_file))
    # shard names stay inside the directory, sizes agree with the weights' headers: before allocating
    check_weight_shapes(raw, weight_files(path)[0], cfg_file)
    register_attention()
    kwargs: Dict[str, Any] = {"attn_implementation": ATTENTION_NAME, **no_hub_kernels()}
    auto = transformers.AutoModelForCausalLM
    if vision:  # the tower attends within each image on its own (sdpa); the text model through the tree
        kwargs["attn_implementation"] = {"text_config": ATTENTION_NAME, "vision_config": "sdpa", "": "sdpa"}
        auto = transformers.AutoModelForImageTextToText
        cfg = cfg.text_config
    else:
        cfg = causal_lm_config(cfg)
    if _moe_options(cfg) or getattr(cfg, "num_experts_per_tok", None):
        kwargs["experts_implementation"] = "eager"  # grouped_mm has no float64 / CPU-portable kernel
    try:
        with _quiet_fla_import():
            hf = auto.from_pretrained(path, dtype=dtype, trust_remote_code=False, **kwargs)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path}: transformers cannot load it as a causal LM ({exc})") from None
    if getattr(hf.get_output_embeddings(), "bias", None) is not None:
        raise CheckpointError(f"{path}: a language-model head with a bias is not supported")
    if dtype is not None:
        hf = hf.to(dtype)  # parameters some families keep in float32 follow the requested dtype
    if cfg.model_type in HYBRID_FAMILIES:
        try:  # the hybrid layers' kernel entry points -> treelit's tree kernels (never fla's)
            bound = bind_tree_kernels(hf)
        except (NotImplementedError, RuntimeError) as exc:
            raise CheckpointError(f"{cfg_file}: config key 'model_type' = {cfg.model_type!r}: {exc}") from None
        recurrent = set(getattr(cfg, "layer_types", None) or ["?"]) - {"full_attention", "sliding_attention"}
        if not bound and recurrent:  # this transformers release no longer calls the entry points by name
            raise CheckpointError(f"{cfg_file}: config key 'model_type' = {cfg.model_type!r}: no layer of this "
                                  f"transformers {transformers.__version__} model calls a kernel entry point "
                                  "treelit can replace; its recurrent layers cannot run in tree mode")
    parts = vision_inputs(hf, freeze_vision, vision_images_per_pass) if vision else None
    model = HFTreeModel(hf, parts).to(device)
    coef = model.config.moe.get("router_aux_loss_coef", 0.0)
    if model._router_refusal and coef > 0 and not router_loss_set:
        raise CheckpointError(f"{cfg_file}: config key 'router_aux_loss_coef' = {coef} (with output_router_logits): "
                              f"{model._router_refusal}")
    return model


def make_hf_model(hf_checkpoint: str, dtype: str = "float32", router_aux_loss_coef: Optional[float] = None,
                  router_aux_loss: Optional[str] = None, activation_checkpointing: bool = False,
                  lora: Optional[Dict[str, Any]] = None, moe: Optional[Dict[str, Any]] = None, vision: bool = False,
                  freeze_vision: bool = False, vision_images_per_pass: int = 0) -> HFTreeModel:
    """The ``model=hf_auto`` config option (``activation_checkpointing``: transformers' own,
    per layer, non-reentrant; ``lora``: PEFT LoRA adapters, :mod:`treelit.models.lora`;
    ``moe.routing``: ``live`` or ``replay``, see :func:`treelit.models.factory.set_moe_routing`;
    ``vision`` / ``freeze_vision``: a vision-language checkpoint with its tower, see
    :mod:`treelit.models.hf_vision`)."""
    if not hf_checkpoint:
        raise ValueError("model=hf_auto needs model.hf_checkpoint=DIR (a Hugging Face checkpoint directory)")
    opts = lora_options(lora)  # bad options fail before the weights load
    if (freeze_vision or vision_images_per_pass) and not vision:
        raise ValueError(f"model.{'freeze_vision' if freeze_vision else 'vision_images_per_pass'} needs model.vision=true "
                         "(a checkpoint loaded with its vision tower)")
    model = load_hf_model(hf_checkpoint, dtype=parse_dtype(dtype), router_loss_set=router_aux_loss_coef is not None,
                          vision=bool(vision), freeze_vision=bool(freeze_vision),
                          vision_images_per_pass=vision_images_per_pass)
    set_router_aux_loss(model, router_aux_loss_coef, router_aux_loss)
    if model._router_refusal and model.config.moe.get("router_aux_loss_coef", 0.0) > 0:
        raise ValueError(f"model.router_aux_loss_coef={router_aux_loss_coef}: {model._router_refusal}")
    model.activation_checkpointing = bool(activation_checkpointing)
    set_moe_routing(model, moe_routing(moe))
    return apply_lora(model, opts)
