"""Learning-rate schedules (the ``scheduler`` config group)."""

from __future__ import annotations

import math

import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warm-up to the base rate, then cosine decay to ``min_ratio`` of it."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        t = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
