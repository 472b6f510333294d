"""ChatML renderers with Qwen3's conventions (``qwen3``, ``qwen3_disable_thinking``, ``chatml``).

The text produced for prompts is exactly what Qwen3's chat template renders (system prompt, the
``# Tools`` block, ``<tool_call>`` JSON, tool results grouped as ``<tool_response>`` blocks in one
user turn), so ``initial_prompt`` equals ``apply_chat_template(..., add_generation_prompt=True)``
token for token. After that nothing is re-rendered: sampled tokens are kept as they are, which is
where this differs from the template on purpose (the template drops ``<think>`` blocks of earlier
turns; a rollout keeps what the model actually saw and produced). A template that writes a default
system prompt when the conversation has none (SmolLM2, Qwen2.5) has it read once from the template.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from polyrl.renderers.base import (
    Message,
    Renderer,
    ToolSpec,
    message_text,
    register_renderer,
    tool_call_from_json,
)

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _block(role: str, text: str) -> str:
    return f"{IM_START}{role}\n{text}{IM_END}\n"


def template_default_system(tokenizer) -> str | None:
    """The system prompt the tokenizer's chat template writes when a conversation has none, if any."""
    probe = "\x00probe\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False)
    except Exception:  # no template, or one that needs more than a user message
        return None
    head = f"{IM_START}system\n"
    system, sep, rest = str(text).partition(f"{IM_END}\n{IM_START}user\n{probe}")
    if not sep or not system.startswith(head):
        return None
    return system[len(head):]


def _is_tool_response(m: Message) -> bool:
    text = m.get("content")
    return isinstance(text, str) and text.startswith("<tool_response>") and text.endswith("</tool_response>")


