"""``module:<path/or.module>[:name]``: environments written as a plain Python module.

The module (a dotted name, a ``.py`` file path relative to the working directory, or a package
directory such as ``./environments/my_task`` holding an ``__init__.py`` -- or, in a project layout,
``my_task/__init__.py`` -- as Minds RL lays environments out) defines
``load_environment(**args)`` (or, named after a colon, ``module:pkg.mod:make_task``, a function of
another name in the same part); the entry's ``args`` are passed to it. A module may instead define an
:class:`~polyrl.envs.base.EnvBuilder` subclass, which :mod:`polyrl.envs.registry` loads directly. The
object ``load_environment`` returns is one of:

**Step-based**: ``initial_observation()`` and ``step(text)``, sync or async. ``load_environment`` is
called once per episode (the object may keep the episode's state). ``initial_observation`` may take
any of ``index``, ``split``, ``seed`` (the task; ``seed`` derives from the run seed, split and index)
and returns a string (the user message), a message, a list of messages, or
``{"messages": [...], "tools": [...]}``; a message's content may hold image parts
(``{"type": "image", "image": <PIL image, bytes or path>}``, see :mod:`polyrl.images`). ``step`` gets the
assistant reply's text (or the whole message, if its parameter is named ``message``) and returns:

- a number: the reward, and the episode ends;
- a mapping with ``reward`` and optionally ``done`` (default: true unless an ``observation`` /
  ``messages`` is given), ``observation`` / ``messages`` (the environment's answer) and ``metrics``;
- a gym-style tuple ``(observation, reward, done[, info])`` or ``(observation, reward, terminated,
  truncated, info)``.

An optional ``num_tasks`` (an int, or a method taking the split) bounds the splits; without it they
are unbounded (give ``splits.test.num_samples`` for evaluation).

**Dataset + rubric**: a ``dataset`` of rows with ``prompt`` (a string or messages) or ``question``
(and whatever else, e.g. ``answer``; a row's ``image`` or ``images`` go before the question, as
image parts of its user message), optionally an ``eval_dataset`` for the test split and a
``system_prompt``, and a ``rubric``: reward functions with weights -- a list of functions, of
``(function, weight)`` pairs, a ``{name: function | (function, weight)}`` mapping, or an object with
``funcs`` and ``weights`` (verifiers-style). Episodes are single-turn: the reply is scored by every
function, the reward is the weighted sum and each function's value is logged as ``reward/<name>``.
Reward functions (sync or async) are called with the keyword arguments they accept among
``completion`` (the reply text), ``prompt``, ``messages``, ``answer``, ``row``, ``info``, ``index``,
``split`` and ``sampling_client`` (anything, if they take ``**kwargs``). An optional ``success``
function on the object, called the same way, gives the environment's verdict on the reply (logged as
the ``success`` metric); without one, success is judged from the reward (see
:func:`polyrl.rl.episode.finalize_reward`).

**Demonstrations** (for ``polyrl sft`` warm starts): a dataset row's ``completion`` (the expert's reply:
a string, or assistant messages) is its demonstration; either kind of object may define
``demonstration`` instead, called with those of ``index``, ``split``, ``seed`` and ``row`` (dataset rows)
it accepts, returning the expert's reply (a string or assistant messages, answering the first
observation) or the whole conversation (messages, or ``{"messages": [...], "tools": [...]}``);
``None`` when the task has none.

**Model-aware rewards**: an object with ``build(sampling_client)`` gets the current sampling client
before it is used (each new sampler, for a dataset environment; each episode's fresh object, for a
step-based one).

Sync functions run on a thread of their own (see :func:`polyrl.envs.base.call_env`): a blocking one
stalls only its episode, and the episode ``timeout`` still applies.

Rewards that are not numbers (or are NaN) count as 0, with a logged warning and the episode metric
``non_numeric_reward`` (how many there were).

Loading the config calls ``load_environment(**args)`` once and discards the object (so it should be
cheap, or cache what is costly): an exception its code raises is an error of the entry's ``args``; an
object of neither shape, reward functions with parameters outside the names above (and no
``**kwargs``), or a named function that is a reward function rather than an environment loader are
errors of its ``type``. Each is one line, before the run starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from polyrl.envs.base import Env, EnvBuilder, Message, Observation, StepResult, call_env, register_env
from polyrl.errors import UserInputError
from polyrl.renderers.base import message_text
from polyrl.rl.episode import Episode, RolloutContext, run_episode

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- loading


MODULE_PREFIX = "module:"


def _looks_like_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def split_target(target: str) -> tuple[str, str | None]:
    """``pkg.mod:name`` or ``path/file.py:name`` -> (module target, name); no name -> (target, None)."""
    module, sep, name = target.rpartition(":")
    if sep and module and name.isidentifier():
        return module, name
    return target, None


def environment_loader(target: str, what: str = "environment") -> tuple[Callable, str]:
    """The function that loads the environment of ``target`` (``load_environment``, or the name after
    its colon) and how errors name it."""
    module_target, name = split_target(target)
    loader = getattr(load_module(module_target, what=what), name or "load_environment", None)
    if not callable(loader):
        raise ValueError(f"{module_target} has no {name or 'load_environment'}() function")
    return loader, f"{module_target}.{name or 'load_environment'}"


def check_load_environment(target: str, args: dict[str, Any], what: str = "environment") -> None:
    """``target`` defines ``load_environment`` and it accepts ``args`` (checked at config load)."""
    loader, where = environment_loader(target, what)
    check_loader_args(loader, where, args)


def check_loader_args(loader: Callable, where: str, args: dict[str, Any]) -> None:
    """``args`` are keyword arguments ``loader`` takes: a one-line ``ValueError`` naming an unknown one
    (with the closest known name) or a missing one."""
    params = _params(loader)
    if params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        known = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for arg in args:
            if arg not in known:
                close = difflib.get_close_matches(arg, known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"{where} does not take these args: unknown arg {arg!r}{hint} "
                                 f"(known: {', '.join(known) or 'none'})")
    try:
        inspect.signature(loader).bind(**args)
    except TypeError as exc:
        raise ValueError(f"{where} does not take these args: {exc}") from exc
    except ValueError:  # no signature to check (a builtin): calling it will tell
        pass


def load_module(target: str, what: str = "environment") -> ModuleType:
    """A module by dotted name, by ``.py`` file path (``.py`` may be left out), or a package directory
    (see :func:`package_init`); one-line ``ValueError`` when it cannot be imported. Dotted names are
    found among the installed modules and, as ``python -m`` finds them, under the working directory
    (added to the end of ``sys.path``)."""
    if _looks_like_path(target):
        path = Path(target).expanduser()
        if path.is_dir():
            return _load_package(path, target, what)
        if not path.is_file() and path.suffix != ".py" and path.with_suffix(".py").is_file():
            path = path.with_suffix(".py")
        if not path.is_file():
            raise ValueError(f"{what} file not found: {target} (from {Path.cwd()})")
        path = path.resolve()
        name = _private_name(path.with_suffix(""))
        if name in sys.modules:
            return sys.modules[name]
        return _exec_module(importlib.util.spec_from_file_location(name, path), target, what)
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:  # as `python -m` does: modules of the working directory
        sys.path.append(cwd)
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise ValueError(f"{what} module {target!r} not found (neither installed nor under the working "
                             f"directory {cwd})") from exc
        raise ValueError(f"importing {what} module {target!r} failed: {exc}") from exc
    except Exception as exc:
        raise ValueError(f"importing {what} module {target!r} failed: {type(exc).__name__}: {exc}") from exc


def package_init(directory: Path) -> Path | None:
    """The ``__init__.py`` of a package directory: its own, or that of the same-named package inside
    it (a project directory with a ``pyproject.toml`` beside ``name/__init__.py``)."""
    for init in (directory / "__init__.py", directory / directory.name / "__init__.py"):
        if init.is_file():
            return init
    return None


def _load_package(directory: Path, target: str, what: str) -> ModuleType:
    """Import a package directory as a package, so its relative imports work. It is named after the
    directory (as harnesses that load ``./environments/<name>`` do) unless another module already has
    that name, and its directory is added to ``sys.path`` for its imports of sibling modules."""
    init = package_init(directory)
    if init is None:
        raise ValueError(f"{what} directory {target} has no __init__.py (nor {directory.name}/__init__.py)")
    init = init.resolve()
    package_dir = init.parent
    name = package_dir.name
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(init):
        return loaded
    if loaded is not None or not name.isidentifier():
        name = _private_name(package_dir)
        if name in sys.modules:
            return sys.modules[name]
    if str(package_dir) not in sys.path:
        sys.path.append(str(package_dir))
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(package_dir)])
    return _exec_module(spec, target, what)


def _private_name(path: Path) -> str:
    return "polyrl_user_" + re.sub(r"\W", "_", str(path))


def _exec_module(spec, target: str, what: str) -> ModuleType:
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {what} file {target}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[spec.name]
        raise ValueError(f"importing {what} {target} failed: {type(exc).__name__}: {exc}") from exc
    return module


import_target = load_module


def accepted(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Those of ``kwargs`` that ``fn``'s signature accepts (all of them if it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def call_with_accepted(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **those kwargs its signature accepts)``."""
    return fn(*args, **accepted(fn, kwargs))


