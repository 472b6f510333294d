"""Checkpoints and training runs over Tinker's REST routes: who may read or change them, saves' admission,
TTLs, publishing, copies, external weights and their signed download URLs, expiry sweeps and the store's
size cap, and the runs' and checkpoints' listings.

A key changes only the checkpoints of its own runs (another key's are "not found"), and reads those, the
ones no key owns, and published ones.
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
from typing import BinaryIO, Iterator
from urllib.parse import quote

import tinker

from polyrl.local.checkpoints import CheckpointPath, check_ttl
from polyrl.serve import protocol as P
from polyrl.serve.protocol import RequestError
from polyrl.serve.runs import Runs, check_id, check_tinker_path, optimizer_config, paginate
from polyrl.serve.sessions import Models, Sessions
from polyrl.serve.state import Futures, ModelRecord, key_owner

log = logging.getLogger("polyrl.serve")


@contextlib.contextmanager
def store_errors(path: str) -> Iterator[None]:
    """The store's errors (the SDK's status errors) as the same HTTP status; one of the file system names
    the checkpoint ``path``, never the server's files."""
    try:
        yield
    except tinker.APIStatusError as e:
        raise RequestError(e.status_code, str(e)) from None
    except FileNotFoundError:  # removed while it was being read
        raise RequestError(404, f"checkpoint {path} not found") from None


class Downloads:
    """Signed URLs of an external checkpoint's files: an HMAC, under a secret of this server process, of
    the file, an expiry, the checkpoint's generation (the id of the save that wrote it) and, for a URL
    issued to another key because the checkpoint was published, that publication's id. A plain GET
    (``urllib``, ``curl``) fetches the file without the API key until the URL expires (or the server
    restarts: the SDK then asks for new ones), and only while the checkpoint is the one, in the publication,
    that the URL was issued for: deleted, replaced by a new save of the name, or unpublished, it is gone."""

    PREFIX = "/api/v1/external_weights_files/"
    LIFETIME_S = 3600

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)

    def _signature(self, run_id: str, name: str, file: str, expires: int, generation: str,
                   publication: str) -> str:
        message = "\0".join([run_id, name, file, str(expires), generation, publication]).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def urls(self, base_url: str, run_id: str, name: str, files: list[str], generation: str,
             publication: str) -> tuple[dict[str, str], datetime]:
        expires = int(time.time()) + self.LIFETIME_S
        base = base_url.rstrip("/") + self.PREFIX + f"{quote(run_id, safe='')}/{quote(name, safe='')}/"
        bound = f"&generation={quote(generation, safe='')}" + \
            (f"&publication={quote(publication, safe='')}" if publication else "")
        urls = {f: f"{base}{quote(f, safe='')}?expires={expires}{bound}"
                   f"&signature={self._signature(run_id, name, f, expires, generation, publication)}"
                for f in files}
        return urls, datetime.fromtimestamp(expires, timezone.utc)

    def check(self, run_id: str, name: str, file: str, expires: int, signature: str, generation: str = "",
              publication: str = "") -> None:
        """A 403 for a URL this server did not sign as it is, or one past its expiry."""
        if not hmac.compare_digest(self._signature(run_id, name, file, expires, generation, publication),
                                   signature):
            raise RequestError(403, "this download URL's signature does not match (ask "
                                    "get_external_weights_urls for a new one)")
        if expires < time.time():
            raise RequestError(403, "this download URL has expired (ask get_external_weights_urls for a "
                                    "new one)")


