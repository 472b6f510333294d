"""Checks of a validated run config that need more than the config: environment types and their
arguments (the environment registry), renderer names, local model directories and optional packages.

:func:`polyrl.config_files.load_config` runs them after validation; anything else that builds a config
for a run (the quickstart, tests) calls :func:`check_config` itself.
"""

from __future__ import annotations

import importlib.util
from typing import TypeVar

from polyrl import renderers
from polyrl.config import ConfigError, EnvConfig, PolicyConfig, TrainConfig
from polyrl.config_errors import problems_line
from polyrl.envs import registry
from polyrl.models import resolve_model_path

C = TypeVar("C", bound=PolicyConfig)


def check_config(config: C) -> C:
    """``config`` itself, or a :class:`ConfigError` naming every problem on one line."""
    if problems := config_problems(config):
        raise ConfigError(problems_line(problems))
    return config


def config_problems(config: PolicyConfig) -> list[tuple[str, str]]:
    """``(dotted key, reason)`` for each problem found."""
    problems = local_model_problems(config.backend, config.model_name)
    if isinstance(config, TrainConfig):
        if config.kl is not None and config.kl.reference and not config.kl.reference.startswith("tinker://"):
            problems += local_model_problems(config.backend, config.kl.reference, "kl.reference")
        if config.teacher is not None and not config.teacher.model.startswith("tinker://"):
            problems += local_model_problems(config.backend, config.teacher.model, "teacher.model")
    if config.renderer is not None and (reason := unknown_renderer(config.renderer)):
        problems.append(("renderer", reason))
    if isinstance(config, TrainConfig) and config.openreward_run_name and not installed("openreward"):
        problems.append(("openreward_run_name", "uploads need the openreward package "
                                                "(pip install 'polyrl[openreward]')"))
    environments = getattr(config, "environments", None)
    return problems + (environment_problems(environments) if environments else [])


def local_model_problems(backend: str, model_name: str, key: str = "model_name") -> list[tuple[str, str]]:
    """A local backend needs ``model_name`` to be an existing directory or a hub id (a remote service
    resolves names itself)."""
    if backend != "local":
        return []
    try:
        resolve_model_path(model_name)
    except ValueError as exc:
        return [(key, str(exc))]
    return []


def unknown_renderer(name: str) -> str | None:
    """Why ``name`` is not a renderer, or None."""
    names = renderers.renderer_names()
    if names and name not in names:
        return f"unknown renderer {name!r} (known: {', '.join(names)})"
    return None


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def environment_problems(envs: dict[str, EnvConfig]) -> list[tuple[str, str]]:
    """Unknown environment types, and arguments an adapter cannot support, before the run starts."""
    problems = []
    # Entries that load a user's module go first: a name its @register_env declares may name another entry.
    for name, env in sorted(envs.items(), key=lambda item: not (item[1].type or "").startswith("module:")):
        try:
            builder = registry.get_env_builder(env.type or name)
        except KeyError as exc:
            problems.append((f"environments.{name}.type", str(exc.args[0] if exc.args else exc)))
            continue
        try:
            getattr(builder, "validate_args", lambda *_: None)(env.type or name, env.args)
        except ValueError as exc:
            problems.append((f"environments.{name}.args", str(exc)))
    return problems
