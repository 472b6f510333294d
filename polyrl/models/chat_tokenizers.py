"""Small offline tokenizers carrying the special tokens of each chat-format family of Tinker's lineup.

The real tokenizers (Qwen3.5's, gpt-oss's o200k harmony, Kimi's tiktoken one, GLM's, ...) are hub
downloads; these stand in for them wherever a test or a tiny model needs a family's markers as single
tokens without the network: the same byte-level BPE as the tiny models' tokenizer (``tiny.train_bpe``),
plus the family's turn markers as special tokens and its content markers (``<think>``, tool-call tags)
as plain added tokens, as the real tokenizers have them. Only the markers are real: ordinary text
tokenizes differently from the real vocabulary, which no chat format depends on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl.errors import UserInputError


@dataclass(frozen=True)
class ChatTokens:
    special: tuple[str, ...]  # turn markers: special tokens (dropped by decode(skip_special_tokens=True))
    added: tuple[str, ...] = ()  # content markers: plain added tokens, still single tokens
    named: dict[str, str] = field(default_factory=dict)  # bos_token / eos_token / pad_token

_THINK = ("<think>", "</think>")
_QWEN_TOOLS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

FAMILIES: dict[str, ChatTokens] = {
    # Qwen3 / Qwen3-VL / Qwen3.5 / 3.6 / 3.8: ChatML, vision markers, thinking and tool tags.
    "qwen": ChatTokens(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
         "<|image_pad|>"),
        _THINK + _QWEN_TOOLS,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
    # Nemotron 3 / 3.5: ChatML with <s>/</s>.
    "nemotron": ChatTokens(
        ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"),
        _THINK + _QWEN_TOOLS,
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"},
    ),
    # Llama 3.x: header tokens; also role_colon's BOS for the Llama base models.
    "llama3": ChatTokens(
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"),
        (),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    # DeepSeek V3.1 and V4.1 (V4.1 adds <｜System｜> and writes tool calls with ｜DSML｜).
    "deepseek": ChatTokens(
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜System｜>", "<｜User｜>", "<｜Assistant｜>",
         "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
         "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
         "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"),
        _THINK + ("｜DSML｜",),
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    ),
    # gpt-oss: OpenAI's harmony format.
    "gpt_oss": ChatTokens(
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
         "<|constrain|>", "<|return|>", "<|call|>"),
        (),
        {"eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
    ),
    # Kimi K2 / K2.5 / K2.6 (the real one is a tiktoken tokenizer loaded with trust_remote_code).
    "kimi": ChatTokens(
        ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
         "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_begin|>", "<|media_content|>",
         "<|media_end|>"),
        _THINK,
        {"bos_token": "[BOS]", "eos_token": "<|im_end|>"},
    ),
    # GLM 5.3: role tokens end the previous turn; XML-ish tool calls.
    "glm": ChatTokens(
        ("[gMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
         "<|endoftext|>"),
        _THINK + ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                  "<tool_response>", "</tool_response>"),
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    ),
}


def build_chat_tokenizer(family: str, vocab_size: int = 1024, seed: int = 0):
    """A small ``PreTrainedTokenizerFast`` with ``family``'s chat markers as single tokens (see
    :data:`FAMILIES`), built offline in a fraction of a second."""
    from polyrl.models.tiny_base import train_bpe

    if family not in FAMILIES:
        raise UserInputError(f"unknown chat-token family {family!r}; choose one of {sorted(FAMILIES)}")
    spec = FAMILIES[family]
    fast = train_bpe(vocab_size, seed, False, list(spec.special), **spec.named)
    fast.add_special_tokens({"additional_special_tokens": list(spec.special)})
    fast.add_tokens(list(spec.added))
    return fast
