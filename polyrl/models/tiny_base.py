"""What the tiny text and vision-language models share: the size of a Qwen3 text model and the
byte-level BPE tokenizer trained offline on a synthetic corpus (digits split one per token, as in Qwen's
tokenizer) with Qwen3's chat special tokens and chat template."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources

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
