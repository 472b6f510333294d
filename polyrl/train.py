"""``polyrl train``: RL fine-tuning on many environments at once.

:func:`train_async` is the whole loop, top to bottom. Each phase is a method of :class:`Trainer` that
can be run (and tested) on its own:

- ``start``: continue the run in ``log_path`` if it has a checkpoint, else warm start from
  ``resume_from``, else start fresh; then the first sampler;
- ``plan``: which environment and task each group of a step draws (by weight, from the data cursors);
- ``rollouts``: the step's batch, taken from the rollout queue (:mod:`polyrl.rollout_queue`) as its
  groups finish; the queue samples each planned group with the newest sampler, up to
  ``max_steps_off_policy`` steps ahead of training (0: the synchronous loop);
- ``update``: failure budgets, advantages (plus the KL penalty and the distillation teacher's per-token
  terms, when configured), Datums and a ``forward_backward`` for each minibatch as it arrives (the whole
  batch unless ``stream_minibatches``), then, once every loss came back finite, one ``optim_step``;
- ``checkpoint``: the sampler for the next groups, and a saved state when one is due;
- ``evaluate`` and ``log``: held-out evaluation, metrics, trajectories, checkpoint rows, console, W&B;
- ``check_learning``: stop when too many steps made no update because groups failed (or, when asked,
  for want of a learning signal).

A step whose update is not finite (an advantage or logprob past float32, a loss that is NaN or inf, or
an ``optim_step`` the engine refused) applies nothing: the run stops naming its last checkpoint, or
skips the step (``nonfinite_steps``). When a remote service lost the run's session or pending
requests (a restart), the run reopens itself from its last checkpoint in the same process, as a
relaunch would (``max_service_recoveries``).

Every group draws its task and seeds from its plan step and the cursors alone, and a checkpoint saves
where drawing stands, so a relaunch after a kill repeats no step and skips none: groups that were in
flight are drawn again. The synchronous loop therefore samples exactly what the uninterrupted run did.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from tinker import types

from polyrl import advantages as adv_lib
from polyrl.backend import ServiceGuard, make_rest_client, service_url, update_refused
from polyrl.config import ConfigError, TrainConfig, scheduled_lr
from polyrl.config_checks import check_config
from polyrl.errors import RunStoppedError, ServiceLostError
from polyrl.evaluate import evaluate_sampler
from polyrl.policy import open_policy
from polyrl.report import refresh_for_training
from polyrl.rollout_queue import DrawPoint, Group, RolloutQueue
from polyrl.rollouts import (Episode, EnvRuntime, ObservationTooLarge, RewardOutOfBounds, collect_group,
                             rollout_bounds, split_roles)
from polyrl.scoring import TokenSignals
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles

NO_UPDATE_MIN_STEPS = 10  # max_no_update_frac is judged once this many steps ran (shorter runs only warn)
FLOAT32_MAX = 3.4028234663852886e38  # Datum inputs travel as float32: anything larger becomes inf


@dataclass
class RunState:
    """Where a run stands. Its fields go into every checkpoint row next to the saved state, so a
    relaunch continues exactly: the next step, each environment's data cursor, the W&B run."""

    step: int = 0
    cursors: dict[str, int] = field(default_factory=dict)  # data cursors before the plan of draw_step
    draw_step: int = 0  # the first plan step with a group not trained yet (see polyrl.rollout_queue)
    consumed: list[tuple[int, int]] = field(default_factory=list)  # groups from there on trained or dropped
    wandb_run_id: str | None = None
    checkpoint: str | None = None  # state path of the last logged checkpoint
    no_update_steps: int = 0  # steps so far that trained nothing
    failed_steps: int = 0  # of those, steps with groups dropped over their failure budget

    def restore(self, row: dict) -> None:
        self.step = int(row["batch"])
        self.cursors.update(row.get("cursors", {}))
        self.draw_step = int(row.get("draw_step", self.step))
        self.consumed = [(int(s), int(i)) for s, i in row.get("consumed", [])]
        self.wandb_run_id = row.get("wandb_run_id")
        self.checkpoint = row["state_path"]

    def draw_from(self, point: DrawPoint) -> None:
        self.draw_step, self.cursors, self.consumed = point.step, point.cursors, point.consumed


