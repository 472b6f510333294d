"""The run configuration's schema: pydantic models, one description per field, and the cross-field
checks that need nothing but the config itself.

Everyday settings are top-level fields (the keys of polyrl's first YAML format); what is optional or
specific to one backend lives in a sub-model (``local:``, ``kl:``, ``off_policy:``, ``optimizer:``,
``advantages:``, ``limits:``, ``outputs:``). The flat keys those replaced are accepted for one release:
:class:`RenamedKeys` moves each to its new place and records one warning line per key.

This module is a leaf: it imports nothing of polyrl above :mod:`polyrl.errors`, :mod:`polyrl.secrets` and
:mod:`polyrl.optim_ranges` (and the environment entry's schema, :mod:`polyrl.config.env`). Reading files
and overrides is :mod:`polyrl.config.files`, checks that need environments, renderers or model directories are
:mod:`polyrl.config.checks`, one-line errors :mod:`polyrl.config.errors` and the ``--help-config``
text :mod:`polyrl.config.reference`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from polyrl.config.env import MAX_EPISODES_PER_STEP, EnvConfig, SplitConfig, SplitName  # noqa: F401
from polyrl.errors import UserInputError
from polyrl.optim_ranges import LEARNING_RATE, optimizer_problems, range_problems
from polyrl.secrets import redact_config

DEFAULT_CORRECTION_CAP = 2.0  # off_policy.correction tis: verl's and TRL's usual cap
CORRECTION_BOUNDS = {"mis": (0.5, 2.0), "seq_mis": (0.5, 2.0), "geo_mis": (0.999, 1.001),
                     "icepop": (0.5, 5.0)}  # off_policy.correction's [low, high] by default
TINKER_KEY_PREFIXES = ("tml-", "eyJ")  # what the tinker SDK accepts: API keys and JWTs
# Bounds on what an environment hands the trainer (LimitsConfig.max_abs_reward, max_observation_*).
DEFAULT_MAX_ABS_REWARD = 1e6
DEFAULT_MAX_OBSERVATION_TOKENS = 32_768
DEFAULT_MAX_OBSERVATION_BYTES = 1 << 20
# Tokens (packed, padding included) per forward/backward pass of the local engine on a CPU (and 'auto''s
# unit on a GPU); a call's datums are split into as many micro-batches as this needs, gradients summed.
DEFAULT_MICRO_BATCH_TOKENS = 4096
LrSchedule = Literal["constant", "linear"]
RENAMED_NOTE = "config key {old!r} is now {new!r}; the old name is accepted until the next release"
# The flat layout's KL keys at these values meant no penalty (every old dump holds them): not moved.
_KL_OFF: dict[str, Any] = {"kl_penalty_coef": 0, "kl_reference": None, "kl_discount_factor": 0}
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


def scheduled_lr(learning_rate: float, schedule: LrSchedule, step: int, max_steps: int) -> float:
    """The learning rate of update ``step`` (0-based) of ``max_steps``: constant, or decayed linearly
    from ``learning_rate`` at step 0 towards 0 at ``max_steps``."""
    return learning_rate * (1.0 - step / max_steps) if schedule == "linear" else learning_rate


@dataclass(frozen=True)
class Registered:
    """Marks a ``str`` field naming a registered part (``kind``: 'loss', 'estimator' or 'renderer'). Its
    registry, not this schema, holds the choices: :mod:`polyrl.config.checks` checks the name against it
    (and the part's settings against what its registration declares), ``--help-config`` lists them."""

    kind: str


LossName = Annotated[str, Registered("loss")]
EstimatorName = Annotated[str, Registered("estimator")]
RendererName = Annotated[str, Registered("renderer")]


class ConfigError(UserInputError):
    """A configuration problem; ``str()`` is one line naming the dotted key and the reason."""


class ConfigProblems(ValueError):
    """Raised by validators and checks: ``(dotted key relative to the validated model, reason)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(f"{key}: {msg}" for key, msg in problems))
        self.problems = problems


# ------------------------------------------------------------------------------------ sub-models


class VllmConfig(BaseModel):
    """Where the vLLM sampler runs (``local.sampler: vllm``): servers polyrl starts, or servers that run."""

    model_config = _STRICT

    python: str = Field(".venv-vllm/bin/python", description="Interpreter of an environment with vLLM "
                        "(`make vllm` builds .venv-vllm); polyrl starts one vLLM server per base model from "
                        "it, on 127.0.0.1, and stops it with the run.")
    urls: list[str] = Field(default_factory=list, description="vLLM servers that already run the base model "
                            "(started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; adapters "
                            "are loaded from paths on this machine, so they must share its filesystem); "
                            "requests spread over them, and one that stops answering is dropped. Empty: "
                            "polyrl starts its own.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of the GPU's memory (on a CPU: of the host's) a started vLLM "
        "reserves; null = 0.4 on a GPU (the learner shares it), 0.1 on a CPU.")
    max_model_len: int | None = Field(None, ge=1, description="Context a started vLLM serves; null = the "
                                      "model's.")
    restarts: int = Field(3, ge=0, description="How often a started vLLM that died is started again (given "
                          "back the adapters in use) before the run stops with an error.")
    start_timeout_s: float = Field(600.0, gt=0, description="How long a started vLLM may take to answer.")

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"not an http(s) URL: {bad[0]!r}")
        return [u.rstrip("/") for u in urls]


class LocalEngineConfig(BaseModel):
    """The built-in engine's settings (backend ``local``), shared by train, sft, eval and serve."""

    model_config = _STRICT

    device: str = Field("auto", description="Torch device ('auto', 'cpu', 'cuda', 'cuda:1', 'mps', ...).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Learner dtype; auto: bfloat16 on GPUs and bf16-capable CPUs (hidden size 512+).")
    sampler_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Dtype sampling computes in, on its own copy of the weights (snapshots folded "
        "in, logprobs the copy's). 'auto': bfloat16 on GPUs and CPUs with native bfloat16 (AVX-512 BF16, "
        "AMX), else the learner's (packed float32 on a CPU); no copy over half the free memory.")
    store_dir: str | None = Field(None, description="Directory of the engine's checkpoint store; null = "
                                  "$POLYRL_STORE_DIR or ~/.cache/polyrl/store.")
    micro_batch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Tokens per forward/backward pass (packed, padding included); a step's datums "
        "are split into as many passes as needed. 'auto': 4096 on a CPU; on a GPU 4096 per 20 GiB of its "
        "memory, up to 16384 (fewer passes: fewer kernel launches). Lower it if training runs out of memory.")
    gradient_checkpointing: Literal["auto", True, False] = Field(
        "auto", description="Recompute activations in backward instead of keeping them (less memory, ~30% "
        "more compute); 'auto' turns it on for models of 300M parameters and more.",
    )
    attention: Literal["auto", "dense", "tree", "flex"] = Field(
        "auto", description="How packed rows attend: 'dense' (a [rows, width, width] mask through SDPA), "
        "'tree' (SDPA calls over each datum's own path), 'flex' (FlexAttention over the rows' prefix trees, "
        "compiled on CUDA); 'auto': tree on a CPU, else dense. Tree and flex need full causal SDPA layers.")
    max_store_bytes: int | None = Field(
        None, ge=1, description="Cap on the bytes the checkpoint store holds; a save that would pass it is "
        "refused (nothing of it kept) until checkpoints are deleted or expire. null = no cap.",
    )
    sampler: Literal["auto", "polyrl", "vllm"] = Field(
        "auto", description="What samples rollouts: 'polyrl' (the engine's own sampler), 'vllm' (vLLM, as "
        "local.vllm says; only the LoRA adapter crosses over, versioned per optimizer step) or 'auto': vLLM "
        "when local.vllm.urls are given or on a CUDA device with local.vllm.python present, else polyrl's "
        "own (the faster on a CPU). Requests vLLM cannot answer (prompt logprobs, images) use polyrl's own.")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="Where the vLLM sampler runs.")


