"""The RL loop: advantages, token-exact rollouts, failure budgets, resume, learning."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from scripted import ScriptedSampler

from polyrl.config.files import load_config
from polyrl.config.schema import EnvConfig, TrainConfig
from polyrl.envs.base import Env, EnvBuilder, Observation, StepResult, register_env
from polyrl.renderers import get_renderer
from polyrl.rl import advantages as adv
from polyrl.rl.episode import Episode, RolloutSettings, finalize_reward, run_episode
from polyrl.rl.rollouts import allocate_groups, run_group
from polyrl.rl.train import train
from polyrl.rl.update import filter_groups
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles


# ---------------------------------------------------------------------------- test environments
class _Flaky(Env):
    """Fails on purpose for some task indices / episodes."""

    def __init__(self, mode: str):
        self.mode = mode

    async def reset(self):
        if self.mode == "raise":
            raise RuntimeError("environment exploded")
        return Observation([{"role": "user", "content": "Say anything."}])

    async def step(self, action):
        if self.mode == "hang":
            await asyncio.sleep(30)
        return StepResult(reward=1.0, done=True)


@register_env("test_flaky")
class FlakyBuilder(EnvBuilder):
    def __init__(self, args, seed=0):
        super().__init__(args, seed)
        self.calls = 0

    def make(self, split, index):
        self.calls += 1
        modes = self.args.get("modes", [])
        return _Flaky(modes[(self.calls - 1) % len(modes)] if modes else "ok")


class _LetterEnv:
    """Sync env (exercises the sync path): reward 1 when the reply contains the letter 'e'."""

    def reset(self):
        return Observation([{"role": "user", "content": "Write a word."}])

    def step(self, action):
        ok = "e" in action["content"]
        return StepResult(reward=float(ok), done=True, metrics={"success": float(ok)})

    def close(self):
        return None


@register_env("test_letter")
class LetterBuilder(EnvBuilder):
    def make(self, split, index):
        return _LetterEnv()


# ---------------------------------------------------------------------------- advantages
def _ep(reward, turns=1, rewards=None, done=True):
    ep = Episode("e", "train", 0, 0)
    ep.reward, ep.done_by_env = reward, done
    ep.turn_spans = [(i, i + 1) for i in range(turns)]
    ep.step_rewards = rewards if rewards is not None else [0.0] * (turns - 1) + [reward]
    return ep


def _advantages(groups, *args, **kwargs) -> None:
    """The estimator's values, recorded on the episodes as the training step does."""
    adv.record_advantages(groups, adv.compute_advantages(groups, *args, **kwargs))


def test_grpo_advantages_hand_computed():
    g1 = [_ep(1.0), _ep(0.0), _ep(0.0), _ep(1.0)]
    g2 = [_ep(3.0, turns=2), _ep(1.0, turns=2)]
    _advantages([g1, g2], "grpo")
    assert [e.turn_advantages for e in g1] == [[0.5], [-0.5], [-0.5], [0.5]]
    assert [e.turn_advantages for e in g2] == [[1.0, 1.0], [-1.0, -1.0]]
    _advantages([g1], "grpo", normalize_by_std=True)
    assert g1[0].turn_advantages[0] == pytest.approx(1.0, rel=1e-5)  # (1 - .5) / .5


def test_rebn_discounted_returns_normalized_over_batch():
    a = _ep(1.0, turns=2, rewards=[0.0, 1.0])
    b = _ep(0.0, turns=1, rewards=[0.0])
    _advantages([[a], [b]], "rebn", gamma=0.5)
    returns = [0.5, 1.0, 0.0]  # a: 0 + .5*1, 1 ; b: 0
    mean = sum(returns) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / 3)
    assert a.turn_advantages == pytest.approx([(0.5 - mean) / std, (1.0 - mean) / std], rel=1e-4)
    assert b.turn_advantages == pytest.approx([(0.0 - mean) / std], rel=1e-4)


def test_rebn_gives_identical_episodes_identical_advantages():
    """Mean reduction: an episode the environment ended and one cut off at max_turns, with the same
    step rewards, get the same per-turn credit (the cut-off one is not rewritten to [1, 1, 1, -2])."""
    settings = RolloutSettings(max_turns=4, max_tokens=8, temperature=1.0, timeout=30,
                               reward_reduction="mean")
    ended, cut_off, zero = (_ep(0.0, turns=4, rewards=[r] * 4, done=d)
                            for r, d in ((1.0, True), (1.0, False), (0.0, True)))
    for ep in (ended, cut_off, zero):
        finalize_reward(ep, settings)
    assert ended.reward == cut_off.reward == 1.0
    _advantages([[ended, cut_off], [zero]], "rebn")
    assert cut_off.turn_advantages == pytest.approx(ended.turn_advantages)
    assert ended.turn_advantages[0] > 0 and all(a < 0 for a in zero.turn_advantages)
    # nonterminal_reward still sets the return of an episode the environment did not end
    penalised = _ep(0.0, turns=2, rewards=[1.0, 1.0], done=False)
    finalize_reward(penalised, RolloutSettings(max_turns=2, max_tokens=8, temperature=1.0, timeout=30,
                                               nonterminal_reward=-1.0))
    _advantages([[penalised], [_ep(1.0, turns=2, rewards=[0.0, 1.0])]], "rebn")
    assert penalised.reward == -1.0 and penalised.turn_advantages[0] < 0


