"""The SDK's ``RestClient`` over the local checkpoint store: training runs and checkpoints, their TTLs,
publishing, copies and external-weights downloads.

Every method has the SDK's name and signature and returns its ``APIFuture``; problems are the SDK's
exception types (see :mod:`polyrl.local.checkpoints`), and what the SDK checks before it sends anything
(a malformed tinker path, a copy with no destination project) raises ``ValueError`` here too. The local
store has one user, so ``access_scope`` and ``weights_access_token`` change nothing; sessions, projects,
traces, audit logs and billing belong to a service and are not here (see docs/reference/tinker-coverage.md).
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Literal

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

from polyrl.local.checkpoints import CheckpointNotFoundError, CheckpointPath, Store
from polyrl.local.engine import Engine

URL_LIFETIME_S = 3600  # how long get_external_weights_urls says its URLs stay valid (local files: no limit)
Scope = Literal["owned", "accessible"]


def training_run(store: Store, run_id: str) -> types.TrainingRun:
    """Tinker's ``TrainingRun`` of a run in the store (what its checkpoints say of it)."""
    rows = store.list(run_id)
    if not rows:
        raise CheckpointNotFoundError(
            f"training run {run_id!r} not found (it has no checkpoints in the store at {store.root})")
    latest = store.meta(store.resolve(rows[-1]["tinker_path"])[1])
    lora = latest.get("lora") or {}
    of_type = {t: [r for r in rows if r["checkpoint_type"] == t] for t in ("training", "sampler")}
    return types.TrainingRun(
        training_run_id=run_id, base_model=latest.get("base_model", "unknown"), model_owner="local",
        is_lora=True, lora_rank=lora.get("rank"), last_request_time=rows[-1]["time"],
        last_checkpoint=of_type["training"][-1] if of_type["training"] else None,
        last_sampler_checkpoint=of_type["sampler"][-1] if of_type["sampler"] else None,
        user_metadata=latest.get("user_metadata"))


def _page(items: list, limit: int, offset: int) -> tuple[list, types.Cursor]:
    limit, offset = max(0, int(limit)), max(0, int(offset))
    return items[offset: offset + limit], types.Cursor(offset=offset, limit=limit, total_count=len(items))