def run_sync(value: Any) -> Any:
    """``value``, awaited on an event loop of its own (on another thread, so a caller's running loop
    is not in the way) when it is awaitable."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()


class RewardCoercion:
    """Turns reward values into floats; anything else is 0 with a counted warning."""

    def __init__(self, where: str):
        self.where = where
        self.count = 0

    def __call__(self, value: Any, metrics: dict[str, float], what: str = "reward") -> float:
        if isinstance(value, (bool, int, float)) or (hasattr(value, "__float__")
                                                     and not isinstance(value, (str, bytes))):
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if math.isfinite(number):
                return number
        self.count += 1
        metrics["non_numeric_reward"] = metrics.get("non_numeric_reward", 0.0) + 1.0
        if self.count == 1 or self.count % 100 == 0:
            logger.warning("%s: %s %r is not a number; counted as 0 (%d so far, metric 'non_numeric_reward')",
                           self.where, what, value, self.count)
        return 0.0


def as_messages(obs: Any, what: str = "observation") -> tuple[list[Message], list[dict]]:
    """An observation as (messages, tools): a string is a user message."""
    if isinstance(obs, Observation):
        return list(obs.messages), list(obs.tools)
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}], []
    if isinstance(obs, dict) and "messages" in obs:
        return as_messages(obs["messages"], what)[0], list(obs.get("tools") or [])
    if isinstance(obs, dict) and "role" in obs:
        return [dict(obs)], []
    if isinstance(obs, (list, tuple)) and all(isinstance(m, (dict, str)) for m in obs):
        return [m if isinstance(m, dict) else {"role": "user", "content": m} for m in obs], []
    raise TypeError(f"{what} must be a string, a message, a list of messages or {{'messages': ...}}, "
                    f"not {type(obs).__name__}")


# ---------------------------------------------------------------------------------- step-based


def parse_step(result: Any, coerce: RewardCoercion) -> StepResult:
    """A ``step`` return value as a StepResult (see the module docstring for the shapes)."""
    if isinstance(result, StepResult):
        return result
    metrics: dict[str, float] = {}
    messages: list[Message] = []
    if isinstance(result, dict):
        obs = result.get("observation", result.get("messages"))
        if obs is not None:
            messages = as_messages(obs)[0]
        done = result.get("done", result.get("terminated"))
        done = obs is None if done is None else bool(done) or bool(result.get("truncated", False))
        for key, value in dict(result.get("metrics") or {}).items():
            if isinstance(value, (bool, int, float)):
                metrics[key] = float(value)
        return StepResult(messages, coerce(result.get("reward"), metrics), done, metrics)
    if isinstance(result, tuple) and len(result) in (3, 4, 5):
        obs, reward = result[0], result[1]
        done = bool(result[2]) or (len(result) == 5 and bool(result[3]))
        info = result[-1] if len(result) in (4, 5) else None
        if obs is not None and not done:
            messages = as_messages(obs)[0]
        if isinstance(info, dict):
            metrics.update({k: float(v) for k, v in info.items() if isinstance(v, (bool, int, float))})
        return StepResult(messages, coerce(reward, metrics), done, metrics)
    return StepResult([], coerce(result, metrics), True, metrics)


class StepEnv(Env):
    """One episode of a step-based module environment."""

    def __init__(self, obj: Any, split: str, index: int, seed: int, coerce: RewardCoercion,
                 sampler: Any = None):
        self.obj, self.split, self.index, self.seed = obj, split, index, seed
        self.coerce, self.sampler = coerce, sampler
        self._message_arg = "message" in _params(obj.step)

    async def reset(self) -> Observation:
        build = getattr(self.obj, "build", None)
        if callable(build) and self.sampler is not None:
            await call_env(build, self.sampler)
        start = self.obj.initial_observation
        obs = await call_env(start, **accepted(start, {"index": self.index, "split": self.split,
                                                       "seed": self.seed}))
        messages, tools = as_messages(obs, "initial_observation()")
        return Observation(messages, tools)

    async def step(self, action: Message) -> StepResult:
        arg = action if self._message_arg else message_text(action)
        return parse_step(await call_env(self.obj.step, arg), self.coerce)

    async def close(self) -> None:
        close = getattr(self.obj, "close", None)
        if callable(close):
            await call_env(close)


def _shown(obj: Any) -> str:
    """``obj`` in an error message: its value when that is short (42, None, 'text'), and its type."""
    if obj is None:
        return "None"
    text = repr(obj)
    kind = type(obj).__name__
    return f"{text} (type {kind})" if len(text) <= 40 else f"an object of type {kind}"


def _params(fn: Callable) -> dict:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


# ----------------------------------------------------------------------------- dataset + rubric


#: The keyword arguments reward functions (and ``success``) are called with, those they name.
REWARD_KWARGS = ("completion", "prompt", "messages", "answer", "row", "info", "index", "split",
                 "sampling_client")


class EnvironmentShapeError(UserInputError):
    """What a ``module:`` type names is not an environment: a function that is no ``load_environment``
    (a reward function named by mistake), or an object that is neither step-based nor a dataset and a
    rubric, or whose reward functions take parameters polyrl does not pass. The config names the
    entry's ``type``."""


