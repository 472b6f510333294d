"""Environment types by name: the built-in environments, the workflows and the adapters.

:mod:`polyrl.envs.base` defines the interface and ``@register_env``; implementations import it and
register themselves. This module imports the implementations, so it is the one place that knows them
all: the built-ins and the workflows (:mod:`polyrl.workflows`, which registers each of its own) at the
top, the adapters for third-party ecosystems on first use.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from polyrl import workflows  # noqa: F401 - registers the workflows (solver_judge)
from polyrl.envs import builtin, python_tool  # noqa: F401 - register the built-in environments
from polyrl.envs.base import ENV_TYPES, EnvBuilder

# Adapters for third-party ecosystems. Their optional packages are imported only when such an
# environment is configured, so a missing package fails that environment alone.
_ADAPTER_MODULES = ("polyrl.envs.openreward_env", "polyrl.envs.module_env", "polyrl.envs.verifiers_env",
                    "polyrl.envs.gem_env", "polyrl.envs.reasoning_gym_env", "polyrl.envs.textarena_env")


def _load_adapters() -> None:
    for module in _ADAPTER_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # pragma: no cover - only with a broken install
            if exc.name != module:
                raise


def env_types() -> list[str]:
    _load_adapters()
    return sorted(ENV_TYPES)


def get_env_builder(type_name: str) -> Callable[..., EnvBuilder]:
    """The builder class for an environment type. ``prefix:rest`` names go to the ``prefix`` adapter."""
    _load_adapters()
    if type_name in ENV_TYPES:
        key = type_name
    elif ":" not in type_name and "/" in type_name:
        key = "openreward:"  # a bare ``Org/EnvName`` is an OpenReward environment
    else:
        key = type_name.split(":", 1)[0] + ":"
    if key not in ENV_TYPES:
        raise KeyError(f"unknown environment type {type_name!r}; known: {', '.join(sorted(ENV_TYPES))}")
    return ENV_TYPES[key]


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