@dataclass
class StepRollouts:
    """A step's batch: ``taken`` fills as the update takes groups from the queue (``source``), the
    stalest first; ``stale`` are the groups dropped on the way; ``seconds`` the time spent waiting."""

    step: int
    size: int
    source: Callable[[int], Awaitable[tuple[list[Group], list[Group]]]] | None = None
    taken: list[Group] = field(default_factory=list)
    stale: list[Group] = field(default_factory=list)
    seconds: float = 0.0
    handed: int = 0  # groups of ``taken`` handed to the update so far

    @classmethod
    def of(cls, step: int, groups: list[list[Episode]], sampler_step: int | None = None) -> "StepRollouts":
        """A batch of groups already sampled (by the policy after ``sampler_step`` updates: ``step``)."""
        version = step if sampler_step is None else sampler_step
        return cls(step, len(groups), taken=[Group(step, i, g, version) for i, g in enumerate(groups)])

    @property
    def groups(self) -> list[list[Episode]]:
        return [g.episodes for g in self.taken]

    @property
    def staleness(self) -> list[int]:
        """Per group: how many updates its sampler is behind the policy this step trains."""
        return [self.step - g.sampler_step for g in self.taken]

    async def next(self, n: int) -> list[list[Episode]]:
        """Up to ``n`` more groups of the batch (waiting for them); [] once all were handed out. Each
        group's episodes are numbered by the group's place in the batch."""
        if self.source is not None and len(self.taken) < self.size:
            started = time.monotonic()
            taken, stale = await self.source(min(n, self.size - len(self.taken)))
            self.seconds += time.monotonic() - started
            for position, group in enumerate(taken, start=len(self.taken)):
                for ep in group.episodes:
                    ep.group_id = position
            self.taken += taken
            self.stale += stale
        part = self.taken[self.handed:self.handed + n]
        self.handed += len(part)
        return [g.episodes for g in part]


@dataclass
class StepUpdate:
    """What a step trained on: the groups kept, their counters, and the optimizer's metrics."""

    kept: list[list[Episode]]
    stats: dict[str, dict[str, float]]
    datums: int
    metrics: dict[str, float]
    seconds: float  # training only: time waiting for streamed groups is the rollouts' time


@dataclass
class Saved:
    """The checkpoint row a step saved (``None`` between checkpoints)."""

    row: dict | None
    seconds: float


async def train_async(config: TrainConfig, console: ConsoleLog | None = None) -> dict[str, float]:
    check_config(config)  # a config built in code meets the checks a loaded one did (environments, models)
    trainer = Trainer(config, console)
    try:
        await trainer.start()
        row: dict[str, float] = {}
        recoveries = 0
        while trainer.state.step < config.max_steps:
            try:
                row = await train_step(trainer)
            except ServiceLostError as lost:
                most = config.limits.max_service_recoveries
                if recoveries == most:
                    raise ServiceLostError(f"{lost}; reopened {recoveries} times already "
                                           f"(max_service_recoveries={most})") from None
                recoveries += 1
                await trainer.reopen(f"{lost}; reopening the run from its last checkpoint, as a relaunch "
                                     f"would (recovery {recoveries} of {most})")
        trainer.finish()
        return row
    except RunStoppedError as exc:
        raise RunStoppedError(f"{exc}; {trainer.resume_hint()}") from None
    finally:
        await trainer.close()


async def train_step(trainer: "Trainer") -> dict[str, float]:
    """One step: its batch, the update, the checkpoint, evaluation and logs; returns the metrics row."""
    state, step, started = trainer.state, trainer.state.step, time.monotonic()
    assert trainer.queue is not None, "start() first"
    rollouts = trainer.rollouts(step)
    update = await trainer.update(rollouts)
    state.step = step + 1
    state.draw_from(trainer.queue.draw_point())  # what a relaunch draws again
    saved = await trainer.checkpoint()
    evaluation = await trainer.evaluate()
    trainer.queue.release(len(rollouts.taken))  # new groups sample the new policy
    row = trainer.log(rollouts, update, saved, evaluation, started)
    trainer.check_learning(rollouts, update)
    return row


def train(config: TrainConfig, console: ConsoleLog | None = None) -> dict[str, float]:
    return asyncio.run(train_async(config, console))


