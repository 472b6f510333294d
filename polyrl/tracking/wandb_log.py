"""Weights & Biases logging, when ``wandb_project_name`` is set (``WANDB_MODE=offline`` works).

A relaunched run continues the same W&B run: the run id is saved with every checkpoint row and
given back to ``wandb.init(id=..., resume="allow")`` on resume. ``log_path/wandb.json`` records the
run (id, project, entity, name, URL, offline or not) for the report, which links it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polyrl.fileio import atomic_write_text
from polyrl.secrets import redact, redact_config, redact_text

RECORD = "wandb.json"


class WandbLog:
    def __init__(self, project: str, name: str | None, config: dict, directory: str,
                 run_id: str | None = None):
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - depends on the optional extra
            raise RuntimeError(
                "wandb_project_name is set but wandb is not installed: pip install 'polyrl[wandb]'"
            ) from e
        self.run = wandb.init(project=redact_text(project), name=name and redact_text(name),
                              config=redact_config(config), dir=str(Path(directory).resolve()), id=run_id,
                              resume="allow")
        self._record(Path(directory))

    @property
    def run_id(self) -> str:
        return self.run.id

    def _record(self, directory: Path) -> None:
        run = self.run
        settings = run.settings
        offline = bool(getattr(settings, "_offline", False)) or getattr(settings, "mode", "") == "offline"
        record = {"id": run.id, "project": run.project, "entity": getattr(run, "entity", None) or None,
                  "name": run.name, "url": None if offline else (run.url or None), "offline": offline,
                  "dir": str(Path(run.dir).parent) if getattr(run, "dir", None) else None}
        atomic_write_text(directory / RECORD, json.dumps(redact(record), indent=2))

    def log(self, row: dict[str, Any], step: int) -> None:
        """The numeric entries of ``row``; names with secrets masked (an environment names its own
        metrics)."""
        self.run.log({redact_text(k): v for k, v in row.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self.run.finish()
