"""``polyrl train``: RL fine-tuning on many environments at once.

:func:`train_step` is one step, top to bottom; :func:`train_async` opens the run
(:func:`polyrl.rl.run.open_run`), runs its steps and closes it. A step:

- takes its batch from the rollout queue (:mod:`polyrl.rl.rollout_queue`) as its groups finish; the
  queue samples each planned group with the newest sampler, up to ``max_steps_off_policy`` steps
  ahead of training (0: the synchronous loop);
- prepares each minibatch of groups as it arrives (failure budgets, advantages, the KL penalty's and
  the distillation teacher's per-token terms, Datums) and sends it to ``forward_backward`` (the whole
  batch is one minibatch unless ``stream_minibatches``), then applies one ``optim_step`` once every
  loss came back finite (:mod:`polyrl.rl.update`);
- makes the sampler for the next groups, saves a checkpoint when one is due, evaluates on the test
  splits every ``eval_every`` steps and after the last one, and hands the queue the new sampler with the
  slots of the groups it trained;
- logs its metrics row, trajectories and checkpoint row (:mod:`polyrl.rl.step_metrics`), and stops the
  run when too many steps made no update because groups failed (or, when asked, for want of a
  learning signal).

With ``eval_every`` set, a run that starts at step 0 first evaluates the weights it starts from (the
base model, or ``resume_from``): its row in ``metrics.jsonl`` has step -1, "after step -1", so the
held-out scores have a point before training and one after the last step.

A step whose update is not finite applies nothing: the run stops naming its last checkpoint, or skips
the step (``nonfinite_steps``). When a remote service lost the run's session or pending requests (a
restart), the run reopens itself from its last checkpoint in the same process, as a relaunch would
(``max_service_recoveries``).

Every group draws its task and seeds from its plan step and the cursors alone, and a checkpoint saves
where drawing stands, so a relaunch after a kill repeats no step and skips none: groups that were in
flight are drawn again. The synchronous loop therefore samples exactly what the uninterrupted run did.

Conventions: names on the training path carry their shape as a suffix, as in tinker-cookbook:
``_G`` one entry per group of the batch (``episodes_G``: ``list[list[Episode]]``, one list of episodes
per group), ``_D`` one per Datum (``data_D``, ``episodes_D``: the episodes trained, one Datum each),
``_T`` one per token of a sequence, ``_P`` one per entry of a step's plan (``plan_P``: ``(environment,
task)``). ``groups`` without a suffix are :class:`polyrl.rl.rollout_queue.Group` records (episodes plus
where they were drawn and which sampler sampled them).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from polyrl.config.checks import check_config
from polyrl.errors import RunStoppedError, ServiceLostError
from polyrl.evaluate import evaluate_sampler
from polyrl.report import refresh_for_training
from polyrl.rl.chat_models import PastSelves
from polyrl.rl.rollout_queue import StepBatch
from polyrl.rl.run import Run, RunState, close_run, open_run, reopen_run, resume_hint, sampler_options
from polyrl.rl.step_metrics import bound_warnings, episode_row, no_update_reason, step_row, update_metrics
from polyrl.rl.update import (
    Minibatch,
    StepUpdate,
    first_problem,
    forward_backward,
    optim_params,
    optimizer_step,
    prepare_minibatch,
    refuse_update,
)
from polyrl.tracking.files import read_jsonl

if TYPE_CHECKING:
    from tinker import types

    from polyrl.clients import Future, SamplingClient
    from polyrl.config.schema import TrainConfig
    from polyrl.rl.episode import Episode
    from polyrl.tracking.console import ConsoleLog

BEFORE_TRAINING = -1  # the step of the evaluation before the first step in metrics.jsonl ("after step -1")
NO_UPDATE_MIN_STEPS = 10  # max_no_update_frac is judged once this many steps ran (shorter runs only warn)


def train(config: TrainConfig, console: ConsoleLog | None = None) -> dict[str, float]:
    return asyncio.run(train_async(config, console))


async def train_async(config: TrainConfig, console: ConsoleLog | None = None) -> dict[str, float]:
    """Open the run, run its steps (reopening it after a lost service, a bounded number of times) and
    close it; returns the last step's metrics row."""
    check_config(config)  # a config built in code meets the checks a loaded one did (environments, models)
    run = await open_run(config, console)
    status = "errored"  # how the service's session ends
    try:
        row: dict[str, float] = {}
        recoveries = 0
        while run.state.step < config.max_steps:
            try:
                if run.state.step == 0:  # a fresh start, or a relaunch with no checkpoint: it starts over
                    await evaluate_before_training(run)
                row = await train_step(run)
            except ServiceLostError as lost:
                most = config.limits.max_service_recoveries
                if recoveries == most:
                    raise ServiceLostError(f"{lost}; reopened {recoveries} times already "
                                           f"(max_service_recoveries={most})") from None
                recoveries += 1
                run = await reopen_run(run, f"{lost}; reopening the run from its last checkpoint, as a "
                                            f"relaunch would (recovery {recoveries} of {most})")
        if config.outputs.report:
            refresh_for_training(run.files.root, run.console)
        status = "success"
        return row
    except RunStoppedError as exc:
        raise RunStoppedError(f"{exc}; {resume_hint(run.state)}") from None
    except (KeyboardInterrupt, asyncio.CancelledError):
        status = "interrupted"
        raise
    finally:
        await close_run(run, status)


