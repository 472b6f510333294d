"""Run configuration: YAML/TOML files plus dotted overrides, validated by pydantic.

``load_config("run.yaml", ["batch_size=64", "environments.arithmetic.num_rollouts=8"])`` reads the
file (format by extension), applies each ``key.path=value`` override (value parsed as YAML), loads
``.env`` and validates. Every problem -- unknown key, wrong type, impossible combination -- comes back
as one :class:`ConfigError` line naming the dotted key. The field descriptions below are the
reference documentation (``polyrl train --help-config`` prints :func:`config_reference`).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Iterable, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from polyrl.errors import UserInputError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from polyrl.secrets import redact, redact_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

M = TypeVar("M", bound=BaseModel)

# Episodes one step may run (batch_size x num_rollouts): 1024 groups of 64, or 4096 of 16, is beyond
# the largest published RL batches; far larger sizes are typos (1e9) that would exhaust memory
# before the first line of output.
MAX_EPISODES_PER_STEP = 65_536
LOSS_FN_CONFIG_KEYS = ("clip_low_threshold", "clip_high_threshold", "beta")
TINKER_KEY_PREFIXES = ("tml-", "eyJ")  # what the tinker SDK accepts: API keys and JWTs
# Bounds on what an environment hands the trainer (TrainConfig.max_abs_reward, max_observation_*).
DEFAULT_MAX_ABS_REWARD = 1e6
DEFAULT_MAX_OBSERVATION_TOKENS = 32_768
DEFAULT_MAX_OBSERVATION_BYTES = 1 << 20
SplitName = Literal["train", "test"]
LrSchedule = Literal["constant", "linear"]


def scheduled_lr(learning_rate: float, schedule: LrSchedule, step: int, max_steps: int) -> float:
    """The learning rate of update ``step`` (0-based) of ``max_steps``: constant, or decayed linearly
    from ``learning_rate`` at step 0 towards 0 at ``max_steps``."""
    return learning_rate * (1.0 - step / max_steps) if schedule == "linear" else learning_rate
_SPLIT_DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {"shuffle": True, "num_samples": None},
    "test": {"shuffle": False, "num_samples": 32},
}
_LOCAL_ONLY_DEFAULTS: dict[str, Any] = {"device": "auto", "dtype": "auto", "store_dir": None,
                                         "micro_batch_tokens": 4096, "gradient_checkpointing": "auto"}


class ConfigError(UserInputError):
    """A configuration problem; ``str()`` is one line naming the dotted key and the reason."""


class _Problems(ValueError):
    """Raised inside validators: ``(dotted key relative to the validated model, reason)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(f"{key}: {msg}" for key, msg in problems))
        self.problems = problems


def local_model_problems(backend: str, model_name: str) -> list[tuple[str, str]]:
    """A local backend needs ``model_name`` to be an existing directory or a hub id (a remote service
    resolves names itself)."""
    if backend != "local":
        return []
    from polyrl.models import resolve_model_path

    try:
        resolve_model_path(model_name)
    except ValueError as exc:
        return [("model_name", str(exc))]
    return []


# --------------------------------------------------------------------------------------- models


