"""The one environment interface polyrl trains on.

Message-level and async: ``reset`` gives the prompt messages and the tool specs; ``step`` takes the
assistant's parsed message and gives new messages (user or tool), a reward, ``done`` and metrics.
Messages are OpenAI-style chat dicts::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"id": str, "type": "function", "function": {"name": str, "arguments": dict}}],
     "tool_call_id": str, "name": str}   # tool messages answer a call (see tool_message)

Tool specs are OpenAI function specs: ``{"type": "function", "function": {"name", "description",
"parameters"}}``. An assistant message handed to ``step`` may carry ``"tool_call_errors"``: a list of
strings, one per malformed tool call the renderer could not parse; an environment answers them with
an error message instead of crashing.

Sync implementations are accepted: ``reset``/``step``/``close`` may be plain functions. The rollout
code calls them through :func:`call_env`, which runs plain functions on a thread of their own, so a
blocking step stalls only its episode (its timeout still fires) and blocking episodes overlap. Code
that only works on the main thread (``signal.alarm`` timeouts, such as math-verify's default
``parsing_timeout``) must be async or do without them (math-verify: ``parsing_timeout=None``).

Environments are built by an :class:`EnvBuilder` registered under a type name (``@register_env``;
:mod:`polyrl.envs.registry` finds them by name, and loads a user's own from a file, a module or an
installed package's ``polyrl.environments`` entry point): the trainer asks it for the environment of
task ``index`` in a split, so data order, resume and held-out evaluation are deterministic.
docs/guides/environments.md walks through writing one.
"""

from __future__ import annotations

import asyncio
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from polyrl.aio import in_daemon_thread

Message = dict[str, Any]
ToolSpec = dict[str, Any]


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
    averaged per environment in the step's metrics row. A final-step ``success`` (0/1) is the
    environment's verdict on the episode; without one, the episode succeeded when its total reward is
    at least 1.0 (full marks). An entry's ``success_threshold`` replaces both: success is then
    ``total reward >= success_threshold`` (see :func:`polyrl.rl.episode.finalize_reward`).
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


@dataclass
class SingleTurnEnv:
    """The short form for single-turn tasks: what a module's ``load_environment`` returns instead of
    writing an :class:`EnvBuilder`. Each episode shows one ``dataset`` row and scores the reply.

    ``dataset`` (and ``eval_dataset``, the ``test`` split; default: ``dataset``): rows with a
    ``prompt`` (a string or messages) or a ``question``, and whatever the reward reads (``answer``,
    ``info``); a row's ``completion`` (the expert's reply) is its demonstration for ``polyrl sft``.
    ``rubric``: a reward function, a list of them or of ``(function, weight)`` pairs, or a
    ``{name: function | (function, weight)}`` mapping; each is called with the keyword arguments it
    names among ``completion``, ``answer``, ``row``, ``prompt``, ``messages``, ``info``, ``index``,
    ``split``, and the reward is the weighted sum. ``success`` (optional, called the same way): the
    environment's verdict on the reply. :mod:`polyrl.envs.module_env` describes every shape it takes.
    """

    dataset: Any
    rubric: Any
    eval_dataset: Any = None
    system_prompt: str | None = None
    success: Callable[..., Any] | None = None


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
        ``ValueError`` with a one-line reason for anything this builder cannot support.

        By default a builder with a constructor of its own is built once here (``cls(args, seed=0)``),
        so the checks its ``__init__`` makes are config errors; override this when building is costly
        (a download, a server)."""
        if cls.__init__ is EnvBuilder.__init__:
            return None
        try:
            build_builder(cls, type_name, args, seed=0)
        except ValueError:
            raise
        except Exception as exc:  # a TypeError or KeyError of the constructor is a bad arg too
            raise ValueError(f"{cls.__name__}({args!r}) failed: {type(exc).__name__}: {exc}") from exc

    @abstractmethod
    def make(self, split: str, index: int) -> Env:
        """The environment for task ``index`` of ``split`` (``train`` or ``test``); deterministic."""

    def num_tasks(self, split: str) -> int | None:
        """Number of tasks in ``split``; ``None`` for procedurally unbounded splits."""
        return None

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]] | None:
        """An expert conversation for task ``index`` (for ``polyrl sft`` warm starts), or ``None``."""
        return None

    def rubrics(self, split: str, index: int) -> list[str] | None:
        """The rubric items an LLM judge grades task ``index``'s episodes by (``judge:`` in its config
        entry), or ``None`` for the judge config's own."""
        return None

    async def rollout(self, ctx: Any) -> list[Any]:
        """Drive the model yourself instead of through ``make``/``step``: multi-agent workflows and
        frameworks that run their own conversation loop override this (typed there: the episode
        machinery builds on this module, so it is not named here). ``ctx`` is a
        :class:`polyrl.rl.episode.RolloutContext` (sampler, renderer, settings, seed, task). Return the
        :class:`polyrl.rl.episode.Episode` objects of ONE rollout, one per role (``episode.role``),
        each with its tokens, logprobs, action mask and final ``reward``; advantages are computed
        per role within the group. Raising counts as one failing rollout."""
        raise NotImplementedError

    @property
    def drives_rollouts(self) -> bool:
        """True when this builder overrides :meth:`rollout`."""
        return type(self).rollout is not EnvBuilder.rollout

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        return None


