"""Recorded mixture-of-experts routing (``routed_experts``): its encoding and its checks.

A sampler that serves a mixture-of-experts policy can return, for every token it ran through
the model and every MoE layer, the experts it sent the token to. Training on those choices
(*routing replay*) keeps the trainer's log-probabilities on the sampler's experts, so an RL
ratio measures a policy change and not a routing change. A branch's record is an integer
array ``[T, L, k]``: T tokens, L MoE layers (in layer order; dense layers have no entry),
k experts per token (the model's top-k). ``T`` is the branch's length, or one less: samplers
never run the final sampled token through the model, so they have no routing for it (that
token's routing then comes from another branch through it, or from the live router; its
hidden state feeds no log-prob of its own branch).

JSON carries it either as nested lists or, compactly, as an object::

    {"dtype": "int16", "shape": [T, L, k], "b64": "<base64 of the little-endian array, C order>"}

``dtype`` is one of ``uint8``, ``int8``, ``int16``, ``int32``, ``int64`` (:func:`encode_routing`
picks the smallest that holds the ids). The order of a token's k experts carries no meaning
(the combine weights are read at the experts, whatever their order): arrays are kept sorted
along k, and a repeated expert is refused.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from treelit.tree.errors import TreeInputError

__all__ = ["ROUTING_DTYPES", "decode_routing", "encode_routing", "check_routing_shape", "check_routing_model",
           "split_keys"]

ROUTING_DTYPES = ("uint8", "int8", "int16", "int32", "int64")


def _fail(where: str, why: str) -> TreeInputError:
    return TreeInputError(f"{where}: {why}")


def decode_routing(value: Any, where: str = "routed_experts") -> np.ndarray:
    """``[T, L, k]`` int64, sorted along k, from nested lists or the compact object (see the module
    docstring); ``where`` names the field in errors."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"dtype", "shape", "b64"})
        if unknown:
            raise _fail(where, f"unknown key {unknown[0]!r} (the compact form is {{dtype, shape, b64}})")
        dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("b64")
        if dtype not in ROUTING_DTYPES:
            raise _fail(where, f"dtype must be one of {', '.join(ROUTING_DTYPES)}, got {dtype!r}")
        if (not isinstance(shape, list) or len(shape) != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise _fail(where, f"shape must be [tokens, moe_layers, top_k] (three integers >= 0), got {shape!r}")
        if not isinstance(data, str):
            raise _fail(where, "b64 must be a base64 string")
        try:
            raw = base64.b64decode(data.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise _fail(where, "b64 is not valid base64") from None
        dt = np.dtype(dtype).newbyteorder("<")
        n = math.prod(shape)  # Python ints: no overflow, so the byte count is checked before any array is made
        if len(raw) != n * dt.itemsize:
            raise _fail(where, f"b64 holds {len(raw)} bytes, shape {shape} of {dtype} needs {n * dt.itemsize}")
        try:  # an empty array can still have a dimension numpy cannot hold ([2**62, 0, 2])
            arr = np.frombuffer(raw, dtype=dt).astype(np.int64).reshape(shape)
        except ValueError:
            raise _fail(where, f"shape {shape} is larger than an array can be") from None
    else:
        if not isinstance(value, (list, np.ndarray)):
            raise _fail(where, f"must be a [tokens][moe_layers][top_k] list of expert ids or "
                               f"{{dtype, shape, b64}}, got {type(value).__name__}")
        try:
            arr = np.array(value)
        except ValueError:  # ragged
            raise _fail(where, "must be a [tokens][moe_layers][top_k] list of expert ids (ragged)") from None
        if arr.size == 0:
            arr = arr.reshape(0, 0, 0) if arr.ndim < 3 else arr
        if arr.ndim != 3:
            raise _fail(where, f"must be a [tokens][moe_layers][top_k] list of expert ids, got {arr.ndim} levels")
        if arr.size and (arr.dtype.kind not in "iu" or arr.dtype == bool):
            raise _fail(where, f"expert ids must be integers, got {arr.dtype}")
        arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        t, layer, _ = np.argwhere(arr < 0)[0]
        raise _fail(where, f"negative expert id {int(arr[t, layer].min())} at token {t}, MoE layer {layer}")
    arr = np.sort(arr, axis=-1)
    if arr.shape[-1] > 1:
        rep = np.argwhere(arr[..., 1:] == arr[..., :-1])
        if rep.size:
            t, layer, j = (int(x) for x in rep[0])
            raise _fail(where, f"expert {int(arr[t, layer, j])} appears twice at token {t}, MoE layer {layer}")
    return arr


def encode_routing(arr: Any, dtype: Optional[str] = None) -> Dict[str, Any]:
    """The compact JSON object of ``arr [T, L, k]`` (``dtype``: default the smallest that holds it)."""
    a = np.asarray(arr)
    if a.ndim != 3:
        raise ValueError(f"routing must be [tokens, moe_layers, top_k], got shape {a.shape}")
    if dtype is None:
        top = int(a.max()) if a.size else 0
        dtype = "uint8" if top < 2**8 else "int16" if top < 2**15 else "int32" if top < 2**31 else "int64"
    if dtype not in ROUTING_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(ROUTING_DTYPES)}, got {dtype!r}")
    raw = np.ascontiguousarray(a.astype(np.dtype(dtype).newbyteorder("<"))).tobytes()
    return {"dtype": dtype, "shape": [int(s) for s in a.shape], "b64": base64.b64encode(raw).decode("ascii")}


def check_routing_shape(arr: np.ndarray, tokens: int, where: str = "routed_experts") -> None:
    """A branch of ``tokens`` tokens has routing for all of them or all but the last."""
    if arr.shape[0] not in (tokens, tokens - 1):
        raise _fail(where, f"routing for {arr.shape[0]} tokens; the branch has {tokens} (give all of them, or all "
                           "but the last: the final sampled token is never run through the model)")


def check_routing_model(arr: np.ndarray, layers: int, experts: int, top_k: int, where: str = "routed_experts") -> None:
    """The routing fits a model with ``layers`` MoE layers of ``experts`` experts, ``top_k`` per token."""
    if arr.shape[1] != layers:
        raise _fail(where, f"routing for {arr.shape[1]} MoE layers; the model has {layers}")
    if arr.shape[2] != top_k:
        raise _fail(where, f"{arr.shape[2]} experts per token; the model routes each token to top_k={top_k}")
    if arr.size and arr.max() >= experts:
        t, layer, _ = np.argwhere(arr >= experts)[0]
        raise _fail(where, f"expert id {int(arr[t, layer].max())} at token {t}, MoE layer {layer} is out of range "
                           f"(the model has {experts} experts: 0..{experts - 1})")


def split_keys(logprobs: Optional[List[np.ndarray]], logprob_tol: float, routing: Optional[List[Optional[np.ndarray]]],
               lengths: Sequence[int]) -> Tuple[Optional[List[np.ndarray]], Optional[np.ndarray]]:
    """Per branch ``[L_b, K]`` float values that must agree for two branches to share a token, and
    the tolerance of each column: the old/ref log-probs (``logprob_conflict=split``; within
    ``logprob_tol``) and the routing's ``L x k`` expert ids (``routing_conflict=split``; exactly,
    float64 holds them exactly). NaN (a value not recorded) agrees with anything. ``(None, None)``
    when neither splits."""
    cols, tols = [], []
    if logprobs is not None:
        cols.append(logprobs)
        tols += [float(logprob_tol)] * logprobs[0].shape[1]
    known = [a for a in (routing or ()) if a is not None]
    if known:
        width = int(np.prod(known[0].shape[1:]))
        per = []
        for a, n in zip(routing, lengths):
            k = np.full((n, width), np.nan)
            if a is not None and a.shape[1:] == known[0].shape[1:]:  # (another shape: named by the routing merge)
                k[: a.shape[0]] = a.reshape(a.shape[0], -1)
            per.append(k)
        cols.append(per)
        tols += [0.0] * width
    if not cols:
        return None, None
    return [np.concatenate(parts, axis=1) for parts in zip(*cols)], np.asarray(tols)
