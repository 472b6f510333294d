"""A training run's resources: opened by :func:`open_run`, closed by :func:`close_run`.

:class:`Run` holds what a run works with -- its config, console and files, the environments, the
training service and its clients, the rollout queue, the per-token signals' scorers, the trackers --
and :class:`RunState`, where the run stands. It holds no step's data: each step's values flow through
the functions of :mod:`polyrl.rl.train` and :mod:`polyrl.rl.update`.

Opening continues the run in ``log_path`` from its last checkpoint row if it has one (a relaunch
always continues its own run), else warm starts from ``resume_from``, else starts fresh. When a
remote service loses the run's session, :func:`reopen_run` closes what the service held and opens it
again from the last checkpoint row, as a relaunch would; environments and trackers stay open.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

from tinker import types

from polyrl.backend import ServiceGuard, finish_session, make_rest_client, sampler_precision, service_url
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.errors import RunStoppedError
from polyrl.renderers.base import Renderer
from polyrl.rl import advantages as adv_lib
from polyrl.rl.chat_models import PastSelves, ServiceChat, open_chat_model
from polyrl.rl.judge import open_judge
from polyrl.rl.policy import open_policy
from polyrl.rl.rollout_queue import DrawPoint, RolloutQueue
from polyrl.rl.rollouts import EnvRuntime, plan_step, rollout_bounds, sample_group
from polyrl.rl.scoring import TokenSignals
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles

if TYPE_CHECKING:
    from polyrl.clients import ServiceClient, Tokenizer, TrainingClient
    from polyrl.tracking.openreward_upload import OpenRewardUploader
    from polyrl.tracking.wandb_log import WandbLog


@dataclass
class RunState:
    """Where a run stands. Its fields go into every checkpoint row next to the saved state, so a
    relaunch continues exactly: the next step, each environment's data cursor, the W&B run."""

    step: int = 0
    cursors: dict[str, int] = field(default_factory=dict)  # data cursors before the plan of draw_step
    draw_step: int = 0  # the first plan step with a group not trained yet (see polyrl.rl.rollout_queue)
    consumed: list[tuple[int, int]] = field(default_factory=list)  # groups from there on trained or dropped
    wandb_run_id: str | None = None
    checkpoint: str | None = None  # state path of the last logged checkpoint
    no_update_steps: int = 0  # steps so far that trained nothing
    failed_steps: int = 0  # of those, steps with groups dropped over their failure budget

    def restore(self, row: dict) -> None:
        """Continue from a checkpoint row (a W&B run already open keeps its id)."""
        self.step = int(row["batch"])
        self.cursors.update(row.get("cursors", {}))
        self.draw_step = int(row.get("draw_step", self.step))
        self.consumed = [(int(s), int(i)) for s, i in row.get("consumed", [])]
        self.wandb_run_id = self.wandb_run_id or row.get("wandb_run_id")
        self.checkpoint = row["state_path"]

    def draw_from(self, point: DrawPoint) -> None:
        self.draw_step, self.cursors, self.consumed = point.step, point.cursors, point.consumed

    def draw_point(self) -> DrawPoint:
        return DrawPoint(self.draw_step, self.cursors, self.consumed)


@dataclass
class Run:
    """A run's resources (see the module docstring)."""

    config: TrainConfig
    console: ConsoleLog
    files: RunFiles
    guard: ServiceGuard  # bounds every wait on a remote service
    runtimes: dict[str, EnvRuntime]  # every configured environment, by name
    weights: dict[str, float]  # the environments with a train split, by batch share
    # what the service holds (opened again after a lost service), and where the run stands
    service: ServiceClient
    training: TrainingClient
    tokenizer: Tokenizer
    renderer: Renderer
    queue: RolloutQueue
    signals: TokenSignals  # per-token advantage terms: KL penalty, distillation teacher
    state: RunState
    wandb: WandbLog | None = None
    uploader: OpenRewardUploader | None = None


