"""Tree-exact recurrent layers (Gated DeltaNet, Mamba2) and their backends (registry kind ``ssm``).

Backends: ``torch`` (pure PyTorch, any device, exact; the scan runs in blocks of
``chunk_size`` tokens, 1 = token by token, the reference) and ``fla``
(flash-linear-attention's Triton kernels, CUDA only, one varlen call per segment
depth level with per-segment initial states).
"""

import torch

from treelit.registry import get_registry

SSM_BACKENDS = get_registry("ssm", ["treelit.ssm"])
SSM_BACKENDS.register("torch", "torch")
SSM_BACKENDS.register("fla", "fla")


def set_ssm_backend(model, name: str = "torch", chunk_size: int = 64):
    """Route every recurrent layer of ``model`` through backend ``name``; returns the model.

    ``chunk_size`` (``torch`` backend): tokens per block of the chunked scan; 1 steps token
    by token (the reference recurrence). Both are exact; blocks are much faster on CPU.
    """
    SSM_BACKENDS.get(name)
    if int(chunk_size) < 1:
        raise ValueError(f"ssm.chunk_size must be >= 1, got {chunk_size}")
    hybrid = [m for m in model.modules() if hasattr(m, "_treelit_forward")]  # transformers' layers (hf_kernels)
    if hybrid and name != "torch":
        raise ValueError(f"ssm={name} is not available for transformers' hybrid layers "
                         f"({type(hybrid[0]).__name__}); they run on treelit's torch scans: use ssm=torch")
    for mod in hybrid:
        mod._treelit_chunk_size = int(chunk_size)
    if name == "fla":
        if not torch.cuda.is_available():
            raise ValueError("ssm=fla needs CUDA (fla's Triton kernels); use ssm=torch on this machine")
        try:
            import fla  # noqa: F401  (optional, treelit[cuda]: checked only for ssm=fla)
        except ImportError as exc:
            raise ValueError("ssm=fla needs flash-linear-attention: pip install 'treelit[cuda]'") from exc
    for mod in model.modules():
        if hasattr(mod, "backend") and hasattr(mod, "reset_tree_parameters"):
            mod.backend = name
            mod.chunk_size = int(chunk_size)
    return model


__all__ = ["SSM_BACKENDS", "set_ssm_backend"]
