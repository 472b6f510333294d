"""Asynchronous, off-policy training: the rollout queue's bounds, staleness and resume points, and
whole runs with ``off_policy.max_steps`` and ``off_policy.stream_minibatches``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.envs.base import EnvBuilder, Observation, StepResult, register_env
from polyrl.rl.episode import Episode
from polyrl.rl.rollout_queue import DrawPoint, RolloutQueue
from polyrl.rl.train import train
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles

B = 2  # groups per step in the queue tests


# ---------------------------------------------------------------------------- the queue alone
class Scripted:
    """Groups that finish when the test says so; records which sampler started each group."""

    def __init__(self):
        self.started: dict[tuple[int, int], str] = {}
        self.finish: dict[tuple[int, int], asyncio.Event] = {}
        self.sampler = ("v0", 0)

    @staticmethod
    def plan(step: int, cursors: dict[str, int]):
        return [("e", cursors["e"] + i) for i in range(B)], {"e": cursors["e"] + B}

    async def sample(self, step, index, env_name, task, sampler):
        self.started[(step, index)] = sampler
        await self.finish.setdefault((step, index), asyncio.Event()).wait()
        return [Episode(env_name, "train", task, index)]

    def done(self, *keys):
        for key in keys:
            self.finish.setdefault(key, asyncio.Event()).set()

    def queue(self, ahead: int, steps: int, start: DrawPoint | None = None,
              drop: bool = True) -> RolloutQueue:
        start = start or DrawPoint(0, {"e": 0})
        return RolloutQueue(self.plan, self.sample, *self.sampler, capacity=B * (ahead + 1),
                            wanted=B * (steps - start.step), start=start,
                            max_staleness=ahead if drop else None)


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_synchronous_queue_samples_each_step_with_the_policy_it_trains():
    async def run():
        s = Scripted()
        q = s.queue(ahead=0, steps=3)
        for step in range(3):
            take = asyncio.ensure_future(q.take(B, step))
            await _settle()
            # never a step ahead
            assert sorted(s.started) == [(p, i) for p in range(step + 1) for i in range(B)]
            s.done(*[(step, i) for i in range(B)][::-1])  # finishing in reverse changes nothing
            taken, stale = await take
            assert [g.key for g in taken] == [(step, 0), (step, 1)] and not stale
            assert {g.sampler_step for g in taken} == {step}
            assert q.draw_point() == DrawPoint(step + 1, {"e": B * (step + 1)}, [])
            s.sampler = (f"v{step + 1}", step + 1)
            q.release(B, *s.sampler)
        await _settle()
        assert len(s.started) == 3 * B  # nothing is started that no step would train
        await q.close()

    asyncio.run(run())


@pytest.mark.parametrize("drop", [True, False], ids=["drop", "keep"])
def test_a_straggler_past_the_bound_is_dropped_and_replaced_or_kept(drop):
    """K = 1: group (0, 0) finishes late, after three steps trained. Dropped, it is counted and a
    fresh group replaces it; kept, it is trained first (the stalest). Nothing else is ever more than
    one step stale, and every group is consumed once."""

    async def run():
        s = Scripted()
        q = s.queue(ahead=1, steps=4, drop=drop)
        trained, dropped = [], []
        for step in range(4):
            if step == 3:
                s.done((0, 0))
                await _settle()
            take = asyncio.ensure_future(q.take(B, step))
            await _settle()
            s.done(*[k for k in s.started if k != (0, 0)])
            taken, stale = await take
            trained.append([(g.key, step - g.sampler_step) for g in taken])
            dropped += [(g.key, step - g.sampler_step) for g in stale]
            s.sampler = (f"v{step + 1}", step + 1)
            q.release(B, *s.sampler)
        await q.close()
        return trained, dropped

    trained, dropped = asyncio.run(run())
    assert [len(t) for t in trained] == [B] * 4
    keys = [key for t in trained for key, _ in t]
    assert len(set(keys)) == len(keys)
    if drop:
        assert dropped == [((0, 0), 3)]
        assert all(lag <= 1 for t in trained for _, lag in t), trained
        assert sorted(keys) == [k for k in [(p, i) for p in range(5) for i in range(B)]
                                if k != (0, 0)][:4 * B]
    else:
        assert dropped == [] and trained[3][0] == ((0, 0), 3)
        assert sorted(keys) == [(p, i) for p in range(4) for i in range(B)]
    for t in trained:  # stalest first, then plan order
        assert [(-lag, key) for key, lag in t] == sorted((-lag, key) for key, lag in t)


def test_draw_point_redraws_what_was_in_flight_and_skips_what_was_trained():
    """Groups taken out of plan order: a queue started from the draw point draws the groups that
    were in flight again and never one that was trained."""

    async def run():
        s = Scripted()
        q = s.queue(ahead=1, steps=6)
        take = asyncio.ensure_future(q.take(B, 0))
        await _settle()
        s.done((0, 1), (1, 0))  # (0, 0) and (1, 1) still running
        taken, _ = await take
        assert [g.key for g in taken] == [(0, 1), (1, 0)]
        s.sampler = ("v1", 1)
        q.release(B, *s.sampler)
        point = q.draw_point()
        await q.close()

        s2 = Scripted()
        q2 = s2.queue(ahead=1, steps=6, start=point)
        take = asyncio.ensure_future(q2.take(B, 1))  # sampling starts with the first take
        await _settle()
        assert sorted(s2.started) == [(0, 0), (1, 1), (2, 0), (2, 1)]
        take.cancel()
        await q2.close()
        return point

    point = asyncio.run(run())
    assert point == DrawPoint(0, {"e": 0}, [(0, 1), (1, 0)])


# ---------------------------------------------------------------------------- config
def test_async_options_are_checked_when_the_config_loads():
    base = ["model_name=m", "environments.arithmetic.max_turns=2"]
    cfg = load_config(None, base + ["off_policy.max_steps=2", "off_policy.stale_groups=keep",
                                    "off_policy.stream_minibatches=4"])
    off = cfg.off_policy
    assert (off.max_steps, off.stale_groups, off.stream_minibatches) == (2, "keep", 4)
    for overrides, key in [(["off_policy.stale_groups=keep"],
                            "off_policy.stale_groups: only used with off_policy.max_steps"),
                           (["off_policy.stream_minibatches=9"],
                            "off_policy.stream_minibatches: 9 groups per minibatch is more than"),
                           (["off_policy.stream_minibatches=2", "advantages.estimator=rebn"],
                            "off_policy.stream_minibatches: advantage"),
                           (["off_policy.max_steps=-1"], "off_policy.max_steps"),
                           (["off_policy.stale_groups=later", "off_policy.max_steps=1"],
                            "off_policy.stale_groups")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, base + overrides)


# ---------------------------------------------------------------------------- whole runs
class _Word:
    """Reward 1 for a reply with an 'e'. The episodes of task 0 (a straggler) end only once
    ``after`` episodes of other tasks have ended."""

    def __init__(self, builder: "StragglerBuilder", index: int):
        self.builder, self.index = builder, index

    async def reset(self):
        return Observation([{"role": "user", "content": "Write a word."}])

    async def step(self, action):
        if self.index == 0:
            while self.builder.ended < self.builder.args.get("after", 0):
                await asyncio.sleep(0.01)
        ok = "e" in action["content"]
        return StepResult(reward=float(ok), done=True)

    async def close(self):
        if self.index != 0:
            self.builder.ended += 1


@register_env("test_straggler")
class StragglerBuilder(EnvBuilder):
    def __init__(self, args, seed=0):
        super().__init__(args, seed)
        self.ended = 0

    def make(self, split, index):
        return _Word(self, index)


def _config(model_dir, tmp_path, **over) -> TrainConfig:
    data = dict(model_name=model_dir, lora_rank=8, batch_size=2, max_steps=4, max_tokens=3, save_every=0,
                learning_rate=3e-3, log_path=str(tmp_path / "run"),
                local={"store_dir": str(tmp_path / "store")},
                seed=5, outputs={"report": False},
                environments={"word": {"type": "test_straggler", "num_rollouts": 2, "max_turns": 1}})
    data.update(over)
    return TrainConfig(**data)


def _trajectories(run_dir) -> list[list[dict]]:
    files = sorted((run_dir / "trajectories").glob("step_*.jsonl"))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def _groups(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """The step's groups by draw key: sampler step, dropped flag (all episodes of a group agree)."""
    out: dict[tuple[int, int], dict] = {}
    for r in rows:
        out.setdefault(tuple(r["drawn"]), {"sampler_step": r["sampler_step"], "group": r["group"],
                                           "stale": r["step"] - r["sampler_step"]})
    return out


