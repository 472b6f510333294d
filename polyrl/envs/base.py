"""The one environment interface polyrl trains on.

Message-level and async: ``reset`` gives the prompt messages and the tool specs; ``step`` takes the
assistant's parsed message and gives new messages (user or tool), a reward, ``done`` and metrics.
Messages are OpenAI-style chat dicts::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"id": str, "type": "function", "function": {"name": str, "arguments": dict}}],
     "tool_call_id": str}   # tool messages answer a call

Tool specs are OpenAI function specs: ``{"type": "function", "function": {"name", "description",
"parameters"}}``. An assistant message handed to ``step`` may carry ``"tool_call_errors"``: a list of
strings, one per malformed tool call the renderer could not parse; an environment answers them with
an error message instead of crashing.

Sync implementations are accepted: ``reset``/``step``/``close`` may be plain functions; the rollout
code awaits them through :func:`maybe_await`.

Environments are built by an :class:`EnvBuilder` registered under a type name (``@register_env``):
the trainer asks it for the environment of task ``index`` in a split, so data order, resume and
held-out evaluation are deterministic.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

Message = dict[str, Any]
ToolSpec = dict[str, Any]
T = TypeVar("T")


@dataclass
class Observation:
    """What an episode starts from."""

    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)


@dataclass
class StepResult:
    """What the environment answers to one assistant message.

    ``messages`` are appended to the conversation (rendered as environment tokens, weight 0 in the
    loss). ``reward`` is this step's reward; ``done`` ends the episode. ``metrics`` are numbers
    averaged per environment in the step's metrics row; a final-step ``success`` (0/1) is the
    episode's success, otherwise success is ``total reward > 0``.
    """

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Env(ABC):
    """One episode. Single use: ``reset`` once, then ``step`` until ``done``; ``close`` always."""

    @abstractmethod
    async def reset(self) -> Observation: ...

    @abstractmethod
    async def step(self, action: Message) -> StepResult: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        return None


class EnvBuilder(ABC):
    """Makes the environments of one configured environment entry.

    ``args`` are the entry's env-specific ``args`` from the config, ``seed`` the run's seed.
    """

    def __init__(self, args: dict[str, Any], seed: int = 0):
        self.args = dict(args)
        self.seed = seed

    @abstractmethod
    def make(self, split: str, index: int) -> Env:
        """The environment for task ``index`` of ``split`` (``train`` or ``test``); deterministic."""

    def num_tasks(self, split: str) -> int | None:
        """Number of tasks in ``split``; ``None`` for procedurally unbounded splits."""
        return None

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]] | None:
        """An expert conversation for task ``index`` (for ``polyrl sft`` warm starts), or ``None``."""
        return None

    async def rollout(self, ctx: Any) -> list[Any]:
        """Drive the model yourself instead of through ``make``/``step``: multi-agent workflows and
        frameworks that run their own conversation loop override this. ``ctx`` is a
        :class:`polyrl.rollouts.RolloutContext` (sampler, renderer, settings, seed, task). Return the
        :class:`polyrl.rollouts.Episode` objects of ONE rollout, one per role (``episode.role``),
        each with its tokens, logprobs, action mask and final ``reward``; advantages are computed
        per role within the group. Raising counts as one failing rollout."""
        raise NotImplementedError

    @property
    def drives_rollouts(self) -> bool:
        """True when this builder overrides :meth:`rollout`."""
        return type(self).rollout is not EnvBuilder.rollout

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        return None


_REGISTRY: dict[str, Callable[..., EnvBuilder]] = {}


def register_env(name: str) -> Callable[[type[EnvBuilder]], type[EnvBuilder]]:
    """Class decorator: make an :class:`EnvBuilder` available under ``name`` in configs."""

    def deco(cls: type[EnvBuilder]) -> type[EnvBuilder]:
        if name in _REGISTRY:
            raise ValueError(f"environment type {name!r} is registered twice")
        _REGISTRY[name] = cls
        return cls

    return deco


def env_types() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_env_builder(type_name: str) -> Callable[..., EnvBuilder]:
    """The builder class for an environment type. ``prefix:rest`` names go to the ``prefix`` adapter."""
    _load_builtins()
    key = type_name if type_name in _REGISTRY else type_name.split(":", 1)[0] + ":"
    if key not in _REGISTRY:
        raise KeyError(f"unknown environment type {type_name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[key]


def _load_builtins() -> None:
    from polyrl.envs import builtin  # noqa: F401 - registers the built-in environments


async def maybe_await(value: T | Awaitable[T]) -> T:
    """Await ``value`` if it is awaitable; lets sync environment implementations plug in."""
    if inspect.isawaitable(value):
        return await value
    return value
