"""Tree-exact recurrent layers (Gated DeltaNet, Mamba2) and their backends (registry kind ``ssm``).

Backends: ``torch`` (pure PyTorch, any device, exact; the scan runs in blocks of
``chunk_size`` tokens, 1 = token by token, the reference) and ``fla``
(flash-linear-attention's Triton kernels - and mamba-ssm's for the Mamba2 mixers of
transformers' hybrids - CUDA only, one varlen call per segment depth level with
per-segment initial states). Both apply to treelit's native layers and to the hybrid
layers the transformers adapter binds (``models/hf_kernels.py``).
"""

import torch

from treelit.registry import get_registry
from treelit.ssm import fla_backend

# the CUDA kernel (ssm=fla) behind each entry point of transformers' hybrid layers (models/hf_kernels.py)
_HYBRID_CUDA = {"chunk_gated_delta_rule": "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule":
                "chunk_gated_delta_rule", "chunk_kda": "chunk_kda", "fused_recurrent_kda": "chunk_kda",
                "mamba_chunk_scan_combined": "mamba_chunk_scan_combined"}

SSM_BACKENDS = get_registry("ssm", ["treelit.ssm"])
SSM_BACKENDS.register("torch", "torch")
SSM_BACKENDS.register("fla", "fla")


def set_ssm_backend(model, name: str = "torch", chunk_size: int = 64):
    """Route every recurrent layer of ``model`` through backend ``name``; returns the model.

    ``chunk_size`` (``torch`` backend): tokens per block of the chunked scan; 1 steps token
    by token (the reference recurrence). Both are exact; blocks are much faster on CPU.
    ``fla`` needs CUDA and the kernels' packages (checked here, each missing one named).
    """
    SSM_BACKENDS.get(name)
    if int(chunk_size) < 1:
        raise ValueError(f"ssm.chunk_size must be >= 1, got {chunk_size}")
    hybrid = [m for m in model.modules() if hasattr(m, "_treelit_forward")]  # transformers' layers (hf_kernels)
    if name == "fla":
        if not torch.cuda.is_available():
            raise ValueError("ssm=fla needs CUDA (fla's Triton kernels); use ssm=torch on this machine")
        needed = {_HYBRID_CUDA[k] for m in hybrid for k in getattr(m, "_treelit_kernels", ()) if k in _HYBRID_CUDA}
        native = any(hasattr(m, "backend") and hasattr(m, "reset_tree_parameters") for m in model.modules())
        if native or needed - {"mamba_chunk_scan_combined"}:  # Mamba2-only hybrids need mamba-ssm alone
            try:
                import fla  # noqa: F401  (optional, treelit[cuda]: checked only for ssm=fla)
            except ImportError as exc:
                raise ValueError("ssm=fla needs flash-linear-attention: pip install 'treelit[cuda]'") from exc
        for kernel in sorted(needed):  # e.g. mamba-ssm for Mamba2 mixers: one line naming it, before training
            fla_backend.cuda_kernel(kernel)
    for mod in hybrid:
        mod._treelit_chunk_size = int(chunk_size)
        mod._treelit_backend = name
    for mod in model.modules():
        if hasattr(mod, "backend") and hasattr(mod, "reset_tree_parameters"):
            mod.backend = name
            mod.chunk_size = int(chunk_size)
    return model


__all__ = ["SSM_BACKENDS", "set_ssm_backend"]