@pytest.mark.parametrize("stale_groups", ["drop", "keep"])
def test_staleness_bound_holds_in_a_run_with_a_straggler(tiny_model_dir, tmp_path, stale_groups):
    """K = 1 on the real engine, with one group that ends only after 7 others did (the trainer is then
    past step 2): dropped, it is counted, logged as dropped and replaced, and no datum comes from a
    sampler more than one step old; kept, it is trained at its staleness. Either way every step trains
    batch_size groups and every group is drawn once."""
    envs = {"word": {"type": "test_straggler", "num_rollouts": 2, "max_turns": 1, "args": {"after": 14}}}
    steps = 7
    cfg = _config(tiny_model_dir, tmp_path, max_steps=steps,
                  off_policy={"max_steps": 1, "stale_groups": stale_groups}, environments=envs)
    train(cfg, ConsoleLog(enabled=False))
    rows = RunFiles(tmp_path / "run").metrics()
    assert [r["step"] for r in rows] == list(range(steps))
    trained, dropped = [], []
    for step, episodes in enumerate(_trajectories(tmp_path / "run")):
        assert {r["step"] for r in episodes} == {step}
        groups = _groups(episodes)
        live = {k: g for k, g in groups.items()
                if not any(r["dropped"] and tuple(r["drawn"]) == k and r["step"] - r["sampler_step"] > 1
                           for r in episodes)}
        stale = {k: g for k, g in groups.items() if k not in live}
        assert len(live) == cfg.batch_size, (step, groups)
        assert sorted(g["group"] for g in live.values()) == list(range(cfg.batch_size))
        order = sorted(live, key=lambda k: live[k]["group"])  # batch order: stalest first, then plan order
        assert order == sorted(live, key=lambda k: (live[k]["sampler_step"], k))
        assert rows[step]["async/stale_dropped"] == len(stale)
        assert rows[step]["async/staleness_max"] == max(g["stale"] for g in live.values())
        trained += [(k, g["stale"]) for k, g in live.items()]
        dropped += [(k, g["stale"]) for k, g in stale.items()]
    keys = [k for k, _ in trained] + [k for k, _ in dropped]
    assert len(set(keys)) == len(keys), "a group was drawn twice"
    if stale_groups == "drop":
        assert [k for k, _ in dropped] == [(0, 0)] and dropped[0][1] >= 2
        assert all(lag <= 1 for _, lag in trained), trained
    else:
        assert dropped == [] and max(lag for _, lag in trained) >= 2
        assert ((0, 0), max(lag for _, lag in trained)) in trained
    assert sorted(keys) == [(p, i) for p in range(steps + 1) for i in range(cfg.batch_size)][:len(keys)]


