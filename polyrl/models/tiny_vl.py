"""Tiny vision-language models in the Qwen3-VL architecture, built offline.

What ``polyrl tiny-model OUT --size vl-unit`` writes is a real Hugging Face model directory: random
weights of ``Qwen3VLForConditionalGeneration`` (a vision tower with its patch merger and DeepStack merger,
a Qwen3 language model with multimodal rotary positions), a byte-level BPE tokenizer with Qwen's chat and
vision tokens (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``) and the
Qwen3-VL-Instruct chat template, and the Qwen2-VL image processor's ``preprocessor_config.json`` (patch 16,
merge 2, as Qwen3-VL's) with small pixel bounds, so a 64 x 64 image is 4 tokens. It loads offline with
``AutoModelForImageTextToText``, ``AutoTokenizer`` and ``AutoImageProcessor`` (the Pillow backend,
``Qwen2VLImageProcessorPil``: torchvision is not needed). ``AutoProcessor`` also wants Qwen3-VL's video
processor, which needs torchvision, as it does for the real models.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from polyrl.models.tiny_base import ADDED_TOKENS, TinySize

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
PATCH_SIZE = 16  # Qwen3-VL's
MERGE_SIZE = 2


@dataclass(frozen=True)
class VisionSize:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    min_pixels: int  # the processor's bounds: images are resized into [min_pixels, max_pixels]
    max_pixels: int
    init_std: float = 0.02


@dataclass(frozen=True)
class TinyVLSize:
    text: TinySize
    vision: VisionSize


VL_SIZES: dict[str, TinyVLSize] = {
    # ~0.3M parameters: unit tests and the visual quickstart. A 64 x 64 image is 4 tokens, 128 x 128 16.
    "vl-unit": TinyVLSize(
        TinySize(64, 2, 4, 2, 192, 1024, init_std=0.2, qk_norm_scale=1.5),
        VisionSize(1, 32, 2, 64, min_pixels=32 * 32, max_pixels=128 * 128),
    ),
}


def chat_template() -> str:
    return resources.files("polyrl.models").joinpath("qwen3_vl_chat_template.jinja").read_text()


def build_vl_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE with Qwen's chat and vision tokens (special) and content markers (added), the
    Qwen3-VL-Instruct chat template, trained also on the visual environment's prompts and answers."""
    from polyrl.envs.builtin.visual import tokenizer_text
    from polyrl.models.tiny_base import train_bpe

    fast = train_bpe(vocab_size, seed, False, SPECIAL_TOKENS, extra_text=tuple(tokenizer_text()),
                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = chat_template()
    return fast


def vl_config(spec: TinyVLSize, tokenizer):
    from transformers import Qwen3VLConfig

    text, vision = spec.text, spec.vision
    head_dim = text.head_dim or text.hidden_size // text.num_attention_heads
    half = head_dim // 2  # rotary frequencies, split over (time, height, width) as Qwen3-VL's 24/20/20 of 64
    section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size, "num_hidden_layers": text.num_hidden_layers,
            "num_attention_heads": text.num_attention_heads, "num_key_value_heads": text.num_key_value_heads,
            "head_dim": head_dim, "max_position_embeddings": text.max_positions,
            "rope_parameters": {"rope_type": "default", "rope_theta": text.rope_theta,
                                "mrope_section": section, "mrope_interleaved": True},
            "initializer_range": text.init_std,
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        },
        vision_config={
            "depth": vision.depth, "hidden_size": vision.hidden_size, "num_heads": vision.num_heads,
            "intermediate_size": vision.intermediate_size, "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": 2, "out_hidden_size": text.hidden_size,
            "num_position_embeddings": (vision.max_pixels // PATCH_SIZE**2),
            "deepstack_visual_indexes": [0], "initializer_range": vision.init_std,
        },
        tie_word_embeddings=True, **ids,
    )


def image_processor(spec: VisionSize):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2,
                                    min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def build_tiny_vl_model(out: Path, size: str, seed: int = 0) -> Path:
    """Write the tiny vision-language model ``size`` (one of :data:`VL_SIZES`) to ``out``."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    spec = VL_SIZES[size]
    tokenizer = build_vl_tokenizer(spec.text.vocab_size, seed)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(vl_config(spec, tokenizer))
    if spec.text.qk_norm_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                layer.self_attn.q_norm.weight.fill_(spec.text.qk_norm_scale)
                layer.self_attn.k_norm.weight.fill_(spec.text.qk_norm_scale)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor(spec.vision).save_pretrained(out)
    (out / "polyrl_tiny.json").write_text(json.dumps({"size": size, "seed": seed, "spec": asdict(spec)}))
    return out
