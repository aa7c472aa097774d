"""Models: torchtune decoders that run in tree mode, presets, and Hugging Face I/O."""

from treelit.models.config import DecoderConfig
from treelit.models.decoder import TreeDecoder, build_decoder
from treelit.models.hf import load_hf_checkpoint, save_hf_checkpoint
from treelit.models.registry import MODELS, build_model

__all__ = ["DecoderConfig", "TreeDecoder", "build_decoder", "build_model", "MODELS", "load_hf_checkpoint", "save_hf_checkpoint"]
