"""Environment types by name: the built-in environments, the workflows, the adapters and a user's own.

:mod:`polyrl.envs.base` defines the interface and ``@register_env``; implementations import it and
register themselves. This module imports the implementations, so it is the one place that knows them
all: the built-ins and the workflows (:mod:`polyrl.workflows`, which registers each of its own) at the
top, the adapters for third-party ecosystems on first use. A type name resolves, in this order, to:

- a registered name (``arithmetic``, or a name a user's module registered once loaded);
- ``module:TARGET`` or ``module:TARGET:NAME``: a user's module (a dotted name or a ``.py`` file path)
  with ``load_environment`` or one :class:`EnvBuilder` subclass; ``NAME`` picks an ``EnvBuilder``
  subclass or a function that plays the part of ``load_environment`` (see :mod:`polyrl.envs.module_env`);
- a name an installed package declares in the ``polyrl.environments`` entry-point group
  (``reverse = "my_env:ReverseBuilder"`` in its pyproject.toml), pointing at any of the same;
- ``prefix:rest`` (``openreward:``, ``gem:``, ...): that adapter; a bare ``Org/Env`` is OpenReward's.

A type that cannot be found or loaded is a ``KeyError`` with a one-line reason (the config names
``environments.NAME.type``); bad args are the builder's ``validate_args`` ``ValueError``
(``environments.NAME.args``), except a ``module:`` object that is no environment
(:class:`~polyrl.envs.module_env.EnvironmentShapeError`, the type's).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from types import ModuleType
from typing import Any, Callable

from polyrl import workflows  # noqa: F401 - registers the workflows (solver_judge)
from polyrl.envs import builtin, prompts_env, python_tool  # noqa: F401 - register the built-in environments
from polyrl.envs.base import ENV_TYPES, EnvBuilder, build_builder
from polyrl.envs.module_env import MODULE_PREFIX, ModuleBuilder, load_module, split_target

#: The entry-point group installed packages declare their environments in.
ENTRY_POINT_GROUP = "polyrl.environments"

# Adapters for third-party ecosystems. Their optional packages are imported only when such an
# environment is configured, so a missing package fails that environment alone.
_ADAPTER_MODULES = ("polyrl.envs.openreward_env", "polyrl.envs.verifiers_env",
                    "polyrl.envs.gem_env", "polyrl.envs.reasoning_gym_env", "polyrl.envs.textarena_env")


def _load_adapters() -> None:
    for module in _ADAPTER_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # pragma: no cover - only with a broken install
            if exc.name != module:
                raise


def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The ``polyrl.environments`` entry points of the installed packages, by name (the first wins)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def env_types() -> list[str]:
    """Every type name a config may give: registered names, adapter prefixes and installed packages'."""
    _load_adapters()
    return sorted(set(ENV_TYPES) | set(entry_points()))


def get_env_builder(type_name: str) -> Callable[..., EnvBuilder]:
    """The builder class for an environment type (see the module docstring for the order); a
    one-line ``KeyError`` when there is none or it fails to load."""
    _load_adapters()
    if type_name.startswith(MODULE_PREFIX):
        return user_builder(type_name.removeprefix(MODULE_PREFIX).strip(), type_name)
    if type_name in ENV_TYPES:
        return ENV_TYPES[type_name]
    if ":" not in type_name and "/" not in type_name and type_name in (points := entry_points()):
        return entry_point_builder(points[type_name])
    if ":" not in type_name and "/" in type_name:
        key = "openreward:"  # a bare ``Org/EnvName`` is an OpenReward environment
    else:
        key = type_name.split(":", 1)[0] + ":"
    if key not in ENV_TYPES:
        raise KeyError(f"unknown environment type {type_name!r}; known: {', '.join(env_types())} "
                       f"(or module:path/to/file.py, module:pkg.mod)")
    return ENV_TYPES[key]


def user_builder(target: str, type_name: str) -> Callable[..., EnvBuilder]:
    """The builder of ``module:TARGET[:NAME]``."""
    if not target:
        raise KeyError("module environments are named 'module:<dotted.module or path/file.py>[:Name]'")
    module_target, name = split_target(target)
    try:
        module = load_module(module_target)
    except ValueError as exc:
        raise KeyError(str(exc)) from None
    if name is not None:
        if not hasattr(module, name):
            raise KeyError(f"{module_target} has no {name!r} (in {type_name})")
        return builder_of(getattr(module, name), target, type_name)
    return builder_of(module, target, type_name)


def builder_of(obj: Any, target: str, type_name: str) -> Callable[..., EnvBuilder]:
    """The builder for what a ``module:`` target or an entry point names: an :class:`EnvBuilder`
    subclass, a function playing ``load_environment``'s part, or a module with ``load_environment``
    or exactly one ``EnvBuilder`` subclass of its own."""
    if isinstance(obj, type) and issubclass(obj, EnvBuilder):
        if inspect.isabstract(obj):
            raise KeyError(f"{type_name}: {obj.__name__} is abstract (it needs make(split, index))")
        return obj
    # A ``module:`` type spells its target (ModuleBuilder reads it there); an entry point's name does not.
    spelled = ModuleBuilder.target_of(type_name) == target
    loader = ModuleBuilder if spelled else ModuleBuilder.for_target(target)
    if isinstance(obj, ModuleType):
        if callable(getattr(obj, "load_environment", None)):
            return loader
        own = [v for v in vars(obj).values() if isinstance(v, type) and issubclass(v, EnvBuilder)
               and v.__module__ == obj.__name__ and not inspect.isabstract(v)]
        if len(own) == 1:
            return own[0]
        if own:
            names = ", ".join(sorted(c.__name__ for c in own))
            raise KeyError(f"{type_name} defines several EnvBuilders ({names}): name one, as in "
                           f"{type_name}:{sorted(c.__name__ for c in own)[0]}")
        raise KeyError(f"{type_name} has neither a load_environment() function nor an EnvBuilder subclass")
    if callable(obj):
        return loader
    raise KeyError(f"{type_name} names a {type(obj).__name__}, not an EnvBuilder subclass or a function")


@functools.lru_cache(maxsize=None)
def entry_point_builder(ep: importlib.metadata.EntryPoint) -> Callable[..., EnvBuilder]:
    """The builder an installed package's entry point names (``module:attr`` or a module)."""
    where = f"environment type {ep.name!r} (entry point {ep.value!r} of group {ENTRY_POINT_GROUP})"
    try:
        obj = ep.load()
    except Exception as exc:
        raise KeyError(f"{where} failed to load: {type(exc).__name__}: {exc}") from None
    return builder_of(obj, ep.value.replace(" ", ""), where)


def make_env_builder(type_name: str, args: dict[str, Any], seed: int = 0) -> EnvBuilder:
    """Build the builder of an environment entry; builders whose ``__init__`` takes ``type_name``
    get it there, every builder gets it as ``builder.type_name``."""
    return build_builder(get_env_builder(type_name), type_name, args, seed)
