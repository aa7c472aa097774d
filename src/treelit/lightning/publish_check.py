"""A written version holds the trained output layer.

A published checkpoint leaves out the output layer (``lm_head``) only when it is the input
embedding (tied): the sampler then ties it back. A separate head the files lack is loaded by
the sampler as some other tensor (a fresh one, or the embedding), and it samples from a policy
that is not the trained one. :func:`check_head_written` looks for the trained head's values
among the written tensors of its shape (names differ between the trainer's model and the
checkpoint format) before the version is made visible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors import safe_open

__all__ = ["separate_head_key", "check_head_written"]


def separate_head_key(model: torch.nn.Module) -> Optional[str]:
    """The state-dict name of ``model``'s output layer weight when it is a tensor of its own
    (not the input embedding's), else None."""
    head, emb = getattr(model, "output", None), getattr(model, "tok_embeddings", None)
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Module) or weight is None:
        return None  # a tied head that holds no tensor (TiedLinear reads the embedding's)
    if emb is not None and weight is getattr(emb, "weight", None):
        return None
    for name, mod in model.named_modules(remove_duplicate=False):
        if mod is head:
            return f"{name}.weight" if name else "weight"
    return None


def check_head_written(model: torch.nn.Module, sd: Dict[str, torch.Tensor], path: Path,
                       where: Optional[str] = None) -> None:
    """Raise ``ValueError`` (one line, naming the parameter and ``where``, default ``path``) unless
    a ``*.safetensors`` file under ``path`` holds a tensor equal to ``sd``'s entry for the model's
    separate head."""
    key = separate_head_key(model)
    if key is None or key not in sd:
        return
    value = sd[key]
    shape = list(value.shape)
    candidates = []
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            candidates += [(not k.endswith(("lm_head.weight", "output.weight")), file, k)
                           for k in f.keys() if list(f.get_slice(k).get_shape()) == shape]
    for _, file, k in sorted(candidates):  # head-like names first: most often the first read decides
        with safe_open(str(file), "pt") as f:
            if torch.equal(f.get_tensor(k), value):
                return
    raise ValueError(f"publish: {where or path} holds no tensor equal to the trained parameter {key} (the output layer, "
                     "a tensor of its own, not tied to the embedding): a sampler would load another head")
