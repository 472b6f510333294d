"""The run directory: ``config.json``, ``metrics.jsonl``, ``trajectories/step_NNNNNN.jsonl``,
``checkpoints.jsonl`` (tinker-cookbook's row format) and ``attempts.jsonl`` (the training run id of
each launch, so a relaunch can find what a killed one left behind).

Appends are flushed and fsynced line by line; whole files are written to a temporary name and
renamed, so a crash never leaves a torn file. A line torn by a crash mid-append is skipped when read
and ended before the next append, so it never hides the rows after it. On resume, rows of steps that
will be re-run are removed first, so no step is ever logged twice.
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
    fd = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a power cut
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a line torn by a crash mid-write is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a+b") as f:
        torn = False
        if f.seek(0, os.SEEK_END) > 0:  # a last line torn by a crash is ended first
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        f.write((("\n" if torn else "") + json.dumps(row, default=_jsonable) + "\n").encode())
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
    def __init__(self, log_path: str | Path):
        self.root = Path(log_path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.trajectories = self.root / "trajectories"
        self.trajectories.mkdir(exist_ok=True)
        self.metrics_path = self.root / "metrics.jsonl"
        self.checkpoints_path = self.root / "checkpoints.jsonl"
        self.attempts_path = self.root / "attempts.jsonl"

    def write_config(self, config: dict) -> None:
        atomic_write_text(self.root / "config.json", json.dumps(redact(config), indent=2))

    def log_metrics(self, row: dict) -> None:
        append_jsonl(self.metrics_path, row)

    def log_trajectories(self, step: int, rows: Iterable[dict]) -> None:
        text = "".join(json.dumps(redact(r), default=_jsonable) + "\n" for r in rows)
        atomic_write_text(self.trajectories / step_file(step), text)

    def log_checkpoint(self, row: dict) -> None:
        append_jsonl(self.checkpoints_path, row)

    def checkpoints(self) -> list[dict]:
        return read_jsonl(self.checkpoints_path)

    def log_attempt(self, row: dict) -> None:
        append_jsonl(self.attempts_path, row)

    def attempts(self) -> list[dict]:
        return read_jsonl(self.attempts_path)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_path)

    def last_resumable(self) -> dict | None:
        rows = [r for r in self.checkpoints() if r.get("state_path")]
        return rows[-1] if rows else None

    def truncate_from(self, step: int) -> None:
        """Forget everything logged for steps >= ``step`` (they are about to be re-run)."""
        rows = read_jsonl(self.metrics_path)
        kept = [r for r in rows if r.get("step", -1) < step]
        if len(kept) != len(rows) or self.metrics_path.exists():
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        for f in self.trajectories.glob("step_*.jsonl"):
            if int(f.stem.split("_")[1]) >= step:
                f.unlink()
        cps = self.checkpoints()
        kept_cps = [r for r in cps if r.get("batch", 0) <= step]
        if len(kept_cps) != len(cps):
            atomic_write_text(self.checkpoints_path, "".join(json.dumps(r) + "\n" for r in kept_cps))