async def open_run(config: TrainConfig, console: ConsoleLog | None = None) -> Run:
    """The run's files, environments, service and trackers: a fresh run, a warm start from
    ``resume_from``, or the run in ``log_path`` continued from its last checkpoint row. What it
    opened is closed again if opening fails."""
    console = console or ConsoleLog()
    files = RunFiles(config.log_path, metrics_json=config.outputs.metrics_json)
    files.write_config(config.dump())
    runtimes = {name: EnvRuntime.create(name, cfg, config.seed, config.max_tokens, **rollout_bounds(config))
                for name, cfg in config.environments.items()}
    state = RunState(cursors={name: 0 for name in runtimes})
    try:
        weights = {n: rt.cfg.weight for n, rt in runtimes.items() if rt.cfg.splits.get("train") is not None}
        if not weights:
            raise ConfigError("environments: none has a train split (splits.train is null everywhere), "
                              "so there is nothing to train on")
        for line in sampling_warnings(config):
            console.warn(line)
        guard = ServiceGuard(service_url(config), config.limits.service_timeout, console.warn)
        run = await open_service(config, console, files, guard, runtimes, weights, state)
    except BaseException as exc:
        await close_environments(runtimes, console)
        if isinstance(exc, RunStoppedError):
            raise RunStoppedError(f"{exc}; {resume_hint(state)}") from None
        raise
    try:
        if config.wandb_project_name:
            from polyrl.tracking.wandb_log import WandbLog

            run.wandb = WandbLog(config.wandb_project_name, config.wandb_run_name, config.dump(),
                                 str(files.root), run.state.wandb_run_id)
            run.state.wandb_run_id = run.wandb.run_id
        if config.openreward_run_name:
            from polyrl.tracking.openreward_upload import OpenRewardUploader

            run.uploader = OpenRewardUploader(config, runtimes, run.state.step)
    except BaseException:
        await close_run(run)
        raise
    return run


async def reopen_run(run: Run, why: str) -> Run:
    """A relaunch in this process, after the service lost the run's session: the groups in flight are
    dropped and everything the service held (training client, samplers, scorers) is opened again from
    the last checkpoint row; steps after it are re-run and logged once, as on a relaunch. Environments
    and trackers stay open."""
    run.console.warn(why)
    await run.queue.close()
    await finish_session(run.service, "errored", run.guard.url, why)
    state = RunState(cursors={name: 0 for name in run.runtimes},
                     wandb_run_id=run.wandb.run_id if run.wandb is not None else None)
    opened = await open_service(run.config, run.console, run.files, run.guard, run.runtimes, run.weights,
                                state)
    return replace(opened, wandb=run.wandb, uploader=run.uploader)


