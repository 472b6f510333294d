"""Console output in logs (stderr a pipe) and in a terminal (a pseudo-terminal), and the SFT progress bar."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": "160"}

STEPS = textwrap.dedent("""
    from polyrl.tracking.console import ConsoleLog
    console = ConsoleLog()
    for step in range(3):
        with console.progress(f"step {step} rollouts", 2) as progress:
            progress.advance(progress.task_ids[0])
            progress.advance(progress.task_ids[0])
        console.step({"step": step, "reward/mean": 0.25 * step, "rollouts/failed": 0, "async/staleness_mean": 0.5 * step,
                      "time/total": 12.5})
    console.info("checkpoint final: tinker://run/weights/final")
    console.warn("step 2 made no update")
""")  # noqa: E501


def _run_in_pty(args: list[str], timeout: float = 300) -> str:
    """Run ``args`` with stdout and stderr on a pseudo-terminal; everything it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], timeout)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the other side closed
            break
        if not data:
            break
        out += data
    os.close(master)
    proc.wait(timeout=30)
    return out.decode("utf-8", "replace")


def test_rows_are_one_clean_line_each_when_stderr_is_a_pipe():
    proc = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.split("\n")
    assert lines[-1] == ""  # ends with a newline
    lines = lines[:-1]
    assert all(line.strip() for line in lines), lines  # no blank lines between rows
    assert all(line == line.rstrip() for line in lines)  # no trailing spaces
    assert "\x1b" not in proc.stderr and "\r" not in proc.stderr  # no escape codes, no redraws
    header, *rows, info, warning = lines
    assert header.split() == ["step", "reward", "success", "kl", "entropy", "loss", "grad", "tokens", "fail",
                              "stale", "s/step"]  # every column, none cut off at 80 characters
    expected = [[str(s), f"{0.25 * s:.3f}", *["-"] * 6, "0", f"{0.5 * s:.2f}", "12.5"] for s in range(3)]
    assert [row.split() for row in rows] == expected
    assert info == "checkpoint final: tinker://run/weights/final"
    assert warning == "warning: step 2 made no update"


def test_a_terminal_still_gets_rich_tables_and_a_live_bar():
    out = _run_in_pty([sys.executable, "-c", STEPS], timeout=60)
    assert "\x1b[" in out  # styled, redrawn in place
    assert "step 0 rollouts" in out and "2/2" in out  # the progress bar was drawn
    assert re.search(r"\b2\s+0\.500\b", out)


@pytest.mark.slow
def test_sft_shows_a_progress_bar_with_the_loss(tiny_model_dir, tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text(textwrap.dedent(f"""
        model_name: {tiny_model_dir}
        lora_rank: 4
        batch_size: 2
        max_steps: 4
        log_path: {tmp_path / "sft"}
        local:
          store_dir: {tmp_path / "store"}
        environments:
          arithmetic: {{splits: {{train: {{num_samples: 4}}}}}}
    """))
    args = [sys.executable, "-m", "polyrl.cli", "sft", "--config_path", str(config)]
    in_terminal = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", _run_in_pty(args))
    assert re.search(r"sft .* 4/4 .* loss \d+\.\d{4}", in_terminal), in_terminal[-2000:]
    in_log = subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300).stderr
    losses = re.findall(r"^sft step (\d+): loss/token \d+\.\d{4}$", in_log, re.M)
    assert losses == ["0", "1", "2", "3"], in_log  # max_steps // 10 < 1: every step gets a line
    assert "\x1b" not in in_log