async def train_step(run: Run) -> dict[str, float]:
    """Step ``run.state.step``, top to bottom; returns its metrics row."""
    config, state, started = run.config, run.state, time.monotonic()
    step = state.step

    # Take the batch from the queue a minibatch at a time (the whole batch unless stream_minibatches);
    # prepare each as its groups arrive and send it to forward_backward while the next one samples
    batch = StepBatch(step, config.batch_size)
    minibatches: list[Minibatch] = []
    pending: list[Future[types.ForwardBackwardOutput]] = []
    while batch.missing:
        episodes_G = await take_groups(run, batch, config.off_policy.stream_minibatches or config.batch_size)
        minibatch = await prepare_minibatch(episodes_G, step, config, run.runtimes, run.signals, run.guard)
        minibatches.append(minibatch)
        if minibatch.data_D and first_problem(minibatches) is None:
            future, minibatch.correction = await forward_backward(run.training, run.guard, minibatch, config)
            pending.append(future)

    # One optimizer step, once every loss came back finite; an update that is not finite applies
    # nothing, and the run stops or skips the step (nonfinite_steps)
    params, problem, optimized = optim_params(config, step), first_problem(minibatches), None
    if any(m.episodes_D for m in minibatches):
        optimized = await optimizer_step(run.training, run.guard, pending, problem, params, step)
        if optimized.refused is not None:
            await refuse_update(run, step, optimized.refused, sent=bool(pending))
    update = StepUpdate.of(minibatches, update_metrics(params, minibatches, optimized),
                           seconds=time.monotonic() - started - batch.seconds)

    # Where the run stands now: a relaunch continues with the next step and draws the groups still in
    # flight again
    state.step = step + 1
    state.draw_from(run.queue.draw_point())

    # The sampler for the next groups; at save_every and the last step, a checkpoint too
    saved = await checkpoint(run, state)

    # Evaluation on the test splits with the new sampler, when due
    evaluation = await evaluate(run, saved.sampler, state.step)

    # Release the batch's slots with the new sampler: the groups started from now on sample the policy
    # this step trained (the one ordering rule: the queue gets the sampler only once it exists)
    run.queue.release(len(batch.taken), saved.sampler, saved.sampler_step)

    # Log the metrics row, the trajectories and the checkpoint row; then console, W&B and the report
    row = step_row(config, batch, update, evaluation, saved.seconds, started)
    log_step(run, state, row, batch, update, saved)

    # Count a step that trained nothing in the run state: the run stops when too many did
    count_step_without_update(config, run.console, state, step, batch.episodes_G, update)
    return row


async def take_groups(run: Run, batch: StepBatch, n: int) -> list[list[Episode]]:
    """Up to ``n`` more groups of ``batch`` from the queue (waiting for them, with a progress bar): the
    episodes of each, numbered by its place in the batch."""
    n, started = min(n, batch.missing), time.monotonic()
    with run.console.progress(f"step {batch.step} rollouts", n) as progress:
        def ready(count: int) -> None:
            progress.update(progress.task_ids[0], completed=count)

        taken, stale = await run.guard.watch(f"sampling for step {batch.step}",
                                             run.queue.take(n, batch.step, ready))
    return batch.add(taken, stale, time.monotonic() - started)


@dataclass
class Saved:
    """The sampler for the next groups (its weights have seen ``sampler_step`` updates) and the
    checkpoint row the step saved (``None`` between checkpoints)."""

    sampler: SamplingClient
    sampler_step: int
    row: dict | None
    seconds: float


async def checkpoint(run: Run, state: RunState) -> Saved:
    """The sampler for the groups after ``state.step`` steps; at ``save_every`` and the last step the
    training state is saved too, with its checkpoint row: ``state``, what a relaunch continues from."""
    started, config, training, done = time.monotonic(), run.config, run.training, state.step
    final = done == config.max_steps
    row = None
    if final or (config.save_every and done % config.save_every == 0):
        name = "final" if final else f"{done:06d}"
        saved = await run.guard(f"saving checkpoint {name}", training.save_state, name)
        sampler_path = (await run.guard(f"saving sampler weights {name}", training.save_weights_for_sampler,
                                        name)).path
        sampler = await run.guard("creating a sampler", training.create_sampling_client, sampler_path,
                                  **sampler_options(config))
        row = {"name": name, "batch": done, "final": final, "state_path": saved.path,
               "sampler_path": sampler_path, "cursors": dict(state.cursors), "draw_step": state.draw_step,
               "consumed": [list(key) for key in state.consumed], "wandb_run_id": state.wandb_run_id}
        run.console.info(f"checkpoint {name}: {saved.path}")
        for rt in run.runtimes.values():  # a pool of past selves takes the checkpoint in
            if isinstance(rt.partner, PastSelves):
                rt.partner.add(done, sampler)
    else:
        sampler = await run.guard("updating the sampler", training.save_weights_and_get_sampling_client,
                                  **sampler_options(config))
    return Saved(sampler, done, row, time.monotonic() - started)


