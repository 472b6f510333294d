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

    #: The configured type string (``openreward:Org/Env``, ``module:pkg.mod``, ...), for adapters.
    type_name: str = ""

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str | None = None):
        self.args = dict(args)
        self.seed = seed
        if type_name is not None:
            self.type_name = type_name

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        """Check an entry's type and ``args`` when the config is loaded, before anything runs; raise
        ``ValueError`` with a one-line reason for anything this builder cannot support."""
        return None

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
    if type_name in _REGISTRY:
        key = type_name
    elif ":" not in type_name and "/" in type_name:
        key = "openreward:"  # a bare ``Org/EnvName`` is an OpenReward environment
    else:
        key = type_name.split(":", 1)[0] + ":"
    if key not in _REGISTRY:
        raise KeyError(f"unknown environment type {type_name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[key]


def parse_prefixed_type(type_name: str, prefix: str, example: str, args: dict[str, Any],
                        known: tuple[str, ...]) -> str:
    """``prefix:<id>`` -> ``<id>``, refusing another prefix, an empty id or an unknown arg by name."""
    got, _, ident = type_name.partition(":")
    if got != prefix or not ident:
        raise ValueError(f"expected '{prefix}:<id>' (e.g. {example}), got {type_name!r}")
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"{prefix}: unknown arg {unknown[0]!r} (known: {', '.join(known)})")
    return ident


def make_env_builder(type_name: str, args: dict[str, Any], seed: int = 0) -> EnvBuilder:
    """Build the builder of an environment entry; builders whose ``__init__`` takes ``type_name``
    get it there, every builder gets it as ``builder.type_name``."""
    cls = get_env_builder(type_name)
    try:
        params = inspect.signature(cls).parameters.values()
        takes_type = any(p.name == "type_name" or p.kind is p.VAR_KEYWORD for p in params)
    except (TypeError, ValueError):
        takes_type = False
    builder = cls(args, seed=seed, type_name=type_name) if takes_type else cls(args, seed=seed)
    builder.type_name = type_name
    return builder


# Adapters for third-party ecosystems. Their optional packages are imported only when such an
# environment is configured, so a missing package fails that environment alone.
_ADAPTER_MODULES = ("polyrl.envs.openreward_env", "polyrl.envs.module_env", "polyrl.envs.verifiers_env",
                    "polyrl.envs.gem_env", "polyrl.envs.reasoning_gym_env", "polyrl.envs.textarena_env",
                    "polyrl.workflows.solver_judge")


def _load_builtins() -> None:
    import importlib

    from polyrl.envs import builtin, python_tool  # noqa: F401 - registers the built-in environments

    for module in _ADAPTER_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # pragma: no cover - only with a broken install
            if exc.name != module:
                raise


async def maybe_await(value: T | Awaitable[T]) -> T:
    """Await ``value`` if it is awaitable; lets sync environment implementations plug in."""
    if inspect.isawaitable(value):
        return await value
    return value
