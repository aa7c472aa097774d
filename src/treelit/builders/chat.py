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

Bounds. A chat template is code from the tokenizer directory: one render may take at most
``render_timeout_s`` seconds (a SIGALRM timer, in the main thread, where training reads
its data; elsewhere no limit applies), so a template that loops without end fails naming
the record instead of hanging the run. Messages nested more than :data:`MAX_DEPTH`
levels are refused before anything recurses through them (Python's recursion limit would
otherwise end the run). Both are data errors: ``on_error=skip`` skips the record.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from treelit.builders.base import TREE_BUILDERS, TreeBuilder
from treelit.builders.vision import NO_VISION
from treelit.builders.image_text import content_for_template, image_text, template_renders_parts
from treelit.data.images import ImageLimits, ImageReader, image_ref, load_image_processor, tokens_per_image
from treelit.data.records import DataError, Record, check_key, check_text, finite_number
from treelit.rl.advantages import ADVANTAGES

ROLES = ("system", "user", "assistant", "tool")
_IMAGE_MARK = "\x00treelit-image\x00"  # where an image part was, until the tokenizer's image text replaces it
MAX_DEPTH = 64  # nesting levels of a conversation (list > message > tool call > function > arguments > ...)


class _RenderTimeout(BaseException):
    """Raised by the timer inside a render (a BaseException: no ``except Exception`` in the
    template engine swallows it)."""


