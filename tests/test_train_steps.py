"""Each phase of a training step on its own, without a model: the free functions of polyrl.rl.train,
polyrl.rl.update, polyrl.rl.step_metrics, polyrl.rl.run, the plan of polyrl.rl.rollouts and the batch of
polyrl.rl.rollout_queue.

The training service is a recording fake here -- and only here -- because these test the phases' own
logic: a training client that records its calls and answers with canned results. Whole runs on the
real engine, through the SDK and ``polyrl serve``, are tests/test_train.py's, test_async.py's and
test_faults.py's."""

from __future__ import annotations

import asyncio
import math

import pytest
from tinker import types

from polyrl.backend import ServiceGuard
from polyrl.config.checks import check_config
from polyrl.config.schema import TrainConfig
from polyrl.envs.base import EnvBuilder, register_env
from polyrl.errors import NonFiniteUpdateError, RunStoppedError
from polyrl.rl import advantages as adv
from polyrl.rl.episode import Episode, finalize_reward
from polyrl.rl.rollout_queue import DrawPoint, Group, RolloutQueue, StepBatch
from polyrl.rl.rollouts import EnvRuntime, plan_step, sample_group, stable_seed
from polyrl.rl.run import Run, RunState, close_run, optimizer_choice, resume_hint
from polyrl.rl.scoring import TokenSignals
from polyrl.rl.step_metrics import (
    bound_warnings,
    episode_metrics,
    kl_metrics,
    no_update_reason,
    step_row,
    token_weighted,
    update_metrics,
)
from polyrl.rl.train import (
    NO_UPDATE_MIN_STEPS,
    checkpoint,
    count_step_without_update,
    evaluate,
    log_step,
    take_groups,
)
from polyrl.rl.update import (
    GroupCounts,
    Minibatch,
    Optimized,
    StepUpdate,
    filter_groups,
    first_problem,
    forward_backward,
    nonfinite_inputs,
    optim_params,
    optimizer_step,
    prepare_minibatch,
    refuse_update,
)
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles


# ---------------------------------------------------------------------------- the smallest honest fakes
class Answered:
    """A request the service already answered: awaitable, with ``result()``, like the SDK's futures."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value

    def __await__(self):
        return self._get().__await__()

    async def _get(self):
        return self.value


class RecordingTraining:
    """A training client that records its calls and answers with canned results: each forward_backward
    the next of ``losses`` and learner logprobs ``gap`` below the sampler's; optim_step ``optim_metrics``
    (or raises ``refuse``)."""

    model_id = "run-a"

    def __init__(self, calls: list, losses=(), optim_metrics=None, refuse: Exception | None = None, gap=0.0):
        self.calls, self.losses, self.gap = calls, list(losses), gap
        self.optim_metrics, self.refuse = optim_metrics, refuse

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        self.calls.append(("forward_backward", len(data), loss_fn, loss_fn_config))
        learner = [[x - self.gap for x in d.loss_fn_inputs["logprobs"].tolist()] for d in data]
        outputs = [{"logprobs": types.TensorData(data=lps, dtype="float32")} for lps in learner]
        metrics = {"loss:sum": self.losses.pop(0) if self.losses else 1.0}
        return Answered(types.ForwardBackwardOutput(loss_fn_output_type="scalar", loss_fn_outputs=outputs,
                                                    metrics=metrics))

    def optim_step(self, adam):
        self.calls.append(("optim_step", adam.learning_rate))
        if self.refuse is not None:
            raise self.refuse
        return Answered(types.OptimStepResponse(metrics=self.optim_metrics))

    def save_state(self, name):
        self.calls.append(("save_state", name))
        return Answered(types.SaveWeightsResponse(path=f"tinker://run-a/weights/{name}"))

    def load_state_with_optimizer(self, path):
        self.calls.append(("load_state_with_optimizer", path))
        return Answered(types.LoadWeightsResponse(path=path))

    def save_weights_for_sampler(self, name):
        self.calls.append(("save_weights_for_sampler", name))
        return Answered(types.SaveWeightsForSamplerResponse(path=f"tinker://run-a/sampler_weights/{name}"))

    def create_sampling_client(self, model_path, **options):
        self.calls.append(("create_sampling_client", model_path, *options.items()))
        return Answered(f"sampler of {model_path}")

    def save_weights_and_get_sampling_client(self, **options):
        self.calls.append(("save_weights_and_get_sampling_client", *options.items()))
        return Answered("sampler of the latest weights")


class RecordingService:
    """A local service's REST side: deleting a checkpoint is recorded."""

    def __init__(self, calls: list):
        self.calls = calls

    def create_rest_client(self):
        return self

    def delete_checkpoint_from_tinker_path(self, path):
        self.calls.append(("delete_checkpoint", path))
        return Answered(None)


