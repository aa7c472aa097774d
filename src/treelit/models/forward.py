"""What treelit's passes call on a model, without importing torchtune.

The loss primitives and the partition engine run every model the same way: inside its
forward (:func:`in_forward`), the final-norm hidden states of a sequence context
(:func:`decoder_hidden`), then the language-model head's weight (:func:`output_weight`).
They dispatch on what a model provides, not on its class, so importing them costs no
model library: a run of a transformers model (``model=hf_auto``) never loads torchtune
(and with it torchao and datasets). A model provides ``tree_hidden_states(input_ids,
position_ids, ctx)`` - treelit's :class:`~treelit.models.decoder.TreeDecoder` over
torchtune's modules, the transformers adapter over transformers' - and a forward that
takes ``treelit_fn``.

Another torchtune ``TransformerDecoder`` (one built by torchtune's own builders) is run
over its modules by the same arithmetic as :class:`TreeDecoder`, reached through the
package face (torchtune is loaded already when such a model exists).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from treelit import models  # the package face: the decoder (torchtune) only for a model that is not treelit's

__all__ = ["decoder_hidden", "in_forward", "output_weight"]


def decoder_hidden(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> torch.Tensor:
    """Final-norm hidden states ``[B, L, D]`` of ``model`` over ``input_ids [B, L]`` at
    ``position_ids [B, L]``.

    ``ctx`` decides what each token sees (see :mod:`treelit.models.context`): independent
    causal rows, or one DFS-serialized tree row attending to its ancestors. A model runs
    its own layers through ``tree_hidden_states``; any other torchtune decoder runs over
    its modules (:func:`treelit.models.decoder.layers_hidden`).
    """
    own = getattr(model, "tree_hidden_states", None)
    if own is not None:
        return own(input_ids, position_ids, ctx)
    return models.layers_hidden(model, input_ids, position_ids, ctx)


def in_forward(model: nn.Module, fn):
    """Run ``fn(model)`` inside ``model``'s forward when it supports that (a model with
    ``tree_hidden_states``, or a wrapper whose ``module`` is one: see ``TreeDecoder.forward``),
    so that hooks on the forward (FSDP2's unshard/reshard and gradient reduction) see the pass."""
    if hasattr(model, "tree_hidden_states") or hasattr(getattr(model, "module", None), "config"):
        return model(treelit_fn=fn)
    return fn(model)


def output_weight(model: nn.Module) -> torch.Tensor:
    """The ``[V, D]`` weight of the language-model head (tied or not)."""
    out = model.output
    if hasattr(out, "modules_to_save") and hasattr(out, "original_module"):  # PEFT's trained copy (LoRA)
        out = out.original_module if out.disable_adapters or not out.active_adapters else \
            out.modules_to_save[out.active_adapters[0]]
    # torchtune's tied head; where torchtune.modules was never imported, no model holds one
    tied = getattr(sys.modules.get("torchtune.modules"), "TiedLinear", None)
    if tied is not None and isinstance(out, tied):
        return out.tied_module.weight
    if isinstance(out, nn.Linear):
        if out.bias is not None:
            raise NotImplementedError("an output projection with bias is not supported")
        return out.weight
    raise TypeError(f"unsupported output projection {type(out).__name__}")
