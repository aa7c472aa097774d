"""Synthetic agentic-shaped trees for benchmarks.

Each case mimics how agent and RL frameworks export training data, with random
token ids standing in for text (a fixed chat-frame around every message):

* ``grpo_group``: one long prompt, G sampled responses (a GRPO group).
* ``multi_turn``: one conversation exported per model call (each call's input is
  the previous call's input plus its output and a tool result).
* ``tool_fanout``: at each turn the assistant issues k concurrent tool calls that are
  followed in separate branches; the conversation continues from one of them.
* ``dropped_thinking``: each call emits hidden reasoning before its answer; later
  calls see only the answers, so every call branches off at its thinking.
* ``subagents``: a main agent spawns sub-agents that share the system prompt and task.
* ``agent_group``: a GRPO group of agent trajectories, each exported per call.
* ``wide_fanout``: many concurrent tool calls per turn (dozens of short segments).

A branch's loss mask is either ``all`` (every token) or ``assistant`` (tokens of
assistant messages, as multi-turn SFT trains them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import numpy as np

IM_START, IM_END = 1, 2
ROLE = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
FIRST_TEXT_ID = 16

Message = Tuple[str, np.ndarray]  # (role, token ids of the body)


@dataclass
class Case:
    name: str
    branches: List[List[int]]
    masks: List[List[int]]


class _Gen:
    def __init__(self, seed: int, vocab: int, scale: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.scale = scale

    def text(self, n: int) -> np.ndarray:
        n = max(1, int(round(n * self.scale)))
        return self.rng.integers(FIRST_TEXT_ID, self.vocab, size=n)

    def jitter(self, n: int, spread: float = 0.3) -> int:
        return max(1, int(n * (1 + spread * (self.rng.random() * 2 - 1))))


def render(messages: List[Message], mask_mode: str) -> Tuple[List[int], List[int]]:
    ids: List[int] = []
    mask: List[int] = []
    for role, body in messages:
        frame = [IM_START, ROLE[role]] + body.tolist() + [IM_END]
        ids.extend(frame)
        on = 1 if (mask_mode == "all" or role == "assistant") else 0
        mask.extend([on] * len(frame))
    return ids, mask


def _per_call(calls: List[List[Message]], mask_mode: str) -> Tuple[List[List[int]], List[List[int]]]:
    out = [render(c, mask_mode) for c in calls]
    return [o[0] for o in out], [o[1] for o in out]


def grpo_group(g: _Gen, mask_mode: str, G: int = 8) -> Tuple[list, list]:
    prompt = [("system", g.text(1200)), ("user", g.text(300))]
    calls = [prompt + [("assistant", g.text(g.jitter(800)))] for _ in range(G)]
    return _per_call(calls, mask_mode)


def multi_turn(g: _Gen, mask_mode: str, turns: int = 9) -> Tuple[list, list]:
    ctx: List[Message] = [("system", g.text(1500)), ("user", g.text(200))]
    calls = []
    for _ in range(turns):
        answer = ("assistant", g.text(g.jitter(150)))
        calls.append(ctx + [answer])
        ctx = ctx + [answer, ("tool", g.text(g.jitter(550)))]
    return _per_call(calls, mask_mode)


def tool_fanout(g: _Gen, mask_mode: str, turns: int = 3, k: int = 4) -> Tuple[list, list]:
    ctx: List[Message] = [("system", g.text(1200)), ("user", g.text(150))]
    calls = []
    for _ in range(turns):
        plan = ("assistant", g.text(60))
        calls.append(ctx + [plan])
        ctx = ctx + [plan]
        follow = []
        for _ in range(k):  # concurrent tool calls, one branch each
            branch = ctx + [("tool", g.text(g.jitter(350))), ("assistant", g.text(g.jitter(100)))]
            calls.append(branch)
            follow.append(branch)
        ctx = follow[int(g.rng.integers(k))] + [("user", g.text(40))]
    return _per_call(calls, mask_mode)


def dropped_thinking(g: _Gen, mask_mode: str, turns: int = 8) -> Tuple[list, list]:
    ctx: List[Message] = [("system", g.text(1500)), ("user", g.text(200))]
    calls = []
    for _ in range(turns):
        answer = ("assistant", g.text(g.jitter(80)))
        thinking = ("assistant", g.text(g.jitter(250)))
        calls.append(ctx + [thinking, answer])  # the call as sampled
        ctx = ctx + [answer, ("tool", g.text(g.jitter(300)))]  # later calls do not see the thinking
    return _per_call(calls, mask_mode)


def subagents(g: _Gen, mask_mode: str, n_sub: int = 3, turns: int = 3) -> Tuple[list, list]:
    system = ("system", g.text(1500))
    task = ("user", g.text(200))
    calls = []
    for _ in range(n_sub):
        ctx: List[Message] = [system, task, ("user", g.text(g.jitter(80)))]
        for _ in range(turns):
            answer = ("assistant", g.text(g.jitter(90)))
            calls.append(ctx + [answer])
            ctx = ctx + [answer, ("tool", g.text(g.jitter(600)))]
    return _per_call(calls, mask_mode)


def agent_group(g: _Gen, mask_mode: str, G: int = 3, turns: int = 5) -> Tuple[list, list]:
    prompt = [("system", g.text(1500)), ("user", g.text(200))]
    calls = []
    for _ in range(G):
        ctx = list(prompt)
        for _ in range(turns):
            answer = ("assistant", g.text(g.jitter(100)))
            calls.append(ctx + [answer])
            ctx = ctx + [answer, ("tool", g.text(g.jitter(350)))]
    return _per_call(calls, mask_mode)


def wide_fanout(g: _Gen, mask_mode: str, turns: int = 2, k: int = 16) -> Tuple[list, list]:
    """Many concurrent tool calls per turn (wide trees with dozens of short segments)."""
    ctx: List[Message] = [("system", g.text(1200)), ("user", g.text(100))]
    calls = []
    for _ in range(turns):
        plan = ("assistant", g.text(40))
        calls.append(ctx + [plan])
        ctx = ctx + [plan]
        follow = []
        for _ in range(k):
            branch = ctx + [("tool", g.text(g.jitter(120))), ("assistant", g.text(g.jitter(50)))]
            calls.append(branch)
            follow.append(branch)
        ctx = follow[int(g.rng.integers(k))] + [("user", g.text(30))]
    return _per_call(calls, mask_mode)


GENERATORS: Dict[str, Callable[..., Tuple[list, list]]] = {
    "grpo_group": grpo_group,
    "multi_turn": multi_turn,
    "tool_fanout": tool_fanout,
    "dropped_thinking": dropped_thinking,
    "subagents": subagents,
    "agent_group": agent_group,
    "wide_fanout": wide_fanout,
}


# The default benchmark suite (agent_group is available by name).
SUITE = ["grpo_group", "multi_turn", "tool_fanout", "dropped_thinking", "subagents", "wide_fanout"]


def make_case(
    name: str, *, seed: int = 0, vocab: int = 32768, scale: float = 1.0, mask_mode: str = "all", **shape
) -> Case:
    """Build case ``name``; ``shape`` overrides the generator's own parameters (turns, k, G, ...)."""
    if name not in GENERATORS:
        raise KeyError(f"unknown case {name!r}; known: {', '.join(GENERATORS)}")
    branches, masks = GENERATORS[name](_Gen(seed, vocab, scale), mask_mode, **shape)
    return Case(name, branches, masks)