class Trainer:
    """The phases of one run (see the module docstring); :func:`train_async` runs them in order."""

    def __init__(self, config: TrainConfig, console: ConsoleLog | None = None):
        self.config = config
        self.console = console or ConsoleLog()
        self.files = RunFiles(config.log_path, metrics_json=config.outputs.metrics_json)
        self.guard = ServiceGuard(service_url(config), config.limits.service_timeout, self.console.warn)
        optimizer = config.optimizer
        self.adam = types.AdamParams(learning_rate=config.learning_rate, beta1=optimizer.beta1,
                                     beta2=optimizer.beta2, eps=optimizer.eps,
                                     weight_decay=optimizer.weight_decay,
                                     grad_clip_norm=optimizer.grad_clip_norm)
        self.state = RunState()
        self.runtimes: dict[str, EnvRuntime] = {}
        self.weights: dict[str, float] = {}  # environments with a train split, by batch share
        self.service: Any = None
        self.training: Any = None
        self.sampler: Any = None
        self.sampler_step = 0  # updates the current sampler's weights have seen
        self.queue: RolloutQueue | None = None
        self.tokenizer: Any = None
        self.renderer: Any = None
        self.signals = TokenSignals()  # per-token advantage terms: KL penalty, distillation teacher
        self.wandb: Any = None
        self.uploader: Any = None

    # ---- start, warm start or resume ------------------------------------------------------------
    async def start(self) -> RunState:
        config, files = self.config, self.files
        files.write_config(config.dump())
        bounds = rollout_bounds(config)
        self.runtimes = {name: EnvRuntime.create(name, cfg, config.seed, config.max_tokens, **bounds)
                         for name, cfg in config.environments.items()}
        self.weights = {n: rt.cfg.weight for n, rt in self.runtimes.items() if rt.cfg.splits.get("train") is not None}
        if not self.weights:
            raise ConfigError("environments: none has a train split (splits.train is null everywhere), "
                              "so there is nothing to train on")
        for line in sampling_warnings(config):
            self.console.warn(line)
        await self.open()
        if config.wandb_project_name:
            from polyrl.tracking.wandb_log import WandbLog

            self.wandb = WandbLog(config.wandb_project_name, config.wandb_run_name, config.dump(), str(files.root),
                                  self.state.wandb_run_id)
            self.state.wandb_run_id = self.wandb.run_id
        if config.openreward_run_name:
            from polyrl.tracking.openreward_upload import OpenRewardUploader

            self.uploader = OpenRewardUploader(config, self.runtimes, self.state.step)
        return self.state

    async def open(self) -> RunState:
        """The service, the training client and the run state: from the last checkpoint row (a relaunch
        always continues its own run), else from ``resume_from``, else fresh; then the sampler, the
        rollout queue drawing from where the state stands, and the per-token signals' scorers."""
        config, files = self.config, self.files
        self.state = RunState(cursors={name: 0 for name in self.runtimes})
        row = files.last_resumable()

        async def connect(service: Any) -> Any:
            if row is not None:
                training = await self.guard("resuming",
                                            service.create_training_client_from_state_with_optimizer,
                                            row["state_path"])
                self.state.restore(row)
                self.console.info(f"resuming from {row['state_path']} at step {self.state.step}")
            elif config.resume_from:
                training = await self.guard("loading resume_from", service.create_training_client_from_state,
                                            config.resume_from)
                self.console.info(f"initialized weights from {config.resume_from}")
            else:
                training = await self.guard("creating the model", service.create_lora_training_client,
                                            base_model=config.model_name, rank=config.lora_rank,
                                            seed=config.seed)
            return training

        policy = await open_policy(config, connect)
        self.service, self.training = policy.service, policy.client
        self.tokenizer, self.renderer = policy.tokenizer, policy.renderer
        files.truncate_from(self.state.step)
        earlier = [r for r in files.metrics() if r.get("optim/datums") == 0]
        self.state.no_update_steps = len(earlier)
        self.state.failed_steps = sum(bool(r.get("rollouts/dropped_groups")) for r in earlier)
        if self.wandb is not None:
            self.state.wandb_run_id = self.wandb.run_id
        await self.remove_unlogged_checkpoints(resuming=row is not None)
        files.log_attempt({"training_run_id": self.training.model_id, "step": self.state.step})
        self.sampler = await self.guard("creating a sampler", self.training.save_weights_and_get_sampling_client)
        self.sampler_step = self.state.step
        ahead = config.off_policy.max_steps
        self.queue = RolloutQueue(
            self.plan, self.sample_group, lambda: (self.sampler, self.sampler_step),
            capacity=config.batch_size * (ahead + 1), wanted=config.batch_size * (config.max_steps - self.state.step),
            start=DrawPoint(self.state.draw_step, self.state.cursors, self.state.consumed),
            max_staleness=ahead if config.off_policy.stale_groups == "drop" else None)
        self.signals = await TokenSignals.open(config, self.service, self.guard, self.sampler, self.tokenizer,
                                               self.console.warn)
        return self.state

    async def reopen(self, why: str) -> RunState:
        """A relaunch in this process, after the service lost the run's session: the groups in flight
        are dropped and everything the service held (training client, samplers, scorers) is opened
        again from the last checkpoint row; steps after it are re-run and logged once, as on a
        relaunch. Environments and trackers stay open."""
        self.console.warn(why)
        if self.queue is not None:
            await self.queue.close()
            self.queue = None
        return await self.open()

    async def remove_unlogged_checkpoints(self, resuming: bool) -> None:
        """What earlier launches of this run saved but never logged (a kill between saving a
        checkpoint and writing its row): no row refers to it, so nothing would ever resume from it.
        Deleted when the run resumes from a row; only reported when the run has no row to resume
        from (``checkpoints.jsonl`` gone or never written), as the weights may still be wanted."""
        attempts = self.files.attempts()
        if not attempts:
            return
        logged = {row.get(key) for row in self.files.checkpoints() for key in ("state_path", "sampler_path")}
        rest = await self.guard("connecting", make_rest_client, self.config, self.service)
        unlogged = []
        for attempt in attempts:
            run_id = attempt["training_run_id"]
            try:
                listing = await self.guard("listing checkpoints", rest.list_checkpoints, run_id)
                for checkpoint in listing.checkpoints:
                    if checkpoint.tinker_path in logged:
                        continue
                    if resuming:
                        await self.guard("deleting a checkpoint", rest.delete_checkpoint_from_tinker_path,
                                         checkpoint.tinker_path)
                    unlogged.append(checkpoint.tinker_path)
            except RunStoppedError:
                raise
            except Exception as exc:  # noqa: BLE001 - tidying up must not keep the run from resuming
                self.console.warn(f"could not check the checkpoints of an interrupted launch ({run_id}): {exc}")
        if unlogged and resuming:
            self.console.info(f"removed {len(unlogged)} checkpoints that interrupted launches saved but never logged")
        elif unlogged:
            self.console.warn(f"{len(unlogged)} checkpoints of earlier launches of this run are named by no row of "
                              f"checkpoints.jsonl and stay in the store, e.g. {unlogged[0]}")

    # ---- one step ---------------------------------------------------------------------------------

    def adam_at(self, step: int) -> types.AdamParams:
        """The optimizer settings for the update of ``step`` (0-based), under ``lr_schedule``."""
        config = self.config
        lr = scheduled_lr(config.learning_rate, config.lr_schedule, step, config.max_steps)
        return self.adam.model_copy(update={"learning_rate": lr})

    def plan(self, step: int, cursors: dict[str, int]) -> tuple[list[tuple[str, int]], dict[str, int]]:
        """The ``(environment, task index)`` of each group of ``step``, and the cursors after it. Pure:
        the same step and cursors always give the same plan."""
        cursors = dict(cursors)
        plan = []
        for name in allocate_groups(self.weights, self.config.batch_size, step):
            plan.append((name, self.runtimes[name].task_index("train", cursors[name])))
            cursors[name] += 1
        return plan, cursors

    async def sample_group(self, step: int, index: int, env_name: str, task: int, sampler: Any) -> list[Episode]:
        """Group ``index`` of ``step``'s plan, sampled by ``sampler`` (seeded by the step and index)."""
        runtime = self.runtimes[env_name]
        return await collect_group(runtime, task, index, "train", runtime.cfg.num_rollouts, sampler, self.renderer,
                                   (self.config.seed, "train", step))

    def rollouts(self, step: int) -> StepRollouts:
        """The batch of ``step``, taken from the rollout queue as the update asks for its groups."""
        assert self.queue is not None, "start() first"
        queue = self.queue

        async def take(n: int) -> tuple[list[Group], list[Group]]:
            with self.console.progress(f"step {step} rollouts", n) as progress:
                def ready(count: int) -> None:
                    progress.update(progress.task_ids[0], completed=count)

                return await self.guard.watch(f"sampling for step {step}", queue.take(n, step, ready))

        return StepRollouts(step, self.config.batch_size, take)

    async def update(self, rollouts: StepRollouts) -> StepUpdate:
        """Failure budgets, advantages and Datums of each minibatch of groups as it arrives, and its
        ``forward_backward`` (the whole batch is one minibatch unless ``stream_minibatches``); then,
        once every loss came back finite, one ``optim_step``. A step whose groups all failed or carry no
        signal trains nothing; one whose update is not finite applies nothing (:meth:`refuse`). With a
        KL reference or a teacher, every sampled token carries a signal, so every episode of a kept
        group trains."""
        started, waited, config = time.monotonic(), rollouts.seconds, self.config
        kept, stats, episodes, datums, futures, signal_parts = [], {}, [], [], [], []
        problem: str | None = None  # why the step's update is not finite, once known
        while groups := await rollouts.next(config.off_policy.stream_minibatches or config.batch_size):
            part, part_stats, part_episodes, part_datums, part_signals, part_problem = await self.prepare(
                groups, rollouts.step)
            signal_parts.append((part_episodes, part_signals))
            kept += part
            episodes += part_episodes
            datums += part_datums
            for name, counts in part_stats.items():
                total = stats.setdefault(name, dict.fromkeys(counts, 0.0))
                for key, value in counts.items():
                    total[key] += value
            problem = problem or part_problem
            if part_datums and problem is None:
                futures.append(self.training.forward_backward(part_datums, config.loss_fn,
                                                              dict(config.loss_fn_config) or None))
        adam = self.adam_at(rollouts.step)
        metrics: dict[str, float] = {"optim/lr": adam.learning_rate, **_token_weighted(signal_parts)}
        if episodes:  # one Datum each, unless a problem kept them from being built
            async def train_step() -> tuple[list[Any], Any, str | None]:
                results = [await fwd for fwd in futures]
                refused = problem or nonfinite_loss(results)
                if refused is not None:  # checked here, whatever the backend does about it
                    return results, None, refused
                try:
                    return results, await self.training.optim_step(adam), None
                except Exception as exc:
                    if update_refused(exc):
                        return results, None, " ".join(str(exc).split())[:300]
                    raise

            fwd_results, opt_result, refused = await self.guard.watch(f"training step {rollouts.step}",
                                                                      train_step())
            if refused is not None:
                metrics.update(await self.refuse(rollouts.step, refused, sent=bool(futures)))
            else:
                outputs = [out for result in fwd_results for out in result.loss_fn_outputs]
                metrics.update(kl_metrics(datums, [ep.action_mask[1:] for ep in episodes], outputs))
                fwd_metrics = [result.metrics for result in fwd_results]
                metrics["optim/loss"] = sum(m.get("loss:sum", float("nan")) for m in fwd_metrics)
                if any("clipped_tokens:sum" in m for m in fwd_metrics):
                    metrics["optim/clip_frac"] = sum(m.get("clipped_tokens:sum", 0.0) for m in fwd_metrics) / max(
                        1.0, sum(m.get("active_tokens:sum", 1.0) for m in fwd_metrics))
                for k, v in (opt_result.metrics or {}).items():
                    metrics[f"optim/{k.split(':')[0]}"] = v
                    if not math.isfinite(v):  # a service that applied it anyway: save nothing more
                        raise RunStoppedError(f"step {rollouts.step}: optim_step reports {k} = {v}, so the "
                                              "update it applied is not finite; nothing more is saved")
        metrics["optim/datums"] = float(len(episodes))
        metrics["tokens/action"] = float(sum(ep.action_tokens for ep in episodes))
        metrics["tokens/total"] = float(sum(len(ep.tokens) - 1 for ep in episodes))
        seconds = time.monotonic() - started - (rollouts.seconds - waited)
        return StepUpdate(kept, stats, len(episodes), metrics, seconds)

    async def refuse(self, step: int, problem: str, sent: bool) -> dict[str, float]:
        """A step whose update is not finite: no optimizer step was applied, so the weights are as they
        were. ``nonfinite_steps: stop`` ends the run (the caller names the last checkpoint); ``skip``
        discards what the step's ``forward_backward`` calls (``sent``) accumulated and goes on."""
        what = f"step {step}: the update is not finite ({problem}); no optimizer step was applied"
        if self.config.limits.nonfinite_steps == "stop":
            raise RunStoppedError(f"{what} (nonfinite_steps: skip passes over such steps)")
        self.console.warn(f"{what}; the step is skipped (nonfinite_steps: skip)")
        if sent:
            await self.discard_gradients(step)
        return {"optim/nonfinite_skipped": 1.0}

    async def discard_gradients(self, step: int) -> None:
        """Drop the gradients a skipped step accumulated in the service. The Tinker interface has no call
        for it, so the training client reloads its own state (weights and optimizer, which the skipped
        step left untouched), saved under a scratch name that is deleted right after."""
        name = f"skipped-{step:06d}"
        saved = await self.guard(f"saving checkpoint {name}", self.training.save_state, name)
        await self.guard(f"reloading checkpoint {name}", self.training.load_state_with_optimizer, saved.path)
        rest = await self.guard("connecting", make_rest_client, self.config, self.service)
        await self.guard(f"deleting checkpoint {name}", rest.delete_checkpoint_from_tinker_path, saved.path)

    async def prepare(self, groups: list[list[Episode]], step: int) -> tuple[
            list[list[Episode]], dict[str, dict[str, float]], list[Episode], list[types.Datum],
            dict[str, float], str | None]:
        """One minibatch's kept groups, counters, trained episodes, their Datums, the metrics of the
        per-token signals (KL penalty, teacher) scored for them, and what in them is not a finite
        float32 (then no Datum is built: it would carry inf)."""
        config = self.config
        adv = config.advantages
        kept, stats = filter_groups(split_roles(groups), self.runtimes, adv.remove_constant_reward_groups)
        adv_lib.compute_advantages(kept, adv.estimator, adv.normalize_by_std, adv.gamma)
        if config.teacher is not None:
            adv_lib.scale_advantages(kept, config.teacher.reward_weight)
        episodes = [ep for g in kept for ep in g
                    if ep.action_tokens and (self.signals.active or any(a != 0 for a in ep.turn_advantages))]
        terms, signal_metrics = await self.guard.watch(f"scoring step {step}", self.signals.terms(episodes))
        problem = nonfinite_inputs(episodes, terms)
        datums = [] if problem else [adv_lib.to_datum(ep, config.loss_fn, t)
                                     for ep, t in zip(episodes, terms)]
        return kept, stats, episodes, datums, signal_metrics, problem

    async def checkpoint(self) -> Saved:
        """The sampler for the next step; at ``save_every`` and the last step, a saved state too."""
        started, config, state = time.monotonic(), self.config, self.state
        final = state.step == config.max_steps
        row = None
        if final or (config.save_every and state.step % config.save_every == 0):
            name = "final" if final else f"{state.step:06d}"
            saved = await self.guard(f"saving checkpoint {name}", self.training.save_state, name)
            sampler_path = (await self.guard(f"saving sampler weights {name}", self.training.save_weights_for_sampler,
                                             name)).path
            self.sampler = await self.guard("creating a sampler", self.training.create_sampling_client, sampler_path)
            row = {"name": name, "batch": state.step, "final": final, "state_path": saved.path,
                   "sampler_path": sampler_path, "cursors": dict(state.cursors), "draw_step": state.draw_step,
                   "consumed": [list(key) for key in state.consumed], "wandb_run_id": state.wandb_run_id}
            self.console.info(f"checkpoint {name}: {saved.path}")
        else:
            self.sampler = await self.guard("updating the sampler", self.training.save_weights_and_get_sampling_client)
        self.sampler_step = state.step
        return Saved(row, time.monotonic() - started)

    async def evaluate(self) -> dict[str, float]:
        """The test splits with the new sampler, every ``eval_every`` steps and at the end."""
        config, done = self.config, self.state.step
        if not config.eval_every or (done % config.eval_every and done != config.max_steps):
            return {}
        return await self.guard.watch(f"evaluating after step {done - 1}", evaluate_sampler(
            self.sampler, self.renderer, self.runtimes, config.eval_num_samples, config.seed))

    def log(self, rollouts: StepRollouts, update: StepUpdate, saved: Saved, evaluation: dict[str, float],
            started: float) -> dict[str, float]:
        """The step's metrics row, trajectories and checkpoint row (last: a resume from it must find the
        step fully logged), then console, W&B and the report."""
        config, step = self.config, rollouts.step
        row = {"step": step, "progress/done_frac": (step + 1) / config.max_steps, **update.metrics, **evaluation}
        row.update(episode_metrics(rollouts.groups, update.stats))
        staleness = rollouts.staleness or [0]
        row.update({"async/staleness_mean": _mean(staleness), "async/staleness_max": float(max(staleness)),
                    "async/stale_dropped": float(len(rollouts.stale))})
        row.update({"time/rollout": rollouts.seconds, "time/train": update.seconds, "time/save": saved.seconds,
                    "time/total": time.monotonic() - started})
        groups = rollouts.taken + rollouts.stale
        episodes = [ep for group in groups for ep in group.episodes]
        kept = {id(ep) for g in update.kept for ep in g}
        self.files.log_trajectories(step, [episode_row(step, ep, self.tokenizer, dropped=id(ep) not in kept, group=g)
                                           for g in groups for ep in g.episodes])
        if self.uploader:
            self.uploader.upload_step(step, episodes, row, {id(ep) for ep in episodes} - kept)
        self.files.log_metrics(row)
        if saved.row is not None:
            self.files.log_checkpoint(saved.row)
            self.state.checkpoint = saved.row["state_path"]
        if self.wandb:
            self.wandb.log(row, step)
        self.console.step(row)
        for line in bound_warnings(step, episodes):
            self.console.warn(line)
        if config.outputs.report and saved.row is not None and not saved.row["final"]:
            refresh_for_training(self.files.root, self.console)
        return row

    def check_learning(self, rollouts: StepRollouts, update: StepUpdate) -> None:
        """Warn about a step that trained nothing, with the share of such steps so far. Groups dropped
        over their failure budget mean something is broken: the run stops once more than
        ``max_no_update_frac`` of its steps made no update for that. Equal rewards everywhere are normal
        early on a hard task: those steps stop the run only past ``max_no_signal_frac`` (1 = never, the
        default). Both are judged from :data:`NO_UPDATE_MIN_STEPS` steps on."""
        config, state, done = self.config, self.state, self.state.step
        if update.datums:
            return
        failed = any(s.get("dropped_groups") for s in update.stats.values())
        state.no_update_steps += 1
        state.failed_steps += failed
        reason = no_update_reason(rollouts.groups, update.stats)
        limits = config.limits
        if failed:
            count, limit, key, kind = state.failed_steps, limits.max_no_update_frac, "max_no_update_frac", \
                "with failed groups"
        else:
            count, limit, key, kind = (state.no_update_steps - state.failed_steps, limits.max_no_signal_frac,
                                       "max_no_signal_frac", "without a learning signal")
        self.console.warn(f"step {rollouts.step} made no update: {reason} "
                          f"({count} of {done} steps so far {kind})")
        if done >= NO_UPDATE_MIN_STEPS and count > limit * done:
            raise RunStoppedError(f"{count} of {done} steps made no update {kind} "
                                  f"(more than {key}={limit:g}); at the last: {reason}")

    # ---- end ----------------------------------------------------------------------------------
    def finish(self) -> None:
        if self.config.outputs.report:
            refresh_for_training(self.files.root, self.console)

    def resume_hint(self) -> str:
        if self.state.checkpoint is None:
            return "no checkpoint saved yet"
        return f"last checkpoint: {self.state.checkpoint} (run the same command again to resume from it)"

    async def close(self) -> None:
        """Stop the groups in flight, then close W&B, the uploader and every environment builder; each
        on its own, so one that fails neither hides the error that ended the run nor keeps the others
        open."""
        if self.queue is not None:
            await self.queue.close()
        closers = [self.wandb.close if self.wandb else None, self.uploader.close if self.uploader else None]
        for close in filter(None, closers):
            try:
                close()
            except Exception as exc:  # noqa: BLE001
                self.console.warn(f"closing failed: {exc}")
        for rt in self.runtimes.values():
            try:
                await rt.builder.aclose()
            except Exception as exc:  # noqa: BLE001
                self.console.warn(f"closing environment {rt.name} failed: {exc}")


