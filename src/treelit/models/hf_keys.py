"""Every ``config.json`` key of a supported family, and what treelit does with it.

A checkpoint key that changes the model's function but is not applied trains the
wrong model without an error, the worst failure a tree trainer can have. So each
key of each supported family is declared here in exactly one of three ways:

* **implemented**: read by the loader and applied (covered by the equivalence tests);
* **refused**: applied only in its neutral setting; any value that would change the
  math raises :class:`~treelit.models.hf.CheckpointError` at load time, naming the key
  (an implemented key may also carry such a check for the values it cannot apply);
* **ignored**: irrelevant to training (token ids, cache flags, initialisation ranges,
  kernel selection, bookkeeping).

``tests/models/test_hf_keys.py`` walks every key of each family's configuration
class in the installed ``transformers`` / ``fla`` and fails on a key that is in none of
the three sets, so a new release that adds a key fails until someone classifies it.
Keys of a checkpoint that no family declares are kept on save and reported once
at load with a warning.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

from treelit.models.errors import CheckpointError

log = logging.getLogger(__name__)

__all__ = ["FAMILY_KEYS", "IGNORED", "check_config_keys", "classify", "effective_windows"]

# Irrelevant to training in every family.
IGNORED = frozenset({
    "_name_or_path", "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "dtype", "torch_dtype", "transformers_version", "use_cache", "id2label", "label2id",
    "output_attentions", "output_hidden_states", "return_dict", "problem_type", "is_encoder_decoder",
    "initializer_range", "tokenizer_class", "treelit", "task_specific_params", "finetuning_task", "prefix",
    "chunk_size_feed_forward",  # transformers' feed-forward chunking: the same function, in slices
    "pretraining_tp",  # tensor-parallel slicing of Llama's projections: the same function
})

Check = Callable[[Any, Dict[str, Any]], Optional[str]]


def _must_be(neutral: Any, why: str) -> Check:
    def check(value: Any, cfg: Dict[str, Any]) -> Optional[str]:
        return None if value == neutral or (neutral is False and value is None) else why

    return check


def _no_dropout(value: Any, cfg: Dict[str, Any]) -> Optional[str]:
    if value in (None, 0, 0.0):
        return None
    return ("dropout draws one mask per tree token where per-branch training draws one per branch, so tree mode "
            "cannot reproduce it; set it to 0")


def _silu(value: Any, cfg: Dict[str, Any]) -> Optional[str]:
    return None if value in (None, "silu", "swish") else f"activation {value!r} is not supported (silu only)"


def effective_windows(cfg: Dict[str, Any]) -> List[Optional[int]]:
    """The sliding window of each layer as transformers applies it (None = full attention).

    Mistral applies ``sliding_window`` to every layer. Qwen2/Qwen3(-MoE) apply it only when
    ``use_sliding_window`` is true: Qwen2/Qwen3 to the layers marked ``sliding_attention`` in
    ``layer_types`` (by default the layers at or above ``max_window_layers``), Qwen3-MoE to
    every layer.
    """
    n = int(cfg.get("num_hidden_layers", 0))
    mt = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if mt in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return [None] * n
    if mt in ("mistral", "qwen3_moe"):  # every layer (Qwen3-MoE ignores max_window_layers)
        return [int(window)] * n
    types = cfg.get("layer_types")
    if not types:
        start = int(cfg.get("max_window_layers", 0) or 0)
        return [int(window) if i >= start else None for i in range(n)]
    return [int(window) if t == "sliding_attention" else None for t in types]


def _layer_types(value: Any, cfg: Dict[str, Any]) -> Optional[str]:
    kinds = set(value or []) - {"full_attention", "sliding_attention"}
    return None if not kinds else f"layer types {sorted(kinds)} are not supported (full_attention, sliding_attention)"


_ATTENTION_FAMILY = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings",
}
_WINDOWS = {"sliding_window", "use_sliding_window", "max_window_layers"}
_MOE = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"}
_BIAS = "q/k/v/o projection biases are not supported for this family"
_QWEN = {"hidden_act": _silu, "attention_dropout": _no_dropout, "layer_types": _layer_types}

FAMILY_KEYS: Dict[str, Dict[str, Any]] = {
    "llama": {
        "implemented": _ATTENTION_FAMILY,
        "refused": {"hidden_act": _silu, "attention_bias": _must_be(False, _BIAS),
                    "mlp_bias": _must_be(False, "MLP biases are not supported"), "attention_dropout": _no_dropout},
    },
    "mistral": {
        "implemented": _ATTENTION_FAMILY | {"sliding_window"},
        "refused": {"hidden_act": _silu, "attention_bias": _must_be(False, _BIAS), "attention_dropout": _no_dropout,
                    "mlp_bias": _must_be(False, "MLP biases are not supported")},
    },
    "qwen2": {"implemented": _ATTENTION_FAMILY | _WINDOWS | {"layer_types"}, "refused": dict(_QWEN)},
    "qwen3": {
        "implemented": _ATTENTION_FAMILY | _WINDOWS | {"layer_types"},
        "refused": {**_QWEN, "attention_bias": _must_be(False, _BIAS)},
    },
    "qwen3_moe": {
        "implemented": _ATTENTION_FAMILY | {"sliding_window", "use_sliding_window"} | _MOE,
        "refused": {**_QWEN, "attention_bias": _must_be(False, _BIAS)},
        # transformers' Qwen3-MoE applies the window to every layer whatever max_window_layers says
        "ignored": {"max_window_layers"},
    },
    "gated_deltanet": {
        "implemented": {
            "vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "tie_word_embeddings",
            "head_dim", "num_heads", "num_v_heads", "expand_v", "use_gate", "use_short_conv", "allow_neg_eigval",
            "conv_size", "output_gate_activation", "intermediate_size", "hidden_ratio", "norm_eps", "attn",
        },
        "refused": {
            "hidden_act": _silu,
            "use_l2warp": _must_be(False, "the l2-warp logit regulariser is not applied in tree mode"),
            "attnres_block_size": _must_be(None, "attention residuals (attnres) are not supported"),
        },
        # fused kernels computing the same function, and the kernel mode
        "ignored": {"attn_mode", "fuse_cross_entropy", "fuse_linear_cross_entropy", "fuse_norm", "fuse_swiglu"},
    },
    "mamba2": {
        "implemented": {
            "vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "tie_word_embeddings",
            "head_dim", "num_heads", "state_size", "expand", "n_groups", "conv_kernel", "use_conv_bias", "use_bias",
            "D_has_hdim", "rmsnorm", "norm_before_gate", "norm_eps", "dt_limit",
        },
        "refused": {
            "hidden_act": _silu,
            "use_l2warp": _must_be(False, "the l2-warp logit regulariser is not applied in tree mode"),
        },
        # initialisation, kernel chunking, fused kernels, and the residual's storage precision
        # (float32 and float64 models keep the residual in their own precision either way)
        "ignored": {"A_init_range", "dt_init_floor", "dt_max", "dt_min", "conv_init", "rescale_prenorm_residual",
                    "chunk_size", "fuse_cross_entropy", "fuse_linear_cross_entropy", "fuse_norm",
                    "residual_in_fp32"},
    },
}


def classify(model_type: str, key: str) -> Optional[str]:
    """``implemented``, ``refused``, ``ignored``, or None (unknown) for ``key`` of ``model_type``."""
    fam = FAMILY_KEYS[model_type]
    if key in fam["implemented"]:  # (it may also have a value check in "refused")
        return "implemented"
    if key in fam["refused"]:
        return "refused"
    if key in IGNORED or key in fam.get("ignored", ()):
        return "ignored"
    return None


_WARNED: set = set()


def check_config_keys(cfg: Dict[str, Any], where: str, max_seq_len: Optional[int] = None) -> None:
    """Raise for every refused key whose value changes the math; warn once about unknown keys."""

    mt = cfg.get("model_type")
    if mt not in FAMILY_KEYS:
        return
    view = dict(cfg, _treelit_max_seq_len=max_seq_len)
    refused = FAMILY_KEYS[mt]["refused"]
    done = set()
    for key, check in refused.items():
        if key not in cfg or check in done:
            continue
        done.add(check)
        why = check(cfg[key], view)
        if why:
            keys = [k for k, c in refused.items() if c is check and k in cfg]  # keys one check reads together
            named = ", ".join(f"{k!r} = {cfg[k]!r}" for k in keys)
            raise CheckpointError(f"{where}: config key{'s' if len(keys) > 1 else ''} {named}: {why}")
    unknown = sorted(k for k in cfg if classify(mt, k) is None)
    if unknown and (mt, tuple(unknown)) not in _WARNED:
        _WARNED.add((mt, tuple(unknown)))
        log.warning("%s: config keys %s are not known for model_type %r; they are kept on save but not applied",
                    where, ", ".join(unknown), mt)


EMBED_KEYS = ("model.embed_tokens.weight", "backbone.embeddings.weight", "backbone.embedding.weight")


def untie_distinct_head(config, sd: Dict[str, Any], where: str) -> None:
    """A checkpoint whose config says tied (``tie_word_embeddings``) but whose weights hold an
    ``lm_head.weight`` unequal to the embedding: transformers (5.x) then does not tie them and
    keeps the head it read; so does treelit (``config.tie_word_embeddings`` becomes False)."""
    head = sd.get("lm_head.weight")
    emb = next((sd[k] for k in EMBED_KEYS if k in sd), None)
    if not config.tie_word_embeddings or head is None or emb is None:
        return
    if head.shape == emb.shape and bool((head == emb).all()):
        return
    log.warning("%s: tie_word_embeddings is true but lm_head.weight differs from the embedding: loaded "
                "untied (as transformers does); set tie_word_embeddings=false in config.json", where)
    config.tie_word_embeddings = False
