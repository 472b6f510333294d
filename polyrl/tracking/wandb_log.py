"""Weights & Biases logging, when ``wandb_project_name`` is set (``WANDB_MODE=offline`` works)."""

from __future__ import annotations

from typing import Any

from polyrl.secrets import redact, redact_text


class WandbLog:
    def __init__(self, project: str, name: str | None, config: dict, directory: str, run_id: str | None = None):
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - depends on the optional extra
            raise RuntimeError("wandb_project_name is set but wandb is not installed: pip install 'polyrl[wandb]'") from e
        self.run = wandb.init(project=redact_text(project), name=name and redact_text(name), config=redact(config),
                              dir=directory, id=run_id, resume="allow")

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, row: dict[str, Any], step: int) -> None:
        """The numeric entries of ``row``; names with secrets masked (an environment names its own metrics)."""
        self.run.log({redact_text(k): v for k, v in row.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self.run.finish()