class Lines(ConsoleLog):
    """A console that keeps what it prints."""

    def __init__(self):
        super().__init__(enabled=False)
        self.lines: list[str] = []
        self.rows: list[dict] = []

    def info(self, text):
        self.lines.append(text)

    def warn(self, text):
        self.lines.append("warning: " + text)

    def step(self, row):
        self.rows.append(row)


class DigitTokenizer:
    def batch_decode(self, sequences):
        return [" ".join(map(str, s)) for s in sequences]


@register_env("steps_test_word")
class _WordBuilder(EnvBuilder):
    """Plays its own episodes without a model: the one sampled token and the reward follow from the
    episode's seed."""

    def make(self, split, index):
        raise NotImplementedError("drives its own rollouts")

    def num_tasks(self, split):
        return 3 if split == "test" else None

    async def rollout(self, ctx):
        ep = ctx.episode()
        ep.append([1, 2])
        ep.append([10 + ctx.seed % 7], [-0.5])
        ep.stop_reasons.append("stop")
        ep.step_rewards, ep.done_by_env = [float(ctx.seed % 2)], True
        finalize_reward(ep, ctx.settings)
        return [ep]


def _config(tmp_path, **over) -> TrainConfig:
    data = dict(model_name="m", batch_size=2, max_steps=4, save_every=2, outputs={"report": False},
                log_path=str(tmp_path / "run"),
                environments={"word": {"type": "steps_test_word", "num_rollouts": 2,
                                       "splits": {"train": {}, "test": {"num_samples": 3}}}})
    data.update(over)
    return TrainConfig(**data)


def _runtimes(config) -> dict[str, EnvRuntime]:
    return {name: EnvRuntime.create(name, cfg, config.seed, config.max_tokens)
            for name, cfg in config.environments.items()}


def _run(tmp_path, training=None, queue=None, calls=None, **over) -> Run:
    config = _config(tmp_path, **over)
    calls = [] if calls is None else calls
    return Run(config, Lines(), RunFiles(config.log_path), ServiceGuard(None, 5.0), _runtimes(config),
               {"word": 1.0}, RecordingService(calls), training or RecordingTraining(calls), DigitTokenizer(),
               None, queue, TokenSignals(), RunState(cursors={"word": 0}))


def _episode(reward: float, env: str = "word", error: str | None = None, sampled: int = 3) -> Episode:
    ep = Episode(env, "train", 0, 0, error=error)
    ep.append([1, 2])  # the prompt
    ep.append([5] * sampled, [-0.5] * sampled)  # one sampled turn
    ep.step_rewards, ep.reward, ep.done_by_env = [reward], reward, True
    return ep


# ---------------------------------------------------------------------------- the plan and the batch
def test_plan_step_draws_by_weight_from_the_cursors_and_sample_group_seeds_by_place(tmp_path):
    config = _config(tmp_path, batch_size=3)
    runtimes = _runtimes(config)
    plan_P, after = plan_step({"word": 1.0}, runtimes, 3, 5, {"word": 4})
    assert plan_P == [("word", 4), ("word", 5), ("word", 6)] and after == {"word": 7}

    group = asyncio.run(sample_group(runtimes, None, 7, 5, 1, "word", 4, "a sampler"))
    again = asyncio.run(sample_group(runtimes, None, 7, 5, 1, "word", 4, "a sampler"))
    assert [ep.tokens for ep in group] == [ep.tokens for ep in again] and len(group) == 2
    assert [ep.tokens[-1] for ep in group] == [10 + stable_seed(7, "train", 5, 1, i) % 7 for i in range(2)]
    assert {(ep.env_name, ep.split, ep.task_index, ep.group_id) for ep in group} == {("word", "train", 4, 1)}


