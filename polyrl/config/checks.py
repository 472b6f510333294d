"""Checks of a validated run config that need more than the config: environment types and their
arguments (the environment registry), the names of registered parts (losses, advantage estimators,
renderers: the fields :class:`polyrl.config.Registered` marks) and the settings their registrations
declare, local model directories and optional packages.

:func:`polyrl.config.files.load_config` runs them after validation; anything else that builds a config
for a run (the quickstart, tests) calls :func:`check_config` itself.
"""

from __future__ import annotations

import difflib
import importlib.util
import types
from typing import Annotated, Any, Callable, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from polyrl import registries
from polyrl.backend import vllm_settings
from polyrl.config.errors import problems_line
from polyrl.config.schema import ConfigError, EnvConfig, PolicyConfig, Registered, TrainConfig
from polyrl.envs import registry
from polyrl.envs.module_env import EnvironmentShapeError
from polyrl.models import resolve_model_path
from polyrl.optim_ranges import LOSS_CONFIG, range_problems
from polyrl.samplers import VllmStartError, check_python, resolve_sampler

C = TypeVar("C", bound=PolicyConfig)

#: For each kind of :class:`Registered` field: what its parts are called, and their names now (the
#: registries fill as their modules load, user modules included, so this is asked, not copied).
REGISTRIES: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "loss": ("policy-gradient loss", lambda: registries.losses().policy_gradient_losses()),
    "estimator": ("advantage estimator", lambda: sorted(registries.advantages().ESTIMATORS)),
    "renderer": ("renderer", lambda: registries.renderers().renderer_names()),
}


def check_config(config: C) -> C:
    """``config`` itself, or a :class:`ConfigError` naming every problem on one line."""
    if problems := config_problems(config):
        raise ConfigError(problems_line(problems))
    return config


def config_problems(config: PolicyConfig) -> list[tuple[str, str]]:
    """``(dotted key, reason)`` for each problem found. The names of registered parts are checked once
    everything else passes: their registries load torch (seconds), and a mistyped model path or
    environment is better said at once."""
    problems = local_model_problems(config.backend, config.model_name)
    if isinstance(config, TrainConfig):
        if config.kl is not None and config.kl.reference and not config.kl.reference.startswith("tinker://"):
            problems += local_model_problems(config.backend, config.kl.reference, "kl.reference")
        if config.teacher is not None and not config.teacher.model.startswith("tinker://"):
            problems += local_model_problems(config.backend, config.teacher.model, "teacher.model")
    if isinstance(config, TrainConfig) and config.openreward_run_name and not installed("openreward"):
        problems.append(("openreward_run_name", "uploads need the openreward package "
                                                "(pip install 'polyrl[openreward]')"))
    if isinstance(config, TrainConfig):  # the ranges losses require of these keys, whichever loss takes them
        problems += [(f"loss_fn_config.{key}", why)
                     for key, why in range_problems(config.loss_fn_config, LOSS_CONFIG)]
    environments = getattr(config, "environments", None)
    problems += environment_problems(environments) if environments else []
    if problems:
        return problems
    problems = registered_problems(config) + sampler_problems(config)
    if isinstance(config, TrainConfig):
        if not problems:
            correct_vllm_by_default(config)
        problems += loss_problems(config) + estimator_problems(config)
    return problems


def sampler_problems(config: PolicyConfig) -> list[tuple[str, str]]:
    """``local.sampler: vllm`` with neither servers to reach nor vLLM's interpreter."""
    local = config.local
    if config.backend != "local" or local.sampler != "vllm" or local.vllm.urls:
        return []
    try:
        check_python(local.vllm.python)
    except VllmStartError as e:
        return [("local.vllm.python", str(e))]
    return []


def correct_vllm_by_default(config: TrainConfig) -> None:
    """With vLLM sampling (``local.sampler`` resolved), ``off_policy.correction`` left unset becomes
    ``icepop`` for a loss that takes a correction: two engines give the same token different logprobs, and
    IcePop weights each token by p_learner / p_sampler inside [0.5, 5] and masks it outside, so a token the
    engines disagree on wildly is dropped instead of weighted (docs: the vLLM guide)."""

    if config.backend != "local" or "correction" in config.off_policy.model_fields_set:
        return
    local = config.local
    if resolve_sampler(local.sampler, local.device, vllm_settings(local.vllm, config.lora_rank)) != "vllm":
        return
    if registries.losses().get_loss(config.loss_fn).correction is not None:
        config.off_policy.correction = "icepop"


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


def registered_kind(field: FieldInfo) -> str | None:
    """The registry a field's value names (its :class:`Registered` mark, optional or not), or None."""
    marks = [m for m in field.metadata if isinstance(m, Registered)]
    tp = field.annotation
    if get_origin(tp) in (Union, types.UnionType):
        marks += [m for arg in get_args(tp) if get_origin(arg) is Annotated
                  for m in get_args(arg)[1:] if isinstance(m, Registered)]
    return marks[0].kind if marks else None


def registered_names(kind: str) -> list[str]:
    """The names a :class:`Registered` field of ``kind`` accepts, sorted."""
    return REGISTRIES[kind][1]()