# ---- helpers of the phases ------------------------------------------------------------------------
def allocate_groups(weights: dict[str, float], batch_size: int, step: int) -> list[str]:
    """Environment name of each group in a step's batch: shares proportional to ``weight``; the
    leftover slots rotate with the step so small shares still get their turn."""
    total = sum(weights.values())
    quotas = {n: batch_size * w / total for n, w in weights.items()}
    counts = {n: math.floor(q) for n, q in quotas.items()}
    left = batch_size - sum(counts.values())
    names = sorted(weights, key=lambda n: (-(quotas[n] - counts[n]), n))
    if left:
        start = step % len(names)
        for n in (names[start:] + names[:start])[:left]:
            counts[n] += 1
    return [n for n in sorted(weights) for _ in range(counts[n])]


def sampling_warnings(config: TrainConfig) -> list[str]:
    """What the config samples differently from what the loss assumes, in one line."""
    tempered = [f"{name} ({env.temperature:g})" for name, env in sorted(config.environments.items())
                if env.temperature != 1.0 and env.splits.get("train") is not None]
    if not tempered:
        return []
    return [f"sampling temperature other than 1 in {', '.join(tempered)}: the sampler's logprobs are the "
            "model's own at temperature 1 (as in Tinker), so the importance ratio compares against a "
            "distribution that was not sampled"]