def reward_problem(fn: Callable, name: str, what: str = "reward function") -> str | None:
    """Why ``fn`` cannot be called with the reward keyword arguments: a required parameter that is not
    among :data:`REWARD_KWARGS` (or a positional-only one), unless it takes ``**kwargs``; or None."""
    params = _params(fn)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    for param in params.values():
        if param.kind is param.VAR_POSITIONAL or param.default is not param.empty:
            continue
        if param.name not in REWARD_KWARGS or param.kind is param.POSITIONAL_ONLY:
            return (f"{what} {name!r} has a parameter {param.name!r}, which polyrl does not pass: it is "
                    f"called with those it names among {', '.join(REWARD_KWARGS)} (or all, given **kwargs)")
    return None


def parse_rubric(rubric: Any, where: str) -> list[tuple[str, Callable, float]]:
    """(name, function, weight) triples from any of the accepted rubric shapes."""
    def named(fn: Callable, i: int) -> str:
        return getattr(fn, "__name__", None) or f"reward_{i}"

    items: list[tuple[str, Any, Any]] = []
    if callable(rubric) and not isinstance(rubric, type) and not hasattr(rubric, "funcs"):
        items = [(named(rubric, 0), rubric, 1.0)]
    elif isinstance(rubric, dict):
        for name, value in rubric.items():
            fn, weight = value if isinstance(value, (tuple, list)) else (value, 1.0)
            items.append((str(name), fn, weight))
    elif isinstance(rubric, (list, tuple)):
        for i, entry in enumerate(rubric):
            fn, weight = entry if isinstance(entry, (tuple, list)) else (entry, 1.0)
            items.append((named(fn, i) if callable(fn) else f"reward_{i}", fn, weight))
    else:
        funcs = getattr(rubric, "funcs", None) or getattr(rubric, "reward_funcs", None)
        if funcs is None:
            raise ValueError(f"{where}: rubric must be reward functions with weights, "
                             f"not {type(rubric).__name__}")
        weights = (getattr(rubric, "weights", None) or getattr(rubric, "reward_weights", None)
                   or [1.0] * len(funcs))
        if len(weights) != len(funcs):
            raise ValueError(f"{where}: rubric has {len(funcs)} functions but {len(weights)} weights")
        items = [(named(fn, i), fn, w) for i, (fn, w) in enumerate(zip(funcs, weights))]
    if not items:
        raise ValueError(f"{where}: the rubric has no reward functions")
    out = []
    for name, fn, weight in items:
        if not callable(fn):
            raise ValueError(f"{where}: rubric entry {name!r} is not callable")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{where}: rubric weight of {name!r} must be a number, not {weight!r}")
        out.append((name, fn, float(weight)))
    return out


