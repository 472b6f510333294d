"""Renderers: chat messages <-> tokens, and parsing the model's replies.

Tokens, not text: a rollout renders the *initial* prompt once with :meth:`Renderer.initial_prompt`;
after each sampled assistant turn it appends exactly the sampled tokens and then
:meth:`Renderer.continuation` of the environment's new messages. History is never re-rendered, so
the training sequence is exactly the sampled one.

Registry: ``@register_renderer("name")`` on a subclass; ``get_renderer(name, tokenizer)`` builds one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

Message = dict[str, Any]
ToolSpec = dict[str, Any]


class Renderer(ABC):
    name: str = ""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @abstractmethod
    def initial_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        """Tokens of the conversation so far, ending with the assistant generation prompt."""

    @abstractmethod
    def continuation(self, messages: list[Message], assistant_finished: bool = True) -> list[int]:
        """Tokens to append after a sampled assistant turn: ``messages`` (user / tool) rendered, then
        the next assistant generation prompt. ``assistant_finished`` is False when the sampled turn
        was cut by ``max_tokens`` (no end-of-turn token was sampled); the renderer then closes it."""

    @abstractmethod
    def stop_sequences(self) -> list[int] | list[str]:
        """What ends an assistant turn in sampling (token ids preferred)."""

    @abstractmethod
    def parse_response(self, tokens: list[int]) -> Message:
        """The assistant message for sampled ``tokens``: ``content`` (thinking removed, kept under
        ``reasoning_content``), ``tool_calls`` parsed from the text, and ``tool_call_errors``
        (messages for malformed calls). Never raises on model output."""

    @abstractmethod
    def supervised(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> tuple[list[int], list[float]]:
        """Tokens of a whole conversation and per-token weights: 1 on assistant-produced tokens
        (including their end-of-turn token), 0 elsewhere. Built turn by turn from
        ``initial_prompt``/``continuation`` so supervised data matches what sampling sees."""


_REGISTRY: dict[str, type[Renderer]] = {}


def register_renderer(name: str) -> Callable[[type[Renderer]], type[Renderer]]:
    def deco(cls: type[Renderer]) -> type[Renderer]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def renderer_names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def get_renderer(name: str, tokenizer: Any) -> Renderer:
    _load()
    if name not in _REGISTRY:
        raise KeyError(f"unknown renderer {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](tokenizer)


def _load() -> None:
    from polyrl import renderers  # noqa: F401 - the package imports every renderer module