def test_datums_mask_action_tokens_for_dro_and_gspo():
    """DRO's penalty and GSPO's sequence ratio must see only sampled tokens, also on a remote service."""
    ep = Episode("e", "train", 0, 0)
    ep.append([1, 2, 3])
    ep.append([4, 5], [-0.1, -0.2])
    ep.append([6])
    ep.append([7], [-0.3])
    ep.turn_advantages = [0.0, 0.0]
    assert adv.to_datum(ep, "dro").loss_fn_inputs["mask"].tolist() == [0, 0, 1, 1, 0, 1]
    assert adv.to_datum(ep, "gspo").loss_fn_inputs["sequence_ratio_mask"].tolist() == [0, 0, 1, 1, 0, 1]
    assert set(adv.to_datum(ep, "importance_sampling").loss_fn_inputs) == {"target_tokens", "logprobs",
                                                                           "advantages"}


def test_a_torn_checkpoint_row_hides_no_later_row(tmp_path):
    files = RunFiles(tmp_path)
    files.log_checkpoint({"name": "000002", "batch": 2, "state_path": "tinker://r/weights/000002"})
    with open(files.checkpoints_path, "a") as f:
        f.write('{"name": "000004", "ba')  # a crash in the middle of an append
    files.log_checkpoint({"name": "000004", "batch": 4, "state_path": "tinker://r/weights/000004"})
    with open(files.checkpoints_path, "a") as f:
        f.write("not json\n")  # a damaged line in the middle
    files.log_checkpoint({"name": "000006", "batch": 6, "state_path": "tinker://r/weights/000006"})
    assert [r["name"] for r in files.checkpoints()] == ["000002", "000004", "000006"]
    assert files.last_resumable()["name"] == "000006"


def test_missing_sampler_logprobs_are_an_error_not_zeros(tokenizer):
    from polyrl.rl.episode import SamplerError

    renderer = get_renderer("qwen3", tokenizer)
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": "hello"}] * 2,
                             logprobs=lambda n: None)
    eps = [Episode("letter", "train", 0, 0) for _ in range(2)]
    with pytest.raises(SamplerError, match="logprobs"):
        asyncio.run(run_group(LetterBuilder({}), eps, renderer, policy, _settings(), [None, None]))


def test_rebn_with_normalize_by_std_is_a_config_error(tmp_path):
    from polyrl.config.schema import ConfigError

    with pytest.raises(ConfigError, match="advantages.normalize_by_std"):
        load_config(None, ["model_name=m", "advantages.estimator=rebn", "advantages.normalize_by_std=true",
                           "environments.arithmetic.max_turns=2"])


def test_no_train_split_is_a_clear_error(tiny_model_dir, tmp_path):
    from polyrl.errors import UserInputError

    cfg = _config(tiny_model_dir, tmp_path,
                  environments={"letter": {"type": "test_letter", "splits": {"train": None}}})
    with pytest.raises(UserInputError, match="train split"):
        train(cfg, ConsoleLog(enabled=False))


class RecordingConsole(ConsoleLog):
    """Keeps every line the trainer prints; optionally dies after logging a given step."""

    def __init__(self, crash_after_step: int | None = None):
        super().__init__(enabled=False)
        self.lines: list[str] = []
        self.crash_after_step = crash_after_step

    def info(self, text: str) -> None:
        self.lines.append(text)

    def warn(self, text: str) -> None:
        self.lines.append("warning: " + text)

    def step(self, row: dict) -> None:
        if row["step"] == self.crash_after_step:
            raise SimulatedCrash(f"crash after step {row['step']}")


class SimulatedCrash(BaseException):
    """Not an Exception: nothing on the way out may swallow it, as with a kill."""


