"""Tiny vision-language checkpoints and transformers as their per-branch float64 oracle.

``vision_checkpoint`` writes a random Qwen2.5-VL / Qwen3-VL / Qwen3.5 (vision + Gated
DeltaNet) / Qwen3.5-MoE / Qwen3-VL-MoE / GLM-4.5V checkpoint with 4-pixel patches and merge
size 2, or a Gemma-3 one (a SigLIP tower on 16x16 images, 4 tokens per image);
``image_processor`` is the Qwen families' own image processor (transformers' PIL backend)
sized to it, ``gemma3_processed`` Gemma-3's; ``vlm_branch_loss`` is per-branch training from
the definition: each branch through the transformers model with its own images
(``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` as the processor returns them;
Gemma-3: ``pixel_values`` and ``token_type_ids``), its positions from the model's forward, one
branch at a time.

``vision_checkpoint(path, "qwen3_5_moe")`` is Qwen3.5-MoE-shaped: the real layer pattern
(three Gated DeltaNet layers, then full attention; every MLP a mixture of experts beside a
gated shared expert; a vision tower, which in Qwen3.5 has no deepstack) at tiny sizes
(``num_hidden_layers=8`` for two rounds of the pattern).
"""

from __future__ import annotations

import numpy as np
import torch

IMAGE, VIDEO, START, END = 35, 36, 37, 38
VOCAB = 40
ROPE = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, max_position_embeddings=256, head_dim=8, rope_parameters=ROPE)
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=32)
MOE = dict(moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
QWEN35_MOE_TEXT = dict(
    {k: v for k, v in TEXT.items() if k != "intermediate_size"}, num_hidden_layers=4,  # layer types: the config's
    linear_key_head_dim=8, linear_value_head_dim=8,  # own pattern (full attention every 4th layer) at any depth
    linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=3,
    moe_intermediate_size=8, shared_expert_intermediate_size=12, num_experts=8, num_experts_per_tok=2,
    rope_parameters=dict(ROPE, mrope_interleaved=True, partial_rotary_factor=0.5))
GEMMA3_TEXT = dict({k: v for k, v in TEXT.items() if k != "rope_parameters"}, sliding_window=3,
                   query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention"])
FAMILIES = {
    "qwen2_5_vl": (dict(TEXT), dict(VISION, window_size=16, fullatt_block_indexes=[1])),
    "qwen3_vl": (dict(TEXT, rope_parameters=dict(ROPE, mrope_interleaved=True)),
                 dict(VISION, deepstack_visual_indexes=[0], num_position_embeddings=64)),
    "qwen3_5": (dict(TEXT, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_conv_kernel_dim=3,
                     rope_parameters=dict(ROPE, mrope_interleaved=True, partial_rotary_factor=0.5)),
                dict(VISION, num_position_embeddings=64)),
    # Qwen3.5-MoE-shaped: Gated DeltaNet layers with full attention every 4th layer (the real pattern,
    # full_attention_interval=4), every MLP a mixture of experts with a gated shared expert
    "qwen3_5_moe": (dict(QWEN35_MOE_TEXT), dict(VISION, num_position_embeddings=64)),
    "qwen3_vl_moe": (dict(TEXT, rope_parameters=dict(ROPE, mrope_interleaved=True), **MOE),
                     dict(VISION, deepstack_visual_indexes=[0], num_position_embeddings=64)),
    "glm4v_moe": (dict(TEXT, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                       routed_scaling_factor=2.5, first_k_dense_replace=1, n_group=2, topk_group=1,
                       norm_topk_prob=True,
                       rope_parameters=dict(ROPE, mrope_section=[1, 1, 0], partial_rotary_factor=0.5)),
                  dict(VISION, num_heads=2, image_size=16, rms_norm_eps=1e-5)),
    # Gemma-3: a SigLIP tower (16x16 images of 4x4 patches, pooled to 2x2 = 4 tokens), sliding and global
    # layers; its language model attends bidirectionally inside each image block
    "gemma3": (dict(GEMMA3_TEXT), dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=16, patch_size=4)),
}
GEMMA3_TOKENS = 4  # mm_tokens_per_image of the tiny Gemma-3
# the image markers and placeholder of each family (Qwen's by default; GLM-4.5V and Gemma-3 name theirs apart)
_QWEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
TOKEN_IDS = {"glm4v_moe": dict(image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START,
                               image_end_token_id=END, video_start_token_id=33, video_end_token_id=34),
             "gemma3": dict(image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END,
                            mm_tokens_per_image=GEMMA3_TOKENS)}


def vision_checkpoint(path, family: str, seed: int = 0, std: float = 0.3, **text_overrides):
    """A random float64 checkpoint of ``family`` at ``path`` (norm weights around 1)."""
    import transformers

    text, vision = FAMILIES[family]
    cfg = transformers.AutoConfig.for_model(family, text_config=dict(text, **text_overrides), vision_config=vision,
                                            **TOKEN_IDS.get(family, _QWEN_IDS))
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.2 * r if "norm" in name and p.ndim == 1 else std * r)
    model.save_pretrained(path)
    return path


