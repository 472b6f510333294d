"""Console output: one compact table row per step (rich), and a live progress bar for rollouts."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

COLUMNS = [
    ("step", "step", "{:d}"),
    ("reward", "reward/mean", "{:.3f}"),
    ("success", "success/mean", "{:.3f}"),
    ("kl", "optim/kl_sample_train_v1", "{:.4f}"),
    ("entropy", "optim/entropy", "{:.3f}"),
    ("loss", "optim/loss", "{:.3g}"),
    ("grad", "optim/grad_norm", "{:.3g}"),
    ("tokens", "tokens/action", "{:.0f}"),
    ("fail", "rollouts/failed", "{:.0f}"),
    ("s/step", "time/total", "{:.1f}"),
]


class ConsoleLog:
    def __init__(self, enabled: bool = True):
        self.console = Console(stderr=True)
        self.enabled = enabled
        self._header_every = 20
        self._rows = 0

    def step(self, row: dict) -> None:
        if not self.enabled:
            return
        table = Table(show_header=self._rows % self._header_every == 0, box=None, pad_edge=False)
        for title, _, _ in COLUMNS:
            table.add_column(title, justify="right", min_width=8)
        table.add_row(*(_fmt(row.get(key), fmt) for _, key, fmt in COLUMNS))
        self.console.print(table)
        self._rows += 1

    def progress(self, description: str, total: int) -> Progress:
        progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=self.console, transient=True, disable=not self.enabled,
        )
        progress.add_task(description, total=total)
        return progress

    def info(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)

    def warn(self, text: str) -> None:
        if self.enabled:
            self.console.print(Text(f"warning: {text}", style="yellow"))


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(int(value) if fmt == "{:d}" else value)
    except (TypeError, ValueError):
        return str(value)
