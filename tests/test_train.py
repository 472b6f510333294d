"""The RL loop: advantages, token-exact rollouts, failure budgets, resume, learning."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from scripted import ScriptedSampler

from polyrl import advantages as adv
from polyrl.config import EnvConfig, TrainConfig, load_config
from polyrl.envs.base import Env, EnvBuilder, Observation, StepResult, register_env
from polyrl.renderers import get_renderer
from polyrl.rollouts import Episode, RolloutSettings, run_episode, run_group
from polyrl.train import allocate_groups, filter_groups, train


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


def test_grpo_advantages_hand_computed():
    g1 = [_ep(1.0), _ep(0.0), _ep(0.0), _ep(1.0)]
    g2 = [_ep(3.0, turns=2), _ep(1.0, turns=2)]
    adv.compute_advantages([g1, g2], "grpo")
    assert [e.turn_advantages for e in g1] == [[0.5], [-0.5], [-0.5], [0.5]]
    assert [e.turn_advantages for e in g2] == [[1.0, 1.0], [-1.0, -1.0]]
    adv.compute_advantages([g1], "grpo", normalize_by_std=True)
    assert g1[0].turn_advantages[0] == pytest.approx(1.0, rel=1e-5)  # (1 - .5) / .5


def test_rebn_discounted_returns_normalized_over_batch():
    a = _ep(1.0, turns=2, rewards=[0.0, 1.0])
    b = _ep(0.0, turns=1, rewards=[0.0])
    adv.compute_advantages([[a], [b]], "rebn", gamma=0.5)
    returns = [0.5, 1.0, 0.0]  # a: 0 + .5*1, 1 ; b: 0
    mean = sum(returns) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / 3)
    assert a.turn_advantages == pytest.approx([(0.5 - mean) / std, (1.0 - mean) / std], rel=1e-4)
    assert b.turn_advantages == pytest.approx([(0.0 - mean) / std], rel=1e-4)


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

    from polyrl.envs.base import get_env_builder

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
    text = tokenizer.apply_chat_template(ep.messages[:-1], tools=tools, tokenize=False, add_generation_prompt=True)
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
    from polyrl.envs.base import get_env_builder
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
    from polyrl.train import EnvRuntime

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
    kept, stats = filter_groups([eps], {"flaky": rt}, remove_constant=False)
    assert kept == [] and stats["flaky"] == {"failed_rollouts": 2.0, "dropped_groups": 1.0, "constant_groups": 0.0}
    rt.cfg.max_failing_rollouts = 2
    kept, stats = filter_groups([eps], {"flaky": rt}, remove_constant=False)
    assert len(kept) == 1 and len(kept[0]) == 2  # failing episodes are left out of a kept group
    assert stats["flaky"]["constant_groups"] == 1.0
    assert filter_groups([eps], {"flaky": rt}, remove_constant=True)[0] == []


# ---------------------------------------------------------------------------- whole runs
def _config(model_dir, tmp_path, **over) -> TrainConfig:
    data = dict(model_name=model_dir, lora_rank=8, batch_size=4, max_steps=4, max_tokens=4, save_every=2,
                learning_rate=3e-3, log_path=str(tmp_path / "run"), store_dir=str(tmp_path / "store"), seed=3,
                environments={"letter": {"type": "test_letter", "num_rollouts": 4, "max_turns": 1}})
    data.update(over)
    return TrainConfig(**data)


@pytest.mark.slow
def test_short_run_improves_reward(small_model_dir, tmp_path):
    from polyrl.tracking.console import ConsoleLog

    cfg = _config(small_model_dir, tmp_path, max_steps=14, batch_size=8, learning_rate=1e-2, save_every=0, max_tokens=1)
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(14))
    early = np.mean([r["reward/mean"] for r in rows[:3]])
    late = np.mean([r["reward/mean"] for r in rows[-3:]])
    assert late > early + 0.2, (early, late)
    traj = [json.loads(x) for x in (tmp_path / "run" / "trajectories" / "step_000013.jsonl").read_text().splitlines()]
    assert len(traj) == 32 and {"messages", "tokens", "logprobs", "advantages", "reward"} <= set(traj[0])
    cps = [json.loads(x) for x in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    assert cps[-1]["name"] == "final" and cps[-1]["state_path"].startswith("tinker://")


def _run_cli(args, cwd, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "polyrl.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_resume_after_kill_repeats_no_step_and_matches_uninterrupted(tiny_model_dir, tmp_path):
    def write(name):
        d = tmp_path / name
        d.mkdir()
        envs = {"arithmetic": {"num_rollouts": 2}, "guess_number": {"num_rollouts": 2, "max_turns": 2}}
        cfg = _config(tiny_model_dir, d, max_steps=6, save_every=2, environments=envs)
        (d / "run.yaml").write_text(json.dumps(cfg.model_dump()))
        return d

    env = {**os.environ, "TINKER_API_KEY": "tml-secret-value-123"}
    ref, killed = write("ref"), write("killed")
    assert _run_cli(["train", "--config_path", "run.yaml"], ref, env).wait(timeout=300) == 0
    proc = _run_cli(["train", "--config_path", "run.yaml"], killed, env)
    cps = killed / "run" / "checkpoints.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (cps.exists() and "000004" in cps.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _run_cli(["train", "--config_path", "run.yaml"], killed, env).wait(timeout=300) == 0

    def steps(d):
        rows = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows]

    assert steps(killed) == list(range(6)) == steps(ref)
    for step in range(6):
        name = f"step_{step:06d}.jsonl"
        a = [json.loads(x) for x in (ref / "run" / "trajectories" / name).read_text().splitlines()]
        b = [json.loads(x) for x in (killed / "run" / "trajectories" / name).read_text().splitlines()]
        assert [r["task_index"] for r in a] == [r["task_index"] for r in b]
        assert [r["tokens"] for r in a] == [r["tokens"] for r in b], f"step {step} diverged after resume"
    for f in (killed / "run").rglob("*.json*"):
        assert "tml-secret-value-123" not in f.read_text()


def test_cli_config_errors_are_one_line_exit_2(tmp_path):
    (tmp_path / "bad.yaml").write_text("model_name: m\nbatch_sise: 3\nenvironments: {arithmetic: {}}\n")
    p = _run_cli(["train", "--config_path", "bad.yaml"], tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2
    assert err.strip().splitlines() == [err.strip()] and "batch_sise" in err and "Traceback" not in err
    p = _run_cli(["train", "--config_path", "bad.yaml", "--overrides", "batch_sise=null", "learning_rate=fast"], tmp_path)
    assert p.wait(timeout=60) == 2


def test_cli_missing_checkpoints_are_one_line_exit_2(tiny_model_dir, tmp_path):
    (tmp_path / "run.yaml").write_text(f"model_name: {tiny_model_dir}\nmax_steps: 1\nstore_dir: {tmp_path / 'store'}\n"
                                       "environments: {arithmetic: {}}\n")
    cases = [
        (["train", "--overrides", "resume_from=tinker://gone/weights/x"], "error: checkpoint tinker://gone/weights/x not found"),
        (["train", "--overrides", "resume_from=runs/x"], "error: checkpoint path 'runs/x' must look like tinker://"),
        (["eval", "--checkpoint", "tinker://gone/sampler_weights/x"], "error: checkpoint tinker://gone/sampler_weights/x not found"),
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