def test_sampling_temperature_is_warned_about_once(tiny_model_dir, tmp_path):
    envs = {"cold": {"type": "test_letter", "num_rollouts": 2, "temperature": 0.7},
            "warm": {"type": "test_letter", "num_rollouts": 2, "temperature": 1.0}}
    console = RecordingConsole()
    train(_config(tiny_model_dir, tmp_path, max_steps=2, batch_size=1, save_every=0, environments=envs),
          console)
    warnings = [line for line in console.lines if line.startswith("warning:") and "temperature" in line]
    assert len(warnings) == 1 and "cold" in warnings[0] and "warm" not in warnings[0], console.lines


def test_relaunch_of_a_warm_started_run_continues_it(tiny_model_dir, tmp_path):
    warm = _config(tiny_model_dir, tmp_path, log_path=str(tmp_path / "warm"), max_steps=1, save_every=0)
    train(warm, ConsoleLog(enabled=False))
    state = RunFiles(tmp_path / "warm").last_resumable()["state_path"]
    cfg = _config(tiny_model_dir, tmp_path, resume_from=state, max_steps=4, save_every=2)
    with pytest.raises(SimulatedCrash):
        train(cfg, RecordingConsole(crash_after_step=2))
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = [json.loads(x) for x in metrics.read_text().splitlines()]
    console = RecordingConsole()
    train(cfg, console)  # the same command again
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[:2] == before[:2], "steps before the checkpoint were run again"
    assert any("resuming" in line and "step 2" in line for line in console.lines), console.lines


def test_datum_puts_advantages_only_on_sampled_tokens():
    ep = Episode("e", "train", 0, 0)
    ep.append([1, 2, 3])
    ep.append([4, 5], [-0.1, -0.2])
    ep.append([6])
    ep.append([7], [-0.3])
    ep.turn_advantages = [2.0, -1.0]
    d = adv.to_datum(ep)
    assert d.model_input.to_ints() == [1, 2, 3, 4, 5, 6]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5, 6, 7]
    assert d.loss_fn_inputs["advantages"].tolist() == [0, 0, 2.0, 2.0, 0, -1.0]
    assert d.loss_fn_inputs["logprobs"].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, -0.3])


def test_allocate_groups_follows_weights_and_rotates_remainders():
    assert sorted(allocate_groups({"a": 3, "b": 1}, 8, 0)) == ["a"] * 6 + ["b"] * 2
    seen = [allocate_groups({"a": 1, "b": 1, "c": 1}, 2, s) for s in range(3)]
    assert all(len(x) == 2 for x in seen)
    assert {n for x in seen for n in x} == {"a", "b", "c"}  # every env gets a turn


# ---------------------------------------------------------------------------- token-exact rollouts
def _settings(**kw):
    base = dict(max_turns=6, max_tokens=32, temperature=1.0, timeout=30)
    base.update(kw)
    return RolloutSettings(**base)