def test_step_batch_numbers_groups_by_place_and_knows_their_staleness():
    batch = StepBatch(step=3, size=3)
    late = Group(drawn=2, index=1, episodes=[_episode(1.0)], sampler_step=2)
    fresh = Group(drawn=3, index=0, episodes=[_episode(0.0), _episode(1.0)], sampler_step=3)
    stale = Group(drawn=1, index=0, episodes=[_episode(0.0)], sampler_step=1)
    assert batch.add([late], [], 0.5) == [late.episodes] and batch.missing == 2
    assert batch.add([fresh], [stale], 0.25) == [fresh.episodes] and batch.missing == 1
    assert [ep.group_id for g in batch.episodes_G for ep in g] == [0, 1, 1]  # their place in the batch
    assert batch.staleness == [1, 0] and batch.stale == [stale] and batch.seconds == 0.75
    whole = StepBatch.of(4, [[_episode(1.0)], [_episode(0.0)]])
    assert whole.missing == 0 and whole.staleness == [0, 0]
    assert [g.key for g in whole.taken] == [(4, 0), (4, 1)]


def test_take_groups_takes_the_batch_from_the_queue_as_it_asks(tmp_path):
    async def sample(step, index, env_name, task, sampler):
        return [Episode(env_name, "train", task, index), Episode(env_name, "train", task, index)]

    def plan(step, cursors):
        return [("word", cursors["word"] + i) for i in range(2)], {"word": cursors["word"] + 2}

    async def take():
        queue = RolloutQueue(plan, sample, "sampler 0", 0, capacity=2, wanted=4,
                             start=DrawPoint(0, {"word": 0}), max_staleness=0)
        run = _run(tmp_path, queue=queue)
        batch = StepBatch(0, 2)
        parts = [await take_groups(run, batch, 1) for _ in range(3)]
        await queue.close()
        return batch, parts

    batch, parts = asyncio.run(take())
    assert [len(p) for p in parts] == [1, 1, 0] and batch.missing == 0
    assert [g.key for g in batch.taken] == [(0, 0), (0, 1)] and batch.staleness == [0, 0]
    assert [[ep.group_id for ep in g] for g in batch.episodes_G] == [[0, 0], [1, 1]]


# ---------------------------------------------------------------------------- the update
def test_prepare_minibatch_keeps_groups_within_budget_and_builds_datums_for_the_signal(tmp_path):
    config = _config(tmp_path)
    runtimes = _runtimes(config)
    signal = [_episode(1.0), _episode(0.0)]
    equal = [_episode(1.0), _episode(1.0)]
    broken = [_episode(0.0, error="RuntimeError: down"), _episode(0.0, error="RuntimeError: down")]
    minibatch = asyncio.run(prepare_minibatch([signal, equal, broken], 0, config, runtimes, TokenSignals(),
                                              ServiceGuard(None, 5.0)))
    assert minibatch.kept_G == [signal, equal] and minibatch.problem is None
    assert minibatch.counts == {"word": GroupCounts(failed_rollouts=2.0, dropped_groups=1.0,
                                                    constant_groups=1.0)}
    assert [ep.turn_advantages for ep in signal + equal] == [[0.5], [-0.5], [0.0], [0.0]]  # recorded once
    assert minibatch.episodes_D == signal and len(minibatch.data_D) == 2  # equal rewards carry no signal
    # shifted like the targets: the second prompt token predicts the first sampled one
    assert minibatch.data_D[0].loss_fn_inputs["advantages"].tolist() == [0.0, 0.5, 0.5, 0.5]

    dropped = asyncio.run(prepare_minibatch([[_episode(1.0), _episode(1.0)]], 0,
                                            _config(tmp_path,
                                                    advantages={"remove_constant_reward_groups": True}),
                                            runtimes,
                                            TokenSignals(), ServiceGuard(None, 5.0)))
    assert dropped.kept_G == [] and dropped.episodes_D == [] and dropped.counts["word"].constant_groups == 1


