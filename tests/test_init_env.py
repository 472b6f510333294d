"""``polyrl init-env``: the package it writes passes its own test, declares its entry point, and its
configs (a warm start, then RL from it) run as their headers say on a tiny model; it refuses a bad name
or a directory in use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from polyrl.cli import main
from polyrl.config.files import load_config
from polyrl.envs.registry import make_env_builder
from polyrl.sft import SFTConfig

REPO = Path(__file__).resolve().parents[1]


def environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "TINKER" not in k}
    env["PYTHONPATH"] = str(REPO)
    return env


def scaffold(tmp_path: Path, model: str, capsys) -> Path:
    out = tmp_path / "pkg"
    main(["init-env", "word-case", str(out), "--model", model])
    assert "wrote" in capsys.readouterr().out
    return out


def test_the_package_declares_its_entry_point_and_its_config_loads(tmp_path, tiny_model_dir, capsys,
                                                                   monkeypatch):
    out = scaffold(tmp_path, tiny_model_dir, capsys)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "pyproject.toml", "sft.yaml",
                                                     "test_word_case.py", "train.yaml", "word_case.py"]
    project = tomllib.loads((out / "pyproject.toml").read_text())
    points = project["project"]["entry-points"]["polyrl.environments"]
    assert points == {"word-case": "word_case:load_environment"}

    monkeypatch.chdir(out)
    config = load_config("train.yaml")
    assert config.model_name == tiny_model_dir and list(config.environments) == ["word-case"]
    sft = load_config("sft.yaml", model=SFTConfig)  # SFT's keys only, the same environment entry
    assert sft.model_name == tiny_model_dir and sft.environments == config.environments
    assert sft.lora_rank == config.lora_rank
    # installed (a dist-info with the pyproject's entry points, as pip writes it), the name is the type
    dist = out / "word_case-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: word-case\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[polyrl.environments]\n" + "".join(
        f"{name} = {value}\n" for name, value in points.items()))
    monkeypatch.syspath_prepend(str(out))
    builder = make_env_builder("word-case", {"num_test": 2}, seed=0)
    assert builder.num_tasks("test") == 2 and builder.rows("test")[0]["answer"] == "APPLE"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # peft and transformers
def test_the_packages_test_passes_and_its_config_trains(tmp_path, tiny_model_dir, capsys):
    out = scaffold(tmp_path, tiny_model_dir, capsys)
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=out,
                            env=environ(), capture_output=True, text=True, timeout=300)
    assert tested.returncode == 0 and "2 passed" in tested.stdout, tested.stdout + tested.stderr

    # the warm start, then RL from it, as the configs' headers and the README say (the configs made small)
    commands = ["START=$(polyrl sft --config_path sft.yaml)",
                "polyrl train --config_path train.yaml --overrides resume_from=$START"]
    for name in ("sft.yaml", "train.yaml", "README.md"):
        assert all(command in (out / name).read_text() for command in commands), name
    small = {"sft.yaml": {"max_steps": 2, "batch_size": 2, "lora_rank": 4},
             "train.yaml": {"max_steps": 2, "batch_size": 2, "max_tokens": 8, "lora_rank": 4,
                            "eval_num_samples": 1, "outputs": {"report": False}, "save_every": 0}}
    for name, values in small.items():
        config = yaml.safe_load((out / name).read_text())
        assert config["model_name"] == tiny_model_dir
        config.update(values, local={"store_dir": str(tmp_path / "store")})
        if name == "train.yaml":
            config["environments"]["word-case"].update(num_rollouts=2, splits={"test": {"num_samples": 2}})
        (out / name).write_text(yaml.safe_dump(config))
    script = "polyrl() { \"$PYTHON\" -m polyrl.cli \"$@\"; }\nset -e\n" + "\n".join(commands) + "\n"
    run = subprocess.run(["bash", "-c", script], cwd=out, env={**environ(), "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "initialized weights from tinker://" in run.stdout + run.stderr and "/weights/sft" in run.stderr
    metrics = out / config["log_path"] / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 0]  # not the evaluation before training (step -1)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["episodes/count"] > 0 and r["rollouts/failed"] == 0 for r in rows), rows
    assert "test/word-case/pass@1" in rows[-1]


@pytest.mark.parametrize("argv,needle", [
    (["init-env", "9lives"], "environment name '9lives'"),
    (["init-env", "my task"], "environment name 'my task'"),
    (["init-env", "ok", "{used}"], "already exists and is not an empty directory"),
])
def test_bad_names_and_used_directories_are_refused(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main([a.replace("{used}", str(used)) for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and needle in err, err
    assert (used / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used"]  # nothing written