def test_tool_episode_is_token_exact_and_env_tokens_get_no_weight(tokenizer):
    from polyrl.envs.builtin import CalculatorBuilder  # noqa: F401 - registered builtin
    from polyrl.envs.registry import get_env_builder

    builder = get_env_builder("calculator")({}, seed=0)
    renderer = get_renderer("qwen3", tokenizer)
    env = builder.make("train", 3)
    task_messages, tools = builder.demonstration("train", 3)
    replies = [m for m in task_messages if m["role"] == "assistant"]
    policy = ScriptedSampler(renderer, replies)
    ep = asyncio.run(run_episode(env, Episode("calculator", "train", 3, 0), renderer, policy, _settings()))
    assert ep.reward == 1.0 and ep.num_turns == 2 and ep.done_by_env
    # each turn's prompt is exactly the episode's token prefix before that turn
    for prompt, (start, _) in zip(policy.prompts, ep.turn_spans):
        assert prompt == ep.tokens[:start]
    # and the prompt of the last turn (tool call + tool result appended) is what the chat
    # template renders for that conversation
    text = tokenizer.apply_chat_template(ep.messages[:-1], tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    last_start = ep.turn_spans[-1][0]
    assert ep.tokens[:last_start] == tokenizer.encode(text, add_special_tokens=False)
    # only sampled tokens carry logprobs and advantages; tool-result tokens carry none
    ep.turn_advantages = [1.0, 1.0]
    d = adv.to_datum(ep)
    advantages = d.loss_fn_inputs["advantages"].tolist()
    tool_text = tokenizer.encode("<tool_response>")[0]
    for i, tok in enumerate(ep.tokens[1:]):
        sampled = ep.action_mask[i + 1] == 1
        assert (advantages[i] != 0) == sampled
        if tok == tool_text:
            assert not sampled


def test_multi_turn_episode_with_the_real_engine(tiny_model_dir, tmp_path):
    from polyrl.envs.registry import get_env_builder
    from polyrl.local import ServiceClient

    sc = ServiceClient(store_dir=tmp_path)
    tc = sc.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    renderer = get_renderer("qwen3", tc.get_tokenizer())
    builder = get_env_builder("guess_number")({"max_guesses": 3}, seed=0)
    ep = asyncio.run(run_episode(builder.make("train", 0), Episode("g", "train", 0, 0), renderer, sampler,
                                 _settings(max_tokens=6), seed=7))
    assert ep.num_turns >= 2  # a random model does not guess right at once
    # learner logprobs of the sampled tokens equal the sampler's: trained == sampled
    ep.turn_advantages = [1.0] * ep.num_turns
    d = adv.to_datum(ep)
    out = tc.forward([d], "importance_sampling").result()
    learner = out.loss_fn_outputs[0]["logprobs"].tolist()
    sampled = d.loss_fn_inputs["logprobs"].tolist()
    mask = ep.action_mask[1:]
    diffs = [abs(a - b) for a, b, m in zip(learner, sampled, mask) if m]
    assert len(diffs) == ep.action_tokens and max(diffs) < 1e-4
    # environment messages between turns were appended, never re-rendered
    assert ep.tokens[: ep.turn_spans[0][0]] == renderer.initial_prompt(ep.messages[:1])


# ---------------------------------------------------------------------------- failure budget
def test_failing_episodes_are_counted_and_groups_over_budget_dropped(tokenizer):
    from polyrl.rl.rollouts import EnvRuntime

    renderer = get_renderer("qwen3", tokenizer)
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": "hi"}] * 20)
    cfg = EnvConfig(type="test_flaky", max_failing_rollouts=1, timeout=0.5,
                    args={"modes": ["ok", "raise", "ok", "hang"]})
    rt = EnvRuntime.create("flaky", cfg, 0, 8)
    eps = [Episode("flaky", "train", 0, 0) for _ in range(4)]
    start = time.monotonic()
    eps = asyncio.run(run_group(rt.builder, eps, renderer, policy, rt.settings, [None] * 4))
    assert time.monotonic() - start < 5  # the hanging episode was timed out
    errors = [e.error for e in eps]
    assert errors[0] is None and "exploded" in errors[1] and errors[2] is None and "timeout" in errors[3]
    kept, counts = filter_groups([eps], {"flaky": rt}, remove_constant=False)
    stats = {name: dataclasses.asdict(c) for name, c in counts.items()}
    assert kept == [] and stats["flaky"] == {"failed_rollouts": 2.0, "dropped_groups": 1.0,
                                             "constant_groups": 0.0}
    rt.cfg.max_failing_rollouts = 2
    kept, counts = filter_groups([eps], {"flaky": rt}, remove_constant=False)
    stats = {name: dataclasses.asdict(c) for name, c in counts.items()}
    assert len(kept) == 1 and len(kept[0]) == 2  # failing episodes are left out of a kept group
    assert stats["flaky"]["constant_groups"] == 1.0
    assert filter_groups([eps], {"flaky": rt}, remove_constant=True)[0] == []


# ---------------------------------------------------------------------------- whole runs
def _config(model_dir, tmp_path, **over) -> TrainConfig:
    data = dict(model_name=model_dir, lora_rank=8, batch_size=4, max_steps=4, max_tokens=4, save_every=2,
                learning_rate=3e-3, log_path=str(tmp_path / "run"),
                local={"store_dir": str(tmp_path / "store")}, seed=3,
                environments={"letter": {"type": "test_letter", "num_rollouts": 4, "max_turns": 1}})
    data.update(over)
    return TrainConfig(**data)


@pytest.mark.slow
def test_short_run_improves_reward(small_model_dir, tmp_path):
    from polyrl.tracking.console import ConsoleLog

    cfg = _config(small_model_dir, tmp_path, max_steps=14, batch_size=8, learning_rate=1e-2, save_every=0,
                  max_tokens=1)
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(14))
    early = np.mean([r["reward/mean"] for r in rows[:3]])
    late = np.mean([r["reward/mean"] for r in rows[-3:]])
    assert late > early + 0.2, (early, late)
    traj = [json.loads(x)
            for x in (tmp_path / "run" / "trajectories" / "step_000013.jsonl").read_text().splitlines()]
    assert len(traj) == 32 and {"messages", "tokens", "logprobs", "advantages", "reward"} <= set(traj[0])
    cps = [json.loads(x) for x in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    assert cps[-1]["name"] == "final" and cps[-1]["state_path"].startswith("tinker://")


def test_linear_lr_schedule_decays_each_update(tiny_model_dir, tmp_path):
    from polyrl.tracking.console import ConsoleLog

    cfg = _config(tiny_model_dir, tmp_path, lr_schedule="linear", save_every=0, batch_size=2)
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["optim/lr"] for r in rows] == pytest.approx([3e-3 * (1 - s / 4) for s in range(4)])
    constant = _config(tiny_model_dir, tmp_path / "c", save_every=0)
    assert constant.lr_schedule == "constant"
    with pytest.raises(ValueError, match="lr_schedule"):
        _config(tiny_model_dir, tmp_path, lr_schedule="cosine")