class KLConfig(BaseModel):
    """A penalty on drifting from a reference policy, folded into the advantages (tinker-cookbook's)."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    penalty_coef: float = Field(
        gt=0, description="Weight of the penalty: each sampled token's advantage gets penalty_coef x (the "
        "batch's mean of d - the token's d), d = sampler logprob - reference logprob; logged as kl/reference "
        "(the mean d).",
    )
    reference: str | None = Field(
        None, description="The reference policy: null = the base model (model_name, no adapter); else a "
        "checkpoint ('tinker://<run>/sampler_weights/<name>') or another base model with the same tokenizer.",
    )
    discount_factor: float = Field(
        0.0, ge=0, le=1, description="Credit each sampled token with the discounted sum of the KL penalty of "
        "the sampled tokens after it (0 = each token alone, as the cookbook's default).",
    )


class TeacherConfig(BaseModel):
    """On-policy distillation: a teacher policy scores every token the student sampled."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    model: str = Field(
        description="The teacher: a checkpoint ('tinker://<run>/sampler_weights/<name>') or a base model "
        "(hub id or directory). It scores the student's token ids, so it must share the student's tokenizer.",
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
        0.0, ge=0, description="Weight of the environments' reward advantages next to the distillation "
        "signal: 0 = pure distillation (rewards are still logged), 1 = the full RL advantage added.",
    )


