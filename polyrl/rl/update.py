"""The update of one step: each minibatch of groups prepared and sent to ``forward_backward`` as it
arrives, then one optimizer step once every loss came back finite.

:func:`prepare_minibatch` applies each environment's failure budget, computes the advantages (plus the
KL penalty's and the distillation teacher's per-token terms, when configured) and builds the Datums;
:func:`forward_backward` sends them (with ``off_policy.correction``, as ``loss_fn_config`` keys on the
local engine, or folded into the Datums after a ``forward`` pass with backend tinker:
:func:`fold_correction`); :func:`optimizer_step` waits for the losses and applies one ``optim_step``.
:class:`StepUpdate` is what the step trained on.

No non-finite number reaches the weights: an advantage, per-token term or sampler logprob past
float32's range keeps its minibatch's Datums from being built; a loss that comes back NaN or inf, or an
``optim_step`` the engine refuses, applies nothing. Such a step stops the run, or is skipped with its
gradients discarded (:func:`refuse_update`, ``nonfinite_steps``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
from tinker import types
from tinker.types.optimizer import OptimParamsBase

from polyrl.backend import ServiceGuard, make_rest_client, update_refused
from polyrl.config.schema import TrainConfig, scheduled_lr
from polyrl.errors import RunStoppedError
from polyrl.local import losses
from polyrl.local.datums import reduce_metrics
from polyrl.rl import advantages as adv_lib
from polyrl.rl.episode import Episode
from polyrl.rl.rollouts import EnvRuntime, split_roles
from polyrl.rl.scoring import TokenSignals

if TYPE_CHECKING:
    from polyrl.clients import Future, OptimParams, TrainingClient
    from polyrl.rl.run import Run

FLOAT32_MAX = 3.4028234663852886e38  # Datum inputs travel as float32: anything larger becomes inf


@dataclass
class GroupCounts:
    """What became of one environment's groups in a minibatch (or a step)."""

    failed_rollouts: float = 0.0  # episodes that failed (an error or a timeout)
    dropped_groups: float = 0.0  # groups over their failure budget, or with no episode left: not trained
    constant_groups: float = 0.0  # groups whose episodes all have the same reward

    def __add__(self, other: GroupCounts) -> GroupCounts:
        return GroupCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass
class Minibatch:
    """One minibatch of a step, ready for ``forward_backward``."""

    kept_G: list[list[Episode]]  # the groups kept (split by role; failing episodes left out)
    counts: dict[str, GroupCounts]  # per environment
    episodes_D: list[Episode]  # the episodes trained on: a signal and sampled tokens; one Datum each
    data_D: list[types.Datum]  # their Datums; none when ``problem`` is set
    metrics: dict[str, float] = field(default_factory=dict)  # the per-token signals' (KL penalty, teacher)
    problem: str | None = None  # what in it is not a finite float32, if anything
    correction: dict[str, float] = field(default_factory=dict)  # a client-side correction's loss metrics


@dataclass
class Optimized:
    """The step's ``forward_backward`` results and its optimizer step, or why none was applied."""

    results: list[types.ForwardBackwardOutput]
    optim: types.OptimStepResponse | None
    refused: str | None = None  # the update is not finite: no optimizer step was applied


@dataclass
class StepUpdate:
    """What a step trained on: the groups kept, their counts per environment, how many Datums, and the
    optimizer's metrics; ``seconds`` is training time only (waiting for groups is the rollouts'). The
    episodes of the Datums (``episodes_D``) carry each token's sampler step."""

    kept_G: list[list[Episode]]
    counts: dict[str, GroupCounts]
    datums: int
    metrics: dict[str, float]
    seconds: float
    episodes_D: list[Episode] = field(default_factory=list)

    @classmethod
    def of(cls, minibatches: list[Minibatch], metrics: dict[str, float], seconds: float) -> StepUpdate:
        counts: dict[str, GroupCounts] = {}
        for minibatch in minibatches:
            for name, part in minibatch.counts.items():
                counts[name] = counts.get(name, GroupCounts()) + part
        kept_G = [group for minibatch in minibatches for group in minibatch.kept_G]
        episodes_D = [ep for minibatch in minibatches for ep in minibatch.episodes_D]
        return cls(kept_G, counts, len(episodes_D), metrics, seconds, episodes_D)


