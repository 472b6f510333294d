"""``log_path/metrics.json`` (``metrics_json: true``): the per-step metrics file of Minds RL's harness.

A JSON list, rewritten (atomically) after every step, of ``{"reward": mean episode reward, "loss":
the step's loss, "step": step}`` rows -- the keys and layout that harness wrote, so scripts that read
its output keep working. ``metrics.jsonl`` beside it has everything else. A loss that is not a
finite number (a step with nothing to train on) is written as 0.0, as the harness did.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from polyrl.fileio import atomic_write_text


class MetricsJson:
    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        if path.exists():
            try:
                loaded = json.loads(path.read_text())
            except ValueError:
                loaded = []
            rows = loaded if isinstance(loaded, list) else []
            self.rows = [r for r in rows if isinstance(r, dict) and "step" in r]

    def log(self, row: dict[str, Any]) -> None:
        """A step's row; the evaluation before training (step -1) is no step of the harness's file."""
        if int(row["step"]) < 0:
            return
        self.rows.append({"reward": _number(row.get("reward/mean")), "loss": _number(row.get("optim/loss")),
                          "step": int(row["step"])})
        self._write()

    def truncate_from(self, step: int) -> None:
        """Forget rows of steps >= ``step`` (a resumed run is about to redo them)."""
        kept = [r for r in self.rows if r["step"] < step]
        if len(kept) != len(self.rows) or not self.path.exists():
            self.rows = kept
            self._write()

    def _write(self) -> None:
        atomic_write_text(self.path, json.dumps(self.rows, indent=2))


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0
