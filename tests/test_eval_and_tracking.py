"""Evaluation (pass@k), `polyrl eval`, in-run evaluation and Weights & Biases logging."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from math import comb

import pytest

from polyrl.config.schema import TrainConfig
from polyrl.evaluate import pass_at_k
from polyrl.rl.train import train
from polyrl.tracking.console import ConsoleLog


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (4, 4, 2), (6, 1, 6)])
def test_pass_at_k_is_the_probability_a_random_k_subset_has_a_success(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_pass_at_k_needs_enough_samples():
    with pytest.raises(ValueError, match="pass@3"):
        pass_at_k(2, 1, 3)


def _config(model_dir, tmp_path, **over):
    data = dict(model_name=model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=4, save_every=0,
                log_path=str(tmp_path / "run"), local={"store_dir": str(tmp_path / "store")}, eval_every=1,
                eval_num_samples=3,
                environments={"arithmetic": {"num_rollouts": 2, "splits": {"test": {"num_samples": 3}}}})
    data.update(over)
    return TrainConfig(**data)


@pytest.mark.slow
def test_in_run_evaluation_and_polyrl_eval_cli(tiny_model_dir, tmp_path):
    cfg = _config(tiny_model_dir, tmp_path)
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert {"test/arithmetic/pass@1", "test/arithmetic/pass@3", "test/arithmetic/reward"} <= set(r)
        assert r["test/arithmetic/pass@1"] <= r["test/arithmetic/pass@3"] <= 1.0
    final = [json.loads(x) for x in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()][-1]
    (tmp_path / "run.json").write_text(json.dumps(cfg.model_dump()))
    out = subprocess.run([sys.executable, "-m", "polyrl.cli", "eval", "--config_path",
                          str(tmp_path / "run.json"), "--checkpoint", final["sampler_path"]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    printed = dict(line.split() for line in out.stdout.strip().splitlines())
    assert set(printed) >= {"test/arithmetic/pass@1", "test/arithmetic/pass@3", "test/pass@1"}
    assert 0.0 <= float(printed["test/arithmetic/pass@3"]) <= 1.0


@pytest.mark.slow
def test_wandb_offline_run_gets_the_metrics(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _config(tiny_model_dir, tmp_path, eval_every=0, wandb_project_name="polyrl-test",
                  wandb_run_name="t1")
    train(cfg, ConsoleLog(enabled=False))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    record_log = next(runs[0].glob("run-*.wandb"))  # written by wandb's own service process
    deadline = time.monotonic() + 30
    while b"env/arithmetic/reward/mean" not in record_log.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"env/arithmetic/reward/mean" in record_log.read_bytes()


@pytest.mark.slow
def test_wandb_resume_continues_the_same_run_after_a_relaunch(tiny_model_dir, tmp_path, monkeypatch):
    """A run stopped after its checkpoint and relaunched with more steps logs into the same W&B run
    (offline mode: each launch writes an offline-run-<time>-<id> directory; the ids agree), and its
    report names that run."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    common = dict(eval_every=0, save_every=1, wandb_project_name="polyrl-test", wandb_run_name="resume")
    run = tmp_path / "run"
    train(_config(tiny_model_dir, tmp_path, max_steps=1, **common), ConsoleLog(enabled=False))
    first = json.loads((run / "wandb.json").read_text())
    train(_config(tiny_model_dir, tmp_path, max_steps=2, **common), ConsoleLog(enabled=False))
    second = json.loads((run / "wandb.json").read_text())
    assert second["id"] == first["id"] and second["offline"] is True and second["url"] is None
    rows = (run / "checkpoints.jsonl").read_text().splitlines()
    checkpoint_ids = {json.loads(line)["wandb_run_id"] for line in rows}
    assert checkpoint_ids == {first["id"]}
    # one offline directory per launch: offline-run-<time>-<id>[-<n> when two start in the same second]
    launches = list((run / "wandb").glob("offline-run-*"))
    assert len(launches) == 2 and all(f"-{first['id']}" in path.name for path in launches)
    assert second["dir"] in map(str, launches) and first["dir"] != second["dir"]
    index = (run / "report" / "data" / "index.js").read_text()
    assert f'"id":"{first["id"]}"' in index


def test_wandb_files_land_under_the_run_directory_whatever_the_service_cwd(tmp_path, monkeypatch):
    """W&B's service process outlives a run and resolves a relative ``dir`` against its own working
    directory: a relative log_path must still put the W&B files under the run, not where the service
    happened to start."""
    pytest.importorskip("wandb")
    from polyrl.tracking.wandb_log import WandbLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    WandbLog("polyrl-test", "first", {}, "run").close()  # starts the service here
    monkeypatch.chdir(tmp_path / "second")
    second = WandbLog("polyrl-test", "second", {}, "run")
    print("a line of console output, which W&B's service copies to files/output.log")
    second.log({"reward": 1.0}, 0)
    second.close()
    assert list((tmp_path / "second" / "run").glob("wandb/offline-run-*"))
    assert len(list((tmp_path / "first" / "run").glob("wandb/offline-run-*"))) == 1
