"""Faults a long run meets: blocking and misbehaving environments, runs that stop learning, remote
services that are unreachable or die, kills between writes. Real subprocesses, real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scripted import ScriptedSampler

from polyrl.config.schema import TrainConfig
from polyrl.envs.base import Env, EnvBuilder, Observation, StepResult, register_env
from polyrl.renderers import get_renderer
from polyrl.rl.episode import Episode, RolloutSettings
from polyrl.rl.rollouts import run_group
from polyrl.rl.train import train
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- test environments
class _SleepyEnv:
    """A sync environment whose step blocks (like a simulator or a sync HTTP client)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def reset(self):
        return Observation([{"role": "user", "content": "Say anything."}])

    def step(self, action):
        time.sleep(self.seconds)
        return StepResult(reward=1.0, done=True)

    def close(self):
        return None


@register_env("faults_sleepy")
class SleepyBuilder(EnvBuilder):
    def make(self, split, index):
        return _SleepyEnv(self.args["seconds"])


class _RaisingEnv(Env):
    def __init__(self, exc: BaseException | None, sync: bool):
        self.exc, self.sync = exc, sync

    async def reset(self):
        return Observation([{"role": "user", "content": "Say anything."}])

    async def step(self, action):
        if self.exc is not None:
            raise self.exc
        return StepResult(reward=1.0, done=True)


class _SyncRaisingEnv(_RaisingEnv):
    def step(self, action):  # type: ignore[override]
        if self.exc is not None:
            raise self.exc
        return StepResult(reward=1.0, done=True)


class RaisingBuilder(EnvBuilder):
    """Episode 0 of every group raises ``args['exc']``, the others finish."""

    def __init__(self, args, seed=0):
        super().__init__(args, seed)
        self.calls = 0

    def make(self, split, index):
        self.calls += 1
        exc = self.args["exc"] if self.calls % 2 == 1 else None
        return (_SyncRaisingEnv if self.args.get("sync") else _RaisingEnv)(exc, self.args.get("sync", False))


class RaisingRolloutBuilder(EnvBuilder):
    """Drives its own rollouts, and raises from them."""

    def make(self, split, index):
        raise AssertionError("not used")

    async def rollout(self, ctx):
        raise self.args["exc"]


@register_env("faults_broken")
class BrokenBuilder(EnvBuilder):
    """Every episode fails: the environment's backend is gone."""

    def make(self, split, index):
        return _BrokenEnv()


class _BrokenEnv(Env):
    async def reset(self):
        raise ConnectionError("environment backend unreachable")

    async def step(self, action):
        raise AssertionError("not reached")


def _settings(**kw) -> RolloutSettings:
    return RolloutSettings(**{"max_turns": 2, "max_tokens": 8, "temperature": 1.0, "timeout": 30, **kw})


def _policy(tokenizer, n: int = 64) -> tuple:
    renderer = get_renderer("qwen3", tokenizer)
    return renderer, ScriptedSampler(renderer, [{"role": "assistant", "content": "hi"}] * n)


def _config(model_dir, tmp_path, **over) -> TrainConfig:
    """A small run; ``over`` replaces top-level settings and is merged into the sub-models it names."""
    data = dict(model_name=model_dir, lora_rank=4, batch_size=2, max_steps=4, max_tokens=4, save_every=2,
                learning_rate=1e-3, log_path=str(tmp_path / "run"),
                local={"store_dir": str(tmp_path / "store")},
                seed=3, outputs={"report": False},
                limits={"max_no_update_frac": 1.0},  # a tiny random model rarely earns a reward
                environments={"arithmetic": {"num_rollouts": 2, "max_turns": 1}})
    for key, value in over.items():
        section = key in ("local", "outputs", "limits")
        data[key] = {**data[key], **value} if section and isinstance(data.get(key), dict) else value
    return TrainConfig(**data)