def test_an_advantage_past_float32_builds_no_datum(tmp_path):
    config = _config(tmp_path)
    huge = [_episode(1e39), _episode(-1e39)]
    minibatch = asyncio.run(prepare_minibatch([huge], 2, config, _runtimes(config), TokenSignals(),
                                              ServiceGuard(None, 5.0)))
    assert minibatch.problem == "an episode of word has advantage 1e+39, past float32's range"
    assert minibatch.data_D == [] and minibatch.episodes_D == huge
    assert nonfinite_inputs(huge, [[0.0], [0.0]], [[0.0] * 5, [math.inf] * 5]).startswith(
        "an episode of word has per-token term inf")
    fine = Minibatch([], {}, [], [])
    assert first_problem([fine, minibatch, Minibatch([], {}, [], [], problem="later")]) == minibatch.problem
    assert first_problem([fine]) is None


def test_forward_backward_sends_a_minibatch_with_the_configured_loss(tmp_path):
    calls: list = []
    datum = adv.to_datum(_record(_episode(1.0), [1.0]))
    guard = ServiceGuard(None, 5.0)

    def send(data, config):
        return asyncio.run(forward_backward(RecordingTraining(calls), guard, Minibatch([], {}, [], data),
                                            config))

    future, correction = send([datum, datum], _config(tmp_path))
    assert calls == [("forward_backward", 2, "importance_sampling", None)]
    assert future.result().metrics == {"loss:sum": 1.0} and correction == {}  # the loss corrects, if asked
    send([datum], _config(tmp_path, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8}))
    assert calls[-1] == ("forward_backward", 1, "ppo", {"clip_low_threshold": 0.8})
    send([datum], _config(tmp_path, loss_fn="ppo", off_policy={"correction": "icepop"}))
    assert calls[-1] == ("forward_backward", 1, "ppo", {"icepop_low": 0.5, "icepop_high": 5.0})


def _record(ep: Episode, advantages: list[float]) -> Episode:
    adv.record_advantages([[ep]], [[advantages]])
    return ep


def _pending(training: RecordingTraining, n: int) -> list:
    datum = adv.to_datum(_record(_episode(1.0), [1.0]))
    return [training.forward_backward([datum], "importance_sampling") for _ in range(n)]


def test_optimizer_step_applies_one_step_once_every_loss_is_finite():
    guard, adam = ServiceGuard(None, 5.0), types.AdamParams(learning_rate=0.01)
    calls: list = []
    training = RecordingTraining(calls, losses=[1.0, 2.0], optim_metrics={"grad_norm:mean": 0.5})
    done = asyncio.run(optimizer_step(training, guard, _pending(training, 2), None, adam, 3))
    assert done.refused is None and done.optim.metrics == {"grad_norm:mean": 0.5} and len(done.results) == 2
    assert calls[-1] == ("optim_step", 0.01) and sum(c[0] == "optim_step" for c in calls) == 1

    for losses, problem, refuse, why in [
            ([1.0, math.nan], None, None, "the forward_backward loss is nan"),
            ([], "an episode of word has advantage inf, past float32's range", None, "an episode of word"),
            ([1.0], None, NonFiniteUpdateError("optim_step refused: the gradient norm is nan"),
             "optim_step refused: the gradient norm is nan")]:
        calls = []
        training = RecordingTraining(calls, losses=losses, refuse=refuse)
        done = asyncio.run(optimizer_step(training, guard, _pending(training, len(losses)), problem, adam, 3))
        assert done.optim is None and done.refused.startswith(why), done.refused
        assert sum(c[0] == "optim_step" for c in calls) == (refuse is not None)  # never after a bad loss

    training = RecordingTraining([], optim_metrics={"grad_norm:mean": math.inf})
    with pytest.raises(RunStoppedError, match="step 3: optim_step reports grad_norm:mean = inf"):
        asyncio.run(optimizer_step(training, guard, _pending(training, 1), None, adam, 3))


