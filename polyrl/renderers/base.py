"""Renderers: chat messages <-> tokens, and parsing the model's replies.

Tokens, not text: a rollout renders the *initial* prompt once with :meth:`Renderer.initial_prompt`;
after each sampled assistant turn it appends exactly the sampled tokens and then
:meth:`Renderer.continuation` of the environment's new messages. History is never re-rendered, so
the training sequence is exactly the sampled one.

Images: a message's content may hold image parts (``{"type": "image", "image": ...}``, see
:mod:`polyrl.images`). :meth:`Renderer.render_prompt`, :meth:`~Renderer.render_continuation` and
:meth:`~Renderer.render_supervised` return a :class:`Rendered`: the tokens, each image's positions
holding the model's placeholder id (``image_placeholder_id``), and the images' spans, from which
:func:`polyrl.images.model_input` builds the ``ModelInput`` of text and ``ImageChunk`` s. Text-only
renderers give the same tokens as ``initial_prompt`` / ``continuation`` / ``supervised`` and refuse a
message with an image (it would be dropped silently otherwise); the vision-language formats of the
cookbook adapter render them.

Registry: ``@register_renderer("name")`` on a subclass (or ``register_factory``); ``get_renderer(name,
tokenizer)`` builds one. Importing the package ``polyrl.renderers`` registers every renderer.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from polyrl.errors import UserInputError
from polyrl.images import ImageSpan, check_spans, has_images

Message = dict[str, Any]
ToolSpec = dict[str, Any]


@dataclass
class Rendered:
    """Rendered tokens and the images among them (their positions hold the placeholder id)."""

    tokens: list[int]
    images: list[ImageSpan] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_spans(self.images, len(self.tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def __add__(self, other: Rendered) -> Rendered:
        return Rendered(self.tokens + other.tokens,
                        self.images + [span.shifted(len(self.tokens)) for span in other.images])

    def ints(self) -> list[int]:
        """The tokens of a rendering without images (the text-only interface's ``list[int]``)."""
        if self.images:
            raise UserInputError("these messages hold images: render them with render_prompt / "
                                 "render_continuation / render_supervised, which keep the images")
        return self.tokens

    def suffix(self, start: int) -> Rendered:
        """The rendering from token ``start`` on (an image is kept whole or not at all)."""
        if any(span.start < start < span.end for span in self.images):
            raise ValueError(f"position {start} cuts an image")
        kept = [span.shifted(-start) for span in self.images if span.start >= start]
        return Rendered(self.tokens[start:], kept)


class Renderer(ABC):
    name: str = ""
    #: The token id that fills an image's positions in a flat token sequence (vision-language formats).
    image_placeholder_id: int | None = None

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._single_token_ids: dict[str, int | None] = {}  # see single_token_id

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
    def supervised(self, messages: list[Message],
                   tools: list[ToolSpec] | None = None) -> tuple[list[int], list[float]]:
        """Tokens of a whole conversation and per-token weights: 1 on assistant-produced tokens
        (including their end-of-turn token), 0 elsewhere. Built turn by turn from
        ``initial_prompt``/``continuation`` so supervised data matches what sampling sees."""

    # -- With images. Text-only renderers refuse them; vision-language ones override these. --

    def render_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> Rendered:
        """:meth:`initial_prompt` with the images of ``messages`` kept."""
        self.refuse_images(messages)
        return Rendered(self.initial_prompt(messages, tools))

    def render_continuation(self, messages: list[Message], assistant_finished: bool = True) -> Rendered:
        """:meth:`continuation` with the images of ``messages`` kept."""
        self.refuse_images(messages)
        return Rendered(self.continuation(messages, assistant_finished))

    def render_supervised(self, messages: list[Message],
                          tools: list[ToolSpec] | None = None) -> tuple[Rendered, list[float]]:
        """:meth:`supervised` with the images of ``messages`` kept."""
        self.refuse_images(messages)
        tokens, weights = self.supervised(messages, tools)
        return Rendered(tokens), weights

    def refuse_images(self, messages: list[Message]) -> None:
        if has_images(messages):
            raise UserInputError(
                f"renderer {self.name!r} is text-only and cannot show the images in these messages; use a "
                "vision-language model with its renderer (qwen3_vl, qwen3_vl_instruct, qwen3_5, ...)"
            )

    # -- Shared helpers (concrete). Not part of the abstract interface; renderers build on them. --

    def assistant_tokens(self, message: Message) -> list[int]:
        """The tokens a model would sample for assistant ``message``, end-of-turn token included.
        Used by :meth:`supervised_by_turns`; renderers that use it override this."""
        raise NotImplementedError(f"{type(self).__name__} does not render assistant turns")

    def encode(self, text: str) -> list[int]:
        """Text -> ids with no BOS/EOS added: renderers write every special token themselves."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        """Ids -> text keeping special tokens and spacing exactly (parsing needs the markers)."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def single_token_id(self, text: str) -> int | None:
        """The id of ``text`` if the tokenizer has it as one token (e.g. ``<|im_end|>``), else None.
        Remembered per renderer: every sampled turn asks for its stop markers."""
        if text not in self._single_token_ids:
            self._single_token_ids[text] = single_token_id(self.tokenizer, text)
        return self._single_token_ids[text]

    def stop_marker(self, text: str) -> list[int] | list[str]:
        """Stop sequences for end-of-turn marker ``text``: its token id when it is one token, else the
        string (tokenizers without the special token still work, with a string stop)."""
        tid = self.single_token_id(text)
        return [tid] if tid is not None else [text]

    def supervised_by_turns(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[float]]:
        """The :meth:`supervised` recipe, built exactly as a rollout would be: ``initial_prompt`` of
        everything before the first assistant message, then each assistant message's
        :meth:`assistant_tokens` (weight 1) and the ``continuation`` of the messages between
        assistant turns (weight 0). Messages after the last assistant turn carry no signal and are
        dropped (no trailing generation prompt)."""
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            prompt = self.initial_prompt(messages, tools)
            return prompt, [0.0] * len(prompt)
        tokens = self.initial_prompt(messages[: turns[0]], tools)
        weights = [0.0] * len(tokens)
        for k, i in enumerate(turns):
            if k:
                env = self.continuation(messages[turns[k - 1] + 1 : i], assistant_finished=True)
                tokens += env
                weights += [0.0] * len(env)
            sampled = self.assistant_tokens(messages[i])
            tokens += sampled
            weights += [1.0] * len(sampled)
        return tokens, weights


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` if ``tokenizer`` encodes it as exactly one token that decodes back to it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text:
        return int(ids[0])
    return None


def message_text(message: Message) -> str:
    """A message's text: string content as is, ``None`` as empty, OpenAI text parts joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
    return "".join(p.get("text", "") for p in parts)


def tool_call_from_json(obj: Any, call_id: str) -> tuple[Message | None, str | None]:
    """Validate one decoded tool-call object ``{"name": str, "arguments"|"parameters": object}``.

    Returns ``(tool_call, None)`` in the OpenAI shape, or ``(None, error)`` naming the problem, so
    that a malformed call becomes feedback for the model instead of an exception. A missing
    arguments field means a call without arguments."""
    if not isinstance(obj, dict):
        return None, f"tool call is not a JSON object: {json.dumps(obj)[:200]}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f'tool call has no "name" string: {json.dumps(obj)[:200]}'
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if not isinstance(args, dict):
        return None, f'tool call {name!r}: "{key}" must be a JSON object, got {type(args).__name__}'
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}, None


# Renderer name -> a callable building one from a tokenizer (a Renderer subclass, or a factory for
# renderers that share one class). Filled as the renderer modules are imported: importing
# ``polyrl.renderers`` imports them all, and this module imports none of them.
_REGISTRY: dict[str, Callable[[Any], Renderer]] = {}


def register_renderer(name: str) -> Callable[[type[Renderer]], type[Renderer]]:
    """Class decorator: ``@register_renderer("name")`` makes ``get_renderer("name", tok)`` build one and
    the config's ``renderer: name`` choose it. A class that is not a complete :class:`Renderer` (an
    abstract method left out) is a TypeError here, not when a run first renders."""

    def deco(cls: type[Renderer]) -> type[Renderer]:
        if not (isinstance(cls, type) and issubclass(cls, Renderer)):
            raise TypeError(f"renderer {name!r}: {cls!r} is not a subclass of polyrl.renderers.base.Renderer")
        if missing := sorted(getattr(cls, "__abstractmethods__", ())):
            raise TypeError(f"renderer {name!r}: {cls.__name__} does not define {', '.join(missing)}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def register_factory(name: str, factory: Callable[[Any], Renderer]) -> None:
    """Register ``factory(tokenizer) -> Renderer`` under ``name`` (for one class serving many names)."""
    _REGISTRY[name] = factory


def renderer_names() -> list[str]:
    return sorted(_REGISTRY)


def get_renderer(name: str, tokenizer: Any) -> Renderer:
    if name not in _REGISTRY:
        raise KeyError(f"unknown renderer {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](tokenizer)