@contextmanager
def _time_limit(seconds: Optional[float]) -> Iterator[None]:
    """Raise :class:`_RenderTimeout` in the block after ``seconds`` (main thread only)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    active = [True]

    def on_alarm(signum, frame):
        if active[0]:
            raise _RenderTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        try:
            active[0] = False  # a timer firing from here on is ignored
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _too_deep(x: Any, limit: int) -> bool:
    """Whether lists and objects nest more than ``limit`` levels in ``x`` (no recursion)."""
    stack = [(x, 1)] if isinstance(x, (dict, list)) else []
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        items = v.values() if isinstance(v, dict) else v
        stack.extend((c, d + 1) for c in items if isinstance(c, (dict, list)))
    return False


def _strings(x: Any, where: str) -> None:
    """Every string inside ``x`` must be encodable as UTF-8 (no lone surrogates)."""
    if isinstance(x, str):
        check_text(x, where)
    elif isinstance(x, dict):
        for k, v in x.items():
            _strings(v, f"{where}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _strings(v, f"{where}[{i}]")


def _check_tool_call(call: Any, where: str) -> None:
    if not isinstance(call, dict):
        raise DataError(f"{where}: a tool call must be an object, got {type(call).__name__}")
    nested = call.get("function") is not None  # (a null 'function' is absent, as Parquet writes it)
    fn = call["function"] if nested else call
    if nested and not isinstance(fn, dict):
        raise DataError(f"{where}.function: must be an object with 'name' and 'arguments', got {type(fn).__name__}")
    fwhere = f"{where}.function" if nested else where
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(f"{fwhere}.name: a tool call needs a non-empty string name, got {fn.get('name')!r}")
    args = fn.get("arguments")
    if not isinstance(args, (str, dict)):
        raise DataError(f"{fwhere}.arguments: must be a JSON string or an object, got {type(args).__name__}")


def validate_chat_record(rec: Dict[str, Any], source: str, group_key: Optional[str] = None) -> None:
    """Check a chat record's structure; raise :class:`DataError` naming the field."""
    if not isinstance(rec, dict):
        raise DataError(f"{source}: a record must be a JSON object, got {type(rec).__name__}")
    check_key(rec.get("id"), f"{source}: id")
    if group_key:
        check_key(rec.get(group_key), f"{source}: {group_key}")
    if rec.get("reward") is not None and not finite_number(rec["reward"]):
        raise DataError(f"{source}: reward: must be a finite number, got {rec['reward']!r}")
    for field, msgs in _conversations(rec, source):
        where = f"{source}: {field}"
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: must be a non-empty list of messages")
        if _too_deep(msgs, MAX_DEPTH):
            raise DataError(f"{where}: lists and objects nested more than {MAX_DEPTH} levels deep (messages, tool "
                            "calls and their arguments need a few)")
        for i, m in enumerate(msgs):
            at = f"{where}[{i}]"
            if not isinstance(m, dict):
                raise DataError(f"{at}: must be an object, got {type(m).__name__}")
            if m.get("role") not in ROLES:
                raise DataError(f"{at}.role: must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
            for key in ("content", "reasoning_content", "thinking"):
                if key == "content" and isinstance(m.get(key), list):
                    _check_parts(m[key], f"{at}.content")
                elif m.get(key) is not None and not isinstance(m[key], str):
                    raise DataError(f"{at}.{key}: must be a string or null, got {type(m[key]).__name__}")
            v = m.get("policy_version")  # the version that sampled an assistant turn (per-token provenance)
            if v is not None and (m["role"] != "assistant" or isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise DataError(f"{at}.policy_version: " + ("must be a non-negative integer, got " + repr(v)
                                if m["role"] == "assistant" else "only assistant messages are sampled"))
            if m.get("compaction") is not None and not isinstance(m["compaction"], bool):
                raise DataError(f"{at}.compaction: must be true or false, got {m['compaction']!r}")
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise DataError(f"{at}.tool_calls: must be a list, got {type(calls).__name__}")
                for c, call in enumerate(calls):
                    _check_tool_call(call, f"{at}.tool_calls[{c}]")
            _strings(m, at)


def _check_parts(parts: List[Any], where: str) -> None:
    """Content parts: ``{"type": "text", "text": ...}`` and image parts (:func:`image_ref`)."""
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in ("text", "image", "image_url"):
            raise DataError(f"{at}: a content part must be an object with type 'text', 'image' or 'image_url'")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise DataError(f"{at}.text: must be a string, got {type(part.get('text')).__name__}")
        image_ref(part, at)


def _conversations(rec: Dict[str, Any], source: str) -> List[Tuple[str, Any]]:
    """``(field name, messages)`` of each conversation of a record."""
    if "messages" in rec:
        return [("messages", rec["messages"])]
    if "traj" in rec:  # tau-bench style records
        return [("traj", rec["traj"])]
    branches = rec.get("branches")
    if isinstance(branches, list) and branches and all(isinstance(b, dict) and "messages" in b for b in branches):
        return [(f"branches[{c}].messages", b["messages"]) for c, b in enumerate(branches)]
    raise DataError(f"{source}: messages: a chat record needs 'messages' (or 'branches' with 'messages')")


def _normalise(m: Dict[str, Any], keep_thinking: bool, parts: bool = False) -> Dict[str, Any]:
    """A message as the template should see it (thinking folded into content or dropped; content
    parts kept as parts for a template that renders them, see :mod:`treelit.builders.image_text`)."""
    out = {k: v for k, v in m.items() if k not in ("reasoning_content", "thinking", "compaction", "policy_version")}
    if isinstance(out.get("content"), list):  # text and image parts: images become their placeholder text
        out["content"] = content_for_template(out["content"], _IMAGE_MARK, parts)
    if out.get("tool_calls"):
        out["tool_calls"] = [{k: v for k, v in c.items() if not (k == "function" and v is None)} for c in out["tool_calls"]]
    thinking = m.get("reasoning_content") or m.get("thinking")
    if out.get("content") is None:
        out["content"] = ""
    if keep_thinking and thinking:
        head = f"<think>\n{thinking}\n</think>\n\n"
        out["content"] = ([{"type": "text", "text": head}] + out["content"] if isinstance(out["content"], list)
                          else head + out["content"])
    return out


def _owned(mask: List[int], msgs: Sequence[Dict[str, Any]], train: Sequence[int], field: str):
    """The 0/1 loss mask of an encoded conversation whose mask names each target's message
    (``k + 1``: ``train[k]``), and ``(versions, where)``: per token its message's
    ``policy_version`` and that field's name (None, None: no trained message has a version)."""
    if not any(msgs[i].get("policy_version") is not None for i in train):
        return [1 if k else 0 for k in mask], None
    versions = [msgs[train[k - 1]].get("policy_version") if k else None for k in mask]
    where = [f"{field}[{train[k - 1]}].policy_version" if k else None for k in mask]
    return [1 if k else 0 for k in mask], (versions, where)


def _visible_history(msgs: Sequence[Dict[str, Any]], upto: int) -> List[int]:
    """Indices of messages a call at position ``upto`` sees (compaction applied)."""
    start = 0
    for i in range(upto):
        if msgs[i].get("compaction") is True:
            start = i
    keep = [i for i in range(start) if msgs[i].get("role") == "system"]
    return keep + list(range(start, upto))


@TREE_BUILDERS.register("chat")
class ChatBuilder(TreeBuilder):
    """Args:
        tokenizer_path: local directory of a Hugging Face tokenizer with a chat template.
        export: ``per_call`` or ``trajectory`` (see the module docstring).
        group_key: records with equal values of this field (a string or an integer) are merged
            into one tree (``None``: every record is its own tree).
        tokenizer: an already loaded tokenizer (overrides ``tokenizer_path``).
        advantage: estimator turning each record's ``reward`` into the advantage of all its
            branches, within the groups of ``group_key`` (``grpo``, ``rloo``,
            ``reinforce_pp_baseline``) or over the batch (``reinforce_pp``); None: no RL data.
            Each conversation counts once in its group, however many calls it has.
        render_timeout_s: the longest one chat-template render may take (None: no limit); a
            longer one fails naming the record (see the module docstring).
        processor_path: local directory of a vision-language checkpoint's image processor
            (``preprocessor_config.json``): content parts ``{"type": "image", "image": PATH}``,
            ``data:`` URIs and OpenAI ``image_url`` parts become that processor's placeholder
            tokens and pixel patches (:mod:`treelit.data.images`); None: records with images are refused.
        image_root: a folder images may also be read from besides the data file's, under the same
            rules (:mod:`treelit.data.images`).
        max_image_bytes, max_image_pixels: bounds on one image's file (or data: URI payload)
            and its decoded size; a larger image fails naming the record.
    """

    reward_per_record = True

    def __init__(
        self,
        tokenizer_path: Optional[str] = None,
        export: str = "per_call",
        group_key: Optional[str] = "group",
        tokenizer: Any = None,
        advantage: Optional[str] = None,
        render_timeout_s: Optional[float] = 10.0,
        processor_path: Optional[str] = None,
        max_image_bytes: int = ImageLimits.max_image_bytes,
        max_image_pixels: int = ImageLimits.max_image_pixels,
        processor: Any = None,
        image_root: Optional[str] = None,
        **advantage_options: Any,
    ) -> None:
        if export not in ("per_call", "trajectory"):
            raise ValueError(f"tree_builder.export must be 'per_call' or 'trajectory', got {export!r}")
        if render_timeout_s is not None and (isinstance(render_timeout_s, bool) or
                                             not isinstance(render_timeout_s, (int, float)) or
                                             not 0 < render_timeout_s < float("inf")):
            raise ValueError(f"tree_builder.render_timeout_s must be a positive number of seconds or null, "
                             f"got {render_timeout_s!r}")
        if tokenizer is None:
            if not tokenizer_path:
                raise ValueError("the chat tree builder needs tree_builder.tokenizer_path (a local tokenizer directory)")
            tokenizer = load_tokenizer(tokenizer_path)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer at {tokenizer_path!r} has no chat template")
        if advantage == "tree_node":
            raise ValueError("tree_builder.advantage=tree_node needs a reward per branch (tree_builder=sequences or "
                             "groups); the chat builder has one reward per conversation")
        if advantage is not None:
            ADVANTAGES.get(advantage)
        self.tok = tokenizer
        self.export = export
        self.group_key = group_key
        self.group_field = group_key or "group"
        self.advantage = advantage
        self.advantage_options = advantage_options
        self.render_timeout_s = None if render_timeout_s is None else float(render_timeout_s)
        self.images: Optional[ImageReader] = None
        self._parts = False  # content parts to the template as parts (only with images)
        if processor is None and processor_path:
            processor = load_image_processor(processor_path)
        if processor is not None:
            self.images = ImageReader(processor, ImageLimits(int(max_image_bytes), int(max_image_pixels)),
                                      image_root=image_root, tokens_per_image=tokens_per_image(processor_path))
            self.image_markers = image_text(self.tok, fixed_count=self.images.fixed is not None)
            self._image_text, self.image_token_id = self.image_markers.text, self.image_markers.token_id
            try:
                self._parts = template_renders_parts(self._render_plain, _IMAGE_MARK)
            except _RenderTimeout:
                raise ValueError(f"the chat template of {tokenizer_path or 'the tokenizer'} took longer than "
                                 f"tree_builder.render_timeout_s={self.render_timeout_s:g} s on one short "
                                 "message") from None
        self._record_path: Optional[str] = None

    def validate(self, rec: Any, source: str) -> None:
        validate_chat_record(rec, source, self.group_key)

    # rendering -------------------------------------------------------------------------
    def _render_plain(self, msgs: List[Dict[str, Any]]) -> str:
        with _time_limit(self.render_timeout_s):
            return self.tok.apply_chat_template(msgs, tokenize=False)

    def _render(self, msgs: List[Dict[str, Any]], gen: bool = False) -> str:
        with _time_limit(self.render_timeout_s):
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        return text.replace(_IMAGE_MARK, self._image_text) if self.images is not None else text

    def _encode(self, msgs: List[Dict[str, Any]], train: List[int], source: str,
                refs: Sequence[Tuple[str, str]] = ()) -> Tuple[List[int], List[int], List[Any]]:
        """Token ids, loss mask and images of ``msgs``, training the assistant messages in ``train``
        (``refs``: the images the messages show, in order, each with the field that names it)."""
        if refs and getattr(self, "model_vision", None) is False:
            raise DataError(f"{refs[0][1]}: {NO_VISION}")
        if refs and self.images is None:  # named by the image part itself
            raise DataError(f"{refs[0][1]}: the conversation has image parts; set tree_builder.processor_path to the "
                            "vision checkpoint's folder to read them")
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
            for k, (a, b) in enumerate(spans):
                if a <= s < b:
                    mask[t] = k + 1  # which trained message (see _owned); 0: context
                    break
        if self.images is None:
            return ids, mask, []
        return self._expand_images(ids, mask, refs, source)

    def _expand_images(self, ids: List[int], mask: List[int], refs: Sequence[Tuple[str, str]], source: str):
        """Each image placeholder token becomes the processor's ``t*h*w / merge**2`` copies (never targets)."""
        at = [t for t, i in enumerate(ids) if i == self.image_token_id]
        if len(at) != len(refs):
            raise DataError(f"{source}: the rendered conversation has {len(at)} image placeholder(s) for {len(refs)} "
                            "image part(s) (does the chat template drop message content, or does a text part "
                            "contain the image token itself?)")
        images = [self.images.read(r, self._record_path, where, self.image_token_id) for r, where in refs]
        out_ids: List[int] = []
        out_mask: List[int] = []
        prev = 0
        for t, im in zip(at, images):
            out_ids += ids[prev:t] + [self.image_token_id] * im.num_tokens
            out_mask += mask[prev:t] + [0] * im.num_tokens
            prev = t + 1
        return out_ids + ids[prev:], out_mask + mask[prev:], images

    def branches_of(self, msgs: List[Dict[str, Any]], source: str, field: str = "messages"
                    ) -> List[Tuple[List[int], List[int]]]:
        """``(ids, mask)`` per exported branch of one conversation (see :meth:`encode`)."""
        return [(ids, mask) for ids, mask, _, _, _ in self._branches(msgs, source, field)]

    def _branches(self, msgs, source, field):
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{source}: {field}: no assistant message to train on")
        try:
            if self.export == "trajectory":
                norm = [_normalise(m, keep_thinking=True, parts=self._parts) for m in msgs]
                train = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
                ids, mask, images = self._encode(norm, train, f"{source}: {field}",
                                                 _refs(msgs, range(len(msgs)), f"{source}: {field}"))
                return [(ids, *_owned(mask, msgs, train, field), field, images)]
            out = []
            for t, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                seen = _visible_history(msgs, t)
                ctx = [_normalise(msgs[i], keep_thinking=False, parts=self._parts) for i in seen]
                call = _normalise(m, keep_thinking=True, parts=self._parts)
                ids, mask, images = self._encode(ctx + [call], [len(ctx)],
                                                 f"{source}: {field}[{t}]",
                                                 _refs(msgs, seen + [t], f"{source}: {field}"))
                out.append((ids, *_owned(mask, msgs, [t], field), f"{field}[{t}]", images))
            return out
        except DataError:
            raise
        except _RenderTimeout:
            raise DataError(f"{source}: {field}: rendering the chat template took longer than "
                            f"tree_builder.render_timeout_s={self.render_timeout_s:g} s (a template that never ends? "
                            "raise the option if the conversation is genuinely that long)") from None
        except MemoryError:
            raise  # not a data error: the reader reports it naming the record
        except Exception as exc:  # the template or tokenizer failed on this record's content
            raise DataError(f"{source}: {field}: the chat template or tokenizer failed on this conversation "
                            f"({type(exc).__name__}: {exc})") from None

    # the builder interface -------------------------------------------------------------------
    def encode(self, record: Record) -> List[Dict[str, Any]]:
        out = []
        reward = record.data.get("reward")
        for field, msgs in _conversations(record.data, record.source):
            try:
                msgs = copy.deepcopy(msgs)
            except RecursionError:  # validate() refuses deep nesting first; this is a backstop
                raise DataError(f"{record.source}: {field}: nested too deeply to copy") from None
            self._record_path = record.path
            for ids, mask, versions, where, images in self._branches(msgs, record.source, field):
                br = {"input_ids": ids, "loss_mask": mask, "reward": reward, "_where": where}
                if versions is not None:  # per assistant turn, per token (treelit.lightning.token_staleness)
                    br["policy_versions"], br["_version_where"] = versions
                if images:
                    br["images"] = images
                out.append(br)
        return out

    def tree_keys(self, record: Record, branches: List[Dict[str, Any]]) -> List[Any]:
        key = record.data.get(self.group_key) if self.group_key else None
        return [key] * len(branches)

    def uses_ids(self, record: Record, tree_keys: List[Any], adv_keys: List[Any]) -> bool:
        return any(k is None for k in tree_keys)


def _refs(msgs: Sequence[Dict[str, Any]], which, field: str) -> List[Tuple[str, str]]:
    """The image references of messages ``which``, in order, each with where it is
    (``<field>[i].content[j]``, ``field`` the file, line and messages field)."""
    out = []
    for i in which:
        content = msgs[i].get("content")
        if isinstance(content, list):
            for j, p in enumerate(content):
                where = f"{field}[{i}].content[{j}]"
                if (r := image_ref(p, where)):
                    out.append((r, where))
    return out


def load_tokenizer(path: str):
    """Load a Hugging Face tokenizer from a local directory (never from the hub)."""
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path!r} does not exist")
    from transformers import AutoTokenizer  # optional and heavy (~1.5 s CPU): Hugging Face paths only

    try:  # never the directory's own Python code (auto_map)
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise ValueError(f"tokenizer directory {path!r} needs its own Python code (auto_map); treelit never runs "
                         "code from a tokenizer directory (trust_remote_code=False)") from None