def test_refuse_update_stops_or_skips_the_step_discarding_its_gradients(tmp_path):
    run = _run(tmp_path)
    stop = (r"step 3: the update is not finite \(the loss is nan\); no optimizer step was applied "
            r"\(nonfinite_steps: skip passes over such steps\)")
    with pytest.raises(RunStoppedError, match=stop):
        asyncio.run(refuse_update(run, 3, "the loss is nan", sent=True))

    calls: list = []
    run = _run(tmp_path, calls=calls, limits={"nonfinite_steps": "skip"})
    asyncio.run(refuse_update(run, 3, "the loss is nan", sent=True))
    saved = "tinker://run-a/weights/skipped-000003"
    assert calls == [("save_state", "skipped-000003"), ("load_state_with_optimizer", saved),
                     ("delete_checkpoint", saved)]
    assert run.console.lines == ["warning: step 3: the update is not finite (the loss is nan); no optimizer "
                                 "step was applied; the step is skipped (nonfinite_steps: skip)"]
    calls.clear()
    asyncio.run(refuse_update(run, 4, "an advantage", sent=False))  # nothing reached the service
    assert calls == []


def test_adam_params_follow_the_learning_rate_schedule(tmp_path):
    config = _config(tmp_path, learning_rate=0.01, lr_schedule="linear", optimizer={"beta1": 0.8},
                     max_steps=4)
    rates = [optim_params(config, s).learning_rate for s in range(4)]
    assert rates == pytest.approx([0.01, 0.0075, 0.005, 0.0025])
    assert optim_params(config, 0).beta1 == 0.8
    assert optim_params(_config(tmp_path, learning_rate=0.01), 3).learning_rate == 0.01


def test_update_metrics_weigh_signals_by_tokens_and_report_the_optimizer(tmp_path):
    a, b = _record(_episode(1.0, sampled=1), [0.5]), _record(_episode(0.0, sampled=3), [-0.5])
    parts = [Minibatch([[a]], {"word": GroupCounts()}, [a], [adv.to_datum(a)], {"kl/teacher": 1.0}),
             Minibatch([[b]], {"word": GroupCounts(1.0)}, [b], [adv.to_datum(b)], {"kl/teacher": 3.0})]
    calls: list = []
    training = RecordingTraining(calls, losses=[0.25, 0.5], gap=0.1)
    results = [training.forward_backward(m.data_D, "importance_sampling").result() for m in parts]
    results[0].metrics["active_tokens:sum"] = 1.0
    results[1].metrics.update({"clipped_tokens:sum": 1.0, "active_tokens:sum": 4.0})
    optimized = Optimized(results, types.OptimStepResponse(metrics={"grad_norm:mean": 2.0}))
    metrics = update_metrics(types.AdamParams(learning_rate=0.01), parts, optimized)
    assert metrics["kl/teacher"] == pytest.approx((1.0 * 1 + 3.0 * 3) / 4)  # weighted by sampled tokens
    assert metrics["optim/kl_sample_train_v1"] == pytest.approx(0.1)
    assert metrics["optim/entropy"] == pytest.approx(0.5)
    assert metrics["optim/loss"] == 0.75 and metrics["optim/grad_norm"] == 2.0
    assert metrics["optim/clip_frac"] == 0.2  # 1 clipped of 1 + 4 active tokens
    assert [metrics[k] for k in ("optim/lr", "optim/datums", "tokens/action", "tokens/total")] == \
        [0.01, 2.0, 4.0, 6.0]
    skipped = update_metrics(types.AdamParams(learning_rate=0.01), parts, Optimized(results, None, "a nan"))
    assert skipped["optim/nonfinite_skipped"] == 1.0 and "optim/loss" not in skipped
    assert token_weighted([([a], {"env/word/kl/teacher": 2.0}), ([_episode(0.0, env="other")], {})]) == \
        {"env/word/kl/teacher": 2.0}
    assert kl_metrics([], [], []) == {}

    update = StepUpdate.of(parts, metrics, 1.5)
    assert update.counts == {"word": GroupCounts(1.0, 0.0, 0.0)}
    assert update.datums == 2 and update.kept_G == [[a], [b]]