def filter_groups(groups: list[list[Episode]], runtimes: dict[str, EnvRuntime],
                  remove_constant: bool) -> tuple[list[list[Episode]], dict[str, dict[str, float]]]:
    """Apply each environment's failure budget; failing episodes of a kept group are left out.
    Returns the kept groups and per-environment counters."""
    kept, stats = [], {}
    for group in groups:
        name = group[0].env_name
        s = stats.setdefault(name, {"failed_rollouts": 0.0, "dropped_groups": 0.0, "constant_groups": 0.0})
        failures = sum(ep.failed for ep in group)
        s["failed_rollouts"] += failures
        ok = [ep for ep in group if not ep.failed]
        if failures > runtimes[name].cfg.max_failing_rollouts or not ok:
            s["dropped_groups"] += 1
            continue
        if len({ep.reward for ep in ok}) == 1:
            s["constant_groups"] += 1
            if remove_constant:
                continue
        kept.append(ok)
    return kept, stats


def nonfinite_inputs(episodes: list[Episode], terms: list[list[float]] | list[None]) -> str | None:
    """What would reach the loss as inf or NaN (Datum inputs travel as float32): an advantage, a
    per-token term or a sampler logprob past float32's range, or None."""
    for ep, token_terms in zip(episodes, terms):
        for what, values in (("advantage", ep.turn_advantages), ("per-token term", token_terms or ()),
                             ("sampler logprob", ep.logprobs)):
            bad = next((v for v in values if not abs(v) <= FLOAT32_MAX), None)
            if bad is not None:
                return f"an episode of {ep.env_name} has {what} {bad:g}, past float32's range"
    return None


