"""Whole-file writes that a crash never tears: the text goes to a temporary name beside the file and
is renamed over it, so a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` through a temporary name and a rename.

    ``durable`` also fsyncs the file and its directory, so the new content survives a power cut;
    leave it off for files that can be rebuilt (the HTML report).
    """
    atomic_write_bytes(path, text.encode(), durable)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """:func:`atomic_write_text` for bytes."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a power cut
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
