"""Training runs and their checkpoints, as Tinker's REST routes describe them.

A run is a model id (``{session_id}:train:{n}``); its checkpoints live in the engine's store under
that id, so they outlive the server. ``run.json`` beside them records what the checkpoints do
not: the run's owner (a digest of the API key that made it, never the key), base model, LoRA
settings and ``user_metadata`` (the cookbook reads ``renderer_name`` from it when resuming),
written when the run starts. Runs without an owner were put in the store by other means (an
in-process ``polyrl train``); every key may load them by path, none sees them listed or deletes them.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

from polyrl.errors import UserInputError
from polyrl.local.checkpoints import KINDS, NAME_PATTERN, CheckpointPath, Store, name_problem
from polyrl.serve.protocol import RequestError

_ID = NAME_PATTERN
RUN_FILE = "run.json"
UNREADABLE = "<run.json unreadable>"  # the owner of a run whose record cannot be read: no key's digest


def check_id(value: str, what: str) -> str:
    """Run ids and checkpoint names become directory names: refuse anything path-like (or hidden)."""
    if problem := name_problem(value, what):
        raise RequestError(400, problem)
    return value


def check_tinker_path(path: str) -> CheckpointPath:
    """A ``tinker://<run>/<weights|sampler_weights>/<name>`` path with safe components (the store's
    own check, as a 400)."""
    try:
        return CheckpointPath.parse(path)
    except UserInputError as exc:
        raise RequestError(400, str(exc)) from exc


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat()


class Runs:
    def __init__(self, store: Store):
        self.store = store
        self._owners: dict[str, str] = {}  # run id -> owner read from its run.json (which never changes)

    # ---- run.json ---------------------------------------------------------------------------------
    def record(self, run_id: str, owner: str, base_model: str, lora: dict, user_metadata: dict | None,
               **extra: str | None) -> None:
        """Write ``run.json``; ``extra`` (a copy's project and source, say) is kept beside the rest."""
        d = self.store.run_directory(run_id)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps({"training_run_id": run_id, "owner": owner, "base_model": base_model,
                                   "lora": lora, "user_metadata": _str_dict(user_metadata),
                                   "created": _iso(time.time()),
                                   **extra}, indent=2))
        os.replace(tmp, d / RUN_FILE)

    def forget(self, run_id: str) -> None:
        """Remove the record of a run that never started (its model could not be created)."""
        d = self.store.run_directory(run_id)
        (d / RUN_FILE).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:  # it holds checkpoints after all
            pass

    def info(self, run_id: str) -> dict | None:
        f = self.store.run_directory(run_id) / RUN_FILE
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError):
            return None

    def owner(self, run_id: str) -> str | None:
        """The owner of a run in the store: a key digest, ``""`` for a run no key owns, None if there is no
        run."""
        d = self.store.run_directory(run_id)
        if not (d / RUN_FILE).exists():
            return "" if d.is_dir() else None
        if run_id in self._owners:
            return self._owners[run_id]
        info = self.info(run_id)
        if info is None:
            return UNREADABLE
        owner = self._owners[run_id] = str(info.get("owner") or "")
        return owner

    # ---- what a key keeps ----------------------------------------------------------------------------
    def count_checkpoints(self, run_ids: list[str]) -> int:
        """Checkpoints stored under these runs (directories only: no metadata is read)."""
        count = 0
        for run_id in run_ids:
            for kind in KINDS:
                base = self.store.run_directory(run_id) / kind
                if base.is_dir():
                    count += sum(1 for d in base.iterdir() if not d.name.startswith(".")
                                 and (d / "polyrl.json").exists())
        return count

    def has_checkpoint(self, run_id: str, kind: str, name: str) -> bool:
        """Whether the checkpoint is in the store (an expired one is removed here, and is not)."""
        return self.store.exists(CheckpointPath(run_id, kind, name))

    def public_runs(self) -> list[str]:
        """Runs in the store with at least one published checkpoint."""
        return [r for r in self.store.runs() if _ID.match(r) and any(c["public"] for c in self.store.list(r))]

    # ---- REST views ---------------------------------------------------------------------------------
    def checkpoints(self, run_id: str) -> list[dict]:
        check_id(run_id, "training run id")
        return self.store.list(run_id) if self.store.run_directory(run_id).is_dir() else []

    def training_run(self, run_id: str, live: dict | None = None, public_only: bool = False) -> dict:
        """Tinker's ``TrainingRun``; ``live`` holds what the server knows of a run it is serving.
        ``public_only``: the run as a key that does not own it sees it, built from its published checkpoints
        alone (the last checkpoints are the last published ones; no user metadata, nothing live)."""
        check_id(run_id, "training run id")
        info = self.info(run_id) or {}
        cps = self.store.list(run_id) if self.store.run_directory(run_id).is_dir() else []
        if public_only:
            info, live, cps = {}, None, [c for c in cps if c["public"]]
        if not (live or info or cps):
            raise RequestError(404, f"training run {run_id!r} not found")
        latest_meta = self._meta(cps[-1]["tinker_path"]) if cps else {}
        live = live or {}
        lora = live.get("lora") or info.get("lora") or latest_meta.get("lora") or {}
        times = [c["time"] for c in cps if c.get("time")]
        if live.get("last_request"):
            times.append(_iso(live["last_request"]))
        elif info.get("created"):
            times.append(info["created"])
        training = [c for c in cps if c["checkpoint_type"] == "training"]
        sampler = [c for c in cps if c["checkpoint_type"] == "sampler"]
        return {
            "training_run_id": run_id,
            "base_model": (live.get("base_model") or info.get("base_model")
                           or latest_meta.get("base_model", "unknown")),
            "model_owner": "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": lora.get("rank"),
            "last_request_time": max(times) if times else _iso(time.time()),
            "last_checkpoint": training[-1] if training else None,
            "last_sampler_checkpoint": sampler[-1] if sampler else None,
            "user_metadata": _str_dict(live.get("user_metadata") if "user_metadata" in live
                                       else info.get("user_metadata")),
        }

    def _meta(self, tinker_path: str) -> dict:
        try:
            _, d = self.store.resolve(tinker_path)
            return self.store.meta(d)
        except (ValueError, OSError):
            return {}

    def run_ids(self, live: list[str], owner: str) -> list[str]:
        """``live`` (runs being served) and the runs in the store that ``owner`` made."""
        on_disk = [r for r in self.store.runs() if _ID.match(r) and r not in live and self.owner(r) == owner]
        return list(dict.fromkeys([*live, *on_disk]))

    @staticmethod
    def checkpoint_path(run_id: str, checkpoint_id: str) -> str:
        """``tinker://<run_id>/<checkpoint_id>`` of a REST route's ``weights/<name>`` (checked)."""
        check_id(run_id, "training run id")
        kind, _, name = checkpoint_id.partition("/")
        if kind not in KINDS or not name:
            raise RequestError(400, f"checkpoint id {checkpoint_id!r} must look like weights/<name>, "
                                    "sampler_weights/<name> or external_weights/<name>")
        check_id(name, "checkpoint name")
        return f"tinker://{run_id}/{kind}/{name}"

    def delete_checkpoint(self, path: str) -> None:
        try:
            self.store.delete(path)
        except (ValueError, OSError):
            raise RequestError(404, f"checkpoint {path} not found") from None


def _str_dict(d: dict | None) -> dict[str, str] | None:
    return None if d is None else {str(k): str(v) for k, v in d.items()}


def paginate(items: list, limit: int, offset: int) -> tuple[list, dict]:
    limit = max(0, min(int(limit), 1000))
    offset = max(0, int(offset))
    return items[offset: offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


def optimizer_config(kind: str) -> dict:
    """The optimizer config a client is told (``get_info``, ``weights_info``), as the SDK's types write it."""
    return {"type": "dimuon", "version": 1} if kind == "dimuon" else {"type": "adamw"}