def nonfinite_loss(results: list[Any]) -> str | None:
    """The ``forward_backward`` loss that came back NaN or inf, if one did."""
    for result in results:
        loss = (result.metrics or {}).get("loss:sum")
        if loss is not None and not math.isfinite(loss):
            return f"the forward_backward loss is {loss}"
    return None


def bound_warnings(step: int, episodes: list[Episode]) -> list[str]:
    """A line for each bound the step's episodes ran into (an absurd reward, a huge observation)."""
    lines = []
    for kind in (RewardOutOfBounds, ObservationTooLarge):
        errors = [ep.error for ep in episodes if ep.error and ep.error.startswith(f"{kind.__name__}: ")]
        if errors:
            lines.append(f"step {step}: {len(errors)} episode(s) failed (counted against their failure "
                         f"budget): {errors[0]}")
    return lines


def no_update_reason(groups: list[list[Episode]], stats: dict[str, dict[str, float]]) -> str:
    """Why a step trained nothing, in a few words: groups dropped and the most common episode error."""
    dropped = sum(s["dropped_groups"] for s in stats.values())
    constant = sum(s["constant_groups"] for s in stats.values())
    reason = f"{dropped:g} of {len(groups)} groups dropped over their failure budget, {constant:g} with equal rewards"
    errors = Counter(" ".join(ep.error.split())[:200] for g in groups for ep in g if ep.error)
    if errors:
        error, count = errors.most_common(1)[0]
        reason += f"; most common episode error ({count}x): {error}"
    return reason


