"""Partial rollouts in asynchronous training: episodes in flight take the newest sampler at each turn
(and each chunk of a long turn), every sampled token records the sampler step that produced it, and the
staleness bound applies per token. Unit tests with versioned fake samplers (no model), a chunked turn on
the real local sampler, and whole runs on the tiny model."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
from tinker import types

from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.envs.base import EnvBuilder, Observation, StepResult, register_env
from polyrl.rl.advantages import provenance_spans
from polyrl.rl.episode import Episode, RolloutContext, RolloutSettings, SamplerRef, run_episode, stop_across
from polyrl.rl.rollout_queue import DrawPoint, RolloutQueue
from polyrl.rl.rollouts import run_group
from polyrl.rl.train import train
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles

SEED = 11


# ---------------------------------------------------------------------------- fakes: no model
class Chars:
    """A renderer whose tokens are characters (``ord``), with a string stop."""

    def __init__(self, stop: str = "STOP"):
        self.stop = stop

    def initial_prompt(self, messages, tools=None) -> list[int]:
        return [ord(c) for c in "".join(m["content"] for m in messages)]

    def continuation(self, messages, assistant_finished: bool = True) -> list[int]:
        return self.initial_prompt(messages)

    def stop_sequences(self) -> list[str]:
        return [self.stop]

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(t) for t in tokens)

    def parse_response(self, tokens: list[int]) -> dict:
        return {"role": "assistant", "content": self.decode(tokens)}


class Script:
    """Text every sampler continues, whatever its version; each call is logged."""

    def __init__(self, text: str):
        self.text, self.at = text, 0
        self.calls: list[dict] = []


class Versioned:
    """The sampler of the weights after ``step`` updates: emits the script's next characters (each with
    logprob ``-(step + 1) / 10``), up to ``max_tokens`` or a stop string in its own output, as a real
    sampler does; ``then`` runs once the call is logged (a release while it samples)."""

    def __init__(self, script: Script, step: int, then=None):
        self.script, self.step, self.then = script, step, then

    async def sample(self, prompt, num_samples, params):
        script = self.script
        script.calls.append({"step": self.step, "prompt": prompt.to_ints(), "max_tokens": params.max_tokens,
                             "seed": params.seed})
        out, reason = [], "length"
        while len(out) < params.max_tokens and script.at < len(script.text):
            out.append(ord(script.text[script.at]))
            script.at += 1
            if any(s in "".join(map(chr, out)) for s in params.stop):
                reason = "stop"
                break
        if self.then is not None:
            self.then()
        seq = types.SampledSequence(stop_reason=reason, sequence_id=f"s{len(script.calls)}",
                                    tokens_np=np.array(out, dtype=np.int32),
                                    logprobs_np=np.full(len(out), -(self.step + 1) / 10, dtype=np.float32))
        return types.SampleResponse(sequences=[seq])


def _settings(**kw) -> RolloutSettings:
    return RolloutSettings(**{"max_turns": 3, "max_tokens": 8, "temperature": 1.0, "timeout": 30, **kw})


class Talk:
    """Three turns; each step hands the episode the next policy's sampler before it answers (a release
    while the environment works)."""

    def __init__(self, samplers: SamplerRef, script: Script):
        self.samplers, self.script = samplers, script

    async def reset(self):
        return Observation([{"role": "user", "content": "Q:"}])

    async def step(self, action):
        step = self.samplers.step + 1
        self.samplers.swap(Versioned(self.script, step), step)
        return StepResult(reward=1.0, done=False, messages=[{"role": "user", "content": "Q:"}])

    async def close(self):
        return None


def test_each_turn_samples_with_the_newest_sampler_and_records_its_step():
    script = Script("ab STOPcd STOPef STOP")
    samplers = SamplerRef(Versioned(script, 0), 0)
    ep = asyncio.run(run_episode(Talk(samplers, script), Episode("e", "train", 0, 0), Chars(), samplers,
                                 _settings(), seed=SEED))
    assert [c["step"] for c in script.calls] == [0, 1, 2]
    replies = [m["content"] for m in ep.messages if m["role"] == "assistant"]
    assert replies == ["ab STOP", "cd STOP", "ef STOP"]
    assert len(ep.sampler_steps) == len(ep.tokens) == len(ep.logprobs)
    for turn, (start, end) in enumerate(ep.turn_spans):
        assert ep.sampler_steps[start:end] == [turn] * (end - start)
        assert ep.logprobs[start:end] == pytest.approx([-(turn + 1) / 10] * (end - start))
    assert all(s == -1 for s, m in zip(ep.sampler_steps, ep.action_mask) if not m)  # prompt, environment
    assert ep.sampled_steps() == [0] * 7 + [1] * 7 + [2] * 7


def test_a_long_turn_continues_in_chunks_with_the_newest_sampler():
    """Chunks of 3 tokens of an 8-token turn; the policy is released while the first chunk samples: the
    rest of the turn continues the prefix with the new weights, and every token keeps its own sampler's
    step and logprob. The first chunk is seeded as the whole turn is without chunks."""
    script = Script("abcdefghijkl")
    samplers = SamplerRef(None, 0, chunk_tokens=3)  # type: ignore[arg-type]
    samplers.swap(Versioned(script, 0, then=lambda: samplers.swap(Versioned(script, 1), 1)), 0)
    ctx = RolloutContext("e", "train", 0, 0, samplers, Chars(), _settings(), SEED)
    ep = Episode("e", "train", 0, 0)
    ep.append([ord(c) for c in "Q:"])
    message = asyncio.run(ctx.sample(ep))
    assert message["content"] == "abcdefgh" and ep.stop_reasons == ["length"] and ep.num_turns == 1
    calls = script.calls
    assert [(c["step"], c["max_tokens"]) for c in calls] == [(0, 3), (1, 3), (1, 2)]
    assert [len(c["prompt"]) for c in calls] == [2, 5, 8]  # the prefix and the turn so far, re-encoded
    assert calls[2]["prompt"] == [ord(c) for c in "Q:abcdef"]
    assert ep.sampled_steps() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert ep.logprobs[2:] == pytest.approx([-0.1] * 3 + [-0.2] * 5)
    # each chunk is its own sampled sequence: a stable_reinforce Datum names each for its tokens
    assert ep.sequence_runs == [(2, 5, "s1"), (5, 8, "s2"), (8, 10, "s3")]
    spans, covered = provenance_spans(ep)
    assert covered == 10 and spans == [
        types.PromptProvenanceSpan(sequence_id="s1", length=2),
        types.SampledProvenanceSpan(sequence_id="s1", length=3),
        types.SampledProvenanceSpan(sequence_id="s2", length=3),
        types.SampledProvenanceSpan(sequence_id="s3", length=2)]
    seeds = [c["seed"] for c in calls]
    assert seeds[0] == (SEED * 1009) % 2**31 and len(set(seeds)) == 3
    again = Script("abcdefghijkl")  # the same turn again: the same calls, seeds included
    ctx2 = RolloutContext("e", "train", 0, 0, SamplerRef(Versioned(again, 0), 0, chunk_tokens=3), Chars(),
                          _settings(), SEED)
    asyncio.run(ctx2.sample(Episode("e", "train", 0, 0, tokens=[ord("Q"), ord(":")])))
    assert [c["seed"] for c in again.calls] == seeds


def test_a_stop_string_split_across_chunks_still_stops():
    """'STOP' begins in one chunk and ends in the next: the sampler of the second sees only 'OP...' and
    would go on, so the turn is cut where the stop string is complete, as without chunks."""
    script = Script("abcST" + "OPxyzw")
    ctx = RolloutContext("e", "train", 0, 0, SamplerRef(Versioned(script, 0), 0, chunk_tokens=5), Chars(),
                         _settings(max_tokens=20), SEED)
    ep = Episode("e", "train", 0, 0)
    asyncio.run(ctx.sample(ep))
    assert ctx.renderer.decode(ep.tokens) == "abcSTOP" and ep.stop_reasons == ["stop"]
    assert len(ep.logprobs) == len(ep.sampler_steps) == 7
    # the same text without chunks stops at the same token
    whole = Script("abcSTOPxyzw")
    ctx = RolloutContext("e", "train", 0, 0, Versioned(whole, 0), Chars(), _settings(max_tokens=20), SEED)
    ep2 = Episode("e", "train", 0, 0)
    asyncio.run(ctx.sample(ep2))
    assert ep2.tokens == ep.tokens and ep2.stop_reasons == ["stop"]
    # the check itself: a stop only before the chunk, or none, is not a stop in the chunk
    decode = Chars().decode
    text = [ord(c) for c in "STOP.abST" + "OPz"]
    assert stop_across(text, 9, ["STOP"], decode) == 11
    assert stop_across(text[:9] + [ord("z")] * 3, 9, ["STOP"], decode) is None
    assert stop_across(text, 9, [7], decode) is None  # token stops end within one chunk: the sampler's


# ---------------------------------------------------------------------------- the queue, per-token bound
class Gated:
    """Two turns; ``reset`` and the first ``step`` of task ``t`` wait for the test's gates."""

    def __init__(self, gates: dict, task: int):
        self.gates, self.task = gates, task

    def gate(self, where: str):
        return self.gates.setdefault((self.task, where), asyncio.Event())

    async def reset(self):
        await self.gate("reset").wait()
        return Observation([{"role": "user", "content": "Q:"}])

    async def step(self, action):
        await self.gate("step").wait()
        return StepResult(reward=1.0, done=False, messages=[{"role": "user", "content": "Q:"}])

    async def close(self):
        return None


