"""The local checkpoint store: ``tinker://<run_id>/<kind>/<name>`` paths resolved to directories.

Layout: ``<root>/<run_id>/{weights|sampler_weights|external_weights}/<name>/`` (the run id
percent-encoded: ``:`` is ``%3A``) holding a standard PEFT adapter
(``adapter_model.safetensors`` + ``adapter_config.json``, age-encrypted as ``*.age`` in an external
export made for age recipients), ``polyrl.json`` (base model, LoRA spec, optimizer steps, the files a
complete checkpoint holds, the ``generation`` (an id of the save that wrote it, new on every write,
overwrite and copy), and the lifecycle: ``expires_at``, ``public`` and the id of its ``publication``) and,
for training state, ``optimizer.pt``. Every checkpoint is written to a temporary directory, its files
fsynced, and renamed into place (the rename fsynced too), so a crash never leaves a half-written
checkpoint. Overwriting moves the old directory aside first and removes it only once the new one is in
place; a crash between the two renames leaves the old one aside, where :meth:`Store.directory` finds and
restores it. ``polyrl.json`` is rewritten the same way. A removal renames the directory out of the way
before its files go. What a killed process leaves anyway (a save's temporary directory, a checkpoint that
lost files to something else) is counted against the size cap, absent to every lookup, and removed by
:meth:`Store.reclaim`.

Lifecycle, as Tinker's: a checkpoint saved with a TTL expires at ``expires_at``; from then on it cannot
be loaded, and it is removed by the first access, by a listing (which shows it once, expired, then
removes it), by the sweep every save runs now and then, and by ``polyrl serve``'s periodic sweep; each
removes only the checkpoint it found expired, never one a save put under the same name meanwhile. A store
may have a size cap (``max_bytes``): a save that would pass it is refused and nothing of it is kept.

Problems are raised as the tinker SDK's own exception types (``tinker.ConflictError`` for a name that
exists, ``tinker.NotFoundError``, ``tinker.BadRequestError``, ``tinker.PermissionDeniedError`` for a full
store), so code written against the SDK behaves the same in-process; each is also a polyrl
:class:`UserInputError` (a ``ValueError``) or, for a full store, a :class:`CheckpointWriteError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import quote, unquote

import httpx
import tinker

from polyrl.errors import CheckpointWriteError, UserInputError

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
MAX_TTL_S = 10 * 365 * 24 * 3600  # Tinker's longest TTL: 10 years
MAX_AGE_RECIPIENTS = 10  # Tinker's limit on an external export's age recipients


# ---- errors, as the SDK raises them ------------------------------------------------------------------
class _StoreStatusError:
    """Builds the SDK's status error (which wants an HTTP response) for a problem found in-process."""

    status = 0

    def __init__(self, message: str):
        response = httpx.Response(self.status, request=httpx.Request("POST", "polyrl://local/store"))
        super().__init__(message, response, {"error": message, "category": "user"})  # type: ignore[call-arg]

    def __reduce__(self):
        return type(self), (str(self),)


class CheckpointConflictError(_StoreStatusError, tinker.ConflictError, UserInputError):
    """A checkpoint of that name exists (or is already in the state asked for): HTTP 409."""

    status = 409


class CheckpointNotFoundError(_StoreStatusError, tinker.NotFoundError, UserInputError):
    """No such checkpoint (or it expired): HTTP 404."""

    status = 404


class CheckpointRequestError(_StoreStatusError, tinker.BadRequestError, UserInputError):
    """A malformed path, TTL or recipient: HTTP 400."""

    status = 400


class StoreFullError(_StoreStatusError, tinker.PermissionDeniedError, CheckpointWriteError):
    """The save would pass the store's size cap: HTTP 403 (nothing of it is kept)."""

    status = 403


