"""Models: torchtune decoders that run in tree mode, presets, and Hugging Face I/O.

The names below are imported on first use (:mod:`treelit.lazy`): ``treelit.models.config``
or the model registry do not load torchtune (and with it torchao and datasets); only
building or loading a decoder does.
"""

from typing import TYPE_CHECKING

from treelit.lazy import lazy_exports

if TYPE_CHECKING:
    from treelit.models.compiled import compile_layers
    from treelit.models.config import DecoderConfig
    from treelit.models.decoder import TreeDecoder, build_decoder
    from treelit.models.hf import load_hf_checkpoint, save_hf_checkpoint
    from treelit.models.registry import MODELS, build_model

_EXPORTS = {
    "compile_layers": "treelit.models.compiled",
    "DecoderConfig": "treelit.models.config",
    "TreeDecoder": "treelit.models.decoder",
    "build_decoder": "treelit.models.decoder",
    "layers_hidden": "treelit.models.decoder",  # treelit.models.forward runs a torchtune builder's decoder with it
    "load_hf_checkpoint": "treelit.models.hf",
    "save_hf_checkpoint": "treelit.models.hf",
    "MODELS": "treelit.models.registry",
    "build_model": "treelit.models.registry",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["compile_layers", "DecoderConfig", "TreeDecoder", "build_decoder", "build_model", "MODELS", "load_hf_checkpoint", "save_hf_checkpoint"]
