"""Other harnesses' run descriptions through ``polyrl train``: a Minds RL TOML config (translated,
printed with ``--print-config``, run, ``metrics.json`` written as that harness wrote it) and GEM's
trainer command line (``env_id=... use_rebn=true``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MINDS = ROOT / "tests" / "fixtures" / "minds"


def polyrl(*args: str, cwd: Path, env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if "TINKER" not in k}
    environ.update(PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "polyrl.cli", *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=timeout)


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``polyrl ARGS`` in this process (quicker than a subprocess for what exits before training);
    the environment (which a translation may set TINKER_API_KEY in) is restored afterwards."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from polyrl.cli import main

    saved = dict(os.environ)
    for key in [k for k in os.environ if "TINKER" in k]:
        del os.environ[key]
    os.environ.update(env or {})
    out, err, code = StringIO(), StringIO(), 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if isinstance(exc.code, str):
            err.write(exc.code + "\n")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture
def minds_repo(tmp_path, monkeypatch) -> Path:
    """A checkout laid out like Minds RL's: configs/train.toml and environments/my_task/ (the cwd)."""
    shutil.copytree(MINDS, tmp_path / "minds")
    monkeypatch.chdir(tmp_path / "minds")
    return tmp_path / "minds"


# ---------------------------------------------------------------------------- Minds RL
def test_minds_config_is_translated_and_printed(minds_repo):
    out = run_cli("train", "--config_path", "configs/train.toml", "--print-config")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# translated from Minds RL config configs/train.toml\n")
    assert "# note: [trainer] kl_beta = 0.1 is not used" in out.stdout
    assert ("# note: no Tinker API key (MINDS_TEST_TINKER_KEY is not set): training on polyrl's local engine"
            in out.stdout)
    config = yaml.safe_load(out.stdout)
    env = config["environments"]["my_task"]
    assert env["type"] == "module:./environments/my_task" and env["args"] == {"word": "b"}
    assert env["num_rollouts"] == 4
    assert (config["model_name"], config["loss_fn"], config["max_tokens"]) == ("Qwen/Qwen3-30B-A3B",
                                                                               "importance_sampling", 4)
    assert (config["learning_rate"], config["lora_rank"], config["batch_size"]) == (0.001, 4, 1)
    assert config["backend"] == "local" and config["outputs"]["metrics_json"] is True
    assert config["log_path"] == "outputs/train" and config["off_policy"]["max_steps"] == 2
    assert "warning:" not in out.stderr  # a translation is written in the current layout

    # what was printed is a polyrl config that reads back to the same thing
    (minds_repo / "printed.yaml").write_text(out.stdout)
    again = run_cli("train", "--config_path", "printed.yaml", "--print-config")
    assert again.returncode == 0, again.stderr
    assert yaml.safe_load(again.stdout) == config and not again.stdout.startswith("#")


def test_minds_api_key_selects_tinker_and_never_shows(minds_repo):
    out = run_cli("train", "--config_path", "configs/train.toml", "--print-config",
                  env={"MINDS_TEST_TINKER_KEY": "tml-minds-secret-123"})
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["backend"] == "tinker" and "no Tinker API key" not in out.stdout
    toml = (minds_repo / "configs" / "train.toml").read_text()
    (minds_repo / "configs" / "inline.toml").write_text(
        toml.replace('api_key_env = "MINDS_TEST_TINKER_KEY"', 'api_key = "tml-inline-secret-456"'))
    out = run_cli("train", "--config_path", "configs/inline.toml", "--print-config")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["backend"] == "tinker" and "secret" not in out.stdout + out.stderr


def test_unknown_minds_keys_are_one_line_errors(minds_repo):
    toml = (minds_repo / "configs" / "train.toml").read_text()
    typo = toml.replace("rollouts_per_example", "rollout_per_example")
    (minds_repo / "configs" / "typo.toml").write_text(typo)
    out = run_cli("train", "--config_path", "configs/typo.toml")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("error: configs/typo.toml: [trainer] rollout_per_example: unknown Minds RL")


@pytest.mark.slow
def test_minds_config_runs_and_writes_its_metrics_json(minds_repo, tiny_model_dir):
    args = ["train", "--config_path", "configs/train.toml", "--overrides", f"model_name={tiny_model_dir}",
            "local.store_dir=store", "max_steps=2", "outputs.report=false"]
    out = polyrl(*args, cwd=minds_repo)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: [trainer] kl_beta = 0.1 is not used" in out.stderr
    run = minds_repo / "outputs" / "train"
    rows = json.loads((run / "metrics.json").read_text())
    assert ([sorted(r) for r in rows] == [["loss", "reward", "step"]] * 2
            and [r["step"] for r in rows] == [0, 1])
    native = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows] == [r["reward/mean"] for r in native]
    first_step = (run / "trajectories" / "step_000000.jsonl").read_text().splitlines()
    episodes = [json.loads(line) for line in first_step]
    assert len(episodes) == 4 and episodes[0]["messages"][0]["content"] == "Reply with the letter b."
    # a relaunch with more steps resumes: metrics.json goes on from where it stopped, no step twice
    out = polyrl(*args[:-2], "max_steps=3", "outputs.report=false", cwd=minds_repo)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in json.loads((run / "metrics.json").read_text())] == [0, 1, 2]


# ---------------------------------------------------------------------------- GEM command line
GEM_ARGS = ["env_id=game:GuessTheNumber-v0-easy", "max_steps=20", "gamma=0.9", "use_rebn=true",
            "template=qwen3_game"]