class SplitConfig(BaseModel):
    """How tasks of one split (``train`` or ``test``) of an environment are drawn."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    shuffle: bool = Field(
        True, description="Visit tasks in a seeded random order (default: true for train, false for test)."
    )
    num_samples: int | None = Field(
        None,
        gt=0,
        description="Use only the first N tasks of the split; null = all of them "
        "(default: null for train, 32 for test).",
    )
    seed: int | None = Field(None, description="Seed of this split's task order; null = use the run's seed.")


def _default_splits() -> dict[SplitName, SplitConfig]:
    return {name: SplitConfig(**values) for name, values in _SPLIT_DEFAULTS.items()}  # type: ignore[misc]


class EnvConfig(BaseModel):
    """One entry of ``environments``: an environment type with its sampling and reward settings."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    type: str | None = Field(
        None,
        description="Environment type (a registered name, or 'prefix:rest' for adapters); defaults to the "
        "entry's name, so a second instance of a type needs another name and an explicit type.",
    )
    splits: dict[SplitName, SplitConfig] = Field(
        default_factory=_default_splits,
        description="Task splits, train and test by default. A split given here is merged over that split's "
        "defaults; a split set to null is left out (e.g. test: null for no held-out evaluation).",
    )
    num_rollouts: int = Field(8, ge=1, le=MAX_EPISODES_PER_STEP,
                              description="Group size: episodes sampled per task; advantages compare them.")
    max_failing_rollouts: int = Field(
        1, ge=0, description="A group with more failing episodes (errors, timeouts) than this is dropped."
    )
    temperature: float = Field(
        1.0,
        ge=0,
        description="Sampling temperature. The sampler's logprobs are the model's own (temperature 1, as in "
        "Tinker), so with any other value the importance ratio compares against a distribution that was not "
        "sampled; polyrl train warns about it once.",
    )
    max_turns: int = Field(8, ge=1, description="Assistant turns per episode before it is cut off.")
    max_tokens: int | None = Field(
        None, ge=1, description="Tokens sampled per turn; null = the top-level max_tokens."
    )
    reward_reduction: Literal["sum", "mean"] = Field(
        "sum", description="How an episode's step rewards combine into its reward."
    )
    nonterminal_reward: float | None = Field(
        None,
        description="Reward of an episode the environment did not finish (max_turns reached or the turn was "
        "truncated at max_tokens); null keeps the reduced step rewards.",
    )
    weight: float = Field(1.0, gt=0, description="Relative share of each batch's groups drawn from this environment.")
    args: dict[str, Any] = Field(default_factory=dict, description="Environment-specific arguments for its builder.")
    timeout: float = Field(300, gt=0, description="Seconds per episode; an episode that times out is failing.")

    @field_validator("splits", mode="before")
    @classmethod
    def _merge_split_defaults(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        merged: dict[Any, Any] = {**_SPLIT_DEFAULTS, **value}
        splits = {
            name: {**_SPLIT_DEFAULTS.get(str(name), {}), **split} if isinstance(split, dict) else split
            for name, split in merged.items()
            if split is not None
        }
        if not splits:
            raise ValueError("at least one split (train or test) is needed")
        return splits


class TeacherConfig(BaseModel):
    """On-policy distillation: a teacher policy scores every token the student sampled."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    model: str = Field(
        description="The teacher: a checkpoint ('tinker://<run>/sampler_weights/<name>') or a base model (hub id "
        "or directory). It scores the student's token ids, so it must share the student's tokenizer.",
    )
    kl_coef: float = Field(
        1.0, gt=0, description="Weight of the distillation signal: each sampled token's advantage gets "
        "kl_coef x (teacher logprob - student sampler logprob), the per-token reverse KL's negative.",
    )
    kl_discount_factor: float = Field(
        0.0, ge=0, le=1, description="Credit each sampled token with the discounted sum of the distillation "
        "signal of the sampled tokens after it (0 = each token alone, as the cookbook's default).",
    )
    reward_weight: float = Field(
        0.0, ge=0, description="Weight of the environments' reward advantages next to the distillation signal: "
        "0 = pure distillation (rewards are still logged), 1 = the full RL advantage added.",
    )


class TrainConfig(BaseModel):
    """Everything ``polyrl train`` needs."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    # model and engine
    backend: Literal["local", "tinker"] = Field(
        "local", description="Training engine: 'local' (built-in, PyTorch) or 'tinker' (a Tinker service)."
    )
    base_url: str | None = Field(
        None, description="URL of the Tinker service; null = the client's default (needs TINKER_API_KEY)."
    )
    model_name: str = Field(description="Base model: a Hugging Face hub id or a local directory.")
    lora_rank: int = Field(32, gt=0, description="Rank of the LoRA adapter being trained.")
    renderer: str | None = Field(
        None, description="Chat format used to turn messages into tokens; null = inferred from the model."
    )
    resume_from: str | None = Field(
        None,
        description="Weights to start from, a 'tinker://.../weights/<name>' path. Only for a log_path without "
        "checkpoints: a relaunch always continues its own run from its last checkpoint.",
    )
    device: str = Field("auto", description="Local engine only: torch device ('auto', 'cpu', 'cuda', 'cuda:1', ...).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Local engine only: parameter dtype; 'auto' picks from the device."
    )
    store_dir: str | None = Field(
        None, description="Local engine only: directory of the engine's weight store; null = the engine's default."
    )
    micro_batch_tokens: int = Field(
        4096, ge=1, description="Local engine only: tokens per forward/backward pass (packed, padding included); "
        "a step's datums are split into as many passes as needed. Lower it if training runs out of memory.",
    )
    gradient_checkpointing: Literal["auto", True, False] = Field(
        "auto", description="Local engine only: recompute activations in backward instead of keeping them "
        "(less memory, ~30% more compute); 'auto' turns it on for models of 300M parameters and more.",
    )

    # loss and advantages
    loss_fn: Literal["importance_sampling", "ppo", "cispo", "dro", "gspo"] = Field(
        "importance_sampling", description="Policy-gradient loss."
    )
    loss_fn_config: dict[str, float] = Field(
        default_factory=dict,
        description="Loss parameters: clip_low_threshold and clip_high_threshold (ppo, cispo, gspo), "
        "beta (dro).",
    )
    advantage_estimator: Literal["grpo", "rebn"] = Field(
        "grpo",
        description="'grpo': episode reward minus its group's mean. 'rebn': per-step discounted returns "
        "normalized over the batch (GEM-style), for multi-turn environments.",
    )
    gamma: float = Field(1.0, gt=0, le=1, description="Discount of future step rewards; rebn only.")
    normalize_advantages_by_std: bool = Field(
        False, description="Divide group advantages by the group's std; grpo only (rebn always normalizes)."
    )
    remove_constant_reward_groups: bool = Field(
        False, description="Drop groups whose episodes all got the same reward (they carry no signal)."
    )
    kl_penalty_coef: float = Field(
        0.0, ge=0, description="Penalty on drifting from kl_reference, folded into each sampled token's advantage "
        "as in tinker-cookbook: kl_penalty_coef x (the batch's mean of d - the token's d), d = sampler logprob - "
        "reference logprob; logged as kl/reference (the mean d). 0 = off.",
    )
    kl_reference: str | None = Field(
        None, description="The KL penalty's reference policy: null = the base model (model_name, no adapter); "
        "else a checkpoint ('tinker://<run>/sampler_weights/<name>') or another base model with the same "
        "tokenizer.",
    )
    kl_discount_factor: float = Field(
        0.0, ge=0, le=1, description="Credit each sampled token with the discounted sum of the KL penalty of "
        "the sampled tokens after it (0 = each token alone, as the cookbook's default).",
    )
    teacher: TeacherConfig | None = Field(
        None, description="On-policy distillation from a teacher policy (polyrl distill sets it); null = none.",
    )

    # optimization
    batch_size: int = Field(8, ge=1, le=MAX_EPISODES_PER_STEP, description="Groups per training step "
                            f"(batch_size x num_rollouts is at most {MAX_EPISODES_PER_STEP} episodes).")
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate.")
    lr_schedule: LrSchedule = Field(
        "constant", description="Learning rate over the run: 'constant', or 'linear' decay from learning_rate at "
                                "step 0 towards 0 at max_steps.")
    adam_beta1: float = Field(0.9, description="Adam beta1.")
    adam_beta2: float = Field(0.95, description="Adam beta2.")
    adam_eps: float = Field(1e-8, description="Adam epsilon.")
    weight_decay: float = Field(0.0, description="Weight decay (AdamW-style).")
    grad_clip_norm: float = Field(0.0, ge=0, description="Clip the gradient norm to this; 0 = no clipping.")
    max_steps: int = Field(100, ge=1, description="Training steps.")
    max_tokens: int = Field(256, ge=1, description="Tokens sampled per turn unless an environment sets its own.")
    seed: int = Field(0, description="Run seed: task order, sampling and environment generation.")
    max_no_update_frac: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the run with an error once more than this share of its steps made no update "
        "because groups failed (a group dropped over its failure budget means something is broken); judged "
        "from the 10th step on (each such step is warned about). 1 = never stop.",
    )
    max_no_signal_frac: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Stop the run with an error once more than this share of its steps made no update only "
        "because every group had equal rewards (no learning signal; normal early on a task the model cannot "
        "solve yet); judged from the 10th step on. Each such step is warned about with the share so far. "
        "1 = never stop (the default).",
    )
    max_abs_reward: float = Field(
        DEFAULT_MAX_ABS_REWARD,
        gt=0,
        le=1e300,
        description="Largest magnitude a reward (an episode's or a step's) may have: an episode past it "
        "fails with a warning and counts against its environment's failure budget, so an absurd reward "
        "(1e308) never reaches the advantages and the weights.",
    )
    nonfinite_steps: Literal["stop", "skip"] = Field(
        "stop",
        description="A step whose update is not finite (a loss, gradient or advantage that is NaN or inf; "
        "the trainer checks the loss before optim_step and the engine refuses such a step): 'stop' ends the "
        "run with one line naming the last checkpoint; 'skip' leaves the weights as they were, discards the "
        "step's gradients, counts the step in optim/nonfinite_skipped and goes on.",
    )
    max_service_recoveries: int = Field(
        3,
        ge=0,
        description="How often a run reopens itself from its last checkpoint, in the same process, when a "
        "remote training service lost its session or pending requests (a restarted polyrl serve); steps are "
        "neither repeated in the logs nor skipped, as on a relaunch. Each recovery is warned about; one more "
        "stops the run.",
    )
    max_observation_tokens: int = Field(
        DEFAULT_MAX_OBSERVATION_TOKENS,
        ge=1,
        description="Most tokens one observation (an environment's first or later messages, rendered) may "
        "add to an episode; an episode past it fails and is counted against the failure budget.",
    )
    max_observation_bytes: int = Field(
        DEFAULT_MAX_OBSERVATION_BYTES,
        ge=1,
        description="Most bytes of text (UTF-8, tool specs and image data included) one observation may "
        "hold; checked before it is tokenized, so an environment that answers with megabytes fails its "
        "episode instead of exhausting memory.",
    )
    max_steps_off_policy: int = Field(
        0,
        ge=0,
        description="Asynchronous training: how many optimizer steps behind the policy being trained a "
        "group's sampler may be. 0 = the synchronous loop (each step samples with the newest weights, then "
        "trains). With K >= 1 up to K more batches of groups are sampled while a step trains, so sampling "
        "and environments never wait for training; the loss's importance ratio against the sampler's "
        "logprobs corrects for the lag (a clipped loss such as ppo or cispo suits stale data best).",
    )
    stale_groups: Literal["drop", "keep"] = Field(
        "drop",
        description="With max_steps_off_policy >= 1, a group whose sampler fell further behind (a slow "
        "group that finished after faster ones were trained) is dropped, counted in async/stale_dropped "
        "and replaced by a fresh one; 'keep' trains it anyway.",
    )
    stream_minibatches: int | None = Field(
        None,
        ge=1,
        description="Groups per forward_backward: training starts on each minibatch of this many groups as "
        "soon as they finish instead of waiting for the whole batch, and steps the optimizer once per "
        "batch (tinker-cookbook's stream_minibatch_config); the last minibatch takes what is left of "
        "batch_size. null = one forward_backward with the whole batch.",
    )
    service_timeout: float = Field(
        120,
        gt=0,
        description="Seconds a remote training service (backend tinker, polyrl serve) may stay unreachable "
        "while its requests are retried; then the run stops, naming the checkpoint to resume from.",
    )

    # checkpoints, evaluation, logging
    save_every: int = Field(20, ge=0, description="Save a checkpoint every N steps; 0 = only at the end.")
    eval_every: int = Field(
        0, ge=0, description="Evaluate on the test splits every N steps; 0 = never during training."
    )
    eval_num_samples: int = Field(1, ge=1, le=MAX_EPISODES_PER_STEP,
                                  description="Samples per test task during evaluation (for pass@k).")
    log_path: str = Field("runs/polyrl", description="Directory for metrics, trajectories, checkpoints and the report.")
    report: bool = Field(True, description="Refresh the HTML report whenever a checkpoint is saved.")
    metrics_json: bool = Field(
        False, description="Also write log_path/metrics.json, a JSON list of {reward, loss, step} per step "
        "(the file Minds RL's harness wrote; on for translated Minds RL configs)."
    )
    wandb_project_name: str | None = Field(None, description="Weights & Biases project; null = no W&B logging.")
    wandb_run_name: str | None = Field(None, description="Weights & Biases run name; null = W&B's default.")
    openreward_run_name: str | None = Field(
        None, description="Run name reported to OpenReward; null = OpenReward's default."
    )

    environments: dict[str, EnvConfig] = Field(
        description="Environments to train on, by name; at least one. Each batch mixes them by weight."
    )

    @field_validator("environments")
    @classmethod
    def _named_environments(cls, envs: dict[str, EnvConfig]) -> dict[str, EnvConfig]:
        if not envs:
            raise ValueError("at least one environment is required")
        for name in envs:
            if not name.strip() or "." in name:
                raise ValueError(f"environment name {name!r} must be non-empty and contain no '.'")
        return {name: env if env.type else env.model_copy(update={"type": name}) for name, env in envs.items()}

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        problems: list[tuple[str, str]] = []
        for key in self.loss_fn_config:
            if key not in LOSS_FN_CONFIG_KEYS:
                problems.append((f"loss_fn_config.{key}", f"unknown key (allowed: {', '.join(LOSS_FN_CONFIG_KEYS)})"))
            elif key == "beta" and self.loss_fn != "dro":
                problems.append((f"loss_fn_config.{key}", f"only used by loss_fn 'dro', not {self.loss_fn!r}"))
            elif key.startswith("clip_") and self.loss_fn in ("dro", "importance_sampling"):
                problems.append((f"loss_fn_config.{key}", f"not used by loss_fn {self.loss_fn!r}"))
        widest = max((env.num_rollouts for env in self.environments.values() if "train" in env.splits), default=1)
        if self.batch_size * widest > MAX_EPISODES_PER_STEP:
            problems.append(("batch_size", f"{self.batch_size} groups of up to {widest} episodes is "
                                           f"{self.batch_size * widest} episodes a step, more than "
                                           f"{MAX_EPISODES_PER_STEP} (lower batch_size or num_rollouts)"))
        for name, env in self.environments.items():
            if env.nonterminal_reward is not None and abs(env.nonterminal_reward) > self.max_abs_reward:
                problems.append((f"environments.{name}.nonterminal_reward", f"{env.nonterminal_reward:g} is past "
                                 f"max_abs_reward={self.max_abs_reward:g}: every unfinished episode would fail"))
        if self.gamma != 1.0 and self.advantage_estimator != "rebn":
            problems.append(("gamma", "only used by advantage_estimator 'rebn', leave it at 1 with 'grpo'"))
        if self.normalize_advantages_by_std and self.advantage_estimator == "rebn":
            problems.append(("normalize_advantages_by_std", "only used by advantage_estimator 'grpo' ('rebn' always "
                                                            "divides by the batch std)"))
        if self.stale_groups != "drop" and self.max_steps_off_policy == 0:
            problems.append(("stale_groups", "only used with max_steps_off_policy >= 1 (the synchronous loop "
                                             "samples every group with the policy it trains)"))
        if self.stream_minibatches is not None:
            if self.stream_minibatches > self.batch_size:
                problems.append(("stream_minibatches", f"{self.stream_minibatches} groups per minibatch is more "
                                                       f"than batch_size ({self.batch_size})"))
            if self.advantage_estimator == "rebn":
                problems.append(("stream_minibatches", "advantage_estimator 'rebn' normalizes over the whole "
                                                       "batch, which a minibatch trained before the rest "
                                                       "finished cannot do (use 'grpo')"))
            if self.kl_penalty_coef:
                problems.append(("stream_minibatches", "the KL penalty is centred on its mean over the whole "
                                                       "batch, which a minibatch trained before the rest "
                                                       "finished cannot do"))
        problems += local_model_problems(self.backend, self.model_name)
        problems += self._scoring_problems()
        if self.backend == "tinker":
            for key, default in _LOCAL_ONLY_DEFAULTS.items():
                if getattr(self, key) != default:
                    problems.append((key, "only used by the local backend, but backend is 'tinker'"))
            key = os.environ.get("TINKER_API_KEY")
            if self.base_url is None and not key:
                problems.append(("backend", "'tinker' needs TINKER_API_KEY (environment or .env) or a base_url"))
            elif key and not key.startswith(TINKER_KEY_PREFIXES):
                problems.append(("backend", "TINKER_API_KEY (environment or .env) is not a Tinker API key: "
                                            "those start with 'tml-'"))
        if self.eval_every > 0 and not any("test" in env.splits for env in self.environments.values()):
            problems.append(("eval_every", "evaluation needs at least one environment with a test split"))
        if self.renderer is not None and (reason := _unknown_renderer(self.renderer)):
            problems.append(("renderer", reason))
        if self.openreward_run_name and not _installed("openreward"):
            problems.append(("openreward_run_name", "uploads need the openreward package "
                                                    "(pip install 'polyrl[openreward]')"))
        problems += _unknown_env_types(self.environments)
        if problems:
            raise _Problems(problems)
        return self

    def _scoring_problems(self) -> list[tuple[str, str]]:
        """The KL reference and the teacher: settings without effect, and models the local engine lacks."""
        problems = []
        if self.kl_penalty_coef == 0:
            for key in ("kl_reference", "kl_discount_factor"):
                if getattr(self, key):
                    problems.append((key, "only used with a KL penalty, but kl_penalty_coef is 0"))
        elif self.kl_reference and not self.kl_reference.startswith("tinker://"):
            problems += [("kl_reference", msg) for _, msg in local_model_problems(self.backend, self.kl_reference)]
        if self.teacher is not None:
            if not self.teacher.model.startswith("tinker://"):
                problems += [("teacher.model", msg) for _, msg in local_model_problems(self.backend, self.teacher.model)]
            if self.teacher.reward_weight == 0 and self.remove_constant_reward_groups:
                problems.append(("remove_constant_reward_groups", "drops groups by their rewards, but rewards do "
                                                                  "not train (teacher.reward_weight is 0)"))
        return problems

    def turn_max_tokens(self, env_name: str) -> int:
        """Per-turn token cap of an environment: its own ``max_tokens`` or the top-level one."""
        return self.environments[env_name].max_tokens or self.max_tokens

    def dump(self) -> dict[str, Any]:
        """JSON-safe dict of the config with secrets redacted (for logs and run directories)."""
        return redact(self.model_dump(mode="json"))