class AdvantagesConfig(BaseModel):
    """How episode rewards become advantages."""

    model_config = _STRICT

    estimator: EstimatorName = Field(
        "grpo", description="A registered advantage estimator. 'grpo': episode reward minus its group's "
        "mean. 'rebn': per-step discounted returns normalized over the batch (GEM-style), for multi-turn "
        "environments.",
    )
    gamma: float = Field(1.0, gt=0, le=1, description="Discount of future step rewards, for an estimator "
                         "that uses it (rebn); leave it at 1 with any other.")
    normalize_by_std: bool = Field(
        False, description="Divide group advantages by the group's std, for an estimator that uses it "
        "(grpo; rebn always normalizes)."
    )
    remove_constant_reward_groups: bool = Field(
        False, description="Drop groups whose episodes all got the same reward (they carry no signal)."
    )


class OptimizerConfig(BaseModel):
    """The optimizer of every step; its learning rate is the top-level ``learning_rate``."""

    model_config = _STRICT

    type: Literal["adam", "dimuon"] = Field(
        "adam", description="Optimizer: 'adam' (with AdamW-style weight decay) or 'dimuon' (Tinker's Dimuon: "
        "momentum, row/column preconditioning and the matrix sign on each LoRA matrix). Fixed when the "
        "training client is created, so a run resumes with the optimizer it started with.")
    beta1: float = Field(0.9, description="Momentum coefficient (Adam's beta1; Dimuon's EMA beta1).")
    beta2: float = Field(0.95, description="Adam beta2 (adam only).")
    eps: float = Field(1e-8, description="Adam epsilon (adam only).")
    weight_decay: float = Field(0.0, description="Weight decay, AdamW-style (adam only).")
    grad_clip_norm: float = Field(0.0, ge=0, description="Clip the gradient norm to this; 0 = no clipping.")
    damping: float | None = Field(
        None, gt=0, description="Dimuon: damping of the row and column preconditioner; null = the service's "
        "default (polyrl's engine: 0.1).")
    rank_lr_correction_exponent: float | None = Field(
        None, description="Dimuon: exponent of the learning-rate correction relative to rank 32 (0 = none); "
        "null = the service's default (polyrl's engine: 0.5).")

    @model_validator(mode="after")
    def _fields_of_type(self) -> OptimizerConfig:
        """A setting the chosen optimizer would ignore is an error."""
        if self.type == "adam":
            unused = [k for k in ("damping", "rank_lr_correction_exponent") if getattr(self, k) is not None]
        else:
            defaults = OptimizerConfig()
            unused = [k for k in ("beta2", "eps", "weight_decay") if getattr(self, k) != getattr(defaults, k)]
        problems = [(k, f"not used by optimizer type {self.type!r}") for k in unused]
        problems += optimizer_problems(self.type, self.model_dump(exclude={"type"}))
        if problems:
            raise ConfigProblems(problems)
        return self