# ---------------------------------------------------------------------------- after the update
def test_checkpoint_makes_the_next_sampler_and_saves_the_state_when_due(tmp_path):
    calls: list = []
    run = _run(tmp_path, calls=calls)
    state = RunState(step=1, cursors={"word": 2}, draw_step=1, consumed=[(1, 0)], wandb_run_id="w")
    saved = asyncio.run(checkpoint(run, state))
    assert (saved.sampler, saved.sampler_step, saved.row) == ("sampler of the latest weights", 1, None)
    assert calls == [("save_weights_and_get_sampling_client",)]

    calls.clear()
    state.step = 2
    saved = asyncio.run(checkpoint(run, state))
    assert [c[0] for c in calls] == ["save_state", "save_weights_for_sampler", "create_sampling_client"]
    assert saved.sampler == "sampler of tinker://run-a/sampler_weights/000002" and saved.sampler_step == 2
    assert saved.row == {"name": "000002", "batch": 2, "final": False,
                         "state_path": "tinker://run-a/weights/000002",
                         "sampler_path": "tinker://run-a/sampler_weights/000002", "cursors": {"word": 2},
                         "draw_step": 1, "consumed": [[1, 0]], "wandb_run_id": "w"}
    state.step = 4
    assert asyncio.run(checkpoint(run, state)).row["name"] == "final"
    assert run.console.lines[-1] == "checkpoint final: tinker://run-a/weights/final"


def test_evaluate_runs_the_test_splits_only_when_due(tmp_path):
    run = _run(tmp_path, eval_every=2, max_steps=5)
    assert asyncio.run(evaluate(run, "a sampler", 1)) == {}
    due = asyncio.run(evaluate(run, "a sampler", 2))
    assert {"test/word/reward", "test/word/pass@1", "test/pass@1"} <= set(due)
    assert set(asyncio.run(evaluate(run, "a sampler", 5))) == set(due)  # the last step, off the period
    assert asyncio.run(evaluate(_run(tmp_path, eval_every=0), "a sampler", 4)) == {}


def test_log_step_writes_trajectories_and_metrics_then_the_checkpoint_row(tmp_path):
    run = _run(tmp_path)
    state = RunState(step=1)
    kept = _record(_episode(1.0), [0.5])
    failed = _episode(0.0, error="RewardOutOfBounds: reward 1e+308 is past x")
    batch = StepBatch.of(0, [[kept, failed]])
    batch.stale.append(Group(0, 5, [_episode(0.0)], sampler_step=0))
    update = StepUpdate([[kept]], {"word": GroupCounts(1.0, 0.0, 0.0)}, 1, {"optim/lr": 0.01}, 0.1)
    row = step_row(run.config, batch, update, {}, 0.0, 0.0)
    saved_row = {"name": "000001", "batch": 1, "final": False, "state_path": "tinker://run-a/weights/000001"}
    log_step(run, state, row, batch, update, _saved(saved_row))
    trajectories = [r for r in _read(tmp_path / "run" / "trajectories" / "step_000000.jsonl")]
    assert [(r["drawn"], r["dropped"], r["advantages"]) for r in trajectories] == \
        [([0, 0], False, [0.5]), ([0, 0], True, []), ([0, 5], True, [])]
    assert trajectories[0]["token_text"] == ["1", "2", "5", "5", "5"]
    assert run.files.metrics() == [row] and run.console.rows == [row]
    assert run.files.checkpoints() == [saved_row]
    assert state.checkpoint == "tinker://run-a/weights/000001" and "resume from it" in resume_hint(state)
    assert any(line.startswith("warning: step 0: 1 episode(s) failed") for line in run.console.lines)


def _saved(row):
    from polyrl.rl.train import Saved

    return Saved("a sampler", 1, row, 0.0)