# ---- a minibatch --------------------------------------------------------------------------------
def filter_groups(episodes_G: list[list[Episode]], runtimes: dict[str, EnvRuntime],
                  remove_constant: bool) -> tuple[list[list[Episode]], dict[str, GroupCounts]]:
    """Apply each environment's failure budget; failing episodes of a kept group are left out.
    Returns the kept groups and the counts per environment."""
    kept_G: list[list[Episode]] = []
    counts: dict[str, GroupCounts] = {}
    for group in episodes_G:
        name = group[0].env_name
        c = counts.setdefault(name, GroupCounts())
        failures = sum(ep.failed for ep in group)
        c.failed_rollouts += failures
        ok = [ep for ep in group if not ep.failed]
        if failures > runtimes[name].cfg.max_failing_rollouts or not ok:
            c.dropped_groups += 1
            continue
        if len({ep.reward for ep in ok}) == 1:
            c.constant_groups += 1
            if remove_constant:
                continue
        kept_G.append(ok)
    return kept_G, counts


async def prepare_minibatch(episodes_G: list[list[Episode]], step: int, config: TrainConfig,
                            runtimes: dict[str, EnvRuntime], signals: TokenSignals,
                            guard: ServiceGuard) -> Minibatch:
    """Groups of ``step`` as they came from the queue -> their kept groups, counts, advantages (recorded
    on the episodes), the per-token signals scored for them, and their Datums. With a KL reference or a
    teacher every sampled token carries a signal, so every episode of a kept group trains."""
    adv = config.advantages
    kept_G, counts = filter_groups(split_roles(episodes_G), runtimes, adv.remove_constant_reward_groups)
    advantages_G = adv_lib.compute_advantages(kept_G, adv.estimator, adv.normalize_by_std, adv.gamma)
    if config.teacher is not None:
        advantages_G = adv_lib.scale_advantages(advantages_G, config.teacher.reward_weight)
    adv_lib.record_advantages(kept_G, advantages_G)  # final now: the Datums and the trajectory log read them
    trained = [(ep, advantages) for group, group_advantages in zip(kept_G, advantages_G)
               for ep, advantages in zip(group, group_advantages)
               if ep.action_tokens and (signals.active or any(a != 0 for a in advantages))]
    episodes_D = [ep for ep, _ in trained]
    terms_D, metrics = await guard.watch(f"scoring step {step}", signals.terms(episodes_D))
    problem = nonfinite_inputs(episodes_D, [advantages for _, advantages in trained], terms_D)
    data_D = [] if problem else [adv_lib.to_datum(ep, config.loss_fn, terms_T)
                                 for ep, terms_T in zip(episodes_D, terms_D)]
    return Minibatch(kept_G, counts, episodes_D, data_D, metrics, problem)


def nonfinite_inputs(episodes_D: list[Episode], advantages_D: list[list[float]],
                     terms_D: list[list[float]] | list[None]) -> str | None:
    """What would reach the loss as inf or NaN (Datum inputs travel as float32): an advantage, a
    per-token term or a sampler logprob past float32's range, or None."""
    for ep, advantages, terms_T in zip(episodes_D, advantages_D, terms_D):
        for what, values in (("advantage", advantages), ("per-token term", terms_T or ()),
                             ("sampler logprob", ep.logprobs)):
            bad = next((v for v in values if not abs(v) <= FLOAT32_MAX), None)
            if bad is not None:
                return f"an episode of {ep.env_name} has {what} {bad:g}, past float32's range"
    return None


def first_problem(minibatches: list[Minibatch]) -> str | None:
    """Why the step's update is not finite, as far as its minibatches so far show."""
    return next((m.problem for m in minibatches if m.problem is not None), None)