def _unknown_renderer(name: str) -> str | None:
    """Why ``name`` is not a renderer, or None (also when the renderers cannot be imported or are none yet)."""
    try:
        try:
            from polyrl.renderers import renderer_names
        except ImportError:
            from polyrl.renderers.base import renderer_names
        names = renderer_names()
    except ImportError:
        return None
    if names and name not in names:
        return f"unknown renderer {name!r} (known: {', '.join(names)})"
    return None


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def _unknown_env_types(envs: dict[str, EnvConfig]) -> list[tuple[str, str]]:
    try:
        from polyrl.envs import registry
    except ImportError:
        return []
    problems = []
    for name, env in envs.items():
        try:
            builder = registry.get_env_builder(env.type or name)
        except KeyError as exc:
            problems.append((f"environments.{name}.type", str(exc.args[0] if exc.args else exc)))
            continue
        except ImportError:  # built-in environments not importable (yet): skip the check
            return []
        try:  # adapters refuse what they cannot support here, before the run starts
            getattr(builder, "validate_args", lambda *_: None)(env.type or name, env.args)
        except ValueError as exc:
            problems.append((f"environments.{name}.args", str(exc)))
    return problems


# ------------------------------------------------------------------------------- files, overrides


#: Nodes that YAML aliases may add to a document when expanded. Anchors and merge keys in a config
#: add a few hundred; an alias bomb ("billion laughs") adds billions.
MAX_ALIAS_NODES = 10_000