def _cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "polyrl.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _write_config(cfg: TrainConfig, path: Path) -> Path:
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_error_line(err: str) -> str:
    """The last stderr line, after checking that it is the only error and that no traceback came."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), err[-3000:]
    assert sum(line.startswith("error: ") for line in lines) == 1, err[-3000:]
    return lines[-1]


# ---------------------------------------------------------------------------- environments
def test_sync_environments_run_off_the_event_loop(tokenizer):
    """A blocking step stalls only its own episode: the episode timeout fires, and blocking steps of
    concurrent episodes overlap."""
    renderer, policy = _policy(tokenizer)
    eps = [Episode("sleepy", "train", 0, 0) for _ in range(4)]
    start = time.monotonic()
    out = asyncio.run(run_group(SleepyBuilder({"seconds": 3.0}), eps, renderer, policy,
                                _settings(timeout=0.5), [None] * 4))
    assert time.monotonic() - start < 2.5
    assert all(ep.error and "timeout" in ep.error for ep in out), [ep.error for ep in out]

    eps = [Episode("sleepy", "train", 0, 0) for _ in range(8)]
    start = time.monotonic()
    out = asyncio.run(run_group(SleepyBuilder({"seconds": 0.4}), eps, renderer, policy, _settings(),
                                [None] * 8))
    assert all(ep.error is None and ep.reward == 1.0 for ep in out)
    assert time.monotonic() - start < 1.6, "8 blocking steps of 0.4 s ran one after the other"


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), asyncio.CancelledError()],
                         ids=lambda e: type(e).__name__)
def test_environment_raising_exit_interrupt_or_cancel_is_a_failing_rollout(tokenizer, exc):
    renderer, policy = _policy(tokenizer)
    for builder in (RaisingBuilder({"exc": exc}), RaisingBuilder({"exc": exc, "sync": True})):
        eps = [Episode("raising", "train", 0, 0) for _ in range(2)]
        out = asyncio.run(run_group(builder, eps, renderer, policy, _settings(), [None, None]))
        assert type(exc).__name__ in (out[0].error or ""), out[0].error
        assert out[1].error is None and out[1].reward == 1.0
    eps = [Episode("raising", "train", 0, 0)]
    out = asyncio.run(run_group(RaisingRolloutBuilder({"exc": exc}), eps, renderer, policy, _settings(),
                                [None]))
    assert type(exc).__name__ in (out[0].error or "")


def test_ctrl_c_still_stops_the_trainer(tiny_model_dir, tmp_path):
    """While a sync environment blocks in its step, SIGINT ends the run promptly (exit 130)."""
    started = tmp_path / "started"
    (tmp_path / "blocking_env.py").write_text(
        "import pathlib, time\n"
        "class Env:\n"
        "    def initial_observation(self):\n"
        "        return 'Say anything.'\n"
        "    def step(self, text):\n"
        f"        pathlib.Path({str(started)!r}).touch()\n"
        "        time.sleep(120)\n"
        "        return 1.0\n"
        "def load_environment(**args):\n"
        "    return Env()\n")
    cfg = _config(tiny_model_dir, tmp_path,
                  environments={"blocking": {"type": f"module:{tmp_path / 'blocking_env.py'}",
                                             "num_rollouts": 2}})
    proc = _cli(["train", "--config_path", str(_write_config(cfg, tmp_path / "run.json"))], tmp_path)
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert started.exists(), proc.communicate()[1][-3000:]
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the trainer ignored Ctrl-C")
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err


def test_ctrl_c_while_the_engine_works_exits_130_every_time(tiny_model_dir, tmp_path):
    """SIGINT while the engine's worker is busy sampling and training: `interrupted` and exit 130, each
    time (the worker is stopped before the interpreter shuts down, so no C++ code of it is left running
    to abort the process)."""
    envs = {"arithmetic": {"num_rollouts": 4}, "guess_number": {"num_rollouts": 2, "max_turns": 3}}
    cfg = _config(tiny_model_dir, tmp_path, max_steps=500, save_every=0, batch_size=4, environments=envs)
    config = _write_config(cfg, tmp_path / "run.json")
    metrics = tmp_path / "run" / "metrics.jsonl"
    for attempt in range(4):
        if metrics.exists():
            metrics.unlink()
        proc = _cli(["train", "--config_path", str(config)], tmp_path)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not (metrics.exists()
                                                                             and metrics.read_text()):
            time.sleep(0.02)
        assert proc.poll() is None and metrics.exists(), proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the trainer ignored Ctrl-C")
        assert proc.returncode == 130, (attempt, proc.returncode, err[-3000:])
        assert "terminate called" not in err and "Traceback" not in err, err[-3000:]
        assert err.rstrip().endswith("interrupted"), err[-3000:]


# ---------------------------------------------------------------------------- runs that stop learning
def test_run_stops_when_too_many_steps_make_no_update(tiny_model_dir, tmp_path):
    from polyrl.errors import RunStoppedError

    cfg = _config(tiny_model_dir, tmp_path, max_steps=30, limits={"max_no_update_frac": 0.5},
                  environments={"broken": {"type": "faults_broken", "num_rollouts": 2}})
    with pytest.raises(RunStoppedError) as info:
        train(cfg, ConsoleLog(enabled=False))
    message = str(info.value)
    assert ("\n" not in message and "no update" in message
            and "environment backend unreachable" in message), message
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and all(r["optim/datums"] == 0 for r in rows)  # judged once 10 steps ran


# ---------------------------------------------------------------- absurd numbers, huge observations
ABSURD_ENV = """
import itertools