async def forward_backward(training: TrainingClient, guard: ServiceGuard, minibatch: Minibatch,
                           config: TrainConfig
                           ) -> tuple[Future[types.ForwardBackwardOutput], dict[str, float]]:
    """Send a minibatch's Datums to ``forward_backward`` (not awaited: the next minibatch is prepared
    meanwhile); the gradients add up in the service until the optimizer step. The off-policy correction
    goes in ``loss_fn_config`` (local engine), or with backend tinker is folded into the Datums first
    (:func:`fold_correction`). Returns the result's future and the client-side correction's metrics
    (empty when the loss does the correction), which the caller keeps as ``minibatch.correction``."""
    data_D, loss_config = minibatch.data_D, dict(config.loss_fn_config)
    correction: dict[str, float] = {}
    if config.off_policy.correction != "none":
        if config.backend == "tinker":
            data_D, correction = await fold_correction(training, guard, data_D, config.loss_fn,
                                                       correction_keys(config))
        else:
            loss_config.update(correction_keys(config))
    return training.forward_backward(data_D, config.loss_fn, loss_config or None), correction


def correction_keys(config: TrainConfig) -> dict[str, float]:
    """``off_policy.correction`` as the ``loss_fn_config`` keys of the local engine and polyrl serve."""
    off_policy = config.off_policy
    if off_policy.correction == "none":
        return {}
    if off_policy.correction == "tis":
        return {"tis_cap": off_policy.correction_cap}
    low, high = off_policy.bounds()
    return {f"{off_policy.correction}_low": low, f"{off_policy.correction}_high": high}


async def fold_correction(training: TrainingClient, guard: ServiceGuard, data_D: list[types.Datum],
                          loss_fn: str, keys: dict[str, float]) -> tuple[list[types.Datum], dict[str, float]]:
    """The correction done client-side, for a service whose ``loss_fn_config`` takes no polyrl keys
    (hosted Tinker): a ``forward`` pass gives the learner's logprobs, each token's factor is computed as
    the local engine's loss does (:func:`polyrl.local.losses.correction_factor`) and multiplied into its
    advantage (a masked token: advantage 0); for a loss whose ratio the correction re-anchors, the
    Datum's ``logprobs`` become the learner's. The step's ``forward_backward`` calls all run on the
    weights this ``forward`` saw, so the result is the in-loss one. ``keys`` are the correction's
    ``loss_fn_config`` keys (:func:`correction_keys`). Returns the new Datums and the metrics."""
    spec = losses.get_loss(loss_fn)
    correction, _ = losses.parse_correction(keys, spec.name, spec.correction)
    assert correction is not None
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"],
        "weights": types.TensorData(data=[1.0] * d.model_input.length, dtype="float32")}) for d in data_D]
    forward = await guard("computing the learner's logprobs", training.forward, plain, "cross_entropy")
    folded, parts = [], []
    for datum, out in zip(data_D, forward.loss_fn_outputs):
        inputs = {k: v.to_torch().float() for k, v in datum.loss_fn_inputs.items() if k != "target_tokens"}
        learner = out["logprobs"].to_torch().float()
        if spec.provenance:
            inputs["sampled"] = sampled_targets(datum, len(learner))
        segments = losses.Segments(torch.zeros(len(learner), dtype=torch.long), 1)
        active = losses.sampled_tokens(inputs)
        factor, metrics = losses.correction_factor(learner - inputs["logprobs"], active, segments, correction)
        changed = dict(datum.loss_fn_inputs)
        changed["advantages"] = types.TensorData.from_torch(inputs["advantages"] * factor)
        if spec.correction == losses.ANCHOR:
            changed["logprobs"] = types.TensorData.from_torch(learner)
        folded.append(dataclasses.replace(datum, loss_fn_inputs=changed))
        parts.append(metrics)
    return folded, reduce_metrics(parts)


def sampled_targets(datum: types.Datum, n: int) -> torch.Tensor:
    """1.0 on the targets a Datum's provenance names as sampled tokens."""
    sampled, pos = torch.zeros(n), 0
    for span in datum.loss_fn_input_spans or ():
        if isinstance(span, types.SampledProvenanceSpan):
            sampled[pos:pos + span.length] = 1.0
        pos += span.length
    return sampled


