"""The run directory: ``config.json``, ``metrics.jsonl``, ``trajectories/step_NNNNNN.jsonl``,
``images/<hash>.jpeg`` (each image of an episode, stored once; trajectories refer to it by that name),
``checkpoints.jsonl`` (tinker-cookbook's row format), ``attempts.jsonl`` (the training run id of
each launch, so a relaunch can find what a killed one left behind), and ``metrics.json`` when asked
for (:mod:`polyrl.tracking.metrics_json`).

Appends are flushed and fsynced line by line; whole files are written to a temporary name and
renamed, so a crash never leaves a torn file. A line torn by a crash mid-append is skipped when read
and ended before the next append, so it never hides the rows after it. On resume, rows of steps that
will be re-run are removed first, so no step is ever logged twice. Every row is written with secrets
masked (metric names and the per-token text of trajectories included): :func:`redacted_json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from polyrl.errors import UserInputError
from polyrl.fileio import atomic_write_bytes, atomic_write_text
from polyrl.secrets import redact, redact_config, redact_pieces, redact_text
from polyrl.tracking.metrics_json import MetricsJson


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


def redacted_json(row: Any, mask_sensitive_keys: bool = True, **dumps_args: Any) -> str:
    """``row`` as JSON with secrets masked in keys, values, the text of objects JSON cannot hold and
    the per-token text of a trajectory row (``token_text``); see :func:`polyrl.secrets.redact`.
    Masking works on the objects, never on the JSON text, which a short secret that looks like a
    number could corrupt."""
    if isinstance(row, dict) and isinstance(row.get("token_text"), list):
        row = {**row, "token_text": redact_pieces([str(t) for t in row["token_text"]])}
    return json.dumps(redact(row, mask_sensitive_keys), default=_jsonable, **dumps_args)


def append_jsonl(path: Path, row: dict) -> None:
    """Append one row of numbers, names and paths (metrics, checkpoints): secrets masked wherever
    they appear, but a key merely named like a secret keeps its value."""
    with open(path, "a+b") as f:
        torn = False
        if f.seek(0, os.SEEK_END) > 0:  # a last line torn by a crash is ended first
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        f.write((("\n" if torn else "") + redacted_json(row, mask_sensitive_keys=False) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return redact(value.tolist())
    if hasattr(value, "model_dump"):
        return redact(value.model_dump())
    return redact_text(str(value))


def make_run_dir(log_path: str | Path) -> Path:
    """``log_path`` as an existing, writable directory; a one-line :class:`UserInputError` when it
    cannot be one (a file in the way, no permission, a NUL in the name), before any work starts."""
    shown = repr(str(log_path))
    if "\0" in str(log_path):
        raise UserInputError(f"log_path {shown} contains a NUL character")
    root = Path(log_path)
    if root.exists() and not root.is_dir():
        raise UserInputError(f"log_path {shown} is a file, not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserInputError(f"log_path {shown}: cannot create the run directory "
                             f"({exc.strerror or exc}: {exc.filename or root})") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserInputError(f"log_path {shown}: the run directory is not writable")
    return root


def step_file(step: int) -> str:
    return f"step_{step:06d}.jsonl"


class RunFiles:
    def __init__(self, log_path: str | Path, metrics_json: bool = False):
        self.root = make_run_dir(log_path)
        self.trajectories = self.root / "trajectories"
        self.trajectories.mkdir(exist_ok=True)
        self.metrics_path = self.root / "metrics.jsonl"
        self.checkpoints_path = self.root / "checkpoints.jsonl"
        self.attempts_path = self.root / "attempts.jsonl"
        self.metrics_json = MetricsJson(self.root / "metrics.json") if metrics_json else None

    def write_config(self, config: dict) -> None:
        atomic_write_text(self.root / "config.json", redacted_json(redact_config(config), False, indent=2))

    def log_metrics(self, row: dict) -> None:
        append_jsonl(self.metrics_path, row)
        if self.metrics_json is not None:
            self.metrics_json.log(row)

    def log_trajectories(self, step: int, rows: Iterable[dict]) -> None:
        text = "".join(redacted_json(r) + "\n" for r in rows)
        atomic_write_text(self.trajectories / step_file(step), text)

    def save_images(self, files: dict[str, bytes]) -> None:
        """Store each image under its name (``images/<hash>.<format>``) unless it is there already: its
        content names it, so an image seen in many episodes and steps is written once."""
        for name, data in files.items():
            path = self.root / name
            if not name.startswith("images/") or "/" in name[len("images/"):] or path.exists():
                continue
            path.parent.mkdir(exist_ok=True)
            atomic_write_bytes(path, data)

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
        """Forget everything logged for steps >= ``step`` (they are about to be re-run); from step 0, the
        evaluation before training (step -1) too, as a run that starts over evaluates again."""
        rows = read_jsonl(self.metrics_path)
        kept = [r for r in rows if r.get("step", -1) < step] if step > 0 else []
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
