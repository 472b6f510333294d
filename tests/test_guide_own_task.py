"""docs/guides/your-own-task.md is real: its code is the example's code, and its commands, run as written
in a shell (shrunk to a few steps with overrides), take the task from nothing to a report: the warm
start's loss falls, RL starts from its checkpoint, logs its steps and writes the report."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "your-own-task.md"
SHRINK = {"polyrl sft": "max_steps=30",  # the guide's other settings stay
          "polyrl train": "max_steps=2 batch_size=2 environments.last_word.num_rollouts=4 "
                          "environments.last_word.splits.test.num_samples=4 eval_every=2"}


def blocks(language: str) -> list[str]:
    text = GUIDE.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_the_guides_code_is_the_examples_code():
    sources = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "examples" / "own_task").glob("*.py"))
    assert blocks("python")
    for block in blocks("python"):
        assert block in sources, f"not in examples/own_task/: {block}"
    for line in blocks("json"):  # a demonstration line as make_demos.py writes it
        row = json.loads(line)
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
        assert row["messages"][2]["content"] == row["messages"][1]["content"].split()[-1]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def shrunk(script: str) -> str:
    """The guide's commands with the overrides that make each run a few steps."""
    lines = []
    for line in script.splitlines():
        for command, overrides in SHRINK.items():
            if command in line:
                assert "--overrides" in line, line
                line = line[:-1] + f" {overrides})" if line.endswith(")") else f"{line} {overrides}"
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_the_guides_commands_train_a_model_on_the_own_task(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "polyrl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m polyrl.cli "$@"\n')
    (bin_dir / "polyrl").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if "TINKER" not in k}
    env.update(PYTHONPATH=str(ROOT), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    script = "set -eu\n" + "".join(shrunk(block) for block in blocks("sh"))
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]

    runs = tmp_path / "runs"
    demos = (runs / "last_word" / "demos.jsonl").read_text().splitlines()
    assert len(demos) == 1000 and json.loads(demos[0])["messages"][2]["role"] == "assistant"
    sft_rows = metrics(runs / "last-word-sft")
    assert len(sft_rows) == 30 and sft_rows[-1]["optim/loss"] < sft_rows[0]["optim/loss"] / 2
    start = json.loads((runs / "last-word-sft" / "sft.json").read_text())["state_path"]
    assert f"initialized weights from {start}" in out.stderr  # RL started from the warm start
    assert json.loads((runs / "last-word-rl" / "config.json").read_text())["resume_from"] == start

    before, *rl_rows = metrics(runs / "last-word-rl")  # evaluated before the first step and after the last
    assert before["step"] == -1 and "test/last_word/pass@1" in before
    assert [r["step"] for r in rl_rows] == [0, 1]
    assert all(r["episodes/count"] > 0 and r["rollouts/failed"] == 0 for r in rl_rows)
    assert "test/last_word/pass@1" in rl_rows[-1]
    report = runs / "last-word-rl" / "report" / "index.html"
    assert report.is_file() and out.stdout.strip().splitlines()[-1].endswith("report/index.html")