# ---- the optimizer step ---------------------------------------------------------------------------
def optim_params(config: TrainConfig, step: int) -> OptimParams:
    """The optimizer settings for the update of ``step`` (0-based), under ``lr_schedule``: Adam's, or
    Dimuon's (its damping and rank correction exponent only when the config sets them, so that a service
    whose DimuonParams lack them takes the step)."""
    lr = scheduled_lr(config.learning_rate, config.lr_schedule, step, config.max_steps)
    optimizer = config.optimizer
    if optimizer.type == "dimuon":
        extra = {k: v for k in ("damping", "rank_lr_correction_exponent")
                 if (v := getattr(optimizer, k)) is not None}
        values = {"learning_rate": lr, "beta1": optimizer.beta1, "grad_clip_norm": optimizer.grad_clip_norm}
        return OptimParamsBase(type="dimuon", **values, **extra) if extra else types.DimuonParams(**values)
    return types.AdamParams(learning_rate=lr, beta1=optimizer.beta1, beta2=optimizer.beta2,
                            eps=optimizer.eps, weight_decay=optimizer.weight_decay,
                            grad_clip_norm=optimizer.grad_clip_norm)


def nonfinite_loss(results: list[types.ForwardBackwardOutput]) -> str | None:
    """The ``forward_backward`` loss that came back NaN or inf, if one did."""
    for result in results:
        loss = (result.metrics or {}).get("loss:sum")
        if loss is not None and not math.isfinite(loss):
            return f"the forward_backward loss is {loss}"
    return None


async def optimizer_step(training: TrainingClient, guard: ServiceGuard,
                         pending: list[Future[types.ForwardBackwardOutput]], problem: str | None,
                         params: OptimParams, step: int) -> Optimized:
    """Wait for the step's ``forward_backward`` results, then apply one ``optim_step`` unless the update
    is not finite: a ``problem`` in the inputs, a loss that came back NaN or inf (checked here, whatever
    the backend does about it), or a step the engine refused. A service that reports a non-finite
    metric for a step it applied stops the run: nothing more is saved."""

    async def finish() -> Optimized:
        results = [await fwd for fwd in pending]
        refused = problem or nonfinite_loss(results)
        if refused is not None:
            return Optimized(results, None, refused)
        try:
            return Optimized(results, await training.optim_step(params))
        except Exception as exc:
            if update_refused(exc):
                return Optimized(results, None, " ".join(str(exc).split())[:300])
            raise

    optimized = await guard.watch(f"training step {step}", finish())
    reported = (optimized.optim.metrics or {}) if optimized.optim is not None else {}
    for key, value in reported.items():
        if not math.isfinite(value):
            raise RunStoppedError(f"step {step}: optim_step reports {key} = {value}, so the update it "
                                  "applied is not finite; nothing more is saved")
    return optimized


async def refuse_update(run: Run, step: int, problem: str, sent: bool) -> None:
    """A step whose update is not finite: no optimizer step was applied, so the weights are as they
    were. ``nonfinite_steps: stop`` ends the run (the caller names the last checkpoint); ``skip`` warns,
    discards what the step's ``forward_backward`` calls (``sent``) accumulated, and goes on."""
    what = f"step {step}: the update is not finite ({problem}); no optimizer step was applied"
    if run.config.limits.nonfinite_steps == "stop":
        raise RunStoppedError(f"{what} (nonfinite_steps: skip passes over such steps)")
    run.console.warn(f"{what}; the step is skipped (nonfinite_steps: skip)")
    if sent:
        await discard_gradients(run, step)


async def discard_gradients(run: Run, step: int) -> None:
    """Drop the gradients a skipped step accumulated in the service. The Tinker interface has no call
    for it, so the training client reloads its own state (weights and optimizer, which the skipped
    step left untouched), saved under a scratch name that is deleted right after."""
    name, guard, training = f"skipped-{step:06d}", run.guard, run.training
    saved = await guard(f"saving checkpoint {name}", training.save_state, name)
    await guard(f"reloading checkpoint {name}", training.load_state_with_optimizer, saved.path)
    rest = await guard("connecting", make_rest_client, run.config, run.service)
    await guard(f"deleting checkpoint {name}", rest.delete_checkpoint_from_tinker_path, saved.path)