class OffPolicyConfig(BaseModel):
    """Asynchronous training: groups sampled ahead of the policy, minibatches trained as they finish."""

    model_config = _STRICT

    max_steps: int = Field(
        0, ge=0, description="How many optimizer steps behind the policy being trained the sampler of any "
        "trained token may be. 0 = the synchronous loop (each step samples with the newest weights, then "
        "trains). With K >= 1 up to K more batches of groups are sampled while a step trains, so sampling "
        "and environments never wait for training; episodes in flight take the newest weights at each turn "
        "(partial rollouts), and the loss's importance ratio against each token's sampler logprob corrects "
        "for the lag (a clipped loss such as ppo or cispo suits stale data best).",
    )
    stale_groups: Literal["drop", "keep"] = Field(
        "drop", description="With max_steps >= 1, a group with a token sampled further behind (a slow group "
        "that finished after faster ones were trained) is dropped, counted in async/stale_dropped and "
        "replaced by a fresh one; 'keep' trains it anyway.",
    )
    partial_chunk_tokens: int | None = Field(
        None, ge=1, description="With max_steps >= 1, a turn samples at most this many tokens with one "
        "sampler, then continues (the turn so far re-encoded) with the newest weights, until a stop or "
        "max_tokens; each token keeps the logprob of the sampler that produced it. Chunks are seeded apart, "
        "so a turn's tokens differ from unchunked sampling. null = each turn with one sampler.",
    )
    stream_minibatches: int | None = Field(
        None, ge=1, description="Groups per forward_backward: training starts on each minibatch of this many "
        "groups as soon as they finish instead of waiting for the whole batch, and steps the optimizer once "
        "per batch (tinker-cookbook's stream_minibatch_config); the last minibatch takes what is left of "
        "batch_size. null = one forward_backward with the whole batch.",
    )
    correction: Literal["none", "tis", "mis", "seq_mis", "geo_mis", "icepop"] = Field(
        "none", description="Off-policy correction, with rho = p_learner / p_sampler per sampled token: "
        "'tis' weights each token's advantage by min(rho, correction_cap); 'mis' masks tokens with rho "
        "outside [correction_low, correction_high], 'seq_mis' sequences whose product of rho is, 'geo_mis' "
        "those whose geometric mean is; 'icepop' weights by rho inside and masks outside. The loss's own "
        "ratio is then taken against the learner (docs: Off-policy correction). 'none': that ratio only.",
    )
    correction_cap: float = Field(DEFAULT_CORRECTION_CAP, ge=1, le=1e6,
                                  description="correction 'tis': the largest importance weight (C).")
    correction_low: float | None = Field(None, ge=0, description="The masks' lower bound on rho (below 1); "
                                         "null = 0.5 (mis, seq_mis, icepop) or 0.999 (geo_mis).")
    correction_high: float | None = Field(None, gt=1, le=1e6, description="The masks' upper bound on rho; "
                                          "null = 2 (mis, seq_mis), 5 (icepop) or 1.001 (geo_mis).")

    @model_validator(mode="after")
    def _check_combinations(self) -> OffPolicyConfig:
        used = [key for key, value in (("stale_groups", self.stale_groups != "drop"),
                                       ("partial_chunk_tokens", self.partial_chunk_tokens is not None))
                if value]
        problems = [] if self.max_steps else [
            (key, "only used with off_policy.max_steps >= 1 (the synchronous loop samples every group with "
                  "the policy it trains)") for key in used]
        masks = self.correction not in ("none", "tis")
        for key in ("correction_low", "correction_high"):
            if getattr(self, key) is not None and not masks:
                problems.append((key, f"only used by the masks (correction mis, seq_mis, geo_mis or icepop), "
                                      f"not correction {self.correction!r}"))
        if self.correction_cap != DEFAULT_CORRECTION_CAP and self.correction != "tis":
            problems.append(("correction_cap", f"only used by correction 'tis', not {self.correction!r}"))
        if masks and not (bounds := self.bounds())[0] < 1 < bounds[1]:
            problems.append(("correction_low", f"must be below 1 and correction_high above it (got "
                                               f"{bounds})"))
        if problems:
            raise ConfigProblems(problems)
        return self

    def bounds(self) -> tuple[float, float]:
        """The masks' [low, high] on rho, with each correction's default where unset."""
        low, high = CORRECTION_BOUNDS.get(self.correction, (0.5, 2.0))
        return (low if self.correction_low is None else self.correction_low,
                high if self.correction_high is None else self.correction_high)