class Checkpoints:
    """The checkpoints of the engine's store and the training runs they belong to, as keys see them: live
    runs are ``models``' training clients, the others the store's ``runs``."""

    MAX_REMEMBERED_COPIES = 10_000  # idempotency keys of copies, per server

    def __init__(self, config, engine, runs: Runs, models: Models, sessions: Sessions,
                 futures: Futures) -> None:
        self._config = config  # read at each call: ``max_checkpoints``
        self._store = engine.store
        self._runs = runs
        self._models = models
        self._sessions = sessions
        self._futures = futures
        self._downloads = Downloads()
        self._copies: OrderedDict[tuple[str, str], str] = OrderedDict()  # (owner, idempotency key) -> path
        self._key_owners = {key_owner_of(k) for k in config.api_keys}
        self._saving: dict[str, list[tuple[Future, tuple[str, str, str]]]] = {}  # owner -> saves not yet done

    # ---- who may do what ---------------------------------------------------------------------------
    def token_owner(self, token: str | None) -> str | None:
        """The owner of ``token`` if it is one of this server's API keys (Tinker takes a key as a weights
        access token): what that key may read, the bearer may read too."""
        if not token:
            return None
        owner = key_owner_of(token)
        return owner if owner in self._key_owners else None

    def run_owner(self, run_id: str) -> str | None:
        """Who owns a run: a key digest, ``""`` for a run no key owns, None if there is no such run."""
        rec = self._models.get(run_id)
        return rec.owner if rec is not None else self._runs.owner(run_id)

    def readable(self, run_id: str, owner: str) -> bool:
        return self.run_owner(run_id) in (owner, "")

    def checkpoint_meta(self, path: str, owner: str, token: str | None = None, loading: bool = False) -> dict:
        """A checkpoint's metadata, if ``owner`` (or the key ``token`` is) may read it: its own, one no key
        owns, or a published one; otherwise the same 404 as for a missing one. ``loading``: external weights
        (made to be downloaded) are a 400."""
        cp = check_tinker_path(path)
        try:
            _, directory = self._store.resolve(path)
            meta = self._store.meta(directory)
        except (ValueError, OSError):
            raise RequestError(404, f"checkpoint {path} not found") from None
        readers = {owner, "", self.token_owner(token)}
        if self.run_owner(cp.run_id) not in readers and not meta.get("public"):
            raise RequestError(404, f"checkpoint {path} not found")
        if loading and cp.kind == "external_weights":
            raise RequestError(400, f"checkpoint {path} is external weights, made to be downloaded; load the "
                                    "training or sampler checkpoint it was saved from")
        return meta

    def _own_checkpoint(self, run_id: str, kind: str, name: str, owner: str) -> str:
        """The path of a checkpoint ``owner`` may change, or the 404 of a missing one."""
        path = self._runs.checkpoint_path(run_id, f"{kind}/{name}")
        if self.run_owner(run_id) != owner:
            raise RequestError(404, f"checkpoint {path} not found")
        return path

    def _own_runs(self, owner: str) -> list[str]:
        return self._runs.run_ids([rec.model_id for rec in self._models.of(owner)], owner)

    # ---- saves -------------------------------------------------------------------------------------------
    def _saves_under_way(self, owner: str) -> list[tuple[Future, tuple[str, str, str]]]:
        """The key's saves of new checkpoints not done yet (with their (run, kind, name))."""
        self._saving[owner] = [x for x in self._saving.get(owner, []) if not x[0].done()]
        return self._saving[owner]

    def _checkpoint_room(self, owner: str) -> RequestError | None:
        """A 403 when the key already keeps ``max_checkpoints`` (counting saves under way), until it
        deletes some."""
        limit = self._config.max_checkpoints
        kept = self._runs.count_checkpoints(self._own_runs(owner))
        # saves under way, not on disk yet
        coming = sum(not self._runs.has_checkpoint(*target) for _, target in self._saves_under_way(owner))
        if kept + coming < limit:
            return None
        pending = f" and is saving {coming} more" if coming else ""
        return RequestError(403, f"this key keeps {kept} checkpoints{pending}, the most this server allows "
                                 f"per key (--max-checkpoints {limit}); delete some "
                                 "(RestClient.delete_checkpoint, or DELETE "
                                 "/api/v1/training_runs/<run>/checkpoints/<id>) to save more")

    def save(self, rec: ModelRecord, seq_id: int, kind: str, name: str, run, overwrite: bool,
             ttl_seconds: int | None = None) -> dict:
        """Submit a checkpoint save, or refuse it at the request (using up ``seq_id``, and answering the
        SDK's retries of it the same): a name that exists (or is being saved), unless ``overwrite``, is a
        409, as from Tinker; a bad TTL a 400; a key that keeps ``max_checkpoints``, or a store at its
        size cap, a 403. Replacing a checkpoint that exists adds none."""
        new = False
        if rec.ops.accepts(seq_id):
            exists = self._runs.has_checkpoint(rec.model_id, kind, name)
            new = not exists
            target = (rec.model_id, kind, name)
            error = None
            try:
                check_ttl(ttl_seconds)
            except ValueError as e:
                error = RequestError(400, str(e))
            taken = exists or any(t == target for _, t in self._saves_under_way(rec.owner))
            if error is None and not overwrite and taken:
                why = "already exists" if exists else "is already being saved"
                error = RequestError(409, f"checkpoint tinker://{rec.model_id}/{kind}/{name} {why} "
                                          "(pass overwrite=True to replace it, or save under another name)")
                # the SDK retries a 409 silently for five minutes before it raises: say it here, once
                log.warning("refused a save of run %s: checkpoint tinker://%s/%s/%s %s and the save "
                            "did not ask to overwrite it (409; the client's SDK retries for about five "
                            "minutes, then raises ConflictError)", rec.model_id, rec.model_id, kind, name,
                            why)
            if error is None and new:
                error = self._checkpoint_room(rec.owner)
            if error is None:
                error = self.store_room(rec.model_id, kind, name)
            if error is not None:
                rec.ops.refuse(seq_id, error)
                raise error
        rid = rec.ops.submit(seq_id, run, dict)
        if new:
            saving = self._futures.get(rid).future
            self._saves_under_way(rec.owner).append((saving, (rec.model_id, kind, name)))
        return {"request_id": rid, "model_id": rec.model_id}

    # ---- one checkpoint's lifecycle ---------------------------------------------------------------------
    def set_checkpoint_ttl(self, run_id: str, kind: str, name: str, req: P.SetTtlReq, owner: str) -> None:
        path = self._own_checkpoint(run_id, kind, name, owner)
        with store_errors(path):
            self._store.set_ttl(path, req.ttl_seconds)

    def publish_checkpoint(self, run_id: str, kind: str, name: str, owner: str, public: bool) -> None:
        """Publish (every key may then load or sample it) or unpublish; 409 if it already is."""
        path = self._own_checkpoint(run_id, kind, name, owner)
        with store_errors(path):
            self._store.set_public(path, public)

    def external_weights_urls(self, run_id: str, kind: str, name: str, owner: str, base_url: str) -> dict:
        """Signed URLs of the checkpoint's files, bound to its generation and, when the caller reads it only
        because it is published, to that publication."""
        path = self._runs.checkpoint_path(run_id, f"{kind}/{name}")
        if kind != "external_weights":
            raise RequestError(400, f"{path} is not external weights: save them with save_weights_external")
        meta = self.checkpoint_meta(path, owner)
        with store_errors(path):
            files = self._store.files(path)
        publication = "" if self.readable(run_id, owner) else _publication(meta)
        urls, expires = self._downloads.urls(base_url, run_id, name, list(files), _generation(meta),
                                             publication)
        return {"urls": urls, "expires": expires.isoformat()}

    def download(self, run_id: str, name: str, file: str, expires: int, signature: str, generation: str = "",
                 publication: str = "") -> BinaryIO:
        """The file a signed URL names, opened, if the URL is valid and its checkpoint is still the
        generation (and, for a reader's URL, the publication) it was issued for. The checkpoint is read
        again after the file is open, so a save that replaced it in between is seen."""
        self._downloads.check(run_id, name, file, expires, signature, generation, publication)
        path = str(check_tinker_path(f"tinker://{run_id}/external_weights/{name}"))
        with store_errors(path):
            files = self._store.files(path)
            if file not in files:
                raise RequestError(404, f"{path} has no file {file!r}")
            handle = files[file].open("rb")
        try:
            with store_errors(path):
                meta = self._store.meta(self._store.resolve(path)[1])
            if _generation(meta) != generation or (publication and _publication(meta) != publication):
                raise RequestError(404, f"checkpoint {path} not found (the checkpoint this URL was issued "
                                        "for was deleted, replaced or unpublished)")
        except BaseException:
            handle.close()
            raise
        return handle

    def copy_weights(self, req: P.CopyWeightsReq, owner: str, idempotency_key: str | None,
                     token: str | None) -> dict:
        """A copy of a checkpoint the caller (or ``token``'s key) may read, in a new training run the caller
        owns: ``session_id:train:model_seq_id`` if given, else one of its own. Its files are linked, not
        duplicated; the source's TTL is not inherited. A retry with the same idempotency key gets the
        first copy back."""
        remembered = (owner, idempotency_key or "")
        if idempotency_key and remembered in self._copies:
            return {"tinker_path": self._copies[remembered]}
        source = check_tinker_path(req.source_path)
        meta = self.checkpoint_meta(req.source_path, owner, token)
        try:
            check_ttl(req.ttl_seconds)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        if req.session_id is not None:
            if req.model_seq_id is None:
                raise RequestError(400, "copy_weights with a session_id needs its model_seq_id")
            session = self._sessions.owned(req.session_id, owner)
            run_id = f"{session.session_id}:train:{req.model_seq_id}"
            if run_id in self._models or self._runs.owner(run_id) is not None:
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
            self._runs.record(run_id, owner, meta["base_model"], meta.get("lora") or {}, None,
                              project_id=req.destination_project_id, copied_from=req.source_path)
        except OSError as e:  # its reason, not str(e), which names the store's files
            raise RequestError(503, f"could not record training run {run_id}: "
                                    f"{e.strerror or str(e) or type(e).__name__}", "server") from None
        target = CheckpointPath(run_id, source.kind, source.name)
        try:
            with store_errors(req.source_path):
                path = self._store.copy(req.source_path, target, req.ttl_seconds,
                                        {"project_id": req.destination_project_id, "model_id": run_id})
        except BaseException:
            self._runs.forget(run_id)
            raise
        if idempotency_key:
            self._copies[remembered] = path
            while len(self._copies) > self.MAX_REMEMBERED_COPIES:
                self._copies.popitem(last=False)
        return {"tinker_path": path}

    # ---- runs and checkpoints, listed -----------------------------------------------------------------
    def _live_run(self, run_id: str) -> dict | None:
        rec = self._models.get(run_id)
        if rec is None:
            return None
        return {"base_model": rec.base_model, "lora": rec.lora, "user_metadata": rec.user_metadata,
                "last_request": rec.last_request}

    def _visible_run(self, run_id: str, owner: str, access_scope: str = "owned") -> str:
        """A run ``owner`` may see: its own or one no key owns; with ``access_scope="accessible"`` also one
        with a published checkpoint."""
        check_id(run_id, "training run id")
        if not self.readable(run_id, owner) and not (
                access_scope == "accessible" and any(c["public"] for c in self._runs.checkpoints(run_id))):
            raise RequestError(404, f"training run {run_id!r} not found")
        return run_id

    def training_run(self, run_id: str, owner: str, access_scope: str = "owned") -> dict:
        return self._run_view(self._visible_run(run_id, owner, access_scope), owner)

    def _run_view(self, run_id: str, owner: str) -> dict:
        """A run as ``owner`` may see it: all of it if it may read the run, else only what is published."""
        if self.readable(run_id, owner):
            return self._runs.training_run(run_id, self._live_run(run_id))
        return self._runs.training_run(run_id, public_only=True)

    def training_runs(self, limit: int, offset: int, owner: str, access_scope: str = "owned",
                      project_id: str | None = None) -> dict:
        """The key's runs (``accessible``: and those with a published checkpoint), newest first; with a
        ``project_id``, those copied into that project."""
        run_ids = self._own_runs(owner)
        if access_scope == "accessible":
            run_ids = list(dict.fromkeys([*run_ids, *self._runs.public_runs()]))
        if project_id is not None:
            run_ids = [r for r in run_ids if (self._runs.info(r) or {}).get("project_id") == project_id]
        rows = []
        for run_id in run_ids:
            try:
                rows.append(self._run_view(run_id, owner))
            except RequestError:
                continue
        rows.sort(key=lambda r: r["last_request_time"], reverse=True)
        page, cursor = paginate(rows, limit, offset)
        return {"training_runs": page, "cursor": cursor}

    def run_checkpoints(self, run_id: str, owner: str) -> dict:
        return {"checkpoints": self._runs.checkpoints(self._visible_run(run_id, owner))}

    def delete_checkpoint(self, run_id: str, checkpoint_id: str, owner: str) -> None:
        path = self._runs.checkpoint_path(run_id, checkpoint_id)
        if self.run_owner(run_id) != owner:  # only the owner deletes; nobody deletes what no key owns
            raise RequestError(404, f"checkpoint {path} not found")
        self._runs.delete_checkpoint(path)

    def user_checkpoints(self, limit: int, offset: int, owner: str) -> dict:
        rows = [c for run_id in self._own_runs(owner) for c in self._runs.checkpoints(run_id)]
        rows.sort(key=lambda c: c.get("time") or "", reverse=True)
        page, cursor = paginate(rows, limit, offset)
        return {"checkpoints": page, "cursor": cursor}

    def weights_info(self, req: P.WeightsInfoReq, owner: str) -> dict:
        meta = self.checkpoint_meta(req.tinker_path, owner)
        lora = meta.get("lora", {})
        return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": lora.get("rank"),
                "train_unembed": lora.get("train_unembed"), "train_mlp": lora.get("train_mlp"),
                "train_attn": lora.get("train_attn"),
                "optimizer_config": optimizer_config(meta.get("optimizer", "adamw"))}

    # ---- the store's bounds ----------------------------------------------------------------------------
    def store_room(self, run_id: str, kind: str, name: str) -> RequestError | None:
        """A 403 when the store's size cap leaves no room for a new checkpoint of this run (as large as its
        latest of that kind; a replaced one frees its own room). The save itself checks exactly."""
        store = self._store
        if store.max_bytes is None:
            return None
        replacing = self._runs.has_checkpoint(run_id, kind, name)
        same_kind = [c for c in self._runs.checkpoints(run_id) if c["checkpoint_id"].startswith(f"{kind}/")]
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
        removed = self._store.sweep()
        if removed:
            log.info("removed %d expired checkpoint(s): %s", len(removed), ", ".join(removed[:5]))
        return removed


def key_owner_of(key: str) -> str:
    return key_owner(key.encode())


def _generation(meta: dict) -> str:
    return str(meta.get("generation") or "")


def _publication(meta: dict) -> str:
    """The id of the checkpoint's current publication ("" while private)."""
    return str(meta.get("publication") or "public") if meta.get("public") else ""