async def open_service(config: TrainConfig, console: ConsoleLog, files: RunFiles, guard: ServiceGuard,
                       runtimes: dict[str, EnvRuntime], weights: dict[str, float], state: RunState) -> Run:
    """The service, the training client and the run ``state`` (restored from the last checkpoint row,
    else as given: a warm start from ``resume_from`` or a fresh run); then the first sampler, the rollout
    queue drawing from where the state stands, and the per-token signals' scorers. A W&B run already
    open keeps its id (``state.wandb_run_id``)."""
    row = files.last_resumable()

    async def connect(service: ServiceClient) -> TrainingClient:
        if row is not None:
            training = await guard("resuming", service.create_training_client_from_state_with_optimizer,
                                   row["state_path"])
            state.restore(row)
            console.info(f"resuming from {row['state_path']} at step {state.step}")
        elif config.resume_from:
            training = await guard("loading resume_from", service.create_training_client_from_state,
                                   config.resume_from, **optimizer_choice(config))
            console.info(f"initialized weights from {config.resume_from}")
        else:
            training = await guard("creating the model", service.create_lora_training_client,
                                   base_model=config.model_name, rank=config.lora_rank, seed=config.seed,
                                   **optimizer_choice(config))
        return training

    policy = await open_policy(config, connect)
    service, training, tokenizer, renderer = policy.service, policy.client, policy.tokenizer, policy.renderer
    files.truncate_from(state.step)
    earlier = [r for r in files.metrics() if r.get("optim/datums") == 0]
    state.no_update_steps = len(earlier)
    state.failed_steps = sum(bool(r.get("rollouts/dropped_groups")) for r in earlier)
    await remove_unlogged_checkpoints(config, console, files, guard, service, resuming=row is not None)
    precision = sampler_precision(config, service)
    for entry in precision:
        console.info(entry["note"])
    files.log_attempt({"training_run_id": training.model_id, "step": state.step,
                       **({"sampler": [{k: v for k, v in e.items() if k != "note"} for e in precision]}
                          if precision else {})})
    sampler = await guard("creating a sampler", training.save_weights_and_get_sampling_client,
                          **sampler_options(config))
    ahead = config.off_policy.max_steps
    queue = RolloutQueue(
        partial(plan_step, weights, runtimes, config.batch_size),
        partial(sample_group, runtimes, renderer, config.seed), sampler, state.step,
        capacity=config.batch_size * (ahead + 1),
        wanted=config.batch_size * (config.max_steps - state.step), start=state.draw_point(),
        max_staleness=ahead if config.off_policy.stale_groups == "drop" else None,
        chunk_tokens=config.off_policy.partial_chunk_tokens)
    signals = await TokenSignals.open(config, service, guard, sampler, tokenizer, console.warn)
    past = [(r["batch"], r["sampler_path"]) for r in files.checkpoints()
            if r.get("sampler_path") and r.get("batch", 0) <= state.step]
    await open_env_models(config.model_name, runtimes, service, guard, renderer, past)
    return Run(config, console, files, guard, runtimes, weights, service, training, tokenizer, renderer,
               queue, signals, state)


async def open_env_models(model_name: str, runtimes: dict[str, EnvRuntime], service: ServiceClient,
                          guard: ServiceGuard, renderer: Renderer,
                          past: Sequence[tuple[int, str]] = ()) -> None:
    """Each environment's judge (``judge:``) and partner (``partner:``), on ``service`` (whose policy is
    ``model_name``); those opened on an earlier service (before it was lost) are closed first. An entry
    whose environment plays against a partner needs one, and only such an entry may name one. ``past``:
    the run's saved sampler checkpoints so far (steps trained, path), which a pool of past selves starts
    with (a resumed run's pool is the one it had)."""
    for name, rt in runtimes.items():
        wants = bool(getattr(rt.builder, "wants_partner", False))
        if wants and rt.cfg.partner is None:
            raise ConfigError(f"environments.{name}.partner: its environment plays against a partner model "
                              "(args.opponent: partner); give one (partner: {} is the policy's base model)")
        if rt.cfg.partner is not None and not wants:
            raise ConfigError(f"environments.{name}.partner: this environment has no side for a partner to "
                              "play (a textarena game takes one with args.opponent: partner)")
        for model in (rt.judge, rt.partner):
            if model is not None:
                await model.aclose()
        if rt.cfg.judge is not None:
            rt.judge = await open_judge(rt.cfg.judge, rt.settings, model_name, service, guard, renderer,
                                        f"environments.{name}.judge")
        if rt.cfg.partner is not None:
            where = f"environments.{name}.partner"
            rt.partner = await open_chat_model(rt.cfg.partner, model_name, service, guard, renderer, where)
            if rt.cfg.partner.pool:
                assert isinstance(rt.partner, ServiceChat)  # the config refuses a pool at an endpoint
                pool = PastSelves(rt.partner, rt.cfg.partner.pool)
                for step, path in past[-rt.cfg.partner.pool:]:
                    pool.add(step, await guard(f"opening {where}'s past self {path}",
                                               service.create_sampling_client, model_path=path))
                rt.partner = pool