_made = itertools.count()


class Env:
    \"\"\"Every group rewards its first episode and not its second. Tasks 2 and 3 (the second step, when
    unshuffled) give that first episode ``reward`` instead of 1.\"\"\"

    def __init__(self, reward):
        self.reward = (reward, 1.0) if next(_made) % 2 == 0 else (0.0, 0.0)

    def initial_observation(self, index=0):
        self.index = index
        return "Say anything."

    def step(self, text):
        return self.reward[0] if self.index in (2, 3) else self.reward[1]


def load_environment(reward):
    return Env(reward)
"""


def _absurd_config(model_dir, tmp_path, reward: float, **over) -> TrainConfig:
    (tmp_path / "absurd_env.py").write_text(ABSURD_ENV)
    env = {"type": f"module:{tmp_path / 'absurd_env.py'}", "num_rollouts": 2, "max_turns": 1,
           "args": {"reward": reward}, "splits": {"train": {"shuffle": False}, "test": None}}
    return _config(model_dir, tmp_path, **{"max_steps": 3, "save_every": 1, "max_tokens": 8,
                                           "environments": {"absurd": env}, **over})


def _adapters(store_dir) -> dict[str, dict]:
    """Every adapter the store holds (state and sampler weights), by checkpoint directory."""
    from safetensors.torch import load_file

    return {str(f.parent.relative_to(store_dir)): load_file(f)
            for f in Path(store_dir).rglob("adapter_model.safetensors")}


def _nonfinite(adapters: dict[str, dict]) -> list[str]:
    return [name for name, tensors in adapters.items()
            if not all(bool(t.isfinite().all()) for t in tensors.values())]


class _StepRewards(Env):
    """Two turns whose step rewards cancel out: +1e308, then -1e308."""

    def __init__(self):
        self.turn = 0

    async def reset(self):
        return Observation([{"role": "user", "content": "Say anything."}])

    async def step(self, action):
        self.turn += 1
        return StepResult(reward=1e308 if self.turn == 1 else -1e308, done=self.turn == 2,
                          messages=[{"role": "user", "content": "again"}])


class _OneEnv(EnvBuilder):
    def make(self, split, index):
        return self.args["env"]()


def test_absurd_reward_fails_its_episode_with_a_warning(tiny_model_dir, tmp_path, tokenizer):
    """A reward past max_abs_reward (1e6 by default) fails its episode, counted against the failure budget
    and warned about; nothing non-finite reaches the weights."""
    from test_train import RecordingConsole

    cfg = _absurd_config(tiny_model_dir, tmp_path, 1e308)
    console = RecordingConsole()
    train(cfg, console)
    rows = RunFiles(cfg.log_path).metrics()
    assert [r["rollouts/failed"] for r in rows] == [0.0, 2.0, 0.0]
    assert any(line.startswith("warning: step 1: 2 episode(s) failed") and
               "RewardOutOfBounds: reward 1e+308 is past max_abs_reward=1e+06" in line
               for line in console.lines), console.lines
    episodes = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "step_000001.jsonl").open()]
    assert [ep["error"] for ep in episodes if ep["error"]] == ["RewardOutOfBounds: reward 1e+308 is past "
                                                                "max_abs_reward=1e+06"] * 2
    adapters = _adapters(cfg.local.store_dir)
    assert len(adapters) == 6 and not _nonfinite(adapters)

    # step rewards are bounded too, even when they add up to an ordinary reward
    renderer, policy = _policy(tokenizer)
    out = asyncio.run(run_group(_OneEnv({"env": _StepRewards}), [Episode("x", "train", 0, 0)], renderer,
                                policy, _settings(), [None]))
    assert out[0].error == "RewardOutOfBounds: step reward 1e+308 is past max_abs_reward=1e+06", out[0].error


def test_nonfinite_update_stops_with_one_line_and_no_nan_checkpoint(tiny_model_dir, tmp_path):
    """With the reward bound set absurdly high, a 1e300 reward gets through: its advantages cannot be
    float32. The trainer applies no optimizer step and stops with one line naming the last checkpoint;
    no checkpoint with non-finite weights is ever written."""
    cfg = _absurd_config(tiny_model_dir, tmp_path, 1e300, limits={"max_abs_reward": 1e300})
    proc = _cli(["train", "--config_path", str(_write_config(cfg, tmp_path / "run.json"))], tmp_path)
    _, err = proc.communicate(timeout=300)
    line = _one_error_line(err)
    rows = RunFiles(cfg.log_path).checkpoints()
    assert proc.returncode == 1 and [r["name"] for r in rows] == ["000001"], err[-3000:]
    assert "step 1: the update is not finite" in line and "no optimizer step was applied" in line, line
    assert f"last checkpoint: {rows[0]['state_path']}" in line, line
    adapters = _adapters(cfg.local.store_dir)
    assert len(adapters) == 2 and not _nonfinite(adapters)


def test_nonfinite_loss_is_skipped_when_asked(tiny_model_dir, tmp_path):
    """Advantages of 1.5e38 fit float32, but the loss they make does not: the trainer sees the loss is not
    finite before optim_step. With nonfinite_steps: skip the step is counted and leaves the weights as
    they were (its gradients discarded); the next step trains as usual."""
    from test_train import RecordingConsole

    cfg = _absurd_config(tiny_model_dir, tmp_path, 3e38,
                         limits={"max_abs_reward": 1e39, "nonfinite_steps": "skip"})
    console = RecordingConsole()
    train(cfg, console)
    rows = RunFiles(cfg.log_path).metrics()
    assert [r.get("optim/nonfinite_skipped", 0.0) for r in rows] == [0.0, 1.0, 0.0]
    assert any("step 1: the update is not finite (the forward_backward loss is" in line and "skipped" in line
               for line in console.lines), console.lines
    states = {Path(name).name: tensors for name, tensors in _adapters(cfg.local.store_dir).items()
              if "/weights/" in name}
    assert sorted(states) == ["000001", "000002", "final"] and not _nonfinite(states)
    for key, before in states["000001"].items():
        assert bool((states["000002"][key] == before).all()), key  # the skipped step changed nothing
    assert any(not bool((states["final"][k] == v).all()) for k, v in states["000002"].items())


def test_engine_refusing_an_optimizer_step(tiny_model_dir, tmp_path, monkeypatch):
    """An engine that refuses a non-finite optimizer step (NonFiniteUpdateError from optim_step, which
    polyrl serve reports as a failed request starting 'optim_step refused') stops the run with one line,
    or is skipped and counted by option."""
    import tinker
    from tinker.types import RequestErrorCategory

    from polyrl.backend import update_refused
    from polyrl.errors import NonFiniteUpdateError, RunStoppedError
    from polyrl.local.engine import Engine

    served = tinker.RequestFailedError("Request failed: optim_step refused: the gradient norm is nan for "
                                       "self.request_id='r1'", "r1", RequestErrorCategory.User)
    assert update_refused(served) and update_refused(NonFiniteUpdateError("optim_step refused: loss is inf"))
    assert not update_refused(ValueError("adam_params.learning_rate must be a finite number >= 0"))

    real = Engine.optim_step

    def refuse_the_second(self, st, params):  # the engine's refusal, as the local engine raises it
        if st.steps == 1:
            raise NonFiniteUpdateError("optim_step refused: the gradient norm is nan; "
                                       "the weights are unchanged")
        return real(self, st, params)

    monkeypatch.setattr(Engine, "optim_step", refuse_the_second)
    cfg = _absurd_config(tiny_model_dir, tmp_path, 1.0, max_steps=2, save_every=0)
    with pytest.raises(RunStoppedError, match=r"step 1: the update is not finite \(optim_step refused: the "
                                              r"gradient norm is nan.*; no checkpoint saved yet"):
        train(cfg, ConsoleLog(enabled=False))
    (tmp_path / "skip").mkdir()
    cfg = _absurd_config(tiny_model_dir, tmp_path / "skip", 1.0, max_steps=3, save_every=0,
                         limits={"nonfinite_steps": "skip"})
    train(cfg, ConsoleLog(enabled=False))
    assert [r.get("optim/nonfinite_skipped", 0.0)
            for r in RunFiles(cfg.log_path).metrics()] == [0.0, 1.0, 1.0]


class _Talkative(Env):
    """Answers with ``size`` characters, at the start or after the first turn."""

    def __init__(self, size: int, first: bool):
        self.size, self.first = size, first

    async def reset(self):
        return Observation([{"role": "user",
                             "content": "x " * (self.size // 2) if self.first else "Say anything."}])

    async def step(self, action):
        return StepResult(reward=1.0, done=False,
                          messages=[{"role": "user", "content": "y " * (self.size // 2)}])


def test_huge_observation_fails_its_episode_before_it_is_tokenized(tiny_model_dir, tmp_path, tokenizer,
                                                                   monkeypatch):
    """An observation past max_observation_bytes fails its episode before any of it is tokenized; one
    that renders past max_observation_tokens fails too; both are counted against the failure budget."""
    renderer, policy = _policy(tokenizer)
    encoded: list[int] = []
    real_encode = type(renderer).encode
    monkeypatch.setattr(type(renderer), "encode",
                        lambda self, text: encoded.append(len(text)) or real_encode(self, text))

    out = asyncio.run(run_group(_OneEnv({"env": lambda: _Talkative(2_000_000, first=True)}),
                                [Episode("x", "train", 0, 0)], renderer, policy, _settings(), [None]))
    assert out[0].error == ("ObservationTooLarge: the observation holds more than 1,048,576 bytes "
                            "(max_observation_bytes)"), out[0].error
    assert max(encoded, default=0) < 1_000_000 and out[0].messages == []  # neither tokenized nor kept
    out = asyncio.run(run_group(_OneEnv({"env": lambda: _Talkative(2_000, first=False)}),
                                [Episode("x", "train", 0, 0)], renderer, policy,
                                _settings(max_observation_tokens=500), [None]))
    assert out[0].error and out[0].error.startswith("ObservationTooLarge: the observation renders to "), \
        out[0].error
    assert "more than max_observation_tokens=500" in out[0].error

    # in a run: the configured bound applies, the episodes are counted and warned about
    from test_train import RecordingConsole

    register_env("faults_talkative")(type("Talkative", (EnvBuilder,), {"make": lambda self, split, index:
                                                                       _Talkative(5_000, first=True)}))
    cfg = _config(tiny_model_dir, tmp_path, max_steps=1, limits={"max_observation_bytes": 4_000},
                  environments={"talkative": {"type": "faults_talkative", "num_rollouts": 2}})
    console = RecordingConsole()
    train(cfg, console)
    assert RunFiles(cfg.log_path).metrics()[0]["rollouts/failed"] == 4.0
    assert any("step 0: 4 episode(s) failed" in line and "max_observation_bytes" in line
               for line in console.lines)


# ---------------------------------------------------------------------------- remote services
class _Health:
    """A real HTTP health endpoint on a fixed port that can go away and come back."""

    def __init__(self, port: int):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"status": "ok"}')

            def log_message(self, *args):
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_service_guard_rides_out_a_short_outage_and_stops_after_a_long_one():
    from polyrl.backend import ServiceGuard
    from polyrl.errors import RunStoppedError

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    warnings: list[str] = []
    restarted: list[_Health] = []

    async def short_outage() -> str:
        _Health(port).stop()  # gone when the operation starts...
        guard = ServiceGuard(url, timeout=3, warn=warnings.append)

        async def come_back() -> None:
            await asyncio.sleep(0.5)  # ...and back well within the bound
            restarted.append(_Health(port))

        async def slow_operation() -> str:
            await asyncio.sleep(2.5)
            return "done"

        back = asyncio.create_task(come_back())
        result = await guard.watch("a slow operation", slow_operation())
        await back
        return result

    assert asyncio.run(short_outage()) == "done"
    restarted[0].stop()
    assert (any("does not answer" in w for w in warnings)
            and any("answers again" in w for w in warnings)), warnings

    async def long_outage() -> None:
        guard = ServiceGuard(f"http://127.0.0.1:{_free_port()}", timeout=1)
        await guard.watch("waiting forever", asyncio.sleep(3600))

    start = time.monotonic()
    with pytest.raises(RunStoppedError, match=r"did not answer for 1s .* while waiting forever"):
        asyncio.run(long_outage())
    assert time.monotonic() - start < 5


def test_service_guard_builds_its_probes_tls_context_once(monkeypatch):
    """Every watched phase probes the service with a fresh HTTP client; the TLS context (~45 ms of CPU to
    build) is made once per guard, not once per phase."""
    import httpx

    from polyrl.backend import ServiceGuard

    made = []
    real = httpx.create_ssl_context
    monkeypatch.setattr(httpx, "create_ssl_context", lambda *a, **k: made.append(1) or real(*a, **k))
    health = _Health(_free_port())
    try:
        guard = ServiceGuard(f"http://127.0.0.1:{health.server.server_address[1]}", timeout=10)

        async def phases() -> list[int]:
            return [await guard.watch(f"phase {k}", asyncio.sleep(0.05, result=k)) for k in range(4)]

        assert asyncio.run(phases()) == [0, 1, 2, 3]
    finally:
        health.stop()
    assert len(made) == 1


def test_service_lost_is_told_from_other_failures():
    """Only a 404 for the run's own session, model, sampler or pending request (as the SDK reports it:
    often a ValueError raised from the 404) means the service lost the run; a missing checkpoint or
    any other failure does not."""
    import httpx
    import tinker

    from polyrl.backend import ServiceGuard, service_lost

    def not_found(endpoint: str, error: str) -> tinker.NotFoundError:
        request = httpx.Request("POST", f"http://127.0.0.1:1/api/v1/{endpoint}")
        return tinker.NotFoundError("Error code: 404", response=httpx.Response(404, request=request),
                                    body={"error": error})

    def raised_from(cause: BaseException) -> ValueError:
        try:
            raise ValueError(f"Error retrieving result: {cause} with status 404") from cause
        except ValueError as exc:
            return exc

    lost = raised_from(not_found("retrieve_future", "unknown or expired request_id 'abc'"))
    assert service_lost(lost) == "retrieve_future: 404 unknown or expired request_id 'abc'"
    assert service_lost(not_found("forward_backward", "unknown model_id 'm'")) == \
        "forward_backward: 404 unknown model_id 'm'"
    assert service_lost(not_found("load_weights", "checkpoint tinker://x/weights/1 not found")) is None
    assert service_lost(ValueError("something else")) is None

    async def failing(exc: BaseException) -> None:
        raise exc

    from polyrl.errors import RunStoppedError, ServiceLostError

    guard = ServiceGuard("http://127.0.0.1:1", timeout=30)
    with pytest.raises(ServiceLostError, match=r"lost this run's session or requests while training "
                                               r"step 3 \(retrieve_future: 404 unknown or expired "
                                               r"request_id 'abc'\)"):
        asyncio.run(guard.watch("training step 3", failing(lost)))
    other = raised_from(not_found("load_weights", "checkpoint not found"))
    with pytest.raises(RunStoppedError, match="failed while resuming: ValueError") as info:
        asyncio.run(guard.watch("resuming", failing(other)))
    assert not isinstance(info.value, ServiceLostError)

    # requests abandoned when the run reopened end with that 404 on a loop nobody reads: asyncio reports
    # them as "never retrieved"; those reports are dropped, any other unretrieved failure is not
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    async def abandon(*excs: BaseException) -> None:
        for exc in excs:
            asyncio.get_running_loop().create_task(failing(exc))
        await asyncio.sleep(0.01)

    import gc

    records = Records()
    logging.getLogger("asyncio").addHandler(records)
    try:
        asyncio.run(abandon(not_found("asample", "unknown sampling_session_id 's:sample:2'"),
                            ValueError("other")))
        gc.collect()
    finally:
        logging.getLogger("asyncio").removeHandler(records)
    unretrieved = [m for m in records.messages if "never retrieved" in m]
    assert len(unretrieved) == 1 and "ValueError('other')" in unretrieved[0], records.messages


def test_unreachable_tinker_service_stops_with_one_line(tiny_model_dir, tmp_path):
    port = _free_port()
    cfg = _config(tiny_model_dir, tmp_path, backend="tinker", base_url=f"http://127.0.0.1:{port}",
                  local={"store_dir": None}, limits={"service_timeout": 2})
    start = time.monotonic()
    proc = _cli(["train", "--config_path", str(_write_config(cfg, tmp_path / "run.json"))], tmp_path,
                {"TINKER_API_KEY": "tml-faults-test"})
    _, err = proc.communicate(timeout=120)
    line = _one_error_line(err)
    assert proc.returncode == 1
    assert f"http://127.0.0.1:{port}" in line and "no checkpoint" in line, line
    assert time.monotonic() - start < 60


def test_malformed_tinker_api_key_is_one_line_exit_2(tiny_model_dir, tmp_path):
    cfg = _config(tiny_model_dir, tmp_path, backend="tinker", base_url="http://127.0.0.1:9",
                  local={"store_dir": None})
    proc = _cli(["train", "--config_path", str(_write_config(cfg, tmp_path / "run.json"))], tmp_path,
                {"TINKER_API_KEY": "sk-not-a-tinker-key-4711"})
    _, err = proc.communicate(timeout=120)
    line = _one_error_line(err)
    assert proc.returncode == 2 and "TINKER_API_KEY" in line and "tml-" in line, line
    assert "4711" not in err  # the key itself is never printed


@pytest.mark.slow
def test_unreachable_openreward_environment_stops_with_one_line(tiny_model_dir, tmp_path):
    pytest.importorskip("openreward")
    port = _free_port()
    cfg = _config(tiny_model_dir, tmp_path, environments={
        "remote": {"type": "openreward:Polyrl/LetterQuest",
                   "args": {"base_url": f"http://127.0.0.1:{port}"}}})
    proc = _cli(["train", "--config_path", str(_write_config(cfg, tmp_path / "run.json"))], tmp_path,
                {"OPENREWARD_API_KEY": "or-faults-test"})
    _, err = proc.communicate(timeout=180)
    line = _one_error_line(err)
    assert proc.returncode == 1 and "OpenReward" in line and f"127.0.0.1:{port}" in line, line


@pytest.mark.slow
def test_trainer_stops_with_one_line_when_polyrl_serve_dies(tiny_model_dir, tmp_path):
    from test_serve import KEY, Served

    served = Served(tiny_model_dir, tmp_path / "serve-store")
    try:
        cfg = _config(tiny_model_dir, tmp_path, backend="tinker", base_url=served.url,
                      local={"store_dir": None}, max_steps=500, save_every=1, limits={"service_timeout": 3})
        proc = _cli(["train", "--config_path", str(_write_config(cfg, tmp_path / "run.json"))], tmp_path,
                    {"TINKER_API_KEY": KEY})
        files = RunFiles(tmp_path / "run")
        deadline = time.monotonic() + 180
        while not files.checkpoints() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert files.checkpoints(), proc.communicate()[1][-3000:]
    finally:
        served.proc.kill()
        served.proc.wait()
    killed_at = time.monotonic()
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the trainer hangs after its service died")
    line = _one_error_line(err)
    assert proc.returncode == 1 and served.url in line, line
    assert files.last_resumable()["state_path"] in line, line
    assert time.monotonic() - killed_at < 60


def _restart_serve_mid_run(model_dir, tmp_path, **over) -> tuple[subprocess.Popen, RunFiles, list]:
    """``polyrl train`` against a ``polyrl serve`` on a fixed port that is SIGKILLed once the run saved a
    checkpoint and started again on the same port and store: the service loses the run's session,
    models, samplers and pending requests. Returns the trainer, its files and the servers to stop."""
    from test_serve import KEY, Served

    port, store = _free_port(), tmp_path / "serve-store"
    servers = [Served(model_dir, store, "--port", str(port))]
    try:
        limits = {"service_timeout": 120, **over.pop("limits", {})}
        cfg = _config(model_dir, tmp_path, backend="tinker", base_url=servers[0].url,
                      local={"store_dir": None}, save_every=2, limits=limits, **over)
        proc = _cli(["train", "--config_path", str(_write_config(cfg, tmp_path / "run.json"))], tmp_path,
                    {"TINKER_API_KEY": KEY})
        files = RunFiles(tmp_path / "run")
        deadline = time.monotonic() + 180
        while not files.checkpoints() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        servers[0].proc.kill()
        servers[0].proc.wait()
        if not files.checkpoints():
            proc.kill()
            pytest.fail(f"no checkpoint before the restart: {proc.communicate()[1][-3000:]}")
        servers.append(Served(model_dir, store, "--port", str(port)))
    except BaseException:
        for served in servers:
            served.stop()
        raise
    return proc, files, servers


@pytest.mark.slow
def test_trainer_recovers_when_polyrl_serve_restarts(tiny_model_dir, tmp_path):
    """The restarted service knows nothing of the run: the trainer reopens it from its last checkpoint in
    the same process, with a warning, and finishes its steps, each logged exactly once."""
    proc, files, servers = _restart_serve_mid_run(tiny_model_dir, tmp_path, max_steps=30)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        for served in servers:
            served.stop()
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert [r["step"] for r in files.metrics()] == list(range(30))
    recoveries = [line for line in err.splitlines() if "reopening the run from its last checkpoint" in line]
    assert len(recoveries) == 1 and "lost this run's session" in recoveries[0], err[-3000:]
    assert ("(recovery 1 of 3)" in recoveries[0]
            and not any(line.startswith("error:") for line in err.splitlines()))
    assert files.checkpoints()[-1]["name"] == "final"


@pytest.mark.slow
def test_trainer_stops_with_one_line_past_its_recoveries(tiny_model_dir, tmp_path):
    proc, files, servers = _restart_serve_mid_run(tiny_model_dir, tmp_path, max_steps=500,
                                                  limits={"max_service_recoveries": 0})
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        for served in servers:
            served.stop()
    line = _one_error_line(err)
    assert proc.returncode == 1 and "lost this run's session" in line, line
    assert "reopened 0 times already (max_service_recoveries=0)" in line, line
    assert files.last_resumable()["state_path"] in line, line


# ---------------------------------------------------------------------------- kills between writes
def test_relaunch_removes_checkpoints_a_killed_attempt_never_logged(tiny_model_dir, tmp_path, monkeypatch):
    """A kill between saving a checkpoint and logging its row leaves it in the store, where no row
    refers to it: the relaunch removes it (and says so)."""
    from test_train import RecordingConsole, SimulatedCrash

    from polyrl.local.checkpoints import Store

    cfg = _config(tiny_model_dir, tmp_path, max_steps=4, save_every=2)
    real_log = RunFiles.log_checkpoint

    def killed_at_second_row(self, row):
        if self.checkpoints():
            raise SimulatedCrash("killed between saving and logging a checkpoint")
        real_log(self, row)

    monkeypatch.setattr(RunFiles, "log_checkpoint", killed_at_second_row)
    with pytest.raises(SimulatedCrash):
        train(cfg, ConsoleLog(enabled=False))
    monkeypatch.undo()
    store = Store(cfg.local.store_dir)
    unlogged = [c["tinker_path"] for run in store.runs() for c in store.list(run)
                if c["tinker_path"].endswith("/final")]
    assert len(unlogged) == 2  # the killed attempt's state and sampler weights of step 4

    console = RecordingConsole()
    train(cfg, console)
    rows = RunFiles(cfg.log_path).checkpoints()
    logged = {r[k] for r in rows for k in ("state_path", "sampler_path")}
    in_store = {c["tinker_path"] for run in store.runs() for c in store.list(run)}
    assert in_store == logged and not set(unlogged) & in_store
    assert any("removed 2" in line for line in console.lines), console.lines

    # without a row to resume from (checkpoints.jsonl deleted), earlier checkpoints are reported, not deleted
    (tmp_path / "run" / "checkpoints.jsonl").unlink()
    console = RecordingConsole()
    train(cfg, console)
    assert in_store <= {c["tinker_path"] for run in store.runs() for c in store.list(run)}
    assert any(line.startswith("warning:") and "stay in the store" in line
               for line in console.lines), console.lines


# ---------------------------------------------------------------------------- a full disk
def _limit_file_size(limit: int):
    """For a child process: files may grow to ``limit`` bytes; a write past it fails with EFBIG
    ("File too large"), as one on a full disk fails with ENOSPC."""
    import resource

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process dying
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_checkpoint_the_disk_refuses_stops_the_run_with_one_line(tiny_model_dir, tmp_path):
    """The first checkpoint's adapter file is larger than the file system lets the process write:
    `polyrl train` exits 1 with one line naming the checkpoint and the disk problem (no traceback),
    and leaves nothing half-written in the store."""
    cfg = _config(tiny_model_dir, tmp_path, lora_rank=8, max_steps=2, save_every=2)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "polyrl.cli", "train", "--config_path",
                           str(_write_config(cfg, tmp_path / "run.json"))], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size(32_000))
    line = _one_error_line(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "could not write checkpoint tinker://" in line and "/weights/final" in line, line
    assert "File too large" in line and "no checkpoint saved yet" in line, line
    assert not list((tmp_path / "store").rglob("*"))  # not even the run's directory


def test_a_full_disk_at_a_later_checkpoint_names_the_last_good_one(tiny_model_dir, tmp_path, monkeypatch):
    """The disk fills while the second checkpoint is written: the run stops with one line naming that
    checkpoint, the disk problem and the last checkpoint saved; the store keeps only whole checkpoints,
    and the relaunch resumes from the last one."""
    import errno
    from pathlib import Path as _Path

    from polyrl.errors import RunStoppedError
    from polyrl.local.checkpoints import Store

    cfg = _config(tiny_model_dir, tmp_path, max_steps=4, save_every=2)
    real_write = _Path.write_bytes

    def full_disk(self, data):
        if self.parent.name.startswith(".tmp-new-") and self.parent.name.endswith("-final"):
            real_write(self, data[: len(data) // 2])  # part of it reached the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(_Path, "write_bytes", full_disk)
    with pytest.raises(RunStoppedError) as caught:
        train(cfg, ConsoleLog(enabled=False))
    monkeypatch.undo()
    message = str(caught.value)
    saved = RunFiles(cfg.log_path).checkpoints()
    assert [r["name"] for r in saved] == ["000002"]
    assert "\n" not in message and "could not write checkpoint tinker://" in message, message
    assert "/weights/final" in message and "No space left on device" in message, message
    assert f"last checkpoint: {saved[0]['state_path']}" in message, message
    store = Store(cfg.local.store_dir)
    assert not [p for p in store.root.rglob(".tmp*")]
    assert {c["tinker_path"] for run in store.runs() for c in store.list(run)} == \
        {saved[0]["state_path"], saved[0]["sampler_path"]}
    train(cfg, ConsoleLog(enabled=False))
    assert [r["name"] for r in RunFiles(cfg.log_path).checkpoints()] == ["000002", "final"]
