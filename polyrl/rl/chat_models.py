"""Chat models a run talks to besides the policy: an LLM judge (:mod:`polyrl.rl.judge`) or a game's
partner. Either is a model on the run's own service (:class:`ServiceChat`: the policy's base model by
default, which the local engine shares with the policy instead of copying it; another base model; a
``tinker://`` checkpoint) or one behind an OpenAI-compatible endpoint (:class:`EndpointChat`). Both are
called as ``await model(messages, seed) -> text``. A partner may also be a pool of past selves
(:class:`PastSelves`): the run's own earlier checkpoints, one drawn per game with ``model.pick(seed)``.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import TYPE_CHECKING, Any, Protocol

from polyrl.backend import ServiceGuard, service_lost
from polyrl.config.env import ChatModelConfig
from polyrl.errors import ServiceLostError, UserInputError
from polyrl.rl.episode import render

if TYPE_CHECKING:
    from polyrl.clients import SamplingClient, ServiceClient
    from polyrl.renderers.base import Renderer

RETRIES = 2  # an endpoint call that fails to connect, or answers 429 or 5xx, is tried again this often


class ChatModelError(Exception):
    """An endpoint answered with an error or without a chat completion."""


class ChatModel(Protocol):
    """What answers a list of messages: :class:`ServiceChat` or :class:`EndpointChat`."""

    label: str

    async def __call__(self, messages: list[dict], seed: int) -> str: ...

    def pick(self, seed: int) -> ChatModel:
        """The model that plays a whole game drawn by ``seed`` (itself, but for a pool of past selves)."""
        ...

    async def aclose(self) -> None: ...


def text_of(content: Any) -> str:
    """A message content's text (an image part as ``[image]``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if p.get("type", "text") == "text" else "[image]"
                       for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def preview(text: str) -> str:
    """``text`` on one line, at most 120 characters, quoted (for an error message)."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= 120 else flat[:117] + "...")


class ServiceChat:
    """A chat model on the run's service: ``sampler`` prompted in ``renderer``'s chat format. ``step``: for
    a past self, the policy steps its weights had trained."""

    def __init__(self, sampler: SamplingClient, renderer: Renderer, cfg: ChatModelConfig, label: str,
                 step: int | None = None):
        self.sampler, self.renderer, self.cfg, self.label, self.step = sampler, renderer, cfg, label, step

    def pick(self, seed: int) -> ServiceChat:
        return self

    async def __call__(self, messages: list[dict], seed: int) -> str:
        from tinker import types

        prompt = render(self.renderer, messages)
        params = types.SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature,
                                      stop=self.renderer.stop_sequences(), seed=seed)
        try:
            response = await self.sampler.sample(types.ModelInput.from_ints(list(prompt.tokens)), 1, params)
        except Exception as exc:
            if (lost := service_lost(exc)) is not None:  # the run's service, not this episode's failure
                raise ServiceLostError(lost) from exc
            raise
        return text_of(self.renderer.parse_response(list(response.sequences[0].tokens)).get("content"))

    async def aclose(self) -> None:
        return None


class EndpointChat:
    """A chat model behind an OpenAI-compatible endpoint's ``/chat/completions``."""

    def __init__(self, cfg: ChatModelConfig):
        assert cfg.base_url is not None and cfg.model is not None
        self.cfg, self.base_url, self.label = cfg, cfg.base_url, f"{cfg.model} at {cfg.base_url}"
        key = os.environ.get(cfg.api_key_env)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client: Any = None

    def pick(self, seed: int) -> EndpointChat:
        return self

    async def __call__(self, messages: list[dict], seed: int) -> str:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.base_url.rstrip("/"), headers=self._headers,
                                             timeout=self.cfg.timeout)
        body = {"model": self.cfg.model, "messages": messages, "max_tokens": self.cfg.max_tokens,
                "temperature": self.cfg.temperature, "seed": seed}
        for attempt in range(RETRIES + 1):  # a dropped connection or a busy endpoint is tried again
            try:
                r = await self._client.post("/chat/completions", json=body)
            except httpx.TransportError:
                if attempt == RETRIES:
                    raise
                await asyncio.sleep(0.5 * 2**attempt)
                continue
            if r.status_code not in (429, 502, 503, 504) or attempt == RETRIES:
                break
            await asyncio.sleep(0.5 * 2**attempt)
        if r.status_code != 200:
            raise ChatModelError(f"{self.label} answered HTTP {r.status_code}: {preview(r.text)}")
        try:
            return text_of(r.json()["choices"][0]["message"]["content"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ChatModelError(f"{self.label} answered no chat completion: {preview(r.text)}") from None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class PastSelves:
    """A pool of past selves (``partner.pool: N``): the partner a run starts with (its frozen base by
    default, as step 0) and the run's checkpoints as it saves them (:meth:`add`), the last ``size`` kept.
    Each game plays one member, drawn uniformly by the game's seed (:meth:`pick`), so a policy meets
    earlier versions of itself instead of only the newest, or only the base."""

    def __init__(self, first: ServiceChat, size: int):
        self.members, self.size, self.label = [first], size, f"a pool of {size} past selves"
        first.step = 0 if first.step is None else first.step

    def add(self, step: int, sampler: SamplingClient) -> None:
        """The policy's sampler after ``step`` steps joins; the oldest member leaves when the pool is full."""
        first = self.members[0]
        self.members.append(ServiceChat(sampler, first.renderer, first.cfg, f"the policy after {step} steps",
                                        step))
        del self.members[:-self.size]

    def pick(self, seed: int) -> ServiceChat:
        return self.members[random.Random(seed).randrange(len(self.members))]

    async def __call__(self, messages: list[dict], seed: int) -> str:
        return await self.pick(seed)(messages, seed)

    async def aclose(self) -> None:
        return None


async def open_chat_model(cfg: ChatModelConfig, model_name: str, service: ServiceClient, guard: ServiceGuard,
                          renderer: Renderer, where: str) -> ChatModel:
    """The model ``cfg`` names, on the run's ``service`` (whose policy is ``model_name``, in ``renderer``'s
    chat format; another base model in its own) unless it is an endpoint. ``where`` names the config key
    in a service's refusal."""
    from polyrl.renderers import resolve_renderer

    if cfg.base_url is not None:
        return EndpointChat(cfg)
    source = cfg.model or model_name
    kwargs = {"model_path": source} if source.startswith("tinker://") else {"base_model": source}
    try:
        sampler = await guard(f"opening {where}", service.create_sampling_client, **kwargs)
    except UserInputError as exc:
        raise UserInputError(f"{where}: {exc}") from None
    base = sampler.get_base_model() if source.startswith("tinker://") else source
    if base != model_name:
        renderer = resolve_renderer(None, base, sampler.get_tokenizer())
    label = "the policy's base model" if cfg.model is None else source
    return ServiceChat(sampler, renderer, cfg, label)