class LimitsConfig(BaseModel):
    """Bounds that keep a broken environment or service from reaching the weights or hanging the run."""

    model_config = _STRICT

    max_abs_reward: float = Field(
        DEFAULT_MAX_ABS_REWARD, gt=0, le=1e300, description="Largest magnitude a reward (an episode's or a "
        "step's) may have: an episode past it fails with a warning and counts against its environment's "
        "failure budget, so an absurd reward (1e308) never reaches the advantages and the weights.",
    )
    max_observation_tokens: int = Field(
        DEFAULT_MAX_OBSERVATION_TOKENS, ge=1, description="Most tokens one observation (an environment's "
        "first or later messages, rendered) may add to an episode; past it the episode fails (a failure).",
    )
    max_observation_bytes: int = Field(
        DEFAULT_MAX_OBSERVATION_BYTES, ge=1, description="Most bytes of text (UTF-8, tool specs included; "
        "images: max_image_*) one observation may hold; checked before it is tokenized, so an environment "
        "that answers with megabytes fails its episode instead of exhausting memory.",
    )
    max_image_bytes: int = Field(20 << 20, ge=1, description="Most bytes of one encoded image of an "
                                 "observation, checked before it is read; past it the episode fails.")
    max_image_pixels: int = Field(36_000_000, ge=1, description="Most pixels (width x height) of one image, "
                                  "read from its header before a pixel is decoded; past it the episode fails")
    nonfinite_steps: Literal["stop", "skip"] = Field(
        "stop", description="A step whose update is not finite (a loss, gradient or advantage that is NaN or "
        "inf; the trainer checks the loss before optim_step and the engine refuses such a step): 'stop' ends "
        "the run with one line naming the last checkpoint; 'skip' leaves the weights as they were, discards "
        "the step's gradients, counts the step in optim/nonfinite_skipped and goes on.",
    )
    max_no_update_frac: float = Field(
        0.5, ge=0, le=1, description="Stop the run with an error once more than this share of its steps made "
        "no update because groups failed (a group dropped over its failure budget means something is "
        "broken); judged from the 10th step on (each such step is warned about). 1 = never stop.",
    )
    max_no_signal_frac: float = Field(
        1.0, ge=0, le=1, description="Stop the run with an error once more than this share of its steps made "
        "no update only because every group had equal rewards (no learning signal; normal early on a task "
        "the model cannot solve yet); judged from the 10th step on. Each such step is warned about with the "
        "share so far. 1 = never stop (the default).",
    )
    service_timeout: float = Field(
        120, gt=0, description="Seconds a remote training service (backend tinker, polyrl serve) may stay "
        "unreachable while its requests are retried; then the run stops, naming the checkpoint to resume.",
    )
    max_service_recoveries: int = Field(
        3, ge=0, description="How often a run reopens itself from its last checkpoint, in the same process, "
        "when a remote training service lost its session or pending requests (a restarted polyrl serve); "
        "steps are neither repeated in the logs nor skipped, as on a relaunch. Each recovery is warned "
        "about; one more stops the run.",
    )