def tool_message(call: Any, index: int, content: str) -> Message:
    """The tool message answering ``call``, the ``index``-th call of an assistant turn: it names the call's
    id (or ``call_<index>`` when the call has none) and the function, which chat formats such as
    harmony (gpt-oss) render as the message's author."""
    call = call if isinstance(call, dict) else {}
    function = call.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    message: Message = {"role": "tool", "tool_call_id": call.get("id") or f"call_{index}", "content": content}
    if isinstance(name, str) and name:
        message["name"] = name
    return message


#: Builder classes by type name, filled by ``@register_env`` (looked up through :mod:`polyrl.envs.registry`).
ENV_TYPES: dict[str, Callable[..., EnvBuilder]] = {}


def register_env(name: str) -> Callable[[type[EnvBuilder]], type[EnvBuilder]]:
    """Class decorator: make an :class:`EnvBuilder` available under ``name`` in configs (``type: name``).
    A module of a user's registers its builders when it is loaded: through the config
    (``type: module:...``) or an installed package's ``polyrl.environments`` entry point."""

    def deco(cls: type[EnvBuilder]) -> type[EnvBuilder]:
        known = ENV_TYPES.get(name)
        # The same class loaded again (a module imported under a second name) replaces itself.
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"environment type {name!r} is registered twice")
        ENV_TYPES[name] = cls
        return cls

    return deco


def build_builder(cls: Callable[..., EnvBuilder], type_name: str, args: dict[str, Any],
                  seed: int = 0) -> EnvBuilder:
    """``cls(args, seed=seed)``, with ``type_name=`` too where its ``__init__`` takes it; every builder gets
    ``type_name`` as ``builder.type_name``."""
    try:
        params = inspect.signature(cls).parameters.values()
        takes_type = any(p.name == "type_name" or p.kind is p.VAR_KEYWORD for p in params)
    except (TypeError, ValueError):
        takes_type = False
    builder = cls(args, seed=seed, type_name=type_name) if takes_type else cls(args, seed=seed)
    builder.type_name = type_name
    return builder


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


class EnvironmentAbort(RuntimeError):
    """Environment code raised ``KeyboardInterrupt``, ``SystemExit`` or a ``CancelledError`` of its
    own: one failing rollout, like any other exception, not the end of the run."""


async def call_env(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for environment code: coroutine functions on the event loop, plain
    functions on a thread of their own (an awaitable they return is awaited here). A real
    cancellation (a timeout, Ctrl-C) passes through; ``KeyboardInterrupt``, ``SystemExit`` and a
    ``CancelledError`` that the environment raises itself become :class:`EnvironmentAbort`."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await in_daemon_thread(fn, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result
    except (KeyboardInterrupt, SystemExit) as exc:
        raise EnvironmentAbort(f"the environment raised {type(exc).__name__}({_args(exc)})") from None
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+; before, every cancel counts as real
        if cancelling is None or cancelling():
            raise  # cancelled from outside: a timeout or the run stopping
        raise EnvironmentAbort(f"the environment raised CancelledError({_args(exc)})") from None


def _args(exc: BaseException) -> str:
    return ", ".join(repr(a) for a in exc.args)
