"""A value function for PPO: a scalar head on the policy's trunk, or a model of its own.

* ``shared``: ``head(h)`` on the policy's final-norm hidden states ``h``; the value loss
  reaches the trunk, scaled by ``vf_coef``; the head trains at its own learning rate.
* ``separate``: a second decoder (any model treelit builds) with its own head; it runs its
  own pass over the same row and the value loss trains it alone.

A token's value is read where its log-prob is read: from the hidden state of its parent
(the state before the token is chosen). The head is one ``Linear(D, 1)``: weights drawn
with a small standard deviation, bias zero.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

__all__ = ["CRITICS", "Critic", "check_critic_options"]

CRITICS = ("none", "shared", "separate")


def check_critic_options(kind: str, vf_coef: Any, value_clip: Any, lr: Any) -> None:
    if kind not in CRITICS:
        raise ValueError(f"critic={kind!r}: choose one of {', '.join(CRITICS)}")
    if isinstance(vf_coef, bool) or not isinstance(vf_coef, (int, float)) or not vf_coef > 0:
        raise ValueError(f"critic.vf_coef={vf_coef!r}: must be a number > 0")
    if value_clip is not None and (isinstance(value_clip, bool) or not isinstance(value_clip, (int, float))
                                   or not value_clip > 0):
        raise ValueError(f"critic.value_clip={value_clip!r}: must be a number > 0, or null (no clipping)")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0):
        raise ValueError(f"critic.lr={lr!r}: must be a number > 0, or null (the optimizer's)")


class Critic(nn.Module):
    """The value function of a PPO run (see the module docs).

    Args:
        kind: ``shared`` or ``separate``.
        hidden_size: the width of the hidden states the head reads.
        trunk: ``separate``: the critic's own decoder (its language-model head is not used).
        vf_coef: the value loss's coefficient in the total loss.
        value_clip: the clipped value loss's range around the values of the rollout (None: no clipping).
        lr: the critic's learning rate (None: the optimizer's).
    """

    def __init__(self, kind: str, hidden_size: int, trunk: Optional[nn.Module] = None, *, vf_coef: float = 0.5,
                 value_clip: Optional[float] = 0.5, lr: Optional[float] = None, dtype: torch.dtype = torch.float32,
                 init_std: float = 0.02) -> None:
        super().__init__()
        check_critic_options(kind, vf_coef, value_clip, lr)
        if kind == "none":
            raise ValueError("critic=none builds no critic")
        if (kind == "separate") != (trunk is not None):
            raise ValueError("critic=separate needs its own model (critic.hf_checkpoint or critic.model); "
                             "critic=shared reads the policy's trunk")
        self.kind = kind
        self.trunk = trunk
        self.head = nn.Linear(int(hidden_size), 1, dtype=dtype)
        with torch.no_grad():
            self.head.weight.normal_(0.0, init_std)
            self.head.bias.zero_()
        self.vf_coef = float(vf_coef)
        self.value_clip = None if value_clip is None else float(value_clip)
        self.lr = None if lr is None else float(lr)

    def values(self, h: torch.Tensor) -> torch.Tensor:
        """Values ``[M]`` from hidden states ``[M, D]`` (the head's dtype follows ``h``)."""
        w, b = self.head.weight, self.head.bias
        if w.dtype != h.dtype and not hasattr(w, "to_local"):
            return (h @ w.to(h.dtype).t()).sum(-1) + b.to(h.dtype)
        return self.head(h).sum(-1)  # [M, 1] -> [M] as a new tensor: FSDP2 warns about a view returned by a forward

    def extra_repr(self) -> str:
        return f"kind={self.kind}, vf_coef={self.vf_coef}, value_clip={self.value_clip}, lr={self.lr}"
