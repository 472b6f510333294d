"""The local checkpoint store: ``tinker://<run_id>/<kind>/<name>`` paths resolved to directories.

Layout: ``<root>/<run_id>/{weights|sampler_weights}/<name>/`` (the run id percent-encoded: ``:`` is
``%3A``) holding a standard PEFT adapter
(``adapter_model.safetensors`` + ``adapter_config.json``), ``polyrl.json`` (base model, LoRA spec,
optimizer steps) and, for training state, ``optimizer.pt``. Every checkpoint is written to a
temporary directory, its files fsynced, and renamed into place (the rename fsynced too), so a crash
never leaves a half-written checkpoint. Overwriting moves the old directory aside first and removes it
only once the new one is in place; a crash between the two renames leaves the old one aside, where
:meth:`Store.directory` finds and restores it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable
from urllib.parse import quote, unquote

from polyrl.errors import CheckpointWriteError, UserInputError

KINDS = {"weights": "training", "sampler_weights": "sampler"}


def default_store_dir() -> Path:
    env = os.environ.get("POLYRL_STORE_DIR")
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "polyrl" / "store"


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    kind: str  # "weights" | "sampler_weights"
    name: str

    @classmethod
    def parse(cls, path: str) -> "CheckpointPath":
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise UserInputError(f"checkpoint path {path!r} must look like tinker://<run_id>/weights/<name>")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or not all(parts) or parts[1] not in KINDS:
            raise UserInputError(
                f"checkpoint path {path!r} must look like tinker://<run_id>/weights/<name> "
                "or tinker://<run_id>/sampler_weights/<name>"
            )
        # the run id and name become directory names: '..' (or any name the store would not write)
        # would lead out of the store
        for value, what in ((parts[0], "run id"), (parts[2], "checkpoint name")):
            if problem := name_problem(value, what):
                raise UserInputError(f"checkpoint path {path!r}: {problem}")
        return cls(*parts)

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


_NEW, _ASIDE = ".tmp-new-", ".tmp-old-"  # + 8 hex digits + "-" + name: a checkpoint being written / replaced


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """Every file below ``directory``, then the directories themselves, to disk."""
    for path in sorted(directory.rglob("*"), key=lambda p: -len(p.parts)):
        _fsync(path)
    _fsync(directory)


# Run ids and checkpoint names become directory names: 1 to 200 letters, digits, '_', '-', '.' or ':',
# not starting with '.' (hidden, and the store's temporary directories) or ':'.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.:\-]*$")
MAX_NAME_CHARS = 200


def name_problem(value: object, what: str = "checkpoint name") -> str | None:
    """Why ``value`` cannot name a run or checkpoint directory, or None."""
    if isinstance(value, str) and NAME_PATTERN.match(value) and len(value) <= MAX_NAME_CHARS:
        return None
    shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:60]}... ({len(str(value))} characters)"
    return (f"invalid {what} {shown}: use 1 to {MAX_NAME_CHARS} letters, digits, '_', '-', '.' or ':', "
            "not starting with '.' or ':'")


def check_name(name: str) -> str:
    """A checkpoint name every store operation accepts (so any name that saves can be loaded)."""
    if problem := name_problem(name):
        raise ValueError(problem)
    return name


class Store:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root).expanduser() if root else default_store_dir()

    def run_directory(self, run_id: str) -> Path:
        """A run's directory; the id is percent-encoded (Tinker's ids hold ':', which not every file
        system accepts in a name)."""
        return self.root / quote(run_id, safe="")

    def directory(self, cp: CheckpointPath) -> Path:
        final = self.run_directory(cp.run_id) / cp.kind / cp.name
        if not final.exists() and final.parent.is_dir():  # a crash mid-overwrite: put the old one back
            for d in final.parent.iterdir():
                if d.name.startswith(_ASIDE) and d.name[len(_ASIDE) + 9:] == cp.name and (d / "polyrl.json").exists():
                    os.replace(d, final)
                    break
        return final

    def resolve(self, path: str) -> tuple[CheckpointPath, Path]:
        cp = CheckpointPath.parse(path)
        d = self.directory(cp)
        if not (d / "polyrl.json").exists():
            raise UserInputError(f"checkpoint {path} not found (looked in {d})")
        return cp, d

    def write(self, cp: CheckpointPath, writer: Callable[[Path], None], meta: dict, overwrite: bool = False) -> str:
        """Run ``writer(tmp_dir)``, add ``polyrl.json``, and move the directory into place atomically.

        A file system error on the way (a full disk, a store turned read-only) raises
        :class:`CheckpointWriteError` naming the checkpoint; nothing of the new checkpoint is kept."""
        final = self.directory(cp)
        if final.exists() and not overwrite:
            raise ValueError(f"checkpoint {cp} already exists (pass overwrite=True to replace it)")
        try:
            return self._write(cp, final, writer, meta)
        except OSError as e:
            for parent in (final.parent, final.parent.parent):  # directories made for it alone
                with contextlib.suppress(OSError):  # not empty
                    parent.rmdir()
            reason = e.strerror or str(e) or type(e).__name__
            raise CheckpointWriteError(f"could not write checkpoint {cp} to the store at {self.root}: "
                                       f"{reason} (nothing of it was kept)") from None

    def _write(self, cp: CheckpointPath, final: Path, writer: Callable[[Path], None], meta: dict) -> str:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f"{_NEW}{uuid.uuid4().hex[:8]}-{cp.name}"
        aside = final.parent / f"{_ASIDE}{uuid.uuid4().hex[:8]}-{cp.name}"
        tmp.mkdir()
        try:
            writer(tmp)
            meta = {**meta, "time": datetime.now(timezone.utc).isoformat(), "tinker_path": str(cp)}
            (tmp / "polyrl.json").write_text(json.dumps(meta, indent=2))
            _fsync_tree(tmp)
            if final.exists():
                os.replace(final, aside)
            try:
                os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):  # else directory() restores it on the next lookup
                    if aside.exists():
                        os.replace(aside, final)
                raise
            _fsync(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return str(cp)

    @staticmethod
    def meta(directory: Path) -> dict:
        return json.loads((directory / "polyrl.json").read_text())

    def list(self, run_id: str) -> list[dict]:
        """Checkpoints of a run, oldest first: dicts with Tinker's ``Checkpoint`` fields."""
        rows = []
        for kind, ctype in KINDS.items():
            base = self.run_directory(run_id) / kind
            if not base.is_dir():
                continue
            for d in base.iterdir():
                if d.name.startswith(".tmp") or not (d / "polyrl.json").exists():
                    continue
                meta = self.meta(d)
                rows.append(
                    {
                        "checkpoint_id": f"{kind}/{d.name}",
                        "checkpoint_type": ctype,
                        "time": meta.get("time"),
                        "tinker_path": meta.get("tinker_path", f"tinker://{run_id}/{kind}/{d.name}"),
                        "size_bytes": sum(f.stat().st_size for f in d.iterdir() if f.is_file()),
                        "public": False,
                        "user_metadata": meta.get("user_metadata"),
                    }
                )
        return sorted(rows, key=lambda r: r["time"] or "")

    def runs(self) -> list[str]:
        return sorted(unquote(p.name) for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def delete(self, path: str) -> None:
        """Remove a checkpoint, and its run's directories once nothing is left in them."""
        cp, d = self.resolve(path)
        shutil.rmtree(d)
        for parent in (d.parent, d.parent.parent):
            with contextlib.suppress(OSError):  # not empty
                parent.rmdir()