def episode_row(step: int, ep: Episode, tokenizer, dropped: bool, group: Group | None = None) -> dict:
    """One line of ``trajectories/step_NNNNNN.jsonl``; ``group`` tells which policy sampled it and
    where it was drawn."""
    return {
        "step": step,
        "sampler_step": step if group is None else group.sampler_step,
        "drawn": [step, ep.group_id] if group is None else [group.drawn, group.index],
        "env": ep.env_name,
        "split": ep.split,
        "task_index": ep.task_index,
        "group": ep.group_id,
        "role": ep.role,
        "reward": ep.reward,
        "success": ep.success,
        "step_rewards": ep.step_rewards,
        "advantages": ep.turn_advantages,
        "num_turns": ep.num_turns,
        "stop_reasons": ep.stop_reasons,
        "done_by_env": ep.done_by_env,
        "error": ep.error,
        "dropped": dropped,
        "metrics": ep.metrics,
        "duration_s": round(ep.duration_s, 4),
        "messages": ep.messages,
        "tools": ep.tools,
        "tokens": ep.tokens,
        "token_text": tokenizer.batch_decode([[t] for t in ep.tokens]) if ep.tokens else [],
        "logprobs": [round(x, 5) for x in ep.logprobs],
        "action_mask": ep.action_mask,
        "turn_spans": ep.turn_spans,
    }


