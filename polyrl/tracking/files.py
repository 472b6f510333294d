"""The run directory: ``config.json``, ``metrics.jsonl``, ``trajectories/step_NNNNNN.jsonl`` and
``checkpoints.jsonl`` (tinker-cookbook's row format); ``metrics.json`` too when asked for
(:mod:`polyrl.tracking.metrics_json`).

Appends are flushed and fsynced line by line; whole files are written to a temporary name and
renamed, so a crash never leaves a torn file. On resume, rows of steps that will be re-run are
removed first, so no step is ever logged twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from polyrl.secrets import redact


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a crash mid-write) is ignored."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=_jsonable) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return str(value)


def step_file(step: int) -> str:
    return f"step_{step:06d}.jsonl"


class RunFiles:
    def __init__(self, log_path: str | Path, metrics_json: bool = False):
        self.root = Path(log_path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.trajectories = self.root / "trajectories"
        self.trajectories.mkdir(exist_ok=True)
        self.metrics_path = self.root / "metrics.jsonl"
        self.checkpoints_path = self.root / "checkpoints.jsonl"
        self.metrics_json = None
        if metrics_json:
            from polyrl.tracking.metrics_json import MetricsJson

            self.metrics_json = MetricsJson(self.root / "metrics.json")

    def write_config(self, config: dict) -> None:
        atomic_write_text(self.root / "config.json", json.dumps(redact(config), indent=2))

    def log_metrics(self, row: dict) -> None:
        append_jsonl(self.metrics_path, row)
        if self.metrics_json is not None:
            self.metrics_json.log(row)

    def log_trajectories(self, step: int, rows: Iterable[dict]) -> None:
        text = "".join(json.dumps(redact(r), default=_jsonable) + "\n" for r in rows)
        atomic_write_text(self.trajectories / step_file(step), text)

    def log_checkpoint(self, row: dict) -> None:
        append_jsonl(self.checkpoints_path, row)

    def checkpoints(self) -> list[dict]:
        return read_jsonl(self.checkpoints_path)

    def last_resumable(self) -> dict | None:
        rows = [r for r in self.checkpoints() if r.get("state_path")]
        return rows[-1] if rows else None

    def truncate_from(self, step: int) -> None:
        """Forget everything logged for steps >= ``step`` (they are about to be re-run)."""
        rows = read_jsonl(self.metrics_path)
        kept = [r for r in rows if r.get("step", -1) < step]
        if len(kept) != len(rows) or self.metrics_path.exists():
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        if self.metrics_json is not None:
            self.metrics_json.truncate_from(step)
        for f in self.trajectories.glob("step_*.jsonl"):
            if int(f.stem.split("_")[1]) >= step:
                f.unlink()
        cps = self.checkpoints()
        kept_cps = [r for r in cps if r.get("batch", 0) <= step]
        if len(kept_cps) != len(cps):
            atomic_write_text(self.checkpoints_path, "".join(json.dumps(r) + "\n" for r in kept_cps))