def registered_problems(model: BaseModel, prefix: str = "") -> list[tuple[str, str]]:
    """Each :class:`Registered` field of ``model`` (its sub-models included) naming no registered part."""
    problems = []
    for name, field in type(model).model_fields.items():
        value: Any = getattr(model, name)
        if isinstance(value, BaseModel):
            problems += registered_problems(value, f"{prefix}{name}.")
        elif isinstance(value, str) and (kind := registered_kind(field)):
            if reason := unknown_part(kind, value):
                problems.append((prefix + name, reason))
    return problems


def unknown_part(kind: str, name: str) -> str | None:
    """Why ``name`` is no registered part of ``kind``, or None."""
    what, _ = REGISTRIES[kind]
    names = registered_names(kind)
    if name in names:
        return None
    if kind == "loss" and name in registries.losses().LOSSES:
        return f"loss {name!r} takes no advantages (a {what} is one of: {', '.join(names)})"
    return f"unknown {what} {name!r} (known: {', '.join(names)})"


def loss_problems(config: TrainConfig) -> list[tuple[str, str]]:
    """``loss_fn_config`` keys the loss's registration does not declare (or out of their range), and an
    off-policy correction the loss cannot take."""
    losses = registries.losses()
    spec = losses.LOSSES.get(config.loss_fn)
    if spec is None or unknown_part("loss", config.loss_fn):
        return []  # named by registered_problems
    own = [key for key in spec.config_keys if key not in losses.CORRECTION_KEYS]
    loss, problems = config.loss_fn, []
    for key, value in config.loss_fn_config.items():
        where = f"loss_fn_config.{key}"
        takers = [name for name in registered_names("loss") if key in losses.LOSSES[name].config_keys]
        if key in losses.CORRECTION_KEYS:
            problems.append((where, "an off-policy correction's key: set off_policy.correction instead"))
        elif key in own:
            continue  # its range was checked with the cheap checks
        elif takers:
            problems.append((where, f"only used by loss_fn {', '.join(map(repr, takers))}, not {loss!r}"))
        else:
            problems.append((where, f"unknown key (loss_fn {loss!r} takes: {', '.join(own) or 'none'})"))
    correction, where = config.off_policy.correction, "off_policy.correction"
    if correction != "none" and spec.correction is None:
        takers = [name for name in registered_names("loss") if losses.LOSSES[name].correction]
        problems.append((where, f"loss_fn {loss!r} takes no off-policy correction (those that do: "
                                f"{', '.join(takers)})"))
    elif correction == "tis" and spec.correction == losses.MASK_ONLY:
        problems.append((where, f"{loss} truncates its importance weight itself; 'tis' would truncate it "
                                "twice (use a mask: mis, seq_mis, geo_mis or icepop)"))
    return problems


def estimator_problems(config: TrainConfig) -> list[tuple[str, str]]:
    """``advantages`` settings the estimator does not use, and streamed minibatches for an estimator that
    compares episodes across groups."""
    name = config.advantages.estimator
    advantages = registries.advantages()
    spec = advantages.ESTIMATORS.get(name)
    if spec is None:
        return []  # named by registered_problems
    settings = {key: getattr(config.advantages, key) for key in advantages.SETTINGS}
    problems = []
    for key in advantages.unused_settings(spec, settings):
        takers = ", ".join(repr(other) for other, s in sorted(advantages.ESTIMATORS.items()) if key in s.uses)
        users = f"only used by advantages.estimator {takers}" if takers else "not used by any estimator"
        default = str(advantages.SETTINGS[key]).lower()
        problems.append((f"advantages.{key}", f"{users}, not {name!r} (leave it at {default})"))
    if config.off_policy.stream_minibatches is not None and not spec.per_group:
        per_group = ", ".join(other for other, s in sorted(advantages.ESTIMATORS.items()) if s.per_group)
        problems.append(("off_policy.stream_minibatches", f"advantages.estimator {name!r} compares episodes "
                         "across groups, which a minibatch trained before the rest of the batch finished "
                         f"cannot do (estimators that can: {per_group})"))
    return problems


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def environment_problems(envs: dict[str, EnvConfig]) -> list[tuple[str, str]]:
    """Unknown environment types, and arguments an adapter cannot support, before the run starts. A
    ``module:`` environment is loaded here (``load_environment`` runs once): what its code raises is
    the args' problem, an object that is no environment the type's."""
    problems = []
    # Entries that load a user's module go first: a name its @register_env declares may name another entry.
    for name, env in sorted(envs.items(), key=lambda item: not (item[1].type or "").startswith("module:")):
        try:
            builder = registry.get_env_builder(env.type or name)
        except KeyError as exc:
            reason = str(exc.args[0] if exc.args else exc)
            others = [n for n in envs if n != name]
            if (env.type or name) == name and (close := difflib.get_close_matches(name, others, n=1)):
                reason = (f"unknown environment type {name!r} (did you mean {close[0]}? An entry without a "
                          "type takes its name as the type)")
            problems.append((f"environments.{name}.type", reason))
            continue
        try:
            getattr(builder, "validate_args", lambda *_: None)(env.type or name, env.args)
        except EnvironmentShapeError as exc:
            problems.append((f"environments.{name}.type", str(exc)))
        except ValueError as exc:
            problems.append((f"environments.{name}.args", str(exc)))
    return problems
