"""The checkpoint lifecycle over Tinker's REST routes: TTLs, publishing, copies, external weights and
their signed download URLs, expiry sweeps and the store's size cap.

:class:`CheckpointLifecycle` is part of :class:`~polyrl.serve.server.Server` (a base class of it), kept
here so that each file has one job. It uses the server's ``engine`` (its store), ``runs``, ``models``,
``config``, its sessions and its ownership rules: a key changes only the checkpoints of its own runs
(another key's are "not found"), and reads those, the ones no key owns, and published ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

import tinker

from polyrl.local.checkpoints import CheckpointPath, age_recipients, check_ttl
from polyrl.serve import protocol as P
from polyrl.serve.protocol import RequestError
from polyrl.serve.runs import check_id, check_tinker_path
from polyrl.serve.state import ModelRecord, key_owner

log = logging.getLogger("polyrl.serve")


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """The store's errors (the SDK's status errors) as the same HTTP status."""
    try:
        yield
    except tinker.APIStatusError as e:
        raise RequestError(e.status_code, str(e)) from None
    except FileNotFoundError as e:  # removed while it was being read
        raise RequestError(404, f"not found: {e.filename}") from None


class Downloads:
    """Signed URLs of an external checkpoint's files: an expiry and an HMAC of the file and expiry under
    a secret of this server process, so that a plain GET (``urllib``, ``curl``) fetches the file without
    the API key until the URL expires (or the server restarts: the SDK then asks for new ones)."""

    PREFIX = "/api/v1/external_weights_files/"
    LIFETIME_S = 3600

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)

    def _signature(self, run_id: str, name: str, file: str, expires: int) -> str:
        message = "\0".join([run_id, name, file, str(expires)]).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def urls(self, base_url: str, run_id: str, name: str,
             files: list[str]) -> tuple[dict[str, str], datetime]:
        expires = int(time.time()) + self.LIFETIME_S
        base = base_url.rstrip("/") + self.PREFIX + f"{quote(run_id, safe='')}/{quote(name, safe='')}/"
        urls = {f: f"{base}{quote(f, safe='')}?expires={expires}"
                   f"&signature={self._signature(run_id, name, f, expires)}" for f in files}
        return urls, datetime.fromtimestamp(expires, timezone.utc)

    def check(self, run_id: str, name: str, file: str, expires: int, signature: str) -> None:
        if not hmac.compare_digest(self._signature(run_id, name, file, expires), signature):
            raise RequestError(403, "this download URL's signature does not match (ask "
                                    "get_external_weights_urls for a new one)")
        if expires < time.time():
            raise RequestError(403, "this download URL has expired (ask get_external_weights_urls for a "
                                    "new one)")


class CheckpointLifecycle:
    """Checkpoint saves' admission, TTLs, publishing, copies, external weights, sweeps: part of ``Server``."""

    MAX_REMEMBERED_COPIES = 10_000  # idempotency keys of copies, per server

    def _init_lifecycle(self) -> None:
        self.downloads = Downloads()
        self.copies: OrderedDict[tuple[str, str], str] = OrderedDict()  # (owner, idempotency key) -> path
        self.key_owners = {key_owner_of(k) for k in self.config.api_keys}

    # ---- who may do what ---------------------------------------------------------------------------
    def token_owner(self, token: str | None) -> str | None:
        """The owner of ``token`` if it is one of this server's API keys (Tinker takes a key as a weights
        access token): what that key may read, the bearer may read too."""
        if not token:
            return None
        owner = key_owner_of(token)
        return owner if owner in self.key_owners else None

    def _own_checkpoint(self, run_id: str, kind: str, name: str, owner: str) -> str:
        """The path of a checkpoint ``owner`` may change, or the 404 of a missing one."""
        path = self.runs.checkpoint_path(run_id, f"{kind}/{name}")
        if self._run_owner(run_id) != owner:
            raise RequestError(404, f"checkpoint {path} not found")
        return path

    # ---- saves -------------------------------------------------------------------------------------------
    def _saving(self, owner: str) -> list[tuple[Future, tuple[str, str, str]]]:
        """The key's saves of new checkpoints not done yet (with their (run, kind, name))."""
        self.saving[owner] = [x for x in self.saving.get(owner, []) if not x[0].done()]
        return self.saving[owner]

    def _checkpoint_room(self, owner: str) -> RequestError | None:
        """A 403 when the key already keeps ``max_checkpoints`` (counting saves under way), until it
        deletes some."""
        limit = self.config.max_checkpoints
        kept = self.runs.count_checkpoints(self._own_runs(owner))
        # saves under way, not on disk yet
        coming = sum(not self.runs.has_checkpoint(*target) for _, target in self._saving(owner))
        if kept + coming < limit:
            return None
        pending = f" and is saving {coming} more" if coming else ""
        return RequestError(403, f"this key keeps {kept} checkpoints{pending}, the most this server allows "
                                 f"per key (--max-checkpoints {limit}); delete some "
                                 "(RestClient.delete_checkpoint, or DELETE "
                                 "/api/v1/training_runs/<run>/checkpoints/<id>) to save more")

    def _save(self, rec: ModelRecord, seq_id: int, kind: str, name: str, run, overwrite: bool,
              ttl_seconds: int | None = None) -> dict:
        """Submit a checkpoint save, or refuse it at the request (using up ``seq_id``, and answering the
        SDK's retries of it the same): a name that exists (or is being saved), unless ``overwrite``, is a
        409, as from Tinker; a bad TTL a 400; a key that keeps ``max_checkpoints``, or a store at its
        size cap, a 403. Replacing a checkpoint that exists adds none."""
        new = False
        if rec.ops.accepts(seq_id):
            exists = self.runs.has_checkpoint(rec.model_id, kind, name)
            new = not exists
            target = (rec.model_id, kind, name)
            error = None
            try:
                check_ttl(ttl_seconds)
            except ValueError as e:
                error = RequestError(400, str(e))
            taken = exists or any(t == target for _, t in self._saving(rec.owner))
            if error is None and not overwrite and taken:
                error = RequestError(409, f"checkpoint tinker://{rec.model_id}/{kind}/{name} already exists "
                                          "(pass overwrite=True to replace it, or save under another name)")
            if error is None and new:
                error = self._checkpoint_room(rec.owner)
            if error is None:
                error = self.store_room(rec.model_id, kind, name)
            if error is not None:
                rec.ops.refuse(seq_id, error)
                raise error
        rid = rec.ops.submit(seq_id, run, dict)
        if new:
            self._saving(rec.owner).append((self.futures.get(rid).future, (rec.model_id, kind, name)))
        return {"request_id": rid, "model_id": rec.model_id}

    def save_external(self, req: P.SaveExternalReq, owner: str) -> dict:
        rec = self._model(req.model_id, owner)
        name = self._checkpoint_name(rec, req.seq_id, req.path)
        try:
            age_recipients(req.age_encryption_recipients)  # checked at the request
        except ValueError as e:
            rec.ops.refuse(req.seq_id, error := RequestError(400, str(e)))
            raise error from None

        def run() -> dict:
            path = self.engine.save_external(rec.ready.result(), name, req.ttl_seconds,
                                             req.age_encryption_recipients)
            rows = self.runs.checkpoints(rec.model_id)
            size = sum(c["size_bytes"] or 0 for c in rows if c["tinker_path"] == path)
            return {"path": path, "size_bytes": size, "type": "save_weights_external"}

        return self._save(rec, req.seq_id, "external_weights", name, run, False, req.ttl_seconds)

    # ---- REST ------------------------------------------------------------------------------------------
    def set_checkpoint_ttl(self, run_id: str, kind: str, name: str, req: P.SetTtlReq, owner: str) -> None:
        path = self._own_checkpoint(run_id, kind, name, owner)
        with store_errors():
            self.engine.store.set_ttl(path, req.ttl_seconds)

    def publish_checkpoint(self, run_id: str, kind: str, name: str, owner: str, public: bool) -> None:
        """Publish (every key may then load or sample it) or unpublish; 409 if it already is."""
        path = self._own_checkpoint(run_id, kind, name, owner)
        with store_errors():
            self.engine.store.set_public(path, public)

    def external_weights_urls(self, run_id: str, kind: str, name: str, owner: str, base_url: str) -> dict:
        path = self.runs.checkpoint_path(run_id, f"{kind}/{name}")
        if kind != "external_weights":
            raise RequestError(400, f"{path} is not external weights: save them with save_weights_external")
        self._checkpoint_meta(path, owner)
        with store_errors():
            files = self.engine.store.files(path)
        urls, expires = self.downloads.urls(base_url, run_id, name, list(files))
        return {"urls": urls, "expires": expires.isoformat()}

    def download(self, run_id: str, name: str, file: str, expires: int, signature: str) -> Path:
        """The file a signed URL names (checked), if its checkpoint is still there."""
        self.downloads.check(run_id, name, file, expires, signature)
        path = str(check_tinker_path(f"tinker://{run_id}/external_weights/{name}"))
        with store_errors():
            files = self.engine.store.files(path)
        if file not in files:
            raise RequestError(404, f"{path} has no file {file!r}")
        return files[file]

    def copy_weights(self, req: P.CopyWeightsReq, owner: str, idempotency_key: str | None,
                     token: str | None) -> dict:
        """A copy of a checkpoint the caller (or ``token``'s key) may read, in a new training run the caller
        owns: ``session_id:train:model_seq_id`` if given, else one of its own. Its files are linked, not
        duplicated; the source's TTL is not inherited. A retry with the same idempotency key gets the
        first copy back."""
        remembered = (owner, idempotency_key or "")
        if idempotency_key and remembered in self.copies:
            return {"tinker_path": self.copies[remembered]}
        source = check_tinker_path(req.source_path)
        meta = self._checkpoint_meta(req.source_path, owner, token)
        try:
            check_ttl(req.ttl_seconds)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        if req.session_id is not None:
            if req.model_seq_id is None:
                raise RequestError(400, "copy_weights with a session_id needs its model_seq_id")
            session = self._session(req.session_id, owner)
            run_id = f"{session.session_id}:train:{req.model_seq_id}"
            if run_id in self.models or self.runs.owner(run_id) is not None:
                raise RequestError(409, f"training run {run_id} exists already; copy into another "
                                        "model_seq_id")
        elif req.destination_project_id:
            run_id = check_id(f"copy-{uuid.uuid4().hex[:12]}:train:0", "training run id")
        else:
            raise RequestError(400, "copy_weights needs a destination_project_id, or a session_id and "
                                    "model_seq_id")
        if (full := self._checkpoint_room(owner)) is not None:
            raise full
        try:
            self.runs.record(run_id, owner, meta["base_model"], meta.get("lora") or {}, None,
                             project_id=req.destination_project_id, copied_from=req.source_path)
        except OSError as e:
            raise RequestError(503, f"could not record training run {run_id}: {e}", "server") from None
        target = CheckpointPath(run_id, source.kind, source.name)
        try:
            with store_errors():
                path = self.engine.store.copy(req.source_path, target, req.ttl_seconds,
                                              {"project_id": req.destination_project_id, "model_id": run_id})
        except BaseException:
            self.runs.forget(run_id)
            raise
        if idempotency_key:
            self.copies[remembered] = path
            while len(self.copies) > self.MAX_REMEMBERED_COPIES:
                self.copies.popitem(last=False)
        return {"tinker_path": path}

    # ---- the store's bounds ----------------------------------------------------------------------------
    def store_room(self, run_id: str, kind: str, name: str) -> RequestError | None:
        """A 403 when the store's size cap leaves no room for a new checkpoint of this run (as large as its
        latest of that kind; a replaced one frees its own room). The save itself checks exactly."""
        store = self.engine.store
        if store.max_bytes is None:
            return None
        replacing = self.runs.has_checkpoint(run_id, kind, name)
        same_kind = [c for c in self.runs.checkpoints(run_id) if c["checkpoint_id"].startswith(f"{kind}/")]
        estimate = 0 if replacing or not same_kind else int(same_kind[-1]["size_bytes"] or 0)
        used = store.used_bytes()
        if used + estimate <= store.max_bytes and used < store.max_bytes:
            return None
        return RequestError(403, f"the checkpoint store holds {used} bytes of its cap of {store.max_bytes} "
                                 f"(--max-store-bytes); a checkpoint of this run needs about {estimate} "
                                 "more: delete checkpoints (RestClient.delete_checkpoint) or save them with "
                                 "a TTL")

    def sweep(self) -> list[str]:
        """Remove expired checkpoints (run every ``sweep_interval_s`` by the server)."""
        removed = self.engine.store.sweep()
        if removed:
            log.info("removed %d expired checkpoint(s): %s", len(removed), ", ".join(removed[:5]))
        return removed


def key_owner_of(key: str) -> str:
    return key_owner(key.encode())