def default_store_dir() -> Path:
    env = os.environ.get("POLYRL_STORE_DIR")
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "polyrl" / "store"


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    kind: str  # "weights" | "sampler_weights" | "external_weights"
    name: str

    @classmethod
    def parse(cls, path: str) -> "CheckpointPath":
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise CheckpointRequestError(
                f"checkpoint path {path!r} must look like tinker://<run_id>/weights/<name>")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or not all(parts) or parts[1] not in KINDS:
            raise CheckpointRequestError(
                f"checkpoint path {path!r} must look like tinker://<run_id>/weights/<name>, "
                "tinker://<run_id>/sampler_weights/<name> or tinker://<run_id>/external_weights/<name>"
            )
        # the run id and name become directory names: '..' (or any name the store would not write)
        # would lead out of the store
        for value, what in ((parts[0], "run id"), (parts[2], "checkpoint name")):
            if problem := name_problem(value, what):
                raise CheckpointRequestError(f"checkpoint path {path!r}: {problem}")
        return cls(*parts)

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


# + 8 hex digits + "-" + name: a checkpoint being written / replaced / removed
_NEW, _ASIDE, _GONE = ".tmp-new-", ".tmp-old-", ".tmp-del-"
META = "polyrl.json"
WEIGHTS = "adapter_model.safetensors"
# A temporary directory nothing has touched for this long belongs to a save that died (killed mid-write):
# the store's lifecycle removes it. Age, not a process id, decides, because two processes (an in-process
# ``polyrl train`` and a server, perhaps on different hosts of a shared file system) may write one store,
# and a live save touches its directory and files as it writes them, within seconds.
STALE_TEMP_S = 600.0


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
        raise CheckpointRequestError(problem)
    return name