def _read(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def test_step_row_reports_episodes_staleness_and_time(tmp_path):
    taken = [Group(3, 0, [_episode(1.0)], 3), Group(2, 1, [_episode(0.0), _episode(1.0)], 1)]
    batch = StepBatch(3, 2, taken=taken,
                      stale=[Group(1, 0, [_episode(0.0)], 0)], seconds=2.0)
    update = StepUpdate([], {"word": GroupCounts(0.0, 0.0, 1.0)}, 0, {"optim/lr": 0.01}, 0.5)
    row = step_row(_config(tmp_path), batch, update, {"test/pass@1": 1.0}, 0.25, 0.0)
    assert [row[k] for k in ("step", "progress/done_frac", "optim/lr", "test/pass@1")] == [3, 1.0, 0.01, 1.0]
    staleness = ("staleness_mean", "staleness_max", "stale_dropped")
    assert [row[f"async/{k}"] for k in staleness] == [1.0, 2.0, 1.0]
    assert [row[f"time/{k}"] for k in ("rollout", "train", "save")] == [2.0, 0.5, 0.25]
    assert row["time/total"] > 0
    assert row["reward/mean"] == pytest.approx(2 / 3) and row["episodes/count"] == 3.0
    assert row["env/word/constant_groups"] == 1.0 and row["rollouts/dropped_groups"] == 0.0
    by_env = episode_metrics([[_episode(1.0, env="a"), _episode(0.0, env="b", error="x")]], {})
    assert by_env["env/a/reward/mean"] == 1.0 and "env/b/reward/mean" not in by_env
    assert by_env["episodes/count"] == 2.0


def test_steps_without_update_are_counted_and_stop_past_the_share(tmp_path):
    config = _config(tmp_path, max_steps=50, limits={"max_no_update_frac": 0.3})
    console, state = Lines(), RunState()
    group = [_episode(0.0, error="RuntimeError: no backend")] * 2
    failed = StepUpdate([], {"word": GroupCounts(2.0, 1.0, 0.0)}, 0, {}, 0.0)
    count_step_without_update(config, console, state, 0, [group], StepUpdate([group], {}, 2, {}, 0.0))
    assert (state.no_update_steps, state.failed_steps, console.lines) == (0, 0, [])
    for step in range(1, 4):
        count_step_without_update(config, console, state, step, [group], failed)
    assert (state.no_update_steps, state.failed_steps) == (3, 3)
    assert console.lines[-1] == ("warning: step 3 made no update: 1 of 1 groups dropped over their failure "
                                 "budget, 0 with equal rewards; most common episode error (2x): "
                                 "RuntimeError: no backend (3 of 4 steps so far with failed groups)")
    for step in range(4, NO_UPDATE_MIN_STEPS - 1):
        count_step_without_update(config, console, state, step, [group],
                                  StepUpdate([group], {}, 2, {}, 0.0))
    with pytest.raises(RunStoppedError, match="4 of 10 steps made no update with failed groups"):
        count_step_without_update(config, console, state, NO_UPDATE_MIN_STEPS - 1, [group], failed)


def test_no_update_reason_and_bound_warnings_name_the_cause():
    groups = [[_episode(0.0, error="TimeoutError: slow")], [_episode(1.0), _episode(1.0)]]
    counts = {"word": GroupCounts(1.0, 1.0, 1.0)}
    assert no_update_reason(groups, counts) == ("1 of 2 groups dropped over their failure budget, 1 with "
                                                "equal rewards; most common episode error (1x): "
                                                "TimeoutError: slow")
    big = _episode(0.0, error="ObservationTooLarge: the observation holds more than 10 bytes")
    assert bound_warnings(7, [big, groups[0][0]]) == [
        "step 7: 1 episode(s) failed (counted against their failure budget): ObservationTooLarge: the "
        "observation holds more than 10 bytes"]


def test_filter_groups_applies_each_environments_failure_budget(tmp_path):
    config = _config(tmp_path)
    runtimes = _runtimes(config)
    one_failed = [_episode(1.0), _episode(0.0, error="x")]
    two_failed = [_episode(1.0), _episode(0.0, error="x"), _episode(0.0, error="y")]
    kept, counts = filter_groups([one_failed, two_failed], runtimes, remove_constant=False)
    assert kept == [[one_failed[0]]] and counts == {"word": GroupCounts(3.0, 1.0, 1.0)}


def test_close_run_closes_every_part_even_when_one_fails(tmp_path):
    closed = []

    class Tracker:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise OSError(f"{self.name} is gone")

    async def close():
        queue = RolloutQueue(lambda s, c: ([], c), None, None, 0, capacity=1, wanted=0,
                             start=DrawPoint(0, {}), max_staleness=None)
        run = _run(tmp_path, queue=queue)
        run.wandb, run.uploader = Tracker("wandb", fails=True), Tracker("uploader")
        builder = run.runtimes["word"].builder

        async def aclose():
            closed.append("word")

        builder.aclose = aclose
        await close_run(run)
        return run

    run = asyncio.run(close())
    assert closed == ["wandb", "uploader", "word"]
    assert run.console.lines == ["warning: closing failed: wandb is gone"]


# ---------------------------------------------------------------------------- StableReinforce, Dimuon
def test_stable_reinforce_samplers_record_and_its_datums_name_their_sequences(tmp_path):
    calls: list = []
    run = _run(tmp_path, calls=calls, loss_fn="stable_reinforce", loss_fn_config={"kl_coeff": 0.1})
    state = RunState(step=1, cursors={"word": 0})
    asyncio.run(checkpoint(run, state))
    state.step = 2
    asyncio.run(checkpoint(run, state))
    record = ("record_stability_info", True)
    assert calls[0] == ("save_weights_and_get_sampling_client", record)
    assert calls[-1] == ("create_sampling_client", "tinker://run-a/sampler_weights/000002", record)

    ep = _episode(1.0)
    ep.sequence_runs = [(s, e, "seq-a") for s, e in ep.turn_spans]
    datum = adv.to_datum(_record(ep, [0.5]), "stable_reinforce")
    assert datum.model_input_spans == [types.PromptProvenanceSpan(sequence_id="seq-a", length=2),
                                       types.SampledProvenanceSpan(sequence_id="seq-a", length=2)]
    assert datum.loss_fn_input_spans == [types.PromptProvenanceSpan(sequence_id="seq-a", offset=1, length=1),
                                         types.SampledProvenanceSpan(sequence_id="seq-a", length=3)]
    # a turn sampled outside polyrl's sampler (an OpenAI-compatible env)
    ep.sequence_runs = [(s, e, None) for s, e in ep.turn_spans]
    with pytest.raises(RunStoppedError, match="stable_reinforce needs the sampler's sequence_id of every"):
        adv.to_datum(ep, "stable_reinforce")
    with pytest.raises(ValueError, match=r"kl_coeff: only used by loss_fn 'stable_reinforce'"):
        check_config(_config(tmp_path, loss_fn="ppo", loss_fn_config={"kl_coeff": 0.1}))


def test_dimuon_config_gives_dimuon_clients_and_steps(tmp_path):
    config = _config(tmp_path, learning_rate=0.02, optimizer={"type": "dimuon", "beta1": 0.7})
    params = optim_params(config, 0)
    assert isinstance(params, types.DimuonParams)
    assert (params.learning_rate, params.beta1, params.grad_clip_norm) == (0.02, 0.7, 0.0)
    assert optimizer_choice(config) == {"optimizer": types.DimuonOptimizerConfig()}
    assert optimizer_choice(_config(tmp_path)) == {}
    tuned = optim_params(_config(tmp_path, optimizer={"type": "dimuon", "damping": 0.3}), 0)
    assert tuned.model_dump() == {"type": "dimuon", "learning_rate": 1e-4, "beta1": 0.9,
                                  "grad_clip_norm": 0.0, "damping": 0.3}
    for bad, words in (({"type": "dimuon", "weight_decay": 0.1}, "weight_decay: not used by optimizer type "
                                                                 "'dimuon'"),
                       ({"damping": 0.3}, "damping: not used by optimizer type 'adam'"),
                       ({"type": "sgd"}, "optimizer.type")):
        with pytest.raises(ValueError, match=words):
            _config(tmp_path, optimizer=bad)