def test_gem_command_line_is_translated(tmp_path, monkeypatch):
    pytest.importorskip("gem")
    monkeypatch.chdir(tmp_path)
    out = run_cli("train", *GEM_ARGS, "--print-config")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# translated from GEM trainer arguments: "
                                 "env_id=game:GuessTheNumber-v0-easy")
    assert "# note: env_wrappers concat left out" in out.stdout
    config = yaml.safe_load(out.stdout)
    env = config["environments"]["GuessTheNumber_v0_easy"]
    assert env["type"] == "gem:game:GuessTheNumber-v0-easy" and env["num_rollouts"] == 1
    assert (config["advantages"]["estimator"], config["advantages"]["gamma"], config["renderer"]) == (
        "rebn", 0.9, "qwen3_game")
    assert "warning:" not in out.stderr
    assert (config["max_steps"], config["batch_size"], config["learning_rate"]) == (20, 128, 4e-5)
    assert (config["model_name"], config["save_every"], config["log_path"]) == (
        "Qwen/Qwen3-8B-Base", 0, "runs/gem-GuessTheNumber_v0_easy")

    ahead = yaml.safe_load(run_cli("train", *GEM_ARGS, "max_steps_off_policy=2", "--print-config").stdout)
    assert ahead["off_policy"]["max_steps"] == 2 and config["off_policy"]["max_steps"] == 0

    bad = run_cli("train", *GEM_ARGS, "use_rebn=false")
    assert bad.returncode == 2 and "use_rebn=false: polyrl has no raw-return estimator" in bad.stderr
    bad = run_cli("train", "env_id=game:GuessTheNumber-v0-easy", "num_epochs=3")
    assert bad.returncode == 2 and "argument 'num_epochs': not a GEM trainer argument" in bad.stderr
    both = run_cli("train", *GEM_ARGS, "--config_path", "x.yaml")
    assert both.returncode == 2 and "not both" in both.stderr


@pytest.mark.slow
def test_gem_command_line_trains(tmp_path, tiny_model_dir):
    pytest.importorskip("gem")
    out = polyrl("train", *GEM_ARGS[:1], "max_steps=1", *GEM_ARGS[2:], f"model_name={tiny_model_dir}",
                 "batch_size=2", "max_tokens=4", "lora_rank=4", "--overrides", "local.store_dir=store",
                 "outputs.report=false", "environments.GuessTheNumber_v0_easy.max_turns=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "gem-GuessTheNumber_v0_easy" / "metrics.jsonl")
            .read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["episodes/count"] == 2.0


def test_print_config_of_a_native_config(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(f"model_name: {tiny_model_dir}\nenvironments: {{arithmetic: {{}}}}\n")
    out = run_cli("train", "--config_path", "run.yaml", "--overrides", "batch_size=3", "--print-config")
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert config["batch_size"] == 3 and config["environments"]["arithmetic"]["type"] == "arithmetic"
    assert not out.stdout.startswith("#")


def test_minds_api_key_from_dotenv(minds_repo):
    (minds_repo / ".env").write_text("MINDS_TEST_TINKER_KEY=tml-dotenv-secret-789\n")
    out = run_cli("train", "--config_path", "configs/train.toml", "--print-config")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["backend"] == "tinker" and "secret" not in out.stdout


@pytest.mark.slow
def test_zero_reward_runs_go_their_configured_steps(minds_repo, tiny_model_dir, tmp_path):
    """A task the model cannot solve yet gives equal rewards for a while: a Minds RL config (one prompt a
    step), GEM's command line and a polyrl YAML config all run their 12 steps, warning about the steps
    without a learning signal, instead of stopping at the 10th."""
    pytest.importorskip("gem")
    environ = {k: v for k, v in os.environ.items() if "TINKER" not in k}
    environ.update(PYTHONPATH=str(ROOT))
    (tmp_path / "gem").mkdir()
    (tmp_path / "run.yaml").write_text(f"model_name: {tiny_model_dir}\nmax_steps: 12\nbatch_size: 2\n"
                                       "max_tokens: 4\nlora_rank: 4\nlog_path: yaml-run\n"
                                       "local: {store_dir: store}\n"
                                       "outputs: {report: false}\n"
                                       "environments:\n  arithmetic: {num_rollouts: 2, max_turns: 1}\n")
    runs = {  # each run's command, directory and metrics file
        "minds": (["train", "--config_path", "configs/train.toml", "--overrides",
                   f"model_name={tiny_model_dir}", "local.store_dir=store", "max_steps=12",
                   "outputs.report=false", "environments.my_task.args.word=zzzzzzzz"],
                  minds_repo, minds_repo / "outputs" / "train" / "metrics.jsonl"),
        "gem": (["train", *GEM_ARGS[:1], "max_steps=12", *GEM_ARGS[2:], f"model_name={tiny_model_dir}",
                 "batch_size=2", "max_tokens=4", "lora_rank=4", "--overrides", "local.store_dir=store",
                 "outputs.report=false", "environments.GuessTheNumber_v0_easy.max_turns=1"],
                tmp_path / "gem", tmp_path / "gem" / "runs" / "gem-GuessTheNumber_v0_easy" / "metrics.jsonl"),
        "yaml": (["train", "--config_path", "run.yaml"], tmp_path, tmp_path / "yaml-run" / "metrics.jsonl"),
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "polyrl.cli", *args], cwd=cwd, env=environ,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, cwd, _) in runs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
        rows = [json.loads(line) for line in runs[name][2].read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(12)), name
        no_signal = [r for r in rows if r["optim/datums"] == 0]
        assert len(no_signal) > 6, f"{name}: the task was meant to give no signal: {len(no_signal)} steps"
        assert "steps so far without a learning signal" in err, f"{name}: {err[-3000:]}"