def test_streamed_minibatches_make_the_same_update_as_one_batch(tiny_model_dir, tmp_path):
    """K = 0: one forward_backward per group as it finishes, then one optim_step, gives the update
    of one forward_backward with the whole batch (same datums; gradients summed in another order)."""
    results = {}
    for name, stream in (("batch", None), ("stream", 1)):
        cfg = _config(tiny_model_dir, tmp_path / name, batch_size=4, max_steps=1,
                      off_policy={"stream_minibatches": stream},
                      optimizer={"eps": 1.0})  # large: the first Adam step is proportional to the gradient
        row = train(cfg, ConsoleLog(enabled=False))
        results[name] = (row, _trajectories(tmp_path / name / "run")[0],
                         _final_weights(tmp_path / name))
    (row_a, traj_a, w_a), (row_b, traj_b, w_b) = results["batch"], results["stream"]
    by_key = lambda rows: sorted((tuple(r["drawn"]), r["tokens"], r["advantages"])  # noqa: E731
                                 for r in rows)
    assert by_key(traj_a) == by_key(traj_b), "both sampled and weighed the same episodes"
    assert row_a["optim/datums"] == row_b["optim/datums"] > 0
    # the loss of group-normalized advantages is a sum of terms that cancel to ~0: its rounding under
    # another summation order is absolute, not relative to the near-zero total
    assert row_b["optim/loss"] == pytest.approx(row_a["optim/loss"], rel=1e-5, abs=1e-5)
    assert row_b["optim/grad_norm"] == pytest.approx(row_a["optim/grad_norm"], rel=1e-5)
    assert row_b["optim/kl_sample_train_v1"] == pytest.approx(row_a["optim/kl_sample_train_v1"], abs=1e-6)
    assert max(float(w_a[k].abs().max()) for k in w_a if "lora_B" in k) > 1e-5, "the step moved B off zero"
    assert all(torch.allclose(w_a[k], w_b[k], rtol=0, atol=1e-7) for k in w_a)


