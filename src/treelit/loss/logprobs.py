"""Token log-probabilities (and entropies) without an N x vocab tensor.

``token_logprobs(h, W, targets)`` returns ``log softmax(h @ W^T)[target]`` per
row. Rows are processed in chunks; the backward pass recomputes each chunk's
logits instead of storing them, so neither pass ever holds more than one chunk
of ``chunk_rows x V`` logits (plus its gradient). The gradient with respect to
the logits of row r is ``g_r * (onehot(target_r) - p_r)`` (and, for the entropy
``H_r = -sum_j p_rj log p_rj``, ``-g^H_r * p_r * (log p_r + H_r)``).

Half-precision inputs are upcast to float32 per chunk; float32/float64 run in
their own precision.

*Chunk size.* Each chunk is a fixed number of kernel launches (about 18 for the fused SFT
head), so on a GPU the chunk is sized by memory, not by a fixed element count: a logits chunk
may take :data:`HEAD_MEMORY_SHARE` of the device's memory (1/32: 2.5 GiB on an 80 GiB device,
4,417 rows at a 151,936-token vocabulary, so 20,000 targets run in 5 chunks, not 364). On CPU,
where a launch costs nothing and cache-sized blocks run fastest, a chunk holds 2^23 logits
(32 MiB in float32). An explicit ``chunk_rows`` overrides both.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from treelit.utils.numerics import equal_blocks

__all__ = ["token_logprobs", "weighted_nll", "default_chunk_rows"]

_MAX_CHUNK_ELEMENTS = 1 << 23  # logits elements per chunk on CPU (32 MiB in float32)
HEAD_MEMORY_SHARE = 1.0 / 32  # on an accelerator: the share of its memory one logits chunk may take


def device_memory_bytes(device: Optional[torch.device]) -> Optional[int]:
    """Total memory of an accelerator ``device`` (None on CPU, meta, or without one)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def default_chunk_rows(vocab_size: int, max_elements: Optional[int] = None, *, device: Optional[torch.device] = None,
                       memory_bytes: Optional[int] = None) -> int:
    """Rows per logits chunk: ``max_elements`` logits if given; else :data:`HEAD_MEMORY_SHARE` of
    ``memory_bytes`` (default: the memory of ``device`` when it is an accelerator) in float32, at
    least the CPU's 2^23 logits; on CPU 2^23 logits."""
    if max_elements is None:
        memory = memory_bytes if memory_bytes is not None else device_memory_bytes(device)
        max_elements = _MAX_CHUNK_ELEMENTS
        if memory is not None:
            max_elements = max(_MAX_CHUNK_ELEMENTS, int(memory * HEAD_MEMORY_SHARE) // 4)
    return max(1, max_elements // max(1, vocab_size))


def even_chunk_rows(rows: int, chunk_rows: int) -> int:
    """Rows per chunk when ``rows`` rows are cut into as few chunks of at most ``chunk_rows``
    as possible, all of about the same size. Every chunk reads the whole ``[V, D]`` weight, so
    a short last chunk (10 rows after three of 256) costs about as much as a full one; equal
    chunks spread the same rows over the same number of weight reads."""
    return max(1, equal_blocks(rows, max(1, int(chunk_rows))))


def _cdt(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows: int, with_entropy: bool):
        chunk_rows = even_chunk_rows(hidden.shape[0], chunk_rows)
        cd = _cdt(hidden)
        M = hidden.shape[0]
        W = weight.to(cd)
        logp = torch.empty(M, dtype=cd, device=hidden.device)
        lse_all = torch.empty(M, dtype=cd, device=hidden.device)
        ent = torch.empty(M if with_entropy else 0, dtype=cd, device=hidden.device)
        Wt = W.t()
        # one logits-sized buffer for every chunk, updated in place (two with the entropy term)
        buf = torch.empty(min(M, chunk_rows), W.shape[0], dtype=cd, device=hidden.device) if M else None
        for s in range(0, M, chunk_rows):
            e = min(M, s + chunk_rows)
            z = buf[: e - s]
            torch.mm(hidden[s:e].to(cd), Wt, out=z)
            z_t = z.gather(1, targets[s:e, None]).squeeze(1)
            mx = z.amax(dim=1, keepdim=True)
            z.sub_(mx)  # logits - max
            p = torch.exp(z) if with_entropy else z.exp_()
            se = p.sum(dim=1, keepdim=True)
            lse = (mx + se.log()).squeeze(1)
            lse_all[s:e] = lse
            logp[s:e] = z_t - lse
            if with_entropy:  # H = -sum p log p = log se - sum p (logits - max) / se
                ent[s:e] = se.log().squeeze(1) - p.mul_(z).sum(-1) / se.squeeze(1)  # (in place: two buffers)
                del p
        ctx.save_for_backward(hidden, weight, targets, lse_all, ent)
        ctx.chunk_rows = chunk_rows
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse_all, ent = ctx.saved_tensors
        cd = _cdt(hidden)
        W = weight.to(cd)
        M = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(W) if need_w else None
        use_ent = ctx.with_entropy and g_ent is not None
        Wt = W.t()
        # one logits-sized buffer for every chunk, updated in place (two with the entropy term)
        buf = torch.empty(min(M, ctx.chunk_rows), W.shape[0], dtype=cd, device=hidden.device) if M else None
        for s in range(0, M, ctx.chunk_rows):
            e = min(M, s + ctx.chunk_rows)
            h = hidden[s:e].to(cd)
            gl = buf[: e - s]
            torch.mm(h, Wt, out=gl)
            gl.sub_(lse_all[s:e, None])  # log p
            g = g_logp[s:e].to(cd) if g_logp is not None else torch.zeros(e - s, dtype=cd, device=h.device)
            if use_ent:  # d/dlogits = -p (g + g_H (log p + H)) + onehot(target) g
                p = torch.exp(gl)
                ge = g_ent[s:e].to(cd)
                gl.add_(ent[s:e, None]).mul_(ge[:, None]).add_(g[:, None]).mul_(p).neg_()
                del p
            else:  # d/dlogits = -p g + onehot(target) g
                gl.exp_().mul_(-g[:, None])
            gl.scatter_add_(1, targets[s:e, None], g[:, None])
            if need_h:
                grad_h[s:e] = (gl @ W).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(gl.t(), h)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_rows: Optional[int] = None,
    with_entropy: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probabilities of ``targets`` under ``softmax(hidden @ weight^T)``.

    Args:
        hidden: ``[M, D]`` final-norm hidden states (one row per target).
        weight: ``[V, D]`` output projection.
        targets: ``[M]`` long token ids.
        chunk_rows: rows per chunk; bounds memory to ``chunk_rows x V`` logits per pass.
        with_entropy: also return the entropy of each row's distribution.

    Returns:
        ``(logp [M], entropy [M] or None)`` in float32 (half inputs) or the input precision.
    """
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"expected hidden [M, D] and targets [M], got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    rows = chunk_rows or default_chunk_rows(weight.shape[0], device=weight.device)
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=_cdt(hidden)) + 0 * hidden.sum() + 0 * weight.sum()
        return z, (z if with_entropy else None)
    logp, ent = _ChunkedLogProbs.apply(hidden, weight, targets, rows, with_entropy)
    return logp, (ent if with_entropy else None)


class _FusedWeightedNLL(torch.autograd.Function):
    """``sum_r coef_r * -log p_r(target_r)`` with its gradients formed during the forward.

    The gradient of this loss with respect to the logits is known in the forward pass
    (``coef_r * (p_r - onehot_r)``), so each chunk's logits are used once for the value
    and both gradients and then freed: three matmuls per chunk instead of the four of a
    recomputing backward, and no logits kept for backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, coef, chunk_rows: int, accumulator=None):
        chunk_rows = even_chunk_rows(hidden.shape[0], chunk_rows)
        cd = _cdt(hidden)
        W = weight.to(cd)
        Wt = W.t()
        M = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty(hidden.shape, dtype=cd, device=hidden.device) if need_h else None
        direct = accumulator is not None
        ctx.direct = direct
        if direct:
            grad_w = accumulator if accumulator.dtype == cd else torch.zeros_like(W)
        else:
            grad_w = torch.zeros_like(W) if need_w else None
        total = torch.zeros((), dtype=cd, device=hidden.device)
        coef = coef.to(cd)
        # One logits buffer for all chunks, updated in place: repeated large allocations
        # cost more than the arithmetic on CPU (page faults) and fragment GPU memory.
        buf = torch.empty(min(M, chunk_rows), W.shape[0], dtype=cd, device=hidden.device)
        for s in range(0, M, chunk_rows):
            e = min(M, s + chunk_rows)
            h = hidden[s:e].to(cd)
            z = buf[: e - s]
            torch.mm(h, Wt, out=z)
            t = targets[s:e, None]
            c = coef[s:e]
            z_t = z.gather(1, t).squeeze(1)
            mx = z.amax(dim=1, keepdim=True)
            z.sub_(mx).exp_()  # z = exp(logits - max)
            se = z.sum(dim=1, keepdim=True)
            lse = (mx + se.log()).squeeze(1)
            total -= (c * (z_t - lse)).sum()
            if need_h or need_w:
                z.mul_(c[:, None] / se)  # = c * softmax
                z.scatter_add_(1, t, -c[:, None])  # d/dlogits of c * -log p
                if need_h:
                    torch.mm(z, W, out=grad_h[s:e])
                if need_w or direct:
                    grad_w.addmm_(z.t(), h)
        if direct and grad_w is not accumulator:
            accumulator.add_(grad_w.to(accumulator.dtype))
        ctx.save_for_backward(
            grad_h.to(hidden.dtype) if need_h else None, grad_w.to(weight.dtype) if (need_w and not direct) else None
        )
        return total

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        return (
            None if grad_h is None else grad_h * g.to(grad_h.dtype),
            None if grad_w is None else grad_w * g.to(grad_w.dtype),
            None,
            None,
            None,
            None,
        )


def weighted_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    *,
    chunk_rows: Optional[int] = None,
    weight_grad_accumulator: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``sum_r coef[r] * -log softmax(hidden[r] @ weight^T)[targets[r]]`` (fused, chunked).

    The SFT loss head: gradients are formed chunk by chunk in the forward pass, so memory
    stays at one ``chunk_rows x V`` block and the backward pass is a scaling.

    ``weight_grad_accumulator`` (``[V, D]``): add the weight's gradient into this buffer during
    the forward pass instead of keeping a copy until backward - only valid when the loss is
    backwarded with gradient 1 (partitioned training uses one buffer for all its passes).
    """
    if hidden.dim() != 2 or targets.shape != coef.shape or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"expected hidden [M, D], targets [M], coef [M]; got {tuple(hidden.shape)}, "
            f"{tuple(targets.shape)}, {tuple(coef.shape)}"
        )
    if hidden.shape[0] == 0:
        return 0.0 * hidden.sum() + 0.0 * weight.sum()
    rows = chunk_rows or default_chunk_rows(weight.shape[0], device=weight.device)
    return _FusedWeightedNLL.apply(hidden, weight, targets, coef, rows, weight_grad_accumulator)
