"""Reward functions (registry kind ``reward``) for the reference sampler ``treelit-rollout``.

The contract: ``fn(prompt_ids=list[int], completion_ids=list[int], **record) -> float``,
where ``record`` holds the prompt record's other fields (everything but ``input_ids`` /
``messages``: an ``answer``, a task id, ...). A reward is named by a registered name, by
``module:function`` (any importable function), or provided by a plugin through the entry
point group ``treelit.reward``.

Built-ins, for the bundled toy tasks (``experiment=rl_online``):

* ``even_tokens``: the share of the completion's tokens that are even ids (a token rule a
  tiny model learns in a few dozen updates);
* ``sum_digits``: 1 when the completion's first token is the record's ``answer`` (single-digit
  additions whose prompt tokens are the digits), else 0;
* ``square_colour``: 1 when the completion's first token names the colour of the square in the
  prompt's image (read from its pixels; defined in :mod:`treelit.rl.visual_task`), else 0.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, List

from treelit.registry import get_registry

__all__ = ["REWARDS", "resolve_reward"]

REWARDS = get_registry("reward", ["treelit.rl.rewards", "treelit.rl.visual_task"])


@REWARDS.register("even_tokens")
def even_tokens(prompt_ids: List[int], completion_ids: List[int], **record: Any) -> float:
    """The share of completion tokens with an even id (0 for an empty completion)."""
    if not completion_ids:
        return 0.0
    return sum(1 for t in completion_ids if t % 2 == 0) / len(completion_ids)


@REWARDS.register("sum_digits")
def sum_digits(prompt_ids: List[int], completion_ids: List[int], answer: Any = None, **record: Any) -> float:
    """1 if the first completion token is the record's ``answer``, else 0."""
    if answer is None:
        raise ValueError("reward sum_digits needs an 'answer' field in each prompt record")
    return float(bool(completion_ids) and completion_ids[0] == int(answer))


def resolve_reward(spec: str) -> Callable[..., float]:
    """A reward function from a registered name (built-in or plugin) or ``module:function``."""
    if ":" in spec:
        mod, _, fn = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--reward {spec}: cannot import {fn!r} from module {mod!r} ({exc})") from None
        if not callable(obj):
            raise ValueError(f"--reward {spec}: {fn!r} is not a function")
        return obj
    return REWARDS.get(spec)