def image_processor(max_pixels: int = 32 * 32):
    import transformers

    return transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                                                 max_pixels=max_pixels)


def vl_processor_dir(path) -> str:
    """A processor folder at ``path``: a Qwen2 BPE tokenizer with Qwen's vision tokens and
    :func:`image_processor` (no config.json)."""
    from treelit.data.tokenizers import build_qwen_vl_tokenizer

    d = build_qwen_vl_tokenizer(path)
    image_processor().save_pretrained(d)
    return str(d)


def png_bytes(img) -> bytes:
    """``img`` (a PIL image) encoded as PNG."""
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def random_image(rng: np.random.Generator, h: int, w: int):
    from PIL import Image

    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def gemma3_processed(pil, dtype=torch.float64, name=""):
    """A PIL image through Gemma-3's image processor (16x16, the tiny tower's size), as a treelit
    ProcessedImage: one ``[1, 3, 16, 16]`` pixel block, grid ``(1, 1, 1)``, ``GEMMA3_TOKENS`` tokens."""
    import transformers

    from treelit.tree.images import ProcessedImage

    proc = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16}, do_pan_and_scan=False)
    out = proc(images=[pil], return_tensors="pt")
    return ProcessedImage(out["pixel_values"].to(dtype), (1, 1, 1), GEMMA3_TOKENS, IMAGE, name=name)


def processed(proc, pil, dtype=torch.float64, name=""):
    """A PIL image through the processor, as a treelit ProcessedImage."""
    from treelit.tree.images import ProcessedImage

    out = proc(images=[pil], return_tensors="pt")
    grid = tuple(int(x) for x in out["image_grid_thw"][0])
    return ProcessedImage(out["pixel_values"].to(dtype), grid, grid[0] * grid[1] * grid[2] // 4, IMAGE, name=name)


def span(im):
    """An image's tokens as the Qwen processors write them."""
    return [START] + [IMAGE] * im.num_tokens + [END]


def load_reference(path, dtype=torch.float64):
    """The transformers model of ``path`` (sdpa; Qwen3.5's Gated DeltaNet on transformers' torch functions;
    experts in transformers' eager loop)."""
    import transformers

    from hf_oracle import no_hub_kernels
    from treelit.models.hf_kernels import bind_torch_kernels

    kw = no_hub_kernels()
    if getattr(transformers.AutoConfig.from_pretrained(path).text_config, "num_experts_per_tok", None):
        kw["experts_implementation"] = "eager"  # MoE: grouped_mm has no float64 kernel
    ref = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                                   **kw).to(dtype)
    bind_torch_kernels(ref)
    return ref


def branch_inputs(model, images):
    """``inputs(b, ids)``: branch b's image arguments as the processor returns them (positions
    from this branch alone)."""
    gemma3 = model.config.model_type == "gemma3"

    def inputs(b, ids):
        model.model.rope_deltas = None  # positions from this branch alone
        ims = images[b]
        if not ims:
            return {}
        if gemma3:  # plain positions; token types mark the image blocks (bidirectional inside each)
            return dict(pixel_values=torch.cat([i.pixel_values for i in ims]), token_type_ids=(ids == IMAGE).long())
        return dict(pixel_values=torch.cat([i.pixel_values for i in ims]),
                    image_grid_thw=torch.tensor([list(i.grid_thw) for i in ims]),
                    mm_token_type_ids=(ids == IMAGE).int())
    return inputs


def vlm_branch_loss(model, branches, images, masks, weights, aggregation: str = "token-mean") -> torch.Tensor:
    """Per-branch loss from the definition (see the module docstring)."""
    from hf_oracle import hf_branch_loss

    return hf_branch_loss(model, branches, masks, weights, aggregation, inputs=branch_inputs(model, images))


def text_mask(branch):
    """Train every text token (never an image's own tokens)."""
    return [0 if t in (IMAGE, VIDEO, START) else 1 for t in branch]


def random_forest(rng: np.random.Generator, pool, n_branches: int = 5):
    """Branches that grow off random points of earlier ones (right after an image included),
    each continuing with text and images drawn from ``pool`` (which may hold equal images)."""
    branches, images = [], []
    for b in range(n_branches):
        if branches and rng.random() < 0.8:
            src = int(rng.integers(len(branches)))
            cut = int(rng.integers(1, len(branches[src])))  # any point: right after an image included
            br = list(branches[src][:cut])
            shown = sum(1 for i in range(cut) if br[i] == START)
            ims = list(images[src][:shown])
            if br[-1] in (START, IMAGE):  # a cut inside an image span drops the partial image
                br = br[: len(br) - br[::-1].index(START) - 1]
                ims = ims[:-1]
        else:
            br, ims = [int(rng.integers(1, 6))], []
        for _ in range(int(rng.integers(1, 3))):
            if rng.random() < 0.5:
                im = pool[int(rng.integers(len(pool)))]
                br += span(im)
                ims.append(im)
            br += [int(v) for v in rng.integers(1, 30, size=int(rng.integers(1, 4)))]
        branches.append(br)
        images.append(ims)
    return branches, images
