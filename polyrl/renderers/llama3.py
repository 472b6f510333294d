"""Llama 3 renderer (``llama3``): header-delimited turns, JSON tool calls, ``ipython`` tool role.

Format: ``<|begin_of_text|>``, then per turn ``<|start_header_id|>role<|end_header_id|>\\n\\n`` +
text + ``<|eot_id|>``; contents are trimmed as Llama's template does. Tools go in the system turn
with Llama 3.1's JSON calling convention (``{"name": ..., "parameters": {...}}`` as the whole
assistant reply; several calls on separate lines). Not a token-exact copy of Llama 3.1's template
(which also injects knowledge-cutoff/date lines); it is a faithful Llama 3 layout.

Works with any tokenizer: the markers are encoded as text, so a tokenizer without Llama's special
tokens still renders them (as several tokens) and the stop sequence becomes the string
``<|eot_id|>``. With a string stop the sampler must keep the stop string in the sampled tokens
(otherwise report the turn as unfinished so ``continuation`` closes it).
"""

from __future__ import annotations

import json
import re

from polyrl.renderers.base import (
    Message,
    Renderer,
    ToolSpec,
    message_text,
    register_renderer,
    tool_call_from_json,
)

BOT, EOT = "<|begin_of_text|>", "<|eot_id|>"
_ENDINGS = (EOT, "<|eom_id|>", "<|end_of_text|>")
_CALL_START = re.compile(r'\{\s*"name"\s*:')
_TOOLS_INTRO = (
    "You have access to the following functions. To call a function, respond with JSON for a function "
    'call in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
    "Do not use variables.\n\n"
)


def _turn(role: str, text: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}"


@register_renderer("llama3")
class Llama3Renderer(Renderer):
    def initial_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        has_system = bool(messages) and messages[0].get("role") == "system"
        text = BOT
        if has_system or tools:
            preamble = _TOOLS_INTRO + "".join(json.dumps(t, indent=4) + "\n\n" for t in tools or [])
            system = message_text(messages[0]).strip() if has_system else ""
            text += _turn("system", (preamble if tools else "") + system) + EOT
        return self.encode(text + self._render(messages[int(has_system) :]) + _turn("assistant", ""))

    def continuation(self, messages: list[Message], assistant_finished: bool = True) -> list[int]:
        close = "" if assistant_finished else EOT  # a finished turn already ends with <|eot_id|>
        return self.encode(close + self._render(messages) + _turn("assistant", ""))

    def stop_sequences(self) -> list[int] | list[str]:
        return self.stop_marker(EOT)

    def assistant_tokens(self, message: Message) -> list[int]:
        return self.encode(self._assistant_text(message) + EOT)

    def supervised(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[float]]:
        return self.supervised_by_turns(messages, tools)

    def parse_response(self, tokens: list[int]) -> Message:
        text = self.decode(tokens)
        while text.endswith(_ENDINGS):
            text = text[: -len(next(e for e in _ENDINGS if text.endswith(e)))]
        text = text.removeprefix("<|python_tag|>")
        calls: list[Message] = []
        errors: list[str] = []
        start = _CALL_START.search(text)
        content = text if start is None else text[: start.start()]
        pos = len(text) if start is None else start.start()
        decoder = json.JSONDecoder()
        while pos < len(text):  # one or more JSON calls, separated by whitespace or ';'
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                snippet = text[pos : pos + 200]
                errors.append(f"invalid JSON in tool call ({e.msg} at char {e.pos - pos}): {snippet!r}")
                break
            except RecursionError:
                errors.append("invalid JSON in tool call (nested too deeply)")
                break
            call, error = tool_call_from_json(obj, f"call_{len(calls)}")
            if call is not None:
                calls.append(call)
            else:
                errors.append(error or "invalid tool call")
            pos = end
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos < len(text) and text[pos] != "{":  # trailing prose stays content
                content = content.rstrip() + "\n" + text[pos:]
                break
        content = content.strip()
        return {"role": "assistant", "content": content, "tool_calls": calls, "tool_call_errors": errors}

    def _render(self, messages: list[Message]) -> str:
        out = []
        for m in messages:
            role = m.get("role")
            if role in ("user", "system"):
                out.append(_turn(role, message_text(m).strip()) + EOT)
            elif role == "assistant":
                out.append(_turn("assistant", self._assistant_text(m)) + EOT)
            elif role in ("tool", "ipython"):
                out.append(_turn("ipython", message_text(m)) + EOT)
            else:
                raise ValueError(f"llama3 renderer: unsupported message role {role!r}")
        return "".join(out)

    @staticmethod
    def _assistant_text(message: Message) -> str:
        """Content, then each tool call as a JSON line (what the model is asked to emit)."""
        lines = [message_text(message).strip()]
        for call in message.get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            lines.append(json.dumps({"name": fn["name"], "parameters": args}, ensure_ascii=False))
        return "\n".join(line for line in lines if line)