def episode_metrics(groups: list[list[Episode]], stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """Reward, success, lengths and environment metrics, overall and per environment."""
    out: dict[str, float] = {}
    by_env: dict[str, list[Episode]] = {}
    for group in groups:
        for ep in group:
            by_env.setdefault(ep.env_name, []).append(ep)
    everything = [ep for eps in by_env.values() for ep in eps]
    for prefix, eps in [("", everything)] + [(f"env/{n}/", eps) for n, eps in sorted(by_env.items())]:
        ok = [ep for ep in eps if not ep.failed]
        if not ok:
            continue
        out[f"{prefix}reward/mean"] = _mean(ep.reward for ep in ok)
        out[f"{prefix}success/mean"] = _mean(float(ep.success) for ep in ok)
        out[f"{prefix}turns/mean"] = _mean(ep.num_turns for ep in ok)
        out[f"{prefix}tokens/action_per_episode"] = _mean(ep.action_tokens for ep in ok)
        out[f"{prefix}tokens/total_per_episode"] = _mean(len(ep.tokens) for ep in ok)
        out[f"{prefix}stop/length_frac"] = _mean(float("length" in ep.stop_reasons) for ep in ok)
        if prefix:
            for key in sorted({k for ep in ok for k in ep.metrics}):
                out[f"{prefix}{key}"] = _mean(ep.metrics.get(key, 0.0) for ep in ok)
    for name, s in stats.items():
        for k, v in s.items():
            out[f"env/{name}/{k}"] = v
    out["rollouts/failed"] = sum(s["failed_rollouts"] for s in stats.values())
    out["rollouts/dropped_groups"] = sum(s["dropped_groups"] for s in stats.values())
    out["episodes/count"] = float(len(everything))
    return out


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def _token_weighted(parts: list[tuple[list[Episode], dict[str, float]]]) -> dict[str, float]:
    """Per-minibatch means of the signal metrics combined into the step's, each minibatch weighted by
    its sampled tokens (of the named environment, for ``env/<name>/...``)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for episodes, metrics in parts:
        for key, value in metrics.items():
            env = key.split("/")[1] if key.startswith("env/") else None
            w = float(sum(ep.action_tokens for ep in episodes if env is None or ep.env_name == env))
            sums[key] = sums.get(key, 0.0) + value * w
            weights[key] = weights.get(key, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


def kl_metrics(datums: list[types.Datum], masks: list[list[int]], outputs: list[dict]) -> dict[str, float]:
    """Sampler vs learner logprobs on the sampled tokens (``masks``): KL estimators and entropy."""
    diffs, sampler_lps = [], []
    for d, mask, out in zip(datums, masks, outputs):
        for s, lr, m in zip(d.loss_fn_inputs["logprobs"].tolist(), out["logprobs"].tolist(), mask):
            if m:
                diffs.append(s - lr)
                sampler_lps.append(s)
    if not diffs:
        return {}
    return {
        "optim/kl_sample_train_v1": _mean(diffs),
        "optim/kl_sample_train_v2": _mean(0.5 * x * x for x in diffs),
        "optim/entropy": -_mean(sampler_lps),
    }
