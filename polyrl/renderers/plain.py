"""Plain-text prompt templates of GEM's reference trainers: ``qwen3_game``, ``qwen3_general``, ``no``.

GEM formats a single observation string into a fixed prompt instead of using a chat template; these
renderers reproduce that text exactly so results are comparable with GEM's. The observation is the
content of the user messages (joined by newlines; system messages are ignored as in GEM). Tools are
not supported.

Multi-turn: GEM re-renders one prompt per turn from a concatenated observation; we never re-render,
so a later observation is wrapped in the same template and appended after the sampled reply (for
the qwen3 templates that yields well-formed ChatML turns; for ``no`` the text is simply appended).
"""

from __future__ import annotations

from polyrl.renderers.base import Message, Renderer, ToolSpec, message_text, register_renderer

IM_END = "<|im_end|>"
_BOXED = (
    "\nPlease reason step by step, and put your final answer within \\boxed{}."
    "<|im_end|>\n<|im_start|>assistant\n"
)


class PlainTemplateRenderer(Renderer):
    """A prompt is ``prefix + observation + suffix``. The assistant turn ends with :meth:`end_marker`;
    ``separator`` follows it before the next wrapped observation."""

    prefix = ""
    suffix = ""
    separator = ""

    def end_marker(self) -> str:
        return IM_END

    def wrap(self, messages: list[Message]) -> str:
        """The templated text for the user observation(s) in ``messages``."""
        for m in messages:
            if m.get("role") not in ("user", "system"):
                raise ValueError(f"{self.name} renderer renders only user observations, not {m.get('role')}")
        observation = "\n".join(message_text(m) for m in messages if m.get("role") == "user")
        return self.prefix + observation + self.suffix

    def initial_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        if tools:
            raise ValueError(f"{self.name} renderer does not support tools; use a chat renderer (qwen3)")
        return self.encode(self.wrap(messages))

    def continuation(self, messages: list[Message], assistant_finished: bool = True) -> list[int]:
        close = "" if assistant_finished else self.end_marker()
        return self.encode(close + self.separator + self.wrap(messages))

    def stop_sequences(self) -> list[int] | list[str]:
        return self.stop_marker(self.end_marker())

    def assistant_tokens(self, message: Message) -> list[int]:
        return self.encode(message_text(message) + self.end_marker())

    def supervised(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[float]]:
        return self.supervised_by_turns(messages, tools)

    def parse_response(self, tokens: list[int]) -> Message:
        text = self.decode(tokens).removesuffix(self.end_marker())
        return {"role": "assistant", "content": text.strip(), "tool_calls": [], "tool_call_errors": []}


@register_renderer("qwen3_game")
class Qwen3GameRenderer(PlainTemplateRenderer):
    prefix = "<|im_start|>user\nYou are playing language games. Make valid actions to win.\nObservation: "
    suffix = _BOXED
    separator = "\n"


@register_renderer("qwen3_general")
class Qwen3GeneralRenderer(PlainTemplateRenderer):
    prefix = "<|im_start|>user\nQuestion: "
    suffix = _BOXED
    separator = "\n"


@register_renderer("no")
class NoTemplateRenderer(PlainTemplateRenderer):
    """The observation as is; turns end with the tokenizer's EOS (``<|endoftext|>`` if it has none)."""

    def end_marker(self) -> str:
        return self.tokenizer.eos_token or "<|endoftext|>"