async def evaluate(run: Run, sampler: SamplingClient, done: int) -> dict[str, float]:
    """The test splits with ``sampler`` after ``done`` steps, every ``eval_every`` steps and after the last
    step ({} when none is due)."""
    config = run.config
    if not config.eval_every or (done % config.eval_every and done != config.max_steps):
        return {}
    return await run.guard.watch(f"evaluating after step {done - 1}", evaluate_sampler(
        sampler, run.renderer, run.runtimes, config.eval_num_samples, config.seed))


async def evaluate_before_training(run: Run) -> dict[str, float]:
    """When ``eval_every`` is set: the test splits with the sampler of the weights the run starts from,
    before its first step; logged as the row of step -1 of ``metrics.jsonl`` (the report's "before" of
    the held-out scores) and on the console. Returns that row's evaluation ({} when not evaluated)."""
    if not run.config.eval_every:
        return {}
    config = run.config
    evaluation = await run.guard.watch("evaluating before training", evaluate_sampler(
        run.queue.samplers.sampler, run.renderer, run.runtimes, config.eval_num_samples, config.seed))
    run.files.log_metrics({"step": BEFORE_TRAINING, **evaluation})
    if run.wandb:  # W&B's steps start at 0: the evaluation shares step 0 with the first step's row
        run.wandb.log(evaluation, 0)
    scores = [f"{k} {v:.3f}" for name in ("pass@1", "reward") for k, v in evaluation.items()
              if k.count("/") == 2 and k.endswith(f"/{name}")]  # per environment
    run.console.info("evaluation before training: " + (", ".join(scores) or "no test task"))
    return evaluation


def held_out_before(log_path: str) -> dict[str, float]:
    """The evaluation before training that the run in ``log_path`` logged ({} when it has none)."""
    rows = [r for r in read_jsonl(Path(log_path) / "metrics.jsonl")
            if isinstance(r, dict) and r.get("step") == BEFORE_TRAINING]
    return {k: v for k, v in rows[-1].items() if k.startswith("test/")} if rows else {}


def log_step(run: Run, state: RunState, row: dict[str, float], batch: StepBatch, update: StepUpdate,
             saved: Saved) -> None:
    """The step's trajectories, metrics row and checkpoint row (last: a resume from it must find the step
    fully logged; ``state`` then points at it), then the OpenReward upload, W&B, the console and the
    report."""
    config, step, files = run.config, batch.step, run.files
    groups = batch.taken + batch.stale
    episodes = [ep for group in groups for ep in group.episodes]
    kept = {id(ep) for g in update.kept_G for ep in g}
    for ep in episodes:
        files.save_images(ep.image_files)  # before the rows that refer to them
    files.log_trajectories(step, [episode_row(step, ep, run.tokenizer, dropped=id(ep) not in kept, group=g)
                                  for g in groups for ep in g.episodes])
    if run.uploader:
        run.uploader.upload_step(step, episodes, row, {id(ep) for ep in episodes} - kept)
    files.log_metrics(row)
    if saved.row is not None:
        files.log_checkpoint(saved.row)
        state.checkpoint = saved.row["state_path"]
    if run.wandb:
        run.wandb.log(row, step)
    run.console.step(row)
    for line in bound_warnings(step, episodes):
        run.console.warn(line)
    if config.outputs.report and saved.row is not None and not saved.row["final"]:
        refresh_for_training(files.root, run.console)


def count_step_without_update(config: TrainConfig, console: ConsoleLog, state: RunState, step: int,
                              episodes_G: list[list[Episode]], update: StepUpdate) -> None:
    """Count step ``step`` in ``state`` if it trained nothing, and warn with the share of such steps so
    far. Groups dropped over their failure budget mean something is broken: the run stops once more
    than ``max_no_update_frac`` of its steps made no update for that. Equal rewards everywhere are
    normal early on a hard task: those steps stop the run only past ``max_no_signal_frac`` (1 = never,
    the default). Both are judged from :data:`NO_UPDATE_MIN_STEPS` steps on."""
    if update.datums:
        return
    done = step + 1
    failed = any(c.dropped_groups for c in update.counts.values())
    state.no_update_steps += 1
    state.failed_steps += failed
    reason = no_update_reason(episodes_G, update.counts)
    limits = config.limits
    if failed:
        count, limit, key, kind = state.failed_steps, limits.max_no_update_frac, "max_no_update_frac", \
            "with failed groups"
    else:
        count, limit, key, kind = (state.no_update_steps - state.failed_steps, limits.max_no_signal_frac,
                                   "max_no_signal_frac", "without a learning signal")
    console.warn(f"step {step} made no update: {reason} ({count} of {done} steps so far {kind})")
    if done >= NO_UPDATE_MIN_STEPS and count > limit * done:
        raise RunStoppedError(f"{count} of {done} steps made no update {kind} "
                              f"(more than {key}={limit:g}); at the last: {reason}")