class RestClient:
    """The SDK's ``RestClient`` for the local store (``ServiceClient.create_rest_client()``)."""

    def __init__(self, engine: Engine,
                 capabilities: Callable[[], types.GetServerCapabilitiesResponse] | None = None,
                 project_id: str | None = None):
        self._engine = engine
        self._store = engine.store
        self._capabilities = capabilities
        self._project_id = project_id

    def _op(self, fn: Callable[[], Any]) -> APIFuture:
        return AwaitableConcurrentFuture(self._engine.submit(fn))

    def _none(self, fn: Callable[[], Any]) -> APIFuture[None]:
        """A future of ``fn()``'s completion (its result is None, as the SDK's)."""
        def op() -> None:
            fn()

        return self._op(op)

    def get_telemetry(self) -> None:
        return None

    def get_server_capabilities(self) -> APIFuture[types.GetServerCapabilitiesResponse]:
        none = types.GetServerCapabilitiesResponse(supported_models=[])
        return self._op(self._capabilities or (lambda: none))

    # ---- training runs -------------------------------------------------------------------------------
    def get_training_run(self, training_run_id: str,
                         access_scope: Scope = "owned") -> APIFuture[types.TrainingRun]:
        return self._op(lambda: training_run(self._store, training_run_id))

    def get_training_run_by_tinker_path(self, tinker_path: str,
                                        access_scope: Scope = "owned") -> APIFuture[types.TrainingRun]:
        run_id = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id
        return self.get_training_run(run_id, access_scope)

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: Scope = "owned",
                           project_id: str | None = None) -> APIFuture[types.TrainingRunsResponse]:
        def op() -> types.TrainingRunsResponse:
            runs = []
            for run_id in self._store.runs():
                try:
                    run = training_run(self._store, run_id)
                except (CheckpointNotFoundError, ValueError, OSError):  # a run left with no checkpoints
                    continue
                if project_id is None or self._project_of(run) == project_id:
                    runs.append(run)
            runs.sort(key=lambda r: r.last_request_time, reverse=True)
            page, cursor = _page(runs, limit, offset)
            return types.TrainingRunsResponse(training_runs=page, cursor=cursor)

        return self._op(op)

    def _project_of(self, run: types.TrainingRun) -> str | None:
        latest = run.last_checkpoint or run.last_sampler_checkpoint
        if latest is None:
            return None
        return self._store.meta(self._store.resolve(latest.tinker_path)[1]).get("project_id")

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[types.WeightsInfoResponse]:
        def op() -> types.WeightsInfoResponse:
            meta = self._store.meta(self._store.resolve(tinker_path)[1])
            lora = meta.get("lora") or {}
            return types.WeightsInfoResponse(
                base_model=meta["base_model"], is_lora=True, lora_rank=lora.get("rank"),
                train_unembed=lora.get("train_unembed"), train_mlp=lora.get("train_mlp"),
                train_attn=lora.get("train_attn"))

        return self._op(op)

    # ---- checkpoints -----------------------------------------------------------------------------------
    def list_checkpoints(self, training_run_id: str) -> APIFuture[types.CheckpointsListResponse]:
        def op() -> types.CheckpointsListResponse:
            rows = self._store.list(training_run_id)
            return types.CheckpointsListResponse(checkpoints=[types.Checkpoint(**row) for row in rows])

        return self._op(op)

    def list_user_checkpoints(self, limit: int = 100,
                              offset: int = 0) -> APIFuture[types.CheckpointsListResponse]:
        def op() -> types.CheckpointsListResponse:
            rows = [row for run_id in self._store.runs() for row in self._store.list(run_id)]
            rows.sort(key=lambda r: r["time"] or "", reverse=True)
            page, cursor = _page(rows, limit, offset)
            checkpoints = [types.Checkpoint(**r) for r in page]
            return types.CheckpointsListResponse(checkpoints=checkpoints, cursor=cursor)

        return self._op(op)

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._op(lambda: self._store.delete(tinker_path))

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str,
                                            ttl_seconds: int | None) -> APIFuture[None]:
        types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self._none(lambda: self._store.set_ttl(tinker_path, ttl_seconds))

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self._none(lambda: self._store.set_public(tinker_path, True))

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self._none(lambda: self._store.set_public(tinker_path, False))

    def get_external_weights_urls(self, tinker_path: str) -> APIFuture[types.ExternalWeightsUrlsResponse]:
        """``file://`` URLs of the checkpoint's files in the store (``urllib`` fetches them as it does
        a service's signed URLs)."""
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        if parsed.checkpoint_type != "external":
            raise ValueError("get_external_weights_urls only accepts external weights checkpoints "
                             f"(tinker://<training_run_id>/external_weights/<name>), got {tinker_path!r}")

        def op() -> types.ExternalWeightsUrlsResponse:
            files = self._store.files(tinker_path)
            expires = datetime.now(timezone.utc) + timedelta(seconds=URL_LIFETIME_S)
            return types.ExternalWeightsUrlsResponse(urls={n: f.resolve().as_uri() for n, f in files.items()},
                                                     expires=expires)

        return self._op(op)

    def copy_weights(self, path: str, destination_project_id: str | None = None, *,
                     ttl_seconds: int | None = None,
                     weights_access_token: str | None = None) -> APIFuture[str]:
        """A copy of ``path`` in a new training run of the store (its files linked, not duplicated); the
        copy's path. As in the SDK, a destination project (or ``TINKER_PROJECT_ID``) is required."""
        destination = destination_project_id or os.environ.get("TINKER_PROJECT_ID") or None
        if destination is None:
            raise ValueError("Provide destination_project_id or set TINKER_PROJECT_ID")
        source = CheckpointPath.parse(path)
        target = CheckpointPath(f"copy-{uuid.uuid4().hex[:12]}:train:0", source.kind, source.name)
        return self._op(lambda: self._store.copy(path, target, ttl_seconds, {"project_id": destination}))


def _async_twin(name: str) -> Callable[..., Any]:
    async def twin(self: RestClient, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self, name)(*args, **kwargs)

    twin.__name__ = f"{name}_async"
    twin.__doc__ = f"``await self.{name}(...)`` (the SDK's deprecated async variant)."
    return twin


for _name in ("get_training_run", "get_training_run_by_tinker_path", "list_training_runs", "list_checkpoints",
              "list_user_checkpoints", "delete_checkpoint", "delete_checkpoint_from_tinker_path",
              "set_checkpoint_ttl_from_tinker_path", "publish_checkpoint_from_tinker_path",
              "unpublish_checkpoint_from_tinker_path", "get_external_weights_urls", "copy_weights"):
    setattr(RestClient, f"{_name}_async", _async_twin(_name))