class _AliasBomb(yaml.YAMLError):
    """A document whose aliases expand past :data:`MAX_ALIAS_NODES` nodes."""


def _check_alias_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases would expand it by more than :data:`MAX_ALIAS_NODES` nodes
    (everything downstream -- validation, redaction, dumps -- walks the expanded tree), or that holds
    a recursive alias. An alias is the very node object its anchor made, so each object's expanded
    size is computed once, depth first without recursion."""
    sizes: dict[int, int] = {}  # expanded size of each node object
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            ancestors.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _yaml_children(node))
        elif id(node) in ancestors:
            raise _AliasBomb("a YAML alias refers to a node that contains it (a recursive alias)")
        elif id(node) not in sizes:
            ancestors.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in _yaml_children(node)]
    if sizes[id(root)] - len(sizes) > MAX_ALIAS_NODES:
        raise _AliasBomb(f"YAML aliases expand the document by more than {MAX_ALIAS_NODES:,} nodes (an alias "
                         "bomb?); write the repeated values out or use fewer aliases")


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads exponent numbers without a dot (``2e-5``, ``1E6``) as floats,
    refuses a key given twice in one mapping (YAML would silently keep the last) and refuses aliases
    that expand the document past :data:`MAX_ALIAS_NODES` nodes."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_alias_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first + 1})", key_node.start_mark)
            lines[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class _JsonProblem(ValueError):
    """What :func:`json.loads` accepts but a config must not hold."""


def _json_mapping(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (``json`` would silently keep the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _JsonProblem(f"duplicate key {key!r}")
        out[key] = value
    return out


def _json_constant(name: str) -> Any:
    raise _JsonProblem(f"{name} is not a number JSON allows")


def parse_scalar(text: str) -> Any:
    """An override value as YAML: ``8`` -> 8, ``2e-5`` -> 2e-05, ``true`` -> True, ``null`` -> None, ``[1, 2]`` -> list.

    Text that is not valid YAML stays a string.
    """
    try:
        return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``key.path=value`` set, creating intermediate mappings as needed."""
    data = copy.deepcopy(data)
    for override in overrides:
        key, sep, text = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(part.strip() for part in parts):
            raise ConfigError(redact_text(f"override {override!r}: expected key.path=value"))
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(redact_text(f"override {override!r}: {prefix} is not a mapping"))
            node = child
        node[parts[-1]] = parse_scalar(text)
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a ``.yaml``/``.yml``/``.json`` or ``.toml`` file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            with path.open("rb") as f:
                data = tomllib.load(f)
        elif suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_json_mapping,
                              parse_constant=_json_constant)
        elif suffix in (".yaml", ".yml"):
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader) or {}  # noqa: S506
        else:
            raise ConfigError(f"{path}: unsupported config format {suffix!r} (use .yaml, .yml or .toml)")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                          f"save the file as UTF-8") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {_one_line(str(exc))}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
    except _JsonProblem as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from exc
    except _AliasBomb as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {_yaml_reason(exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, not {type(data).__name__}")
    return data


def _yaml_reason(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return _one_line(str(exc))
    return f"line {mark.line + 1}, column {mark.column + 1}: {_one_line(problem)}"


def load_dotenv_file(path: str | Path = ".env") -> bool:
    """Load ``path`` (relative to the working directory) into ``os.environ``; variables already set win."""
    from dotenv import load_dotenv

    path = Path(path)
    return path.is_file() and load_dotenv(path, override=False)


def load_config(
    path: str | Path | None,
    overrides: Iterable[str] = (),
    *,
    model: type[M] = TrainConfig,  # type: ignore[assignment]
    base: dict[str, Any] | None = None,
) -> M:
    """Read ``path`` (over ``base``, if given), apply ``overrides``, load ``.env`` and validate.

    Raises :class:`ConfigError` with one line naming every offending dotted key.
    """
    load_dotenv_file()
    data = copy.deepcopy(base) if base else {}
    if path is not None:
        data = _merge(data, read_config_file(path))
    data = apply_overrides(data, overrides)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model)) from exc


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged


# --------------------------------------------------------------------------------------- errors


def format_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """One line: ``dotted.key: reason`` for each error, joined with '; '."""
    lines: list[str] = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"] if part != "[key]"]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _Problems):
            lines += [_error_line(loc + key.split("."), msg) for key, msg in cause.problems]
            continue
        msg = err["msg"]
        if err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif err["type"] == "extra_forbidden":
            match = difflib.get_close_matches(loc[-1], _fields_at(model, loc[:-1]), n=1)
            msg = "unknown key" + (f" (did you mean {match[0]}?)" if match else "")
        lines.append(_error_line(loc, msg))
    return redact_text("; ".join(dict.fromkeys(lines)))


def _error_line(loc: list[str], msg: str) -> str:
    msg = msg.replace("; ", ", ")  # '; ' only separates errors
    key = ".".join(loc)
    return f"{key}: {_one_line(msg)}" if key else _one_line(msg)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _fields_at(model: type[BaseModel], path: list[str]) -> list[str]:
    """Field names of the model found at ``path`` below ``model`` (dict keys are skipped over)."""
    tp: Any = model
    for part in path:
        tp = _strip_none(tp)
        if _is_model(tp):
            field = tp.model_fields.get(part)
            if field is None:
                return []
            tp = field.annotation
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return []
    tp = _strip_none(tp)
    return list(tp.model_fields) if _is_model(tp) else []


# ------------------------------------------------------------------------------------ reference


def config_reference(model: type[BaseModel] = TrainConfig) -> str:
    """Every field as ``dotted.name  (type, default)`` plus its description, nested models included."""
    lines = [f"{model.__name__}: set in the config file or with --overrides key.path=value", ""]
    _describe(model, "", lines)
    return "\n".join(lines)


def _describe(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        key = prefix + name
        default = "required" if field.is_required() else "default " + _show(field.get_default(call_default_factory=True))
        lines.append(f"{key}  ({_type_name(field.annotation)}{_bounds(field)}, {default})")
        lines += textwrap.wrap(field.description or "", width=100, initial_indent="    ", subsequent_indent="    ")
        tp = _strip_none(field.annotation)
        if _is_model(tp):
            _describe(tp, key + ".", lines)
        elif get_origin(tp) is dict and _is_model(get_args(tp)[1]):
            key_type, value_type = get_args(tp)
            placeholder = "|".join(get_args(key_type)) if get_origin(key_type) is Literal else "name"
            _describe(value_type, f"{key}.<{placeholder}>.", lines)


def _bounds(field: FieldInfo) -> str:
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    found = [f"{op} {getattr(m, attr)}" for m in field.metadata for attr, op in ops.items() if hasattr(m, attr)]
    return ", " + ", ".join(found) if found else ""


def _show(value: Any) -> str:
    return json.dumps(to_jsonable_python(value))


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is dict:
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _strip_none(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        rest = [arg for arg in get_args(tp) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)