def row_messages(row: Any, system_prompt: str | None, where: str) -> tuple[list[Message], list[dict]]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: dataset rows must be mappings, not {type(row).__name__}")
    if row.get("prompt") is not None:
        messages, tools = as_messages(row["prompt"], "row['prompt']")
    elif row.get("question") is not None:
        pictures = row.get("images", row.get("image"))
        pictures = [] if pictures is None else pictures if isinstance(pictures, (list, tuple)) else [pictures]
        content: Any = str(row["question"])
        if pictures:
            content = [*({"type": "image", "image": p} for p in pictures), {"type": "text", "text": content}]
        messages, tools = [{"role": "user", "content": content}], []
    else:
        raise ValueError(f"{where}: dataset rows need a 'prompt' or a 'question' (got keys {sorted(row)})")
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages, list(row.get("tools") or tools)


class RubricEnv(Env):
    """One single-turn episode of a dataset + rubric module environment."""

    def __init__(self, builder: "ModuleBuilder", split: str, index: int, sampler: Any = None):
        self.builder, self.split, self.index, self.sampler = builder, split, index, sampler
        self.row = dict(builder.rows(split)[index])
        self.messages: list[Message] = []

    async def reset(self) -> Observation:
        if self.sampler is not None:
            await self.builder.build_for(self.sampler)
        self.messages, tools = row_messages(self.row, self.builder.system_prompt, self.builder.where)
        return Observation(self.messages, tools)

    async def step(self, action: Message) -> StepResult:
        text = message_text(action)
        metrics: dict[str, float] = {}
        total = 0.0
        kwargs = dict(completion=text, prompt=self.messages, messages=[*self.messages, action],
                      answer=self.row.get("answer"), row=self.row, info=self.row.get("info"),
                      index=self.index, split=self.split, sampling_client=self.sampler)
        for name, fn, weight in self.builder.rubric:
            value = self.builder.coerce(await call_env(fn, **accepted(fn, kwargs)), metrics,
                                        f"reward function {name!r} returned")
            metrics[f"reward/{name}"] = value
            total += weight * value
        verdict = getattr(self.builder.obj, "success", None)
        if callable(verdict):
            metrics["success"] = float(bool(await call_env(verdict, **accepted(verdict, kwargs))))
        return StepResult([], total, True, metrics)