# ---------------------------------------------------------------------------- the loop's phases, alone
def _opened(model_dir, tmp_path, **over):
    from polyrl.rl.run import open_run

    return asyncio.run(open_run(_config(model_dir, tmp_path, **over), RecordingConsole()))


def test_plan_phase_is_a_pure_function_of_step_and_cursors(tiny_model_dir, tmp_path):
    from polyrl.rl.rollouts import EnvRuntime, plan_step

    envs = {"letter": {"type": "test_letter", "num_rollouts": 2, "weight": 3},
            "other": {"type": "test_letter", "num_rollouts": 2}}
    config = _config(tiny_model_dir, tmp_path, environments=envs)
    runtimes = {name: EnvRuntime.create(name, cfg, config.seed, config.max_tokens)
                for name, cfg in config.environments.items()}
    plan_of = functools.partial(plan_step, {n: rt.cfg.weight for n, rt in runtimes.items()}, runtimes,
                                config.batch_size)
    cursors = {"letter": 5, "other": 1}
    plan, after = plan_of(7, cursors)
    assert plan_of(7, cursors) == (plan, after) and cursors == {"letter": 5, "other": 1}
    assert [name for name, _ in plan] == allocate_groups({"letter": 3, "other": 1}, 4, 7)
    assert after == {"letter": 5 + sum(n == "letter" for n, _ in plan),
                     "other": 1 + sum(n == "other" for n, _ in plan)}
    assert plan != plan_of(7, after)[0]  # the next tasks, not the same ones again


def test_rollouts_update_checkpoint_and_log_phases_alone(tiny_model_dir, tmp_path):
    from polyrl.rl.rollout_queue import StepBatch
    from polyrl.rl.rollouts import plan_step, sample_group
    from polyrl.rl.run import resume_hint
    from polyrl.rl.step_metrics import step_row, update_metrics
    from polyrl.rl.train import checkpoint, log_step, take_groups
    from polyrl.rl.update import StepUpdate, forward_backward, optim_params, optimizer_step, prepare_minibatch

    run = _opened(tiny_model_dir, tmp_path, max_steps=4, save_every=2, batch_size=2)
    state = run.state
    assert (state.step, state.cursors, state.checkpoint) == (0, {"letter": 0}, None)
    plan, cursors = plan_step(run.weights, run.runtimes, run.config.batch_size, 0, state.cursors)

    # rollouts: the step's groups from the queue, in plan order, sampled by the current sampler; a
    # group is seeded by its plan step and place, so sampling it again gives the same tokens
    async def sample_step():
        batch = StepBatch(0, 2)
        assert await take_groups(run, batch, 2) and await take_groups(run, batch, 2) == []
        await run.queue.close()
        return batch

    first = asyncio.run(sample_step())
    assert [g.key for g in first.taken] == [(0, 0), (0, 1)] and first.staleness == [0, 0] and not first.stale
    assert [len(g) for g in first.episodes_G] == [4, 4]
    assert [[ep.task_index for ep in g] for g in first.episodes_G] == [[t] * 4 for _, t in plan]
    same_weights = run.training.save_weights_and_get_sampling_client().result()
    again = asyncio.run(sample_group(run.runtimes, run.renderer, run.config.seed, 0, 1, *plan[1],
                                     same_weights))
    assert [ep.tokens for ep in first.episodes_G[1]] == [ep.tokens for ep in again]

    # update: nothing to train on changes no weight; a step with signal does
    def weights():
        return [p.detach().clone() for p in run.training._state.params]

    async def update(episodes_G):  # the loop's update blocks, for one minibatch of step 0
        minibatch = await prepare_minibatch(episodes_G, 0, run.config, run.runtimes, run.signals, run.guard)
        pending = [(await forward_backward(run.training, run.guard, minibatch, run.config))[0]] \
            if minibatch.data_D else []
        adam, optimized = optim_params(run.config, 0), None
        if minibatch.episodes_D:
            optimized = await optimizer_step(run.training, run.guard, pending, minibatch.problem, adam, 0)
        return StepUpdate.of([minibatch], update_metrics(adam, [minibatch], optimized), 0.0)

    before = weights()
    failed = [[Episode("letter", "train", 0, 0, error="boom")] * 4]
    nothing = asyncio.run(update(failed))
    assert nothing.datums == 0 and nothing.counts["letter"].dropped_groups == 1
    assert all(torch.equal(a, b) for a, b in zip(before, weights()))
    mixed = [ep for g in first.episodes_G for ep in g]
    for i, ep in enumerate(mixed):
        ep.reward = float(i % 2)  # a signal in every group
    trained = asyncio.run(update(first.episodes_G))
    assert (trained.datums == 8 and trained.metrics["optim/datums"] == 8.0
            and "optim/grad_norm" in trained.metrics)
    assert any(not torch.equal(a, b) for a, b in zip(before, weights()))

    # checkpoint: a new sampler every step, a saved state only when one is due
    state.step, state.cursors = 1, cursors
    saved = asyncio.run(checkpoint(run, state))
    assert saved.row is None and saved.sampler_step == 1
    state.step = 2
    saved = asyncio.run(checkpoint(run, state))
    assert saved.row["name"] == "000002" and saved.row["cursors"] == cursors and not saved.row["final"]

    # log: the metrics row, then the checkpoint row, which the run state now points at
    row = step_row(run.config, first, trained, {}, saved.seconds, time.monotonic())
    log_step(run, state, row, first, trained, saved)
    assert row["step"] == 0 and row["optim/datums"] == 8.0 and row["episodes/count"] == 8.0
    files = RunFiles(tmp_path / "run")
    assert [r["step"] for r in files.metrics()] == [0] and files.checkpoints() == [saved.row]
    assert state.checkpoint == saved.row["state_path"] and resume_hint(state).endswith("to resume from it)")
    assert len((tmp_path / "run" / "trajectories" / "step_000000.jsonl").read_text().splitlines()) == 8


