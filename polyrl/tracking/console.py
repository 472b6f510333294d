"""Console output: one compact table row per step (rich), and a live progress bar for rollouts.

In a terminal, rows are rich tables and progress bars redraw in place. When stderr is not a terminal
(CI logs, ``| tee``), every row is one plain line of fixed-width columns (no wrapping, no trailing
spaces, no blank lines) and progress bars are silent: a log file reads like a table.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from polyrl.secrets import redact_text

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
_WIDTH = 8


class ConsoleLog:
    def __init__(self, enabled: bool = True):
        self.console = Console(stderr=True)
        self.enabled = enabled
        self._header_every = 20
        self._rows = 0

    @property
    def is_terminal(self) -> bool:
        return self.console.is_terminal

    def step(self, row: dict) -> None:
        if not self.enabled:
            return
        header = self._rows % self._header_every == 0
        cells = [_fmt(row.get(key), fmt) for _, key, fmt in COLUMNS]
        if self.is_terminal:
            table = Table(show_header=header, box=None, pad_edge=False)
            for title, _, _ in COLUMNS:
                table.add_column(title, justify="right", min_width=_WIDTH)
            table.add_row(*cells)
            self.console.print(table)
        else:
            if header:
                self._line(_plain_row([title for title, _, _ in COLUMNS]))
            self._line(_plain_row(cells))
        self._rows += 1

    def progress(self, description: str, total: int, **fields: Any) -> Progress:
        """A transient progress bar; keyword ``fields`` (e.g. ``loss="-"``) are shown after it and
        updated with ``progress.update(task_id, loss=...)``. Silent when stderr is not a terminal."""
        columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), *(TextColumn(f"{name} {{task.fields[{name}]}}") for name in fields)]
        progress = Progress(*columns, console=self.console, transient=True,
                            disable=not (self.enabled and self.is_terminal))
        progress.add_task(description, total=total, **fields)
        return progress

    def info(self, text: str) -> None:
        if not self.enabled:
            return
        text = redact_text(text)
        if self.is_terminal:
            self.console.print(text)
        else:
            self._line(text)

    def warn(self, text: str) -> None:
        if self.enabled:
            self.console.print(Text(f"warning: {text}", style="yellow"))

    def _line(self, text: str) -> None:
        """One line, written as is (rich would wrap it at 80 columns when not in a terminal)."""
        file = self.console.file or sys.stderr
        file.write(text.rstrip() + "\n")
        file.flush()


def _plain_row(cells: list[str]) -> str:
    return "  ".join(cell.rjust(_WIDTH) for cell in cells).rstrip()


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(int(value) if fmt == "{:d}" else value)
    except (TypeError, ValueError):
        return redact_text(str(value))