# -------------------------------------------------------------------------------------- builder


@register_env(MODULE_PREFIX)
class ModuleBuilder(EnvBuilder):
    """Adapter for ``module:`` environments; see the module docstring. :meth:`for_target` gives the
    builder of one target, for types that do not spell it (an installed package's entry point)."""

    #: The ``load_environment`` target of a :meth:`for_target` class; otherwise read from the type name.
    fixed_target: str | None = None

    @classmethod
    @functools.lru_cache(maxsize=None)
    def for_target(cls, target: str) -> type[ModuleBuilder]:
        """The builder class of the environment that ``target`` (``pkg.mod`` or ``pkg.mod:function``)
        loads, whatever the entry's type name."""
        return type("ModuleBuilder", (cls,),
                    {"fixed_target": target, "__doc__": cls.__doc__, "__module__": cls.__module__})

    @classmethod
    def target_of(cls, type_name: str) -> str:
        return cls.fixed_target or type_name.partition(":")[2].strip()

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str = ""):
        super().__init__(args, seed, type_name)
        self.target = self.target_of(type_name)
        if not self.target:
            raise ValueError("module environments are named 'module:<dotted.module or path/file.py>'")
        self.where = f"module:{self.target}"
        self._load, loader_name = environment_loader(self.target)
        self._check_loader(loader_name)
        try:
            self.obj = self._load(**self.args)
        except Exception as exc:  # the user's code refused its args (a ValueError, a TypeError, ...)
            raised = f"{loader_name}() raised {type(exc).__name__}"
            raise UserInputError(" ".join(f"{exc} ({raised})".split()) if str(exc) else raised) from None
        self.coerce = RewardCoercion(self.where)
        try:
            self._inspect(self.obj)
        except ValueError as exc:  # the object load_environment() returned has the wrong shape
            raise EnvironmentShapeError(" ".join(str(exc).split())) from None
        self.uses_sampler = callable(getattr(self.obj, "build", None))
        self._built_for: Any = None
        self._build_lock = asyncio.Lock()

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        """Builds the builder once, so ``load_environment(**args)`` runs when the config loads: the
        errors its code raises are the args' (a ``ValueError``), a wrong-shaped object or a function
        that is no environment loader the type's (:class:`EnvironmentShapeError`). The object is
        discarded; the run calls ``load_environment`` again (and, step-based, once per episode)."""
        cls(args, seed=0, type_name=type_name)

    def _check_loader(self, loader_name: str) -> None:
        """The loader takes the entry's args; a function named by the type whose required parameters
        are a reward function's is refused as no environment loader."""
        name = split_target(self.target)[1]
        required = [p.name for p in _params(self._load).values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        missing = [p for p in required if p not in self.args]
        if name is not None and missing and all(p in REWARD_KWARGS for p in missing):
            raise EnvironmentShapeError(
                f"{self.where}: {name}({', '.join(required)}) looks like a reward function, not an "
                f"environment: a module: type names a load_environment(**args)-like function that returns "
                f"the environment (a SingleTurnEnv, or an object with initial_observation() and step(text)), "
                f"or an EnvBuilder subclass")
        check_loader_args(self._load, loader_name, self.args)

    def _inspect(self, obj: Any) -> None:
        """Which kind of environment ``obj`` is (step-based or dataset + rubric); a ``ValueError``
        naming the problem when it is neither."""
        if callable(getattr(obj, "initial_observation", None)) and callable(getattr(obj, "step", None)):
            self.kind = "step"
        elif getattr(obj, "dataset", None) is not None and getattr(obj, "rubric", None) is not None:
            self.kind = "dataset"
            self.rubric = parse_rubric(obj.rubric, self.where)
            self.system_prompt = getattr(obj, "system_prompt", None)
            self._rows: dict[str, Any] = {}
            if self.num_tasks("train") == 0:
                raise ValueError(f"{self.where}: the dataset is empty")
            row_messages(self.rows("train")[0], self.system_prompt, self.where)
            verdict = getattr(obj, "success", None)
            checks = [(fn, name, "reward function") for name, fn, _ in self.rubric]
            for fn, name, what in checks + ([(verdict, "success", "function")] if callable(verdict) else []):
                if problem := reward_problem(fn, name, what):
                    raise ValueError(f"{self.where}: {problem}")
        else:
            loader = split_target(self.target)[1] or "load_environment"
            raise ValueError(f"{self.where}: {loader}() returned {_shown(obj)} with neither "
                             f"initial_observation() and step(text) nor a dataset and a rubric")

    @property
    def drives_rollouts(self) -> bool:
        """Environments with ``build(sampling_client)`` need the sampler, which only
        :meth:`rollout` is given."""
        return self.uses_sampler

    # -- tasks -------------------------------------------------------------------------------------

    def rows(self, split: str):
        if split not in self._rows:
            data = getattr(self.obj, "eval_dataset", None) if split == "test" else None
            data = data if data is not None else self.obj.dataset
            self._rows[split] = data() if callable(data) and not hasattr(data, "__len__") else data
        return self._rows[split]

    def num_tasks(self, split: str) -> int | None:
        if self.kind == "dataset":
            return len(self.rows(split))
        n = getattr(self.obj, "num_tasks", None)
        if callable(n):
            n = call_with_accepted(n, split) if _params(n) else n()
        return None if n is None else int(n)

    async def build_for(self, sampler: Any) -> None:
        """``obj.build(sampler)`` once per new sampling client (dataset environments)."""
        async with self._build_lock:
            if self._built_for is not sampler:
                await call_env(self.obj.build, sampler)
                self._built_for = sampler

    # -- episodes ----------------------------------------------------------------------------------

    def _env(self, split: str, index: int, sampler: Any = None) -> Env:
        if self.kind == "dataset":
            return RubricEnv(self, split, index, sampler)
        return StepEnv(self._load(**self.args), split, index, self._seed(split, index), self.coerce, sampler)

    def make(self, split: str, index: int) -> Env:
        return self._env(split, index)

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[dict]] | None:
        """The object's ``demonstration`` or, for a dataset, the row's ``completion``: the expert's reply
        after the task's prompt, or a whole conversation (see the module docstring)."""
        row = dict(self.rows(split)[index]) if self.kind == "dataset" else None
        obj = self.obj if row is not None else self._load(**self.args)
        give = getattr(obj, "demonstration", None)
        if callable(give):
            demo = run_sync(call_with_accepted(give, index=index, split=split, seed=self._seed(split, index),
                                               row=row))
        else:
            demo = row.get("completion") if row is not None else None
        if demo is None:
            return None
        if isinstance(demo, str):
            replies = [{"role": "assistant", "content": demo}]
        else:
            replies, tools = as_messages(demo, f"{self.where}: demonstration")
            if not replies or replies[0].get("role") != "assistant":
                return replies, tools  # a whole conversation
        # the expert's replies (a string, or TRL-style completion messages) answer the task's prompt
        if row is not None:
            messages, tools = row_messages(row, self.system_prompt, self.where)
        else:
            start = obj.initial_observation
            obs = run_sync(call_with_accepted(start, index=index, split=split, seed=self._seed(split, index)))
            messages, tools = as_messages(obs, "initial_observation()")
        return [*messages, *replies], tools

    def rubrics(self, split: str, index: int) -> list[str] | None:
        """A dataset row's ``rubrics`` (a list of items, or one), for the entry's judge."""
        if self.kind != "dataset":
            return None
        rubrics = dict(self.rows(split)[index]).get("rubrics")
        return [rubrics] if isinstance(rubrics, str) else list(rubrics) if rubrics else None

    def _seed(self, split: str, index: int) -> int:
        return int.from_bytes(hashlib.sha256(repr((self.seed, split, index)).encode()).digest()[:4], "little")

    async def rollout(self, ctx: RolloutContext) -> list[Episode]:
        env = self._env(ctx.split, ctx.task_index, ctx.sampler)
        return [await run_episode(env, ctx.episode(), ctx.renderer, ctx.sampler_ref, ctx.settings, ctx.seed)]