def test_steps_without_update_warn_then_stop(tiny_model_dir, tmp_path):
    from polyrl.errors import RunStoppedError
    from polyrl.rl.run import RunState
    from polyrl.rl.train import NO_UPDATE_MIN_STEPS, count_step_without_update
    from polyrl.rl.update import GroupCounts, StepUpdate

    config, console, state = _config(tiny_model_dir, tmp_path, max_steps=50,
                                     limits={"max_no_update_frac": 0.5}), \
        RecordingConsole(), RunState()
    group = [Episode("letter", "train", 0, 0, error="RuntimeError: no backend")] * 2
    nothing = StepUpdate([], {"letter": GroupCounts(failed_rollouts=2.0, dropped_groups=1.0,
                                                    constant_groups=0.0)},
                         0, {}, 0.0)
    trained = StepUpdate([group], {}, 3, {}, 0.0)
    for done in range(1, NO_UPDATE_MIN_STEPS):
        count_step_without_update(config, console, state, done - 1, [group],
                                  nothing if done % 2 else trained)
    assert sum("made no update" in line for line in console.lines) == (NO_UPDATE_MIN_STEPS) // 2
    # 5 of 10: not more than half
    count_step_without_update(config, console, state, NO_UPDATE_MIN_STEPS - 1, [group], trained)
    with pytest.raises(RunStoppedError, match="6 of 11 steps made no update.*RuntimeError: no backend"):
        count_step_without_update(config, console, state, NO_UPDATE_MIN_STEPS, [group], nothing)


def test_steps_without_signal_warn_with_their_share_and_stop_only_when_asked(tiny_model_dir, tmp_path):
    """Equal rewards everywhere are normal while a model cannot solve a task yet: a sparse-reward run
    (one prompt a step) goes on, warning with the share of such steps; only max_no_signal_frac stops it."""
    from polyrl.errors import RunStoppedError
    from polyrl.rl.run import RunState
    from polyrl.rl.train import NO_UPDATE_MIN_STEPS, count_step_without_update
    from polyrl.rl.update import GroupCounts, StepUpdate

    group = [Episode("letter", "train", 0, 0), Episode("letter", "train", 0, 0)]
    equal = StepUpdate([group], {"letter": GroupCounts(failed_rollouts=0.0, dropped_groups=0.0,
                                                       constant_groups=1.0)},
                       0, {}, 0.0)
    config, console, state = _config(tiny_model_dir, tmp_path, max_steps=50), RecordingConsole(), RunState()
    for done in range(1, 3 * NO_UPDATE_MIN_STEPS):
        count_step_without_update(config, console, state, done - 1, [group], equal)
    warnings = [line for line in console.lines if "made no update" in line]
    assert len(warnings) == 3 * NO_UPDATE_MIN_STEPS - 1
    assert warnings[-1].endswith("1 with equal rewards (29 of 29 steps so far without a learning signal)"), \
        warnings[-1]

    asked = _config(tiny_model_dir, tmp_path / "asked", max_steps=50, limits={"max_no_signal_frac": 0.5})
    asked_state = RunState()
    for done in range(1, NO_UPDATE_MIN_STEPS):
        count_step_without_update(asked, console, asked_state, done - 1, [group], equal)
    with pytest.raises(RunStoppedError, match="10 of 10 steps made no update without a learning signal "
                                              r"\(more than max_no_signal_frac=0.5\)"):
        count_step_without_update(asked, console, asked_state, NO_UPDATE_MIN_STEPS - 1, [group], equal)