def _final_weights(root):
    from safetensors.torch import load_file

    from polyrl.local.checkpoints import Store

    row = RunFiles(root / "run").checkpoints()[-1]
    return load_file(Store(root / "store").resolve(row["state_path"])[1] / "adapter_model.safetensors")



def _run_cli(args, cwd, env=None):
    return subprocess.Popen([sys.executable, "-m", "polyrl.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_kill_and_resume_off_policy_repeats_no_step_and_trains_every_group_once(tiny_model_dir, tmp_path):
    """K = 1, SIGKILLed three times (before the first checkpoint, right after one, between two) with
    groups of the next step in flight each time: the relaunches run every step once, each with
    batch_size groups at most one step stale, and the groups trained (or dropped as stale) over the
    whole run are the first ones of the plan, each once: in-flight groups were drawn again."""
    envs = {"arithmetic": {"num_rollouts": 2}, "guess_number": {"num_rollouts": 2, "max_turns": 3}}
    steps = 8
    cfg = _config(tiny_model_dir, tmp_path, batch_size=3, max_steps=steps, save_every=2,
                  off_policy={"max_steps": 1}, environments=envs)
    (tmp_path / "run.yaml").write_text(json.dumps(cfg.model_dump()))
    run = tmp_path / "run"
    metrics, cps = run / "metrics.jsonl", run / "checkpoints.jsonl"
    kill_points = [
        lambda: metrics.exists() and metrics.read_text().count("\n") >= 1,
        lambda: cps.exists() and "000002" in cps.read_text(),
        lambda: metrics.exists() and '"step": 4,' in metrics.read_text(),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for reached in kill_points:
        proc = _run_cli(["train", "--config_path", "run.yaml"], tmp_path, env)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not reached() and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc = _run_cli(["train", "--config_path", "run.yaml"], tmp_path, env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]

    files = RunFiles(run)
    assert [r["step"] for r in files.metrics()] == list(range(steps))
    assert len(files.attempts()) == 1 + len(kill_points)
    assert all("draw_step" in row and "consumed" in row for row in files.checkpoints())
    trained, dropped = [], []
    for step, episodes in enumerate(_trajectories(run)):
        groups: dict[tuple[int, int], list[dict]] = {}
        for r in episodes:
            groups.setdefault(tuple(r["drawn"]), []).append(r)
        for key, rows in groups.items():
            lag = step - rows[0]["sampler_step"]
            stale = lag > 1
            assert not stale or all(r["dropped"] for r in rows)
            (dropped if stale else trained).append(key)
        assert len(groups) - sum(1 for k in groups if k in dropped) == cfg.batch_size
    keys = trained + dropped
    assert len(set(keys)) == len(keys), "a group was trained twice"
    assert sorted(keys) == [(p, i) for p in range(steps + 2) for i in range(cfg.batch_size)][:len(keys)]
    assert len(trained) == steps * cfg.batch_size


def test_off_policy_streamed_training_through_the_sdk_and_polyrl_serve(tiny_model_dir, tmp_path, monkeypatch):
    """The same loop on a remote service: the official SDK against ``polyrl serve``, sampling from the
    previous step's weights while the server trains, one forward_backward per finished group."""
    from test_serve import KEY, Served

    served = Served(tiny_model_dir, tmp_path / "serve-store")
    try:
        monkeypatch.setenv("TINKER_API_KEY", KEY)
        cfg = _config(tiny_model_dir, tmp_path, backend="tinker", base_url=served.url, local={}, max_steps=4,
                      save_every=2, off_policy={"max_steps": 1, "stream_minibatches": 1})
        train(cfg, ConsoleLog(enabled=False))
    finally:
        served.stop()
    files = RunFiles(tmp_path / "run")
    rows = files.metrics()
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["async/staleness_max"] == 0 and max(r["async/staleness_max"] for r in rows[1:]) == 1
    assert all(r["async/staleness_max"] <= 1 and r["async/stale_dropped"] == 0 for r in rows)
    assert sum(r["optim/datums"] for r in rows) > 0
    assert [c["name"] for c in files.checkpoints()] == ["000002", "final"]
    assert all(c["state_path"].startswith("tinker://") for c in files.checkpoints())
