"""The run report: ``LOG_PATH/report/index.html``, a static page with the run's curves, a trajectory
browser, its config and checkpoints. ``polyrl report LOG_PATH`` builds it; ``polyrl train`` refreshes
it whenever it saves a checkpoint (``report: true``)."""

from __future__ import annotations

from pathlib import Path

from polyrl.report.build import build_report

__all__ = ["build_report", "refresh_for_training"]


def refresh_for_training(log_path: str | Path, console=None) -> Path | None:
    """Refresh the report from inside a training run: never raises (a report problem must not stop
    training); prints the page's path, or why it could not be written."""
    try:
        path = build_report(log_path)
    except Exception as e:  # noqa: BLE001 - reported, training goes on
        if console is not None:
            console.info(f"report not refreshed: {type(e).__name__}: {e}")
        return None
    if console is not None:
        console.info(f"report: {path}")
    return path
