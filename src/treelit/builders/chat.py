"""``chat``: conversations rendered with a Hugging Face tokenizer's chat template.

Record format (messages in OpenAI chat format: ``system``/``user``/``assistant``/``tool``
roles, ``tool_calls`` on assistant messages, ``tool_call_id``/``name`` on tool messages)::

    {"id": "task-3/trial-1", "group": "task-3", "messages": [...]}         # one conversation
    {"id": "task-3", "branches": [{"messages": [...]}, {"messages": [...]}]}  # explicit branches

Each conversation becomes one or more token branches:

* ``export="per_call"`` (default): one branch per assistant message - the context the
  model saw at that call plus its output, trained on that output only. This is how
  agent frameworks export every model call; consecutive calls share their contexts.
  An assistant message's ``reasoning_content`` (hidden thinking) is part of its own
  call but *dropped* from later contexts, so each call branches off at its thinking.
  A message with ``"compaction": true`` replaces the history before it: later calls
  see the system messages, the compaction message and what follows.
* ``export="trajectory"``: the whole conversation as one branch, trained on every
  assistant message.

Explicit ``branches`` (concurrent tool calls, sub-agents, ...) are exported one by
one and merged; records sharing ``group_key`` (e.g. the trials of one task) are merged
into one tree. The loss covers assistant tokens (content, tool calls and end-of-turn
token), never the role header the template writes before them.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from treelit.builders.base import TREE_BUILDERS, BuiltTree, TreeBuilder
from treelit.data.records import DataError, Record
from treelit.tree.token_tree import TokenTree, TreeInputError

ROLES = ("system", "user", "assistant", "tool")


def validate_chat_record(rec: Dict[str, Any], source: str) -> None:
    if not isinstance(rec, dict):
        raise DataError(f"{source}: a record must be a JSON object")
    convs = _conversations(rec, source)
    for c, msgs in enumerate(convs):
        where = f"{source}: " + (f"branches[{c}]." if "branches" in rec else "") + "messages"
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise DataError(f"{where}[{i}]: must be an object")
            if m.get("role") not in ROLES:
                raise DataError(f"{where}[{i}].role: must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                raise DataError(f"{where}[{i}].content: must be a string or null")
            if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
                raise DataError(f"{where}[{i}].tool_calls: must be a list")


def _conversations(rec: Dict[str, Any], source: str) -> List[List[Dict[str, Any]]]:
    if "messages" in rec:
        return [rec["messages"]]
    if "traj" in rec:  # tau-bench style records
        return [rec["traj"]]
    branches = rec.get("branches")
    if isinstance(branches, list) and branches and all(isinstance(b, dict) and "messages" in b for b in branches):
        return [b["messages"] for b in branches]
    raise DataError(f"{source}: a chat record needs 'messages' (or 'branches' with 'messages')")


def _normalise(m: Dict[str, Any], keep_thinking: bool) -> Dict[str, Any]:
    """A message as the template should see it (thinking folded into content or dropped)."""
    out = {k: v for k, v in m.items() if k not in ("reasoning_content", "thinking", "compaction")}
    thinking = m.get("reasoning_content") or m.get("thinking")
    if out.get("content") is None:
        out["content"] = ""
    if keep_thinking and thinking:
        out["content"] = f"<think>\n{thinking}\n</think>\n\n{out['content']}"
    return out


def _visible_history(msgs: Sequence[Dict[str, Any]], upto: int) -> List[int]:
    """Indices of messages a call at position ``upto`` sees (compaction applied)."""
    start = 0
    for i in range(upto):
        if msgs[i].get("compaction"):
            start = i
    keep = [i for i in range(start) if msgs[i].get("role") == "system"]
    return keep + list(range(start, upto))


@TREE_BUILDERS.register("chat")
class ChatBuilder(TreeBuilder):
    """Args:
        tokenizer_path: local directory of a Hugging Face tokenizer with a chat template.
        export: ``per_call`` or ``trajectory`` (see the module docstring).
        group_key: records with equal values of this field are merged into one tree
            (``None``: every record is its own tree).
        tokenizer: an already loaded tokenizer (overrides ``tokenizer_path``).
        advantage: estimator turning the records' ``reward`` into per-branch advantages,
            within each group (``grpo``, ``rloo``, ``reinforce_pp``, ``raw``; None: no RL data).
    """

    validate = staticmethod(validate_chat_record)

    def __init__(
        self,
        tokenizer_path: Optional[str] = None,
        export: str = "per_call",
        group_key: Optional[str] = "group",
        tokenizer: Any = None,
        advantage: Optional[str] = None,
    ) -> None:
        if export not in ("per_call", "trajectory"):
            raise ValueError(f"tree_builder.export must be 'per_call' or 'trajectory', got {export!r}")
        if tokenizer is None:
            if not tokenizer_path:
                raise ValueError("the chat tree builder needs tree_builder.tokenizer_path (a local tokenizer directory)")
            tokenizer = load_tokenizer(tokenizer_path)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer at {tokenizer_path!r} has no chat template")
        self.tok = tokenizer
        self.export = export
        self.group_key = group_key
        self.advantage = advantage

    # rendering -------------------------------------------------------------------------
    def _render(self, msgs: List[Dict[str, Any]], gen: bool = False) -> str:
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    def _encode(self, msgs: List[Dict[str, Any]], train: List[int], source: str) -> Tuple[List[int], List[int]]:
        """Token ids and loss mask of ``msgs``, training the assistant messages in ``train``."""
        text = self._render(msgs)
        spans = []
        for i in train:
            head = self._render(msgs[:i], gen=True)
            upto = self._render(msgs[: i + 1])
            if not (text.startswith(upto) and upto.startswith(head)):
                raise DataError(
                    f"{source}: the chat template does not render message {i} as a prefix extension "
                    "of the conversation before it, so its tokens cannot be located"
                )
            spans.append((len(head), len(upto)))
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        mask = [0] * len(ids)
        for t, (s, _) in enumerate(enc["offset_mapping"]):
            for a, b in spans:
                if a <= s < b:
                    mask[t] = 1
                    break
        return ids, mask

    def branches_of(self, msgs: List[Dict[str, Any]], source: str) -> List[Tuple[List[int], List[int]]]:
        if self.export == "trajectory":
            norm = [_normalise(m, keep_thinking=True) for m in msgs]
            train = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            return [self._encode(norm, train, source)]
        out = []
        for t, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            ctx = [_normalise(msgs[i], keep_thinking=False) for i in _visible_history(msgs, t)]
            out.append(self._encode(ctx + [_normalise(m, keep_thinking=True)], [len(ctx)], source))
        return out

    # building ----------------------------------------------------------------------------
    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        groups: Dict[str, List[Tuple[List[int], List[int], str, Optional[float]]]] = {}
        sources: Dict[str, str] = {}
        order: List[str] = []
        for r in records:
            key = r.data.get(self.group_key) if self.group_key else None
            gid = f"{self.group_key}={key}" if key is not None else r.id
            if gid not in groups:
                groups[gid], sources[gid] = [], r.source
                order.append(gid)
            reward = r.data.get("reward")
            if self.advantage is not None and (reward is None or not isinstance(reward, (int, float))):
                raise DataError(f"{r.source}: field 'reward' must be a number (tree_builder.advantage={self.advantage})")
            for msgs in _conversations(r.data, r.source):
                for ids, mask in self.branches_of(copy.deepcopy(msgs), r.source):
                    groups[gid].append((ids, mask, r.id, reward))
        adv: Dict[str, List[float]] = {}
        if self.advantage is not None:
            from treelit.rl.advantages import compute_advantages

            flat = [(gid, it[3]) for gid in order for it in groups[gid]]
            values = compute_advantages(self.advantage, [x[1] for x in flat], [x[0] for x in flat])
            pos = 0
            for gid in order:
                adv[gid] = [float(v) for v in values[pos : pos + len(groups[gid])]]
                pos += len(groups[gid])
        out = []
        for gid in order:
            items = groups[gid]
            if not items:
                raise DataError(f"{sources[gid]}: record {gid!r} has no assistant message to train on")
            try:
                tree = TokenTree.from_branches(
                    [i[0] for i in items], [i[1] for i in items],
                    branch_fields={"record": [i[2] for i in items], "reward": [i[3] for i in items]},
                    source=f"{sources[gid]}: ",
                    advantages=adv.get(gid),
                )
            except TreeInputError as exc:
                raise DataError(str(exc)) from exc
            out.append(BuiltTree(gid, tree, sources[gid]))
        return out


def load_tokenizer(path: str):
    """Load a Hugging Face tokenizer from a local directory (never from the hub)."""
    import os

    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path!r} does not exist")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
