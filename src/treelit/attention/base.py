"""The attention backend interface and its registry."""

from __future__ import annotations

import inspect
import logging
from typing import Any, List, Optional, Union

import torch

from treelit.registry import get_registry

__all__ = ["ATTENTION", "AttentionBackend", "get_backend", "make_attention", "resolve_backend", "available_backends"]

log = logging.getLogger(__name__)

ATTENTION = get_registry(
    "attention",
    ["treelit.attention.dense", "treelit.attention.segment", "treelit.attention.flex"],
)


class AttentionBackend:
    """Interface of a tree attention backend.

    ``plan(layout)`` runs once per forward pass (shared by all layers) and returns
    whatever the backend precomputes from the tree structure; ``__call__`` then
    computes ``softmax(q k^T * scale + mask) v`` for one layer:

    * ``q``: ``[1, Hq, N, D]`` post-RoPE queries of the row's N tokens;
    * ``k, v``: ``[1, Hkv, E + N, D]`` keys/values, E external ones first; ``Hq % Hkv == 0``
      and query head ``h`` reads kv head ``h // (Hq / Hkv)`` (GQA);
    * returns ``[1, Hq, N, D]``.

    Query ``q`` attends to key ``j`` iff ``layout.kv_lo[j] <= q < layout.kv_hi[j]``.

    ``external_keys``: whether the backend takes E > 0 external keys (ancestors that live
    outside the row). Partitioned passes and context parallelism need them; a plugin backend
    that handles the row's own keys only sets it to False and is refused there by name.

    ``bidirectional_blocks``: whether the backend takes row keys seen by queries before them
    (``kv_lo[E + j] < j``: the bidirectional image blocks of Gemma-3); backends that plan from the
    tree's structure (causal within a segment) do not, and are refused by name there.
    """

    name: str = "?"
    requires_cuda: bool = False
    external_keys: bool = True
    bidirectional_blocks: bool = False

    def plan(self, layout) -> Any:
        raise NotImplementedError

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any) -> torch.Tensor:
        raise NotImplementedError

    def check_device(self, device: torch.device) -> None:
        if self.requires_cuda and torch.device(device).type != "cuda":
            others = [n for n in available_backends() if not ATTENTION.get(n).requires_cuda]
            raise ValueError(
                f"attention backend {self.name!r} needs a CUDA device (got {device}); "
                f"on this device use one of: {', '.join(others)} or 'auto'"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def make_attention(name: str = "auto", device: Optional[str] = None, **options) -> Union[str, AttentionBackend]:
    """The ``attention`` config group: ``"auto"`` stays a name (resolved per batch); any other
    name becomes a backend instance, checked now against the device it will run on."""
    if name == "auto":
        if options:
            raise ValueError(f"attention=auto takes no options, got {sorted(options)}")
        return "auto"
    backend = get_backend(name, **options)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend.check_device(torch.device(dev))
    return backend


def available_backends() -> List[str]:
    return ATTENTION.names()


def get_backend(name: str, **options) -> AttentionBackend:
    """Instantiate the backend registered as ``name``. An option the backend does not take is
    refused with a ValueError naming it and the options it has (``attention.<option>``)."""
    cls = ATTENTION.get(name)
    params = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        known = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            has = f"its options: {', '.join(known)}" if known else "it takes no options"
            raise ValueError(f"attention={name} has no option {', '.join(f'attention.{k}' for k in unknown)}; {has}")
    return cls(**options)


def resolve_backend(
    spec: Union[str, AttentionBackend, None], device: Any = "cpu", batch=None
) -> AttentionBackend:
    """Turn a name (or ``"auto"``/None) into a backend instance checked against ``device``.

    ``auto`` picks ``flex`` on CUDA, and on CPU ``sdpa_dense`` for tiny rows (where the
    dense mask is cheaper than per-segment bookkeeping) and ``segment`` otherwise.
    """
    if isinstance(spec, AttentionBackend):
        spec.check_device(torch.device(device))
        return spec
    if spec is None or spec == "auto":
        name = auto_backend_name(torch.device(device), batch)
        why = (torch.device(device).type, name)
        if why not in _AUTO_LOGGED:  # once per (device type, choice), not once per step
            _AUTO_LOGGED.add(why)
            log.info("attention=auto: using %r on %s%s", name, why[0], _auto_reason(name))
        backend = get_backend(name)
    else:
        backend = get_backend(spec)
    backend.check_device(torch.device(device))
    return backend


_AUTO_LOGGED: set = set()


def _auto_reason(name: str) -> str:
    return {
        "flex": " (fused FlexAttention kernels)",
        "segment": " (exact, work = sum of segment x path)",
        "sdpa_dense": " (small row: dense mask is cheapest)",
    }.get(name, "")


def auto_backend_name(device: torch.device, batch=None) -> str:
    """The backend ``auto`` picks for ``batch`` on ``device``."""
    if device.type == "cuda" and "flex" in ATTENTION:
        return "flex"
    if batch is None or "segment" not in ATTENTION:
        return "sdpa_dense"
    return "sdpa_dense" if _dense_is_cheaper(batch) else "segment"


def _dense_is_cheaper(batch, max_tokens: int = 512) -> bool:
    """Dense wins only on small rows: its N x N work is trivial there and it needs no plan.
    Everywhere else ``segment`` does at most the work of dense (usually far less)."""
    return batch.num_tokens <= max_tokens