async def remove_unlogged_checkpoints(config: TrainConfig, console: ConsoleLog, files: RunFiles,
                                      guard: ServiceGuard, service: ServiceClient, resuming: bool) -> None:
    """What earlier launches of this run saved but never logged (a kill between saving a
    checkpoint and writing its row): no row refers to it, so nothing would ever resume from it.
    Deleted when the run resumes from a row; only reported when the run has no row to resume
    from (``checkpoints.jsonl`` gone or never written), as the weights may still be wanted."""
    attempts = files.attempts()
    if not attempts:
        return
    logged = {row.get(key) for row in files.checkpoints() for key in ("state_path", "sampler_path")}
    rest = await guard("connecting", make_rest_client, config, service)
    unlogged = []
    for attempt in attempts:
        run_id = attempt["training_run_id"]
        try:
            listing = await guard("listing checkpoints", rest.list_checkpoints, run_id)
            for checkpoint in listing.checkpoints:
                if checkpoint.tinker_path in logged:
                    continue
                if resuming:
                    await guard("deleting a checkpoint", rest.delete_checkpoint_from_tinker_path,
                                checkpoint.tinker_path)
                unlogged.append(checkpoint.tinker_path)
        except RunStoppedError:
            raise
        except Exception as exc:  # noqa: BLE001 - tidying up must not keep the run from resuming
            console.warn(f"could not check the checkpoints of an interrupted launch ({run_id}): {exc}")
    if unlogged and resuming:
        console.info(f"removed {len(unlogged)} checkpoints that interrupted launches saved but never logged")
    elif unlogged:
        console.warn(f"{len(unlogged)} checkpoints of earlier launches of this run are named by no row of "
                     f"checkpoints.jsonl and stay in the store, e.g. {unlogged[0]}")


def sampling_warnings(config: TrainConfig) -> list[str]:
    """What the config samples differently from what the loss assumes, in one line."""
    tempered = [f"{name} ({env.temperature:g})" for name, env in sorted(config.environments.items())
                if env.temperature != 1.0 and env.splits.get("train") is not None]
    if not tempered:
        return []
    return [f"sampling temperature other than 1 in {', '.join(tempered)}: the sampler's logprobs are the "
            "model's own at temperature 1 (as in Tinker), so the importance ratio compares against a "
            "distribution that was not sampled"]


def resume_hint(state: RunState) -> str:
    """Where a relaunch continues from, for the line that says why the run stopped."""
    if state.checkpoint is None:
        return "no checkpoint saved yet"
    return f"last checkpoint: {state.checkpoint} (run the same command again to resume from it)"


async def close_run(run: Run, status: str = "errored") -> None:
    """Stop the groups in flight, then close W&B, the uploader and every environment builder, and end the
    service's session as ``status``; each on its own, so one that fails neither hides the error that
    ended the run nor keeps the others open."""
    await run.queue.close()
    closers = [run.wandb.close if run.wandb else None, run.uploader.close if run.uploader else None]
    for close in filter(None, closers):
        try:
            close()
        except Exception as exc:  # noqa: BLE001
            run.console.warn(f"closing failed: {exc}")
    await close_environments(run.runtimes, run.console)
    await finish_session(run.service, status, run.guard.url)


async def close_environments(runtimes: dict[str, EnvRuntime], console: ConsoleLog) -> None:
    for rt in runtimes.values():
        try:
            await rt.builder.aclose()
            for model in (rt.judge, rt.partner):
                if model is not None:
                    await model.aclose()
        except Exception as exc:  # noqa: BLE001
            console.warn(f"closing environment {rt.name} failed: {exc}")


def sampler_options(config: TrainConfig) -> dict:
    """How the run's samplers are made: a loss that trains on what the service recorded of each sampled
    sequence (stable_reinforce) needs them to record it."""
    return {"record_stability_info": True} if adv_lib.needs_provenance(config.loss_fn) else {}


def optimizer_choice(config: TrainConfig) -> dict:
    """The ``optimizer=`` a new training client is created with (Tinker fixes it for the client's life)."""
    return {"optimizer": types.DimuonOptimizerConfig()} if config.optimizer.type == "dimuon" else {}