class OutputsConfig(BaseModel):
    """Files a run writes under ``log_path`` besides metrics, trajectories and checkpoints."""

    model_config = _STRICT

    report: bool = Field(True, description="Refresh the HTML report whenever a checkpoint is saved.")
    metrics_json: bool = Field(
        False, description="Also write log_path/metrics.json, a JSON list of {reward, loss, step} per step "
        "(the file Minds RL's harness wrote; on for translated Minds RL configs)."
    )


# --------------------------------------------------------------------------------- old flat keys


def move_renamed_keys(data: dict[str, Any], renamed: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with each old flat key of ``renamed`` moved to its ``section.key``, and one warning line
    per key moved. A key given both ways is a :class:`ConfigProblems` naming both."""
    data, notes, problems = dict(data), [], []
    for old, new in renamed.items():
        if old not in data:
            continue
        value = data.pop(old)
        notes.append(RENAMED_NOTE.format(old=old, new=new))
        section, key = new.split(".")
        target = data.get(section)
        target = {} if target is None else target
        if not isinstance(target, dict) or key in target:
            problems.append((new, f"given both as {old!r} and as {new!r} (keep {new!r})"))
        elif not (old in _KL_OFF and value == _KL_OFF[old]):  # how the flat layout said "no KL penalty"
            data[section] = {**target, key: value}
    if problems:
        raise ConfigProblems(problems)
    return data, notes


class RenamedKeys(BaseModel):
    """A config that accepts, for one release, the flat keys of :attr:`RENAMED` (old -> ``section.key``)."""

    RENAMED: ClassVar[dict[str, str]] = {}
    _renamed_warnings: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _move_renamed_keys(cls, data: Any, handler: Any) -> Any:
        notes: list[str] = []
        if isinstance(data, dict) and cls.RENAMED:
            data, notes = move_renamed_keys(data, cls.RENAMED)
        model = handler(data)
        if notes:
            model._renamed_warnings = notes
        return model

    @property
    def renamed_warnings(self) -> list[str]:
        """One line per old key this config was given (the command line prints them as warnings)."""
        return list(self._renamed_warnings)


# the engine settings that were top-level keys before ``local:`` (newer ones never were)
LOCAL_RENAMED = {key: f"local.{key}" for key in ("device", "dtype", "store_dir", "micro_batch_tokens",
                                                 "gradient_checkpointing")}


# -------------------------------------------------------------------------------- the run configs


class PolicyConfig(RenamedKeys):
    """The policy being trained or sampled and the service that runs it (train, sft and eval)."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)
    RENAMED: ClassVar[dict[str, str]] = LOCAL_RENAMED

    backend: Literal["local", "tinker"] = Field(
        "local", description="Training engine: 'local' (built-in, PyTorch) or 'tinker' (a Tinker service)."
    )
    base_url: str | None = Field(
        None, description="URL of the Tinker service; null = the client's default (needs TINKER_API_KEY)."
    )
    model_name: str = Field(description="Base model: a Hugging Face hub id or a local directory.")
    lora_rank: int = Field(32, gt=0, description="Rank of the LoRA adapter being trained.")
    renderer: RendererName | None = Field(
        None, description="Chat format used to turn messages into tokens (a registered renderer); null = "
        "inferred from the model."
    )
    local: LocalEngineConfig = Field(
        default_factory=LocalEngineConfig, description="The built-in engine's settings (backend 'local' "
        "only)."
    )


class TrainConfig(PolicyConfig):
    """Everything ``polyrl train`` needs."""

    RENAMED: ClassVar[dict[str, str]] = {
        **LOCAL_RENAMED,
        "advantage_estimator": "advantages.estimator", "gamma": "advantages.gamma",
        "normalize_advantages_by_std": "advantages.normalize_by_std",
        "remove_constant_reward_groups": "advantages.remove_constant_reward_groups",
        "kl_penalty_coef": "kl.penalty_coef", "kl_reference": "kl.reference",
        "kl_discount_factor": "kl.discount_factor",
        "adam_beta1": "optimizer.beta1", "adam_beta2": "optimizer.beta2", "adam_eps": "optimizer.eps",
        "weight_decay": "optimizer.weight_decay", "grad_clip_norm": "optimizer.grad_clip_norm",
        "max_steps_off_policy": "off_policy.max_steps", "stale_groups": "off_policy.stale_groups",
        "stream_minibatches": "off_policy.stream_minibatches",
        **{key: f"limits.{key}" for key in LimitsConfig.model_fields if "image" not in key},  # once flat
        "report": "outputs.report", "metrics_json": "outputs.metrics_json",
    }

    resume_from: str | None = Field(
        None, description="Weights to start from, a 'tinker://.../weights/<name>' path. Only for a log_path "
        "without checkpoints: a relaunch always continues its own run from its last checkpoint.",
    )

    # loss and advantages
    loss_fn: LossName = Field(
        "importance_sampling", description="Policy-gradient loss: a registered loss that takes advantages. "
        "stable_reinforce (Tinker's StableReinforce) trains against the sampler logprobs the service "
        "recorded for each sampled turn, named by provenance spans on the Datums; it stays stable off-policy."
    )
    loss_fn_config: dict[str, float] = Field(
        default_factory=dict, description="The loss's parameters, the keys its registration declares: "
        "clip_low_threshold and clip_high_threshold (ppo, cispo, gspo), beta (dro), kl_coeff and max_ratio "
        "(stable_reinforce).",
    )
    advantages: AdvantagesConfig = Field(
        default_factory=AdvantagesConfig, description="How episode rewards become advantages."
    )
    kl: KLConfig | None = Field(None, description="A KL penalty against a reference policy; null = none.")
    teacher: TeacherConfig | None = Field(
        None, description="On-policy distillation from a teacher policy (polyrl distill sets it); null = "
        "none.",
    )

    # optimization
    batch_size: int = Field(8, ge=1, le=MAX_EPISODES_PER_STEP, description="Groups per training step "
                            f"(batch_size x num_rollouts is at most {MAX_EPISODES_PER_STEP} episodes).")
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate.")
    lr_schedule: LrSchedule = Field(
        "constant", description="Learning rate over the run: 'constant', or 'linear' decay from "
        "learning_rate at step 0 towards 0 at max_steps.")
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig, description="The optimizer's type and parameters."
    )
    max_steps: int = Field(100, ge=1, description="Training steps.")
    max_tokens: int = Field(256, ge=1,
                            description="Tokens sampled per turn unless an environment sets its own.")
    seed: int = Field(0, description="Run seed: task order, sampling and environment generation.")
    off_policy: OffPolicyConfig = Field(
        default_factory=OffPolicyConfig, description="Asynchronous training: sampling ahead of the policy "
        "being trained, and minibatches trained as their groups finish (both off by default)."
    )
    limits: LimitsConfig = Field(
        default_factory=LimitsConfig, description="Bounds on rewards, observations, steps without an update "
        "and an unreachable service."
    )

    # checkpoints, evaluation, logging
    save_every: int = Field(20, ge=0, description="Save a checkpoint every N steps; 0 = only at the end.")
    eval_every: int = Field(
        0, ge=0, description="Evaluate on the test splits every N steps and after the last step, and once "
        "before the first step of a run that starts at step 0 (logged as step -1); 0 = never."
    )
    eval_num_samples: int = Field(1, ge=1, le=MAX_EPISODES_PER_STEP,
                                  description="Samples per test task during evaluation (for pass@k).")
    log_path: str = Field("runs/polyrl",
                          description="Directory for metrics, trajectories, checkpoints and the report.")
    outputs: OutputsConfig = Field(
        default_factory=OutputsConfig, description="Files written under log_path besides metrics.jsonl, "
        "trajectories and checkpoints."
    )
    wandb_project_name: str | None = Field(None,
                                           description="Weights & Biases project; null = no W&B logging.")
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
        return {name: env if env.type else env.model_copy(update={"type": name})
                for name, env in envs.items()}

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        problems = self._loss_problems() + self._batch_problems() + self._backend_problems()
        if self.teacher is not None and self.teacher.reward_weight == 0 \
                and self.advantages.remove_constant_reward_groups:
            problems.append(("advantages.remove_constant_reward_groups", "drops groups by their rewards, but "
                                                                         "rewards do not train "
                                                                         "(teacher.reward_weight is 0)"))
        bound = self.limits.max_abs_reward
        for name, env in self.environments.items():
            if env.nonterminal_reward is not None and abs(env.nonterminal_reward) > bound:
                problems.append((f"environments.{name}.nonterminal_reward",
                                 f"{env.nonterminal_reward:g} is past limits.max_abs_reward={bound:g}: every "
                                 "unfinished episode would fail"))
            if env.partner is not None and env.partner.pool and not self.save_every:
                problems.append((f"environments.{name}.partner.pool",
                                 "past selves join the pool at every save_every, but save_every is 0 (only "
                                 "the final checkpoint): set save_every"))
        if self.eval_every > 0 and not any("test" in env.splits for env in self.environments.values()):
            problems.append(("eval_every", "evaluation needs at least one environment with a test split"))
        if problems:
            raise ConfigProblems(problems)
        return self

    def _loss_problems(self) -> list[tuple[str, str]]:
        """A learning rate past the engine's range (the loss and its ``loss_fn_config`` are checked against
        the loss's registration by :mod:`polyrl.config.checks`)."""
        return range_problems({"learning_rate": self.learning_rate}, {"learning_rate": LEARNING_RATE})

    def _batch_problems(self) -> list[tuple[str, str]]:
        """A step's size, and minibatches that cannot be trained before the whole batch is in."""
        problems = []
        train_envs = [env for env in self.environments.values() if "train" in env.splits]
        widest = max((env.num_rollouts for env in train_envs), default=1)
        if self.batch_size * widest > MAX_EPISODES_PER_STEP:
            problems.append(("batch_size", f"{self.batch_size} groups of up to {widest} episodes is "
                                           f"{self.batch_size * widest} episodes a step, more than "
                                           f"{MAX_EPISODES_PER_STEP} (lower batch_size or num_rollouts)"))
        stream, key = self.off_policy.stream_minibatches, "off_policy.stream_minibatches"
        if stream is not None:
            if stream > self.batch_size:
                problems.append((key, f"{stream} groups per minibatch is more than batch_size "
                                      f"({self.batch_size})"))
            if self.kl is not None:
                problems.append((key, "the KL penalty is centred on its mean over the whole batch, which a "
                                      "minibatch trained before the rest finished cannot do"))
        return problems

    def _backend_problems(self) -> list[tuple[str, str]]:
        """A remote backend: engine settings it would ignore, and its API key."""
        if self.backend != "tinker":
            return []
        defaults = LocalEngineConfig()
        problems = [(f"local.{key}", "only used by the local backend, but backend is 'tinker'")
                    for key, value in self.local if value != getattr(defaults, key)]
        key = os.environ.get("TINKER_API_KEY")
        if self.base_url is None and not key:
            problems.append(("backend", "'tinker' needs TINKER_API_KEY (environment or .env) or a base_url"))
        elif key and not key.startswith(TINKER_KEY_PREFIXES):
            problems.append(("backend", "TINKER_API_KEY (environment or .env) is not a Tinker API key: "
                                        "those start with 'tml-'"))
        return problems

    def turn_max_tokens(self, env_name: str) -> int:
        """Per-turn token cap of an environment: its own ``max_tokens`` or the top-level one."""
        return self.environments[env_name].max_tokens or self.max_tokens

    def dump(self) -> dict[str, Any]:
        """JSON-safe dict of the config with secrets redacted (for logs and run directories); the values
        of settings named like a key or token masked too (:func:`polyrl.secrets.redact_config`)."""
        return redact_config(self.model_dump(mode="json"))
