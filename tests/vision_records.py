"""Processor folders of the tiny vision checkpoints of ``vision_oracle``, built offline: a
character-level tokenizer whose image tokens have the checkpoint's ids, a chat template in the
family's manner, and the family's own processor (Gemma-3: ``Gemma3Processor`` with
``Gemma3ImageProcessor``; GLM-4.5V: ``Glm4vProcessor`` with ``Glm4vImageProcessor``), so that a
record's tokens and pixels can be held against the processor's own chat template and ``__call__``
(``glm_record``: a chat record with two images and, per branch, what the processor is given).

``CaptureStep`` is a callback for in-process ``treelit-train`` runs: the first optimizer step's
loss and every parameter gradient (before the update; run with ``grad_clip=null``).
"""

from __future__ import annotations

import string

import numpy as np

import lightning.pytorch as pl

from vision_oracle import END, IMAGE, START, VOCAB, random_image

CHARS = list(string.ascii_lowercase) + [" ", "\n", ":", "?", "."]
# a template in Gemma-3's manner: <bos>, turns of user / model, text parts trimmed, an image part as <start_of_image>
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] | trim }}{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif p['type'] == 'text' -%}{{ p['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
GEMMA3_SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<start_of_turn>", 5: "<end_of_turn>",
                   IMAGE: "<image_soft_token>", START: "<start_of_image>", END: "<end_of_image>"}
# a template in GLM-4.5V's manner: <|user|> / <|assistant|> turns, an image part as its three markers
GLM4V_TEMPLATE = (
    "[gMASK]<sop>{%- for m in messages -%}{{ '<|' + m['role'] + '|>\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{%- elif p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}")
GLM4V_SPECIALS = {0: "<|endoftext|>", 1: "[gMASK]", 2: "<sop>", 3: "<unk>", 4: "<|user|>", 5: "<|assistant|>",
                  IMAGE: "<|image|>", START: "<|begin_of_image|>", END: "<|end_of_image|>"}


def char_tokenizer(specials, template, **kw):
    """A fast tokenizer of ``VOCAB`` ids: ``specials`` at their ids, one token per character of
    ``CHARS`` in the ids left (a chat template ``template``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    free = [i for i in range(VOCAB) if i not in specials]
    assert len(free) >= len(CHARS)
    vocab = dict(zip(CHARS, free))
    vocab.update({t: i for i, t in specials.items()})
    backend = Tokenizer(models.WordLevel(vocab, unk_token=specials[3]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=specials[3], pad_token=specials[0], **kw)
    tok.chat_template = template
    return tok


def gemma3_processor(tokens: int = 4):
    """Gemma-3's processor for the tiny checkpoint: 16x16 images, ``tokens`` tokens per image."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    tok = char_tokenizer(GEMMA3_SPECIALS, GEMMA3_TEMPLATE, bos_token="<bos>", eos_token="<eos>",
                         extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                               "image_token": "<image_soft_token>"})
    ip = Gemma3ImageProcessorPil(size={"height": 16, "width": 16}, do_pan_and_scan=False)
    return Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=GEMMA3_TEMPLATE, image_seq_length=tokens)


def glm4v_processor():
    """GLM-4.5V's processor for the tiny checkpoint: 4-pixel patches, merge size 2 (without its
    video processor, which needs torchvision; images only)."""
    from transformers import Glm4vImageProcessorPil, Glm4vProcessor

    class ImagesOnly(Glm4vProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    tok = char_tokenizer(GLM4V_SPECIALS, GLM4V_TEMPLATE, eos_token="<|endoftext|>")
    ip = Glm4vImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                size={"shortest_edge": 64, "longest_edge": 32 * 32})
    return ImagesOnly(image_processor=ip, tokenizer=tok, chat_template=GLM4V_TEMPLATE)


def processor_dir(path, processor) -> str:
    """``processor``'s tokenizer and image processor saved at ``path`` (Gemma-3: the whole processor)."""
    path.mkdir(parents=True, exist_ok=True)
    if getattr(processor, "video_processor", None) is None and hasattr(processor, "video_token"):
        processor.tokenizer.save_pretrained(path)
        processor.image_processor.save_pretrained(path)
    else:
        processor.save_pretrained(path)
    return str(path)


def glm_record(folder):
    """A chat record with two images (files in ``folder``), and per branch the processor's
    messages and images."""
    rng = np.random.default_rng(0)
    pics = {"a.png": random_image(rng, 20, 16), "b.png": random_image(rng, 16, 24)}
    for name, pic in pics.items():
        pic.save(folder / name)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image", "image": "a.png"},
                                         {"type": "text", "text": " what?"}]},
            {"role": "assistant", "content": "red."},
            {"role": "user", "content": [{"type": "image", "image": "b.png"}, {"type": "text", "text": "and this?"}]},
            {"role": "assistant", "content": "blue."}]
    plain = [dict(m, content=[{"type": "image"} if p["type"] == "image" else p for p in m["content"]])
             if isinstance(m["content"], list) else m for m in msgs]
    return {"id": "g", "messages": msgs}, [(plain[:2], [pics["a.png"]]), (plain, [pics["a.png"], pics["b.png"]])]


class CaptureStep(pl.Callback):
    """Keeps the first optimizer step's loss and gradients (by parameter name) in ``CAPTURED``."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if "grads" not in CAPTURED:
            CAPTURED["loss"] = sum(v for _, v in pl_module._micro_losses)
            CAPTURED["grads"] = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()
                                 if p.grad is not None}


CAPTURED: dict = {}