def _run_cli(args, cwd, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "polyrl.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# How far a relaunched run's final weights may be from the uninterrupted run's, relative to how far the
# run moved them after its first checkpoint (L2). Sampler logprobs differ in their last bits with the
# batch a request was sampled in (timing decides it), and the loss's importance ratio carries that into
# the weights (docs/guides/runs.md, "Resuming"): measured about 1e-6. A repeated or skipped step, or lost
# optimizer state, is 0.1 and more.
RESUME_WEIGHTS_RTOL = 1e-2
SIGNAL_ENV = """
class Env:
    def initial_observation(self):
        return "Say anything."

    def step(self, text):  # rewards differ within a group, so every step trains
        return float(len(text) % 3) / 2


def load_environment(**args):
    return Env()
"""


@pytest.mark.slow
def test_resume_after_kill_repeats_no_step_and_matches_uninterrupted(tiny_model_dir, tmp_path):
    """SIGKILL a run again and again (before its first checkpoint, right after one, between two) and
    relaunch it each time: it samples the same tokens as an uninterrupted run and ends with its weights
    (to float32 rounding of the sampler's logprobs, see RESUME_WEIGHTS_RTOL), also beside two busy
    processes that change when sampling requests meet, and leaves no checkpoint in the store that its
    rows do not name."""
    (tmp_path / "signal_env.py").write_text(SIGNAL_ENV)

    def write(name):
        d = tmp_path / name
        d.mkdir()
        envs = {"arithmetic": {"num_rollouts": 2}, "guess_number": {"num_rollouts": 2, "max_turns": 2},
                "signal": {"type": f"module:{tmp_path / 'signal_env.py'}", "num_rollouts": 3}}
        cfg = _config(tiny_model_dir, d, max_steps=6, save_every=2, environments=envs)
        (d / "run.yaml").write_text(json.dumps(cfg.model_dump()))
        return d

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2)]
    try:
        _resume_after_kills(write)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _resume_after_kills(write) -> None:
    from polyrl.local.checkpoints import Store

    env = {**os.environ, "TINKER_API_KEY": "tml-secret-value-123"}
    ref, killed = write("ref"), write("killed")
    assert _run_cli(["train", "--config_path", "run.yaml"], ref, env).wait(timeout=300) == 0

    metrics, cps = killed / "run" / "metrics.jsonl", killed / "run" / "checkpoints.jsonl"
    kill_points = [  # each a condition on the run directory, checked every 10 ms
        lambda: metrics.exists() and metrics.read_text().count("\n") >= 1,  # before any checkpoint
        lambda: cps.exists() and "000002" in cps.read_text(),  # right after a checkpoint row
        lambda: metrics.exists() and '"step": 2,' in metrics.read_text(),  # between two checkpoints
        lambda: cps.exists() and "000004" in cps.read_text(),
    ]
    for reached in kill_points:
        proc = _run_cli(["train", "--config_path", "run.yaml"], killed, env)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not reached() and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _run_cli(["train", "--config_path", "run.yaml"], killed, env).wait(timeout=300) == 0

    def steps(d):
        rows = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows]

    assert steps(killed) == list(range(6)) == steps(ref)
    assert len(RunFiles(killed / "run").attempts()) == 1 + len(kill_points)
    for step in range(6):
        name = f"step_{step:06d}.jsonl"
        a = [json.loads(x) for x in (ref / "run" / "trajectories" / name).read_text().splitlines()]
        b = [json.loads(x) for x in (killed / "run" / "trajectories" / name).read_text().splitlines()]
        assert [r["task_index"] for r in a] == [r["task_index"] for r in b]
        assert [r["tokens"] for r in a] == [r["tokens"] for r in b], f"step {step} diverged after resume"
        for x, y in zip(a, b):  # logged to 5 decimals; equal to float32 rounding (see RESUME_WEIGHTS_RTOL)
            assert np.allclose(x["logprobs"], y["logprobs"], rtol=0, atol=2e-5), f"step {step} diverged"

    def weights(d, which):
        from safetensors.torch import load_file

        row = RunFiles(d / "run").checkpoints()[which]
        return load_file(Store(d / "store").resolve(row["state_path"])[1] / "adapter_model.safetensors")

    assert all(RunFiles(d / "run").checkpoints()[-1]["final"] for d in (ref, killed))
    want, got, first = weights(ref, -1), weights(killed, -1), weights(ref, 0)
    assert want.keys() == got.keys() == first.keys()
    moved = math.sqrt(sum(float(((want[k] - first[k]).double() ** 2).sum()) for k in want))
    apart = math.sqrt(sum(float(((want[k] - got[k]).double() ** 2).sum()) for k in want))
    assert moved > 0, "no step after the first checkpoint trained: the comparison would be vacuous"
    assert apart <= RESUME_WEIGHTS_RTOL * moved, (apart, moved)
    store = Store(killed / "store")
    rows = RunFiles(killed / "run").checkpoints()
    assert {c["tinker_path"] for run in store.runs() for c in store.list(run)} == \
        {r[k] for r in rows for k in ("state_path", "sampler_path")}
    for f in (killed / "run").rglob("*.json*"):
        assert "tml-secret-value-123" not in f.read_text()