class GatedBuilder(EnvBuilder):
    def __init__(self):
        super().__init__({}, 0)
        self.gates: dict = {}

    def make(self, split, index):
        return Gated(self.gates, index)

    def open(self, task: int, *where: str):
        for w in where:
            Gated(self.gates, task).gate(w).set()


def _gated_queue(builder: GatedBuilder, script: Script) -> RolloutQueue:
    """K = 1, one two-turn group a step, three steps; the first sampler is v0."""
    renderer, settings = Chars(), _settings(max_turns=2)

    def plan(step, cursors):
        return [("e", cursors["e"])], {"e": cursors["e"] + 1}

    async def sample(step, index, env_name, task, samplers):
        return await run_group(builder, [Episode(env_name, "train", task, index)], renderer, samplers,
                               settings, [SEED + step])

    return RolloutQueue(plan, sample, Versioned(script, 0), 0, capacity=2, wanted=3,
                        start=DrawPoint(0, {"e": 0}), max_staleness=1)


async def _until(condition) -> None:
    """Let the event loop run until ``condition()`` holds (no clock involved)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def _take(q: RolloutQueue, step: int):
    return asyncio.wait_for(q.take(1, step), 60)  # a bound, so a wrong rule fails instead of hanging


def test_queue_episodes_in_flight_take_released_samplers_and_the_bound_is_per_token():
    """K = 1, one group a step. Group 1 starts with v0 but its reset waits until v1 is out, and its
    second turn until v2 is: its tokens come from v1 and v2, so at step 2 it is one step stale and
    trained (bounded by the sampler the group started with, it would be two behind and dropped).
    Group 2 starts with v1 and is trained at step 1."""
    builder, script = GatedBuilder(), Script("xSTOP" * 40)

    async def run():
        q = _gated_queue(builder, script)
        builder.open(0, "reset", "step")
        taken0, stale0 = await _take(q, 0)  # group 0, all v0; group 1 waits to reset
        q.release(1, Versioned(script, 1), 1)  # group 2 starts, with v1
        builder.open(1, "reset")
        builder.open(2, "reset", "step")
        await _until(lambda: len(script.calls) == 5)  # group 0's two turns, group 1's first, group 2's two
        taken1, stale1 = await _take(q, 1)  # group 2: group 1 still waits in its first step
        q.release(1, Versioned(script, 2), 2)
        builder.open(1, "step")  # group 1's second turn: v2
        taken2, stale2 = await _take(q, 2)
        await q.close()
        return [taken0, taken1, taken2], stale0 + stale1 + stale2

    taken_G, stale = asyncio.run(run())
    assert stale == []
    assert [[g.key for g in taken] for taken in taken_G] == [[(0, 0)], [(2, 0)], [(1, 0)]]
    (g0,), (g2,), (g1,) = taken_G
    def turns(g):
        return [set(g.episodes[0].sampler_steps[a:b]) for a, b in g.episodes[0].turn_spans]

    assert turns(g0) == [{0}, {0}] and g0.sampler_step == 0
    assert turns(g2) == [{1}, {1}] and g2.sampler_step == 1
    assert turns(g1) == [{1}, {2}] and g1.sampler_step == 1  # started with v0, sampled nothing with it


def test_the_bound_drops_a_group_by_its_oldest_token():
    """K = 1: group 1 samples its first turn with v0 and its second with v2; at step 2 its first turn is
    two updates old, so the group is dropped and replaced, though its last turn is fresh."""
    builder, script = GatedBuilder(), Script("xSTOP" * 40)

    async def run():
        q = _gated_queue(builder, script)
        for task in range(5):
            builder.open(task, "reset")
        builder.open(0, "step")
        first = asyncio.ensure_future(_take(q, 0))  # sampling starts with the first take
        await _until(lambda: len(script.calls) == 3)  # group 0's two turns and group 1's first, all v0
        taken0, _ = await first
        q.release(1, Versioned(script, 1), 1)
        builder.open(2, "step")
        taken1, _ = await _take(q, 1)
        q.release(1, Versioned(script, 2), 2)
        builder.open(1, "step")
        builder.open(3, "step")
        taken2, stale2 = await _take(q, 2)
        await q.close()
        return taken0 + taken1 + taken2, stale2

    taken, stale = asyncio.run(run())
    assert [g.key for g in stale] == [(1, 0)]
    ep = stale[0].episodes[0]
    assert [ep.sampler_steps[a] for a, _ in ep.turn_spans] == [0, 2] and stale[0].sampler_step == 0
    assert [g.key for g in taken] == [(0, 0), (2, 0), (3, 0)]
    assert all(2 - s <= 1 for s in taken[2].episodes[0].sampled_steps())


# ---------------------------------------------------------------------------- the real sampler
def test_a_chunked_turn_on_the_local_sampler_has_the_logprobs_of_the_whole_sequence(tiny_model_dir, tmp_path):
    """Chunks of 2 tokens with one sampler: each chunk re-encodes the prefix, and the turn's logprobs are
    what the model gives the whole sequence; the first chunk's tokens are the unchunked turn's."""
    from polyrl.local import ServiceClient
    from polyrl.renderers import get_renderer

    service = ServiceClient(store_dir=tmp_path / "store")
    sampler = service.create_sampling_client(base_model=tiny_model_dir).result()
    renderer = get_renderer("qwen3", sampler.get_tokenizer())
    prompt = renderer.initial_prompt([{"role": "user", "content": "Say something."}])

    def turn(chunk_tokens):
        ctx = RolloutContext("e", "train", 0, 0, SamplerRef(sampler, 0, chunk_tokens), renderer,
                             _settings(max_tokens=7), SEED)
        ep = Episode("e", "train", 0, 0)
        ep.append(prompt)
        asyncio.run(ctx.sample(ep))
        return ep

    chunked, again, whole = turn(2), turn(2), turn(None)
    new = chunked.tokens[len(prompt):]
    assert chunked.tokens == again.tokens and 1 <= len(new) <= 7
    assert new[:2] == whole.tokens[len(prompt):][:2]
    forward = sampler.compute_logprobs(types.ModelInput.from_ints(chunked.tokens)).result()
    assert chunked.logprobs[len(prompt):] == pytest.approx(forward[len(prompt):], abs=1e-4)
    assert chunked.sampled_steps() == [0] * len(new)


# ---------------------------------------------------------------------------- whole runs
B = 2  # groups per step in the runs


class _Relay:
    """Two turns. In plan step p >= 1 (tasks p * B ... p * B + B - 1), the first step answers only once
    step p - 1's metrics row is written, which is after the trainer released the sampler of step p: the
    second turn is sampled by newer weights than the first."""

    def __init__(self, metrics: Path, task: int):
        self.metrics, self.task = metrics, task

    async def reset(self):
        return Observation([{"role": "user", "content": "Write a word."}])

    async def step(self, action):
        wait_for = self.task // B - 1
        deadline = time.monotonic() + 300
        while wait_for >= 0 and not self._logged(wait_for):
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {wait_for} was never logged")
            await asyncio.sleep(0.01)
        ok = "e" in action["content"]
        return StepResult(reward=float(ok), done=False, messages=[{"role": "user", "content": "Another."}])

    def _logged(self, step: int) -> bool:
        if not self.metrics.exists():
            return False
        return any(json.loads(line)["step"] == step for line in self.metrics.read_text().splitlines() if line)

    async def close(self):
        return None


@register_env("test_relay")
class RelayBuilder(EnvBuilder):
    def make(self, split, index):
        return _Relay(Path(self.args["metrics"]), index)


@pytest.mark.parametrize("chunk", [None, 2], ids=["turns", "chunks"])
def test_async_run_trains_no_token_more_than_k_steps_behind_and_later_turns_use_newer_weights(
        tiny_model_dir, tmp_path, chunk):
    """K = 1 on the tiny model, every group of plan step p >= 1 waiting in its first environment step
    until step p - 1 is logged: its first turn is sampled by the weights of step p - 1 and its second by
    those of step p, which trains it. Every trained token is at most one step behind, and the metrics
    give the staleness per token beside the per-group one."""
    steps = 4
    run_dir = tmp_path / "run"
    cfg_env = {"type": "test_relay", "num_rollouts": 2, "max_turns": 2,
               "args": {"metrics": str(run_dir / "metrics.jsonl")}}
    cfg = TrainConfig(model_name=tiny_model_dir, lora_rank=8, batch_size=B, max_steps=steps, max_tokens=4,
                      save_every=0, learning_rate=3e-3, log_path=str(run_dir), seed=5,
                      outputs={"report": False}, local={"store_dir": str(tmp_path / "store")},
                      off_policy={"max_steps": 1, "partial_chunk_tokens": chunk},
                      environments={"relay": cfg_env})
    train(cfg, ConsoleLog(enabled=False))
    rows = RunFiles(run_dir).metrics()
    assert [r["step"] for r in rows] == list(range(steps))
    files = sorted((run_dir / "trajectories").glob("step_*.jsonl"))
    lags = []
    for step, path in enumerate(files):
        episodes = [json.loads(line) for line in path.read_text().splitlines()]
        assert episodes and all(not r["dropped"] and r["drawn"][0] == step for r in episodes)
        for r in episodes:
            sampled = [s for s, m in zip(r["sampler_steps"], r["action_mask"]) if m]
            assert all(s == -1 for s, m in zip(r["sampler_steps"], r["action_mask"]) if not m)
            assert sampled == sorted(sampled), "an episode never goes back to older weights"
            assert all(0 <= step - s <= 1 for s in sampled), (step, sampled)  # the bound, per token
            turns = [r["sampler_steps"][a:b] for a, b in r["turn_spans"]]
            assert len(turns) == 2
            assert turns[0][0] == max(step - 1, 0) and set(turns[1]) == {step}  # later turns: newer weights
            assert r["sampler_step"] == min(sampled)
            lags += [step - s for s in sampled]
        assert rows[step]["async/stale_dropped"] == 0
        assert rows[step]["async/staleness_max"] == (1 if step else 0)
        assert rows[step]["async/token_staleness_max"] == (1 if step else 0)
        assert (0 < rows[step]["async/token_staleness_mean"] < 1) if step else \
            rows[step]["async/token_staleness_mean"] == 0
    assert max(lags) == 1 and 0 in lags


def test_partial_chunk_tokens_is_checked_when_the_config_loads():
    base = ["model_name=m", "environments.arithmetic.max_turns=2"]
    assert load_config(None, base + ["off_policy.max_steps=1", "off_policy.partial_chunk_tokens=64"]
                       ).off_policy.partial_chunk_tokens == 64
    with pytest.raises(ConfigError, match="partial_chunk_tokens: only used with off_policy.max_steps"):
        load_config(None, base + ["off_policy.partial_chunk_tokens=64"])
    with pytest.raises(ConfigError, match="off_policy.partial_chunk_tokens"):
        load_config(None, base + ["off_policy.max_steps=1", "off_policy.partial_chunk_tokens=0"])