def check_ttl(ttl_seconds: Any) -> int | None:
    """A TTL the store honours: whole seconds from 1 to 10 years, or None (never expires). Tinker's own
    lower bound (an hour) is a policy of its service; a local store accepts short ones (tests use them)."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 1 <= ttl_seconds <= MAX_TTL_S:
        raise CheckpointRequestError(f"ttl_seconds must be a whole number of seconds from 1 to {MAX_TTL_S} "
                                     f"(10 years), or None for no expiry; got {ttl_seconds!r}")
    return ttl_seconds


def expiry(ttl_seconds: int | None, now: float | None = None) -> str | None:
    """``expires_at`` (ISO 8601, UTC) of a checkpoint given ``ttl_seconds`` from ``now``."""
    if ttl_seconds is None:
        return None
    start = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    return (start + timedelta(seconds=ttl_seconds)).isoformat()


def expired(meta: dict, now: float | None = None) -> bool:
    at = meta.get("expires_at")
    if not at:
        return False
    try:
        return datetime.fromisoformat(at).timestamp() <= (time.time() if now is None else now)
    except (TypeError, ValueError):
        return False


def age_recipients(recipients: list[str] | None) -> list[Any]:
    """Parsed age recipients (native ``age1...`` keys or SSH public keys) for an external export."""
    if not recipients:
        return []
    if len(recipients) > MAX_AGE_RECIPIENTS:
        raise CheckpointRequestError(
            f"at most {MAX_AGE_RECIPIENTS} age_encryption_recipients, got {len(recipients)}")
    try:
        import pyrage
    except ImportError:
        raise CheckpointRequestError(
            "age_encryption_recipients need the pyrage package (pip install pyrage)") from None
    parsed = []
    for r in recipients:
        try:
            kind = pyrage.ssh if isinstance(r, str) and r.startswith("ssh-") else pyrage.x25519
            parsed.append(kind.Recipient.from_str(r))
        except Exception:  # noqa: BLE001 - pyrage raises its own error types, or TypeError for a non-string
            shown = r if isinstance(r, str) and len(r) <= 100 else f"{str(r)[:60]}..."
            raise CheckpointRequestError(
                f"age recipient {shown!r} is neither an age1... key nor an SSH public key") from None
    return parsed


def encrypt_files(directory: Path, recipients: list[Any]) -> None:
    """Replace every file in ``directory`` by its age encryption to ``recipients`` (``<name>.age``)."""
    import pyrage

    for f in sorted(p for p in directory.iterdir() if p.is_file()):
        (directory / f"{f.name}.age").write_bytes(pyrage.encrypt(f.read_bytes(), recipients))
        f.unlink()


class Store:
    SWEEP_EVERY_S = 60.0  # how often a save also sweeps the whole store for expired checkpoints

    def __init__(self, root: str | Path | None = None, max_bytes: int | None = None):
        self.root = Path(root).expanduser() if root else default_store_dir()
        self.max_bytes = max_bytes
        self._lock = threading.RLock()  # removals, metadata rewrites and renames into place
        self._swept_at = 0.0

    def run_directory(self, run_id: str) -> Path:
        """A run's directory; the id is percent-encoded (Tinker's ids hold ':', which not every file
        system accepts in a name)."""
        return self.root / quote(run_id, safe="")

    def directory(self, cp: CheckpointPath) -> Path:
        final = self.run_directory(cp.run_id) / cp.kind / cp.name
        if not final.exists() and final.parent.is_dir():  # a crash mid-overwrite: put the old one back
            with self._lock:  # not between an overwrite's two renames
                for d in final.parent.iterdir():
                    if (d.name.startswith(_ASIDE) and d.name[len(_ASIDE) + 9:] == cp.name
                            and not final.exists() and (d / META).exists()):
                        os.replace(d, final)
                        break
        return final

    def resolve(self, path: str) -> tuple[CheckpointPath, Path]:
        """The checkpoint at ``path`` and its directory. An incomplete one (a crash removed some of its
        files) is not found; an expired one is removed here (NotFound). Messages name the ``tinker://``
        path, never a directory: they reach clients of ``polyrl serve``."""
        cp = CheckpointPath.parse(path)
        while True:
            d = self.directory(cp)
            meta = self._read_meta(d)
            if meta is None or not self.complete(d, meta):
                raise CheckpointNotFoundError(f"checkpoint {path} not found")
            if not expired(meta):
                return cp, d
            if self._remove_if(d, meta):
                raise CheckpointNotFoundError(
                    f"checkpoint {path} expired at {meta['expires_at']} and was removed")
            # replaced (or its TTL changed) since it was read: decide again on what is there now

    def exists(self, cp: CheckpointPath) -> bool:
        """Whether ``cp`` is in the store (an expired one is removed, and is not)."""
        try:
            self.resolve(str(cp))
        except CheckpointNotFoundError:
            return False
        return True

    def write(self, cp: CheckpointPath, writer: Callable[[Path], None], meta: dict, overwrite: bool = False,
              ttl_seconds: int | None = None) -> str:
        """Run ``writer(tmp_dir)``, add ``polyrl.json``, and move the directory into place atomically.

        A name that exists is a :class:`CheckpointConflictError` unless ``overwrite``; a save past the
        store's size cap a :class:`StoreFullError`. A file system error on the way (a full disk, a store
        turned read-only) raises :class:`CheckpointWriteError` naming the checkpoint. Either way nothing of
        the new checkpoint is kept."""
        ttl = check_ttl(ttl_seconds)
        self._sweep_now_and_then()
        final = self.directory(cp)
        if not overwrite and self.exists(cp):
            raise CheckpointConflictError(
                f"checkpoint {cp} already exists (pass overwrite=True to replace it)")
        try:
            return self._write(cp, final, writer, {**meta, "expires_at": expiry(ttl), "public": False})
        except (OSError, StoreFullError) as e:
            for parent in (final.parent, final.parent.parent):  # directories made for it alone
                with contextlib.suppress(OSError):  # not empty
                    parent.rmdir()
            if isinstance(e, StoreFullError):
                raise
            reason = e.strerror or str(e) or type(e).__name__  # strerror, not str(e), which names a file
            raise CheckpointWriteError(f"could not write checkpoint {cp} to the checkpoint store: "
                                       f"{reason} (nothing of it was kept)") from None

    def _write(self, cp: CheckpointPath, final: Path, writer: Callable[[Path], None], meta: dict) -> str:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f"{_NEW}{uuid.uuid4().hex[:8]}-{cp.name}"
        aside = final.parent / f"{_ASIDE}{uuid.uuid4().hex[:8]}-{cp.name}"
        tmp.mkdir()
        try:
            writer(tmp)
            # generation: this write's own id (a download URL is bound to it); files: what a complete
            # checkpoint holds (a crash that removed some leaves it incomplete, and so absent)
            meta = {**meta, "time": datetime.now(timezone.utc).isoformat(), "tinker_path": str(cp),
                    "generation": uuid.uuid4().hex,
                    "files": sorted(f.name for f in tmp.iterdir() if f.is_file())}
            (tmp / META).write_text(json.dumps(meta, indent=2))
            self._check_room(cp, tmp, final)
            _fsync_tree(tmp)
            with self._lock:
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

    # ---- size --------------------------------------------------------------------------------------
    def _check_room(self, cp: CheckpointPath, new: Path, replaced: Path) -> None:
        if self.max_bytes is None:
            return
        kept = [d for d in self._held_dirs() if d not in (replaced, new)]
        total = _bytes([*kept, new])
        if total > self.max_bytes:
            self.sweep()  # expired checkpoints make room first
            kept = [d for d in self._held_dirs() if d not in (replaced, new)]
            total = _bytes([*kept, new])
        if total > self.max_bytes:
            held = _bytes(kept)
            raise StoreFullError(f"checkpoint {cp} ({total - held} bytes) does not fit the store's cap of "
                                 f"{self.max_bytes} bytes ({held} held); delete checkpoints, or save them "
                                 "with a TTL, to make room (nothing of it was kept)")

    def used_bytes(self) -> int:
        """Bytes the store holds: its checkpoints, and saves under way, incomplete checkpoints and a crash's
        leftovers until they are removed (a file linked into several copies counts once)."""
        return _bytes(list(self._held_dirs()))

    def _kind_dirs(self, run_id: str | None = None) -> Iterator[Path]:
        runs = [self.run_directory(run_id)] if run_id is not None else \
            (sorted(p for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else [])
        for run in runs:
            for kind in KINDS:
                if (run / kind).is_dir():
                    yield run / kind

    def _held_dirs(self) -> Iterator[Path]:
        """Every directory under the runs' kind directories: checkpoints, whole or not, and temporary ones."""
        for base in self._kind_dirs():
            with contextlib.suppress(OSError):  # removed meanwhile
                yield from sorted(d for d in base.iterdir() if d.is_dir())

    def _checkpoint_dirs(self, run_id: str | None = None) -> Iterator[Path]:
        for base in self._kind_dirs(run_id):
            for d in sorted(base.iterdir()):
                if not d.name.startswith(".") and (d / META).exists():
                    yield d

    @staticmethod
    def complete(directory: Path, meta: dict) -> bool:
        """Whether every file the checkpoint was written with is there (a crash may have removed some).
        A checkpoint whose metadata lists no files needs at least its adapter weights."""
        names = meta.get("files")
        if not isinstance(names, list):
            names = [f"{WEIGHTS}.age" if meta.get("encrypted") else WEIGHTS]
        return all(isinstance(n, str) and (directory / n).is_file() for n in names)

    # ---- metadata ------------------------------------------------------------------------------------
    @staticmethod
    def meta(directory: Path) -> dict:
        return json.loads((directory / META).read_text())

    def _read_meta(self, directory: Path) -> dict | None:
        try:
            return self.meta(directory)
        except (OSError, ValueError):
            return None

    def _update_meta(self, directory: Path, **changes: Any) -> dict:
        """Rewrite ``polyrl.json`` with ``changes``, atomically (a temporary file renamed over it)."""
        with self._lock:
            meta = {**self.meta(directory), **changes}
            tmp = directory / f".{META}.tmp"
            tmp.write_text(json.dumps(meta, indent=2))
            _fsync(tmp)
            os.replace(tmp, directory / META)
            _fsync(directory)
        return meta

    def set_ttl(self, path: str, ttl_seconds: int | None) -> dict:
        """Expire the checkpoint ``ttl_seconds`` from now (None: never)."""
        ttl = check_ttl(ttl_seconds)
        _, d = self.resolve(path)
        return self._update_meta(d, expires_at=expiry(ttl))

    def set_public(self, path: str, public: bool) -> dict:
        """Publish (or unpublish) a checkpoint; one that already is gets a conflict, as from Tinker. Each
        publication has its own id (``publication``): what was handed out under one (a download URL) ends
        with it, and a later publication does not revive it."""
        _, d = self.resolve(path)
        if bool(self.meta(d).get("public")) == public:
            raise CheckpointConflictError(f"checkpoint {path} is already {'public' if public else 'private'}")
        return self._update_meta(d, public=public, publication=uuid.uuid4().hex if public else None)

    def files(self, path: str) -> dict[str, Path]:
        """The files of a checkpoint, by name (what a download gets: not the store's own metadata)."""
        _, d = self.resolve(path)
        return {f.name: f for f in sorted(d.iterdir()) if f.is_file() and f.name != META
                and not f.name.startswith(".")}

    def copy(self, source: str, target: CheckpointPath, ttl_seconds: int | None = None,
             meta: dict | None = None) -> str:
        """A new checkpoint ``target`` with ``source``'s files, linked where the file system allows (no
        bytes duplicated; removing either leaves the other whole). The source's TTL is not inherited."""
        cp, d = self.resolve(source)
        if target.kind != cp.kind:
            raise CheckpointRequestError(f"a copy of {source} keeps its kind ({cp.kind}), not {target.kind}")
        lifecycle = ("time", "tinker_path", "expires_at", "public", "publication", "generation", "files")
        base = {k: v for k, v in self.meta(d).items() if k not in lifecycle}

        def link(tmp: Path) -> None:
            for name, f in self.files(source).items():
                try:
                    os.link(f, tmp / name)
                except OSError:  # another file system, or one without links
                    shutil.copy2(f, tmp / name)

        meta = {**base, "copied_from": source, **(meta or {})}
        return self.write(target, link, meta, ttl_seconds=ttl_seconds)

    # ---- listing, expiry and removal -------------------------------------------------------------------
    def row(self, directory: Path, meta: dict) -> dict:
        """A checkpoint as Tinker's ``Checkpoint`` fields."""
        kind, name = directory.parent.name, directory.name
        run_id = unquote(directory.parent.parent.name)
        return {
            "checkpoint_id": f"{kind}/{name}",
            "checkpoint_type": KINDS[kind],
            "time": meta.get("time"),
            "tinker_path": meta.get("tinker_path", f"tinker://{run_id}/{kind}/{name}"),
            "size_bytes": sum(f.stat().st_size for f in directory.iterdir() if f.is_file()),
            "public": bool(meta.get("public")),
            "user_metadata": meta.get("user_metadata"),
            "expires_at": meta.get("expires_at"),
        }

    def list(self, run_id: str) -> list[dict]:
        """Checkpoints of a run, oldest first: dicts with Tinker's ``Checkpoint`` fields. An expired
        checkpoint is listed (its ``expires_at`` past) and then removed: the next listing has it no more."""
        rows, gone = [], []
        now = time.time()
        for d in self._checkpoint_dirs(run_id):
            meta = self._read_meta(d)
            if meta is None or not self.complete(d, meta):
                continue
            with contextlib.suppress(OSError):  # removed meanwhile
                rows.append(self.row(d, meta))
                if expired(meta, now):
                    gone.append((d, meta))
        for d, meta in gone:
            self._remove_if(d, meta)
        return sorted(rows, key=lambda r: r["time"] or "")

    def runs(self) -> list[str]:
        return (sorted(unquote(p.name) for p in self.root.iterdir() if p.is_dir())
                if self.root.is_dir() else [])

    def delete(self, path: str) -> None:
        """Remove a checkpoint, and its run's directories once nothing is left in them."""
        _, d = self.resolve(path)
        self._remove(d)

    def _remove(self, directory: Path) -> None:
        self._remove_if(directory, None, always=True)

    def _remove_if(self, directory: Path, meta: dict | None, always: bool = False) -> bool:
        """Remove ``directory`` if its metadata is still ``meta`` (None: still missing or unreadable), or
        ``always``; whether it did. The check and the move out of the way happen under the lock that
        overwrites take, so a save landing after the caller decided is never what is removed. The
        directory is renamed before its files go, so that a crash midway leaves no half-removed
        checkpoint, only a temporary directory the lifecycle removes."""
        gone: Path | None = directory.parent / f"{_GONE}{uuid.uuid4().hex[:8]}-{directory.name}"
        with self._lock:
            if not always and self._read_meta(directory) != meta:
                return False
            try:
                os.replace(directory, gone)
            except FileNotFoundError:  # removed meanwhile
                return False
            except OSError:  # a store that refuses the rename (read-only): remove in place, as far as it goes
                shutil.rmtree(directory, ignore_errors=True)
                gone = None
        if gone is not None:
            shutil.rmtree(gone, ignore_errors=True)
        with self._lock:
            for parent in (directory.parent, directory.parent.parent):
                with contextlib.suppress(OSError):  # not empty
                    parent.rmdir()
        return True

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove every expired checkpoint (their paths), then a crash's leftovers (:meth:`reclaim`)."""
        now = time.time() if now is None else now
        self._swept_at = time.monotonic()
        removed = []
        for d in list(self._checkpoint_dirs()):
            meta = self._read_meta(d)
            if meta is not None and expired(meta, now) and self._remove_if(d, meta):
                removed.append(meta.get("tinker_path") or d.name)
        self.reclaim()
        return removed

    def reclaim(self) -> None:
        """Remove what a crash left in the store: incomplete checkpoints (some of their files, or their
        metadata, gone), removals cut short, and temporary directories of saves that died
        (untouched for ``STALE_TEMP_S``; a live save's are kept). A checkpoint set aside by an overwrite cut
        short between its two renames is put back. Run when the store opens for an engine (a server's
        start) and by every sweep; problems reading or removing are left for the next time."""
        now = time.time()
        for base in list(self._kind_dirs()):
            with contextlib.suppress(OSError):
                for d in sorted(base.iterdir()):
                    with contextlib.suppress(OSError):
                        self._reclaim_one(d, now)

    def _reclaim_one(self, d: Path, now: float) -> None:
        if not d.is_dir():
            return
        if d.name.startswith(_GONE):
            shutil.rmtree(d, ignore_errors=True)
        elif d.name.startswith((_NEW, _ASIDE)):
            if now - _last_touched(d) < STALE_TEMP_S:
                return
            final = d.parent / d.name[len(_ASIDE) + 9:]
            with self._lock:
                if d.name.startswith(_ASIDE) and not final.exists() and (d / META).exists():
                    os.replace(d, final)
                    return
            shutil.rmtree(d, ignore_errors=True)
        elif not d.name.startswith("."):
            meta = self._read_meta(d)
            if meta is None or not self.complete(d, meta):
                self._remove_if(d, meta)

    def _sweep_now_and_then(self) -> None:
        if time.monotonic() - self._swept_at >= self.SWEEP_EVERY_S:
            self.sweep()


def _last_touched(directory: Path) -> float:
    """The latest modification time of ``directory`` and the entries in it."""
    return max([directory.stat().st_mtime, *(p.stat().st_mtime for p in directory.iterdir())])


def _bytes(directories: list[Path]) -> int:
    """Bytes of the files in ``directories``, each file (inode) once."""
    seen, total = set(), 0
    for d in directories:
        with contextlib.suppress(OSError):
            for f in d.iterdir():
                with contextlib.suppress(OSError):
                    st = f.stat()
                    if f.is_file() and (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
    return total