@register_renderer("qwen3")
class ChatMLRenderer(Renderer):
    """Qwen3 ChatML. ``think``: split ``<think>`` blocks into ``reasoning_content`` (and render
    ``reasoning_content`` back); ``empty_think_prompt``: Qwen3's ``enable_thinking=False``
    generation prompt, which pre-fills an empty think block."""

    think = True
    empty_think_prompt = False

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.default_system = template_default_system(tokenizer)

    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n" + ("<think>\n\n</think>\n\n" if self.empty_think_prompt else "")

    def initial_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        has_system = bool(messages) and messages[0].get("role") == "system"
        if not has_system and self.default_system is not None:
            messages, has_system = [{"role": "system", "content": self.default_system}, *messages], True
        text = ""
        if tools:
            system = message_text(messages[0]) + "\n\n" if has_system else ""
            tool_lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
            text = _block("system", system + _TOOLS_INTRO + tool_lines + _TOOLS_OUTRO)
        elif has_system:
            text = _block("system", message_text(messages[0]))
        # The template's history rule: only assistant turns after the last real user query keep
        # their thinking (and the very last message gets a think block even if empty).
        last_query = max(
            (i for i, m in enumerate(messages) if m.get("role") == "user" and not _is_tool_response(m)),
            default=len(messages) - 1,
        )
        last = len(messages) - 1
        text += self._render(messages, int(has_system), lambda i, r: i > last_query and bool(r or i == last))
        return self.encode(text + self.generation_prompt())

    def continuation(self, messages: list[Message], assistant_finished: bool = True) -> list[int]:
        # Sampled tokens stop at <|im_end|>; the template's newline after it belongs to us.
        close = "\n" if assistant_finished else IM_END + "\n"
        return self.encode(close + self._render(messages, 0, lambda i, r: False) + self.generation_prompt())

    def stop_sequences(self) -> list[int] | list[str]:
        return self.stop_marker(IM_END)

    def assistant_tokens(self, message: Message) -> list[int]:
        # As sampled: thinking is written when there is some, unless the prompt pre-filled it.
        text = self._assistant_text(message, lambda r: bool(r) and not self.empty_think_prompt)
        return self.encode(text + IM_END)

    def supervised(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[float]]:
        return self.supervised_by_turns(messages, tools)

    def parse_response(self, tokens: list[int]) -> Message:
        text = self.decode(tokens)
        while text.endswith((IM_END, EOT)):
            text = text[: -len(IM_END if text.endswith(IM_END) else EOT)]
        message: Message = {"role": "assistant"}
        if self.think and ("</think>" in text or "<think>" in text):
            if "</think>" in text:  # opening tag may be in the prompt (thinking-only templates)
                head, _, text = text.partition("</think>")
                head = head.split("<think>")[-1]
            else:  # cut off while thinking
                text, _, head = text.partition("<think>")
            message["reasoning_content"] = head.strip("\n")
        calls: list[Message] = []
        errors: list[str] = []
        pieces: list[str] = []
        pos = 0
        for n, match in enumerate(_TOOL_CALL.finditer(text)):
            pieces.append(text[pos : match.start()])
            pos = match.end()
            body = match.group(1).strip()
            try:
                call, error = tool_call_from_json(json.loads(body), f"call_{len(calls)}")
            except json.JSONDecodeError as e:
                call, error = None, f"invalid JSON ({e.msg} at char {e.pos}): {body[:200]!r}"
            except RecursionError:
                call, error = None, "invalid JSON (nested too deeply)"
            if call is not None:
                calls.append(call)
            else:
                errors.append(f"<tool_call> block {n}: {error}")
        tail = text[pos:]
        if "<tool_call>" in tail:
            tail, _, body = tail.partition("<tool_call>")
            errors.append(f"unclosed <tool_call> (missing </tool_call>): {body.strip()[:200]!r}")
        pieces.append(tail)
        message.update(content="".join(pieces).strip(), tool_calls=calls, tool_call_errors=errors)
        return message

    def _render(self, messages: list[Message], start: int, think_block: Callable[[int, str], bool]) -> str:
        """``messages[start:]`` as the template renders them (tool groups look at neighbours in
        ``messages``); ``think_block(i, reasoning)`` says whether assistant message ``i`` is written
        with a think block."""
        out = []
        for i in range(start, len(messages)):
            m = messages[i]
            role = m.get("role")
            if role in ("user", "system"):
                out.append(_block(role, message_text(m)))
            elif role == "assistant":
                text = self._assistant_text(m, lambda r, i=i: think_block(i, r))
                out.append(f"{IM_START}assistant\n{text}{IM_END}\n")
            elif role == "tool":
                first = i == 0 or messages[i - 1].get("role") != "tool"
                last = i == len(messages) - 1 or messages[i + 1].get("role") != "tool"
                response = f"\n<tool_response>\n{message_text(m)}\n</tool_response>"
                out.append((f"{IM_START}user" if first else "") + response + (f"{IM_END}\n" if last else ""))
            else:
                raise ValueError(f"{self.name} renderer: unsupported message role {role!r}")
        return "".join(out)

    def _assistant_text(self, message: Message, think_block: Callable[[str], bool]) -> str:
        """Assistant turn text without header or end token. Reasoning comes from
        ``reasoning_content`` or a ``<think>`` block in the content (as in the template) and is
        written as a think block when ``think_block(reasoning)``."""
        content = message_text(message)
        reasoning = message.get("reasoning_content")
        if self.think and not isinstance(reasoning, str):
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
        text = content
        if self.think and think_block(reasoning or ""):
            text = "<think>\n" + (reasoning or "").strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        for k, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function", call)
            args = fn.get("arguments", {})
            args_json = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            sep = "\n" if (k == 0 and content) or k > 0 else ""
            text += f'{sep}<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args_json}}}\n</tool_call>'
        return text


@register_renderer("qwen3_disable_thinking")
class Qwen3NoThinkRenderer(ChatMLRenderer):
    """Qwen3 with ``enable_thinking=False``: each generation prompt pre-fills an empty think block."""

    empty_think_prompt = True


@register_renderer("chatml")
class PlainChatMLRenderer(ChatMLRenderer):
    """Same ChatML and tool format, for non-thinking models: ``<think>`` is ordinary text."""

    think = False
