"""A PNG of a run report's first screen, rendered by headless Chromium (the README's picture).

    python -m polyrl.report.screenshot OUT.png                 # a synthetic 60-step run (the README's)
    python -m polyrl.report.screenshot OUT.png --run LOG_PATH  # a run of your own

The report is (re)built first. Needs ``chromium`` on the PATH (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from polyrl.errors import UserInputError
from polyrl.report.build import build_report
from polyrl.report.synthetic import write_synthetic_run

WINDOW = (1280, 900)


def readme_run(root: Path) -> Path:
    """The README's run: three environments over 60 steps, evaluated every 10, one of them cutting
    most of its answers at max_tokens (so the page shows a banner), one judged by a reward threshold."""
    run = write_synthetic_run(root, steps=60, episodes_per_step=24, group_size=4, eval_every=10,
                              save_every=20, seed=3, think_words=12, truncated={"guess_number": 0.7}, pace=25,
                              env_config={"guess_number": {"max_tokens": 128},
                                          "calculator": {"success_threshold": 0.5}})
    config_path = run / "config.json"
    started = config_path.stat().st_mtime  # when the run started, as the report reads it
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "log_path": "runs/polyrl-demo"},
                                      indent=2))
    os.utime(config_path, (started, started))
    return run


def screenshot(page: Path, out: Path, window: tuple[int, int] = WINDOW) -> Path:
    """Render ``page`` (an ``index.html``) in headless Chromium at ``window`` and write ``out``."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise UserInputError("no chromium on the PATH (Debian: apt-get install chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--run-all-compositor-stages-before-draw", "--disable-background-networking",
             "--disable-component-update", "--no-first-run",
             f"--user-data-dir={profile}", f"--window-size={window[0]},{window[1]}",
             "--virtual-time-budget=5000", f"--screenshot={out.resolve()}", page.resolve().as_uri()],
            capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("--run", type=Path, help="a run directory (log_path); default: the README's synthetic run")
    args = p.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = args.run or readme_run(Path(tmp) / "polyrl-demo")
            if not run.is_dir():
                raise UserInputError(f"--run {str(run)!r}: no run directory there")
            print(screenshot(build_report(run), args.out))
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