def test_cli_config_errors_are_one_line_exit_2(tmp_path):
    (tmp_path / "bad.yaml").write_text("model_name: m\nbatch_sise: 3\nenvironments: {arithmetic: {}}\n")
    p = _run_cli(["train", "--config_path", "bad.yaml"], tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2
    assert err.strip().splitlines() == [err.strip()] and "batch_sise" in err and "Traceback" not in err
    p = _run_cli(["train", "--config_path", "bad.yaml", "--overrides", "batch_sise=null",
                  "learning_rate=fast"], tmp_path)
    assert p.wait(timeout=60) == 2


def test_cli_missing_checkpoints_are_one_line_exit_2(tiny_model_dir, tmp_path):
    (tmp_path / "run.yaml").write_text(f"model_name: {tiny_model_dir}\nmax_steps: 1\n"
                                       f"local: {{store_dir: {tmp_path / 'store'}}}\n"
                                       "environments: {arithmetic: {}}\n")
    cases = [
        (["train", "--overrides", "resume_from=tinker://gone/weights/x"],
         "error: checkpoint tinker://gone/weights/x not found"),
        (["train", "--overrides", "resume_from=runs/x"],
         "error: checkpoint path 'runs/x' must look like tinker://"),
        (["eval", "--checkpoint", "tinker://gone/sampler_weights/x"],
         "error: checkpoint tinker://gone/sampler_weights/x not found"),
    ]
    for args, expected in cases:
        p = _run_cli([args[0], "--config_path", "run.yaml", *args[1:]], tmp_path)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and err.strip().startswith(expected) and "Traceback" not in err, err


def test_overrides_reach_the_loop_config(tmp_path):
    (tmp_path / "run.yaml").write_text("model_name: m\nenvironments: {arithmetic: {}}\n")
    cfg = load_config(tmp_path / "run.yaml", ["batch_size=64", "learning_rate=2e-5",
                                              "environments.arithmetic.num_rollouts=8"])
    assert (cfg.batch_size, cfg.learning_rate, cfg.environments["arithmetic"].num_rollouts) == (64, 2e-5, 8)


def test_stable_reinforce_with_dimuon_trains_on_the_real_engine(tiny_model_dir, tmp_path):
    """``loss_fn: stable_reinforce`` and ``optimizer.type: dimuon`` end to end in process on a multi-turn
    environment: the samplers record, every Datum names the sequences of its turns (the engine checks
    each token against them), and each step applies a Dimuon update. (A KL penalty gives every sampled
    token a signal, so a random model's all-zero rewards still train.)"""
    from polyrl.local.checkpoints import Store
    from polyrl.tracking.console import ConsoleLog

    cfg = _config(tiny_model_dir, tmp_path, max_steps=2, save_every=0, batch_size=2,
                  loss_fn="stable_reinforce", loss_fn_config={"max_ratio": 1.5}, optimizer={"type": "dimuon"},
                  learning_rate=0.02,
                  kl={"penalty_coef": 0.05}, environments={"guess": {
                      "type": "guess_number", "num_rollouts": 4, "max_turns": 3, "args": {"max_guesses": 3}}})
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["turns/mean"] > 1 and r["optim/datums"] == 8 and np.isfinite(r["optim/loss"]) for r in rows)
    assert rows[-1]["optim/grad_norm"] > 0
    final = [json.loads(x) for x in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()][-1]
    store = Store(tmp_path / "store")
    assert store.meta(store.resolve(final["state_path"])[1])["optimizer"] == "dimuon"
