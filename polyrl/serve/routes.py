"""Tinker's ``/api/v1`` endpoints, grouped in routers by the object that serves them: set-up and health,
sessions, training, sampling, results, training runs and checkpoints, and external weights' files.

Each router factory takes the :class:`~polyrl.serve.server.Server` and its routes call the object that owns
the operation (``server.training``, ``server.samplers``, ...). The request helpers are plain functions:
:func:`read_body` (the body, within ``max_body_bytes``, zstd decoded), :func:`parse` (a JSON body as a
request model; :func:`parse_model_op` for a training client's operation), :func:`owner` (whose request it
is) and :func:`ok` (the answer).
"""

from __future__ import annotations

import asyncio
import io
import os
from typing import Any, Iterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from polyrl.serve import protocol as P
from polyrl.serve.lifecycle import Downloads
from polyrl.serve.protocol import RequestError
from polyrl.serve.server import Server
from polyrl.serve.training import Training

API = "/api/v1"
PROTOBUF = "application/x-protobuf"
SDK_CHUNK_BYTES = 5_000_000  # the SDK's own limit on a forward_backward request's estimated size
MIN_BYTES_PER_TOKEN = 12  # in the SDK's estimate: an int32 token and at least an int64 target per token
PAGE = {"ge": 0, "lt": 2**31}  # limits and offsets of listings


def sdk_config(limits: P.RequestLimits) -> dict:
    """What the SDK asks for first; its forward_backward chunks then stay within ``limits``."""
    return {
        "pjwt_auth_enabled": False,
        "parallel_fwdbwd_chunks": True,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
        "fwdbwd_max_chunk_len": limits.max_datums,
        "fwdbwd_max_chunk_bytes_count": min(SDK_CHUNK_BYTES, MIN_BYTES_PER_TOKEN * limits.max_tokens),
    }


# ---- request helpers -----------------------------------------------------------------------------------
async def read_body(request: Request, limit: int) -> bytes:
    """The request's body: a 413 past ``limit`` bytes (declared, received or decompressed), a 400 for a
    client gone before it arrived or a bad zstd body."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {int(declared)} bytes exceeds the server's limit "
                                f"of {limit} bytes")
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"request body exceeds the server's limit of {limit} bytes")
            parts.append(chunk)
    except ClientDisconnect:  # gone (or closed for being too slow): nobody reads the answer
        raise RequestError(400, "the client disconnected before its request body arrived") from None
    data = b"".join(parts)
    if request.headers.get("content-encoding", "").lower() == "zstd":
        import zstandard

        out = bytearray()
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))
            while chunk := reader.read(1 << 20):
                out += chunk
                if len(out) > limit:
                    raise RequestError(413, f"decompressed body exceeds the server's limit "
                                            f"of {limit} bytes")
        except zstandard.ZstdError as e:
            raise RequestError(400, f"bad zstd body: {e}") from None
        data = bytes(out)
    return data


async def parse(request: Request, model: type[P.R], limit: int) -> P.R:
    """The JSON body as ``model`` (a 400 naming what is wrong)."""
    return P.parse_json(model, await read_body(request, limit))


async def parse_model_op(request: Request, model: type[P.R], limit: int, training: Training) -> P.R:
    """Like :func:`parse`, for an operation on a training client: a malformed body that names its model and
    seq_id still uses up that seq_id (so that the model's later operations need not wait for it)."""
    data = await read_body(request, limit)
    try:
        return P.parse_json(model, data)
    except RequestError as e:
        ids = P.peek_json_ids(data)
        if ids is not None:
            training.refuse_op(ids[0], ids[1], e, owner(request))
        raise


def owner(request: Request) -> str:
    """Whose request it is: the digest of its API key (set by the API-key middleware)."""
    return request.state.owner


def ok(payload: Any, status: int = 200) -> Response:
    """Protobuf for bytes, JSON for the rest."""
    if isinstance(payload, bytes):
        return Response(payload, status, media_type=PROTOBUF)
    return JSONResponse(payload, status)


# ---- routers ------------------------------------------------------------------------------------------
def setup_router(server: Server) -> APIRouter:
    """The SDK's set-up and telemetry, the server's health and capabilities."""
    r = APIRouter(prefix=API)

    @r.post("/client/config")
    async def client_config(request: Request):
        return ok(sdk_config(server.limits))

    @r.post("/client/dynamic_config")
    async def dynamic_config(request: Request):
        return ok({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    @r.get("/healthz")
    async def healthz():
        return ok({"status": "ok"})

    @r.get("/get_server_capabilities")
    async def capabilities():
        return ok(server.bases.capabilities())

    @r.post("/telemetry")
    async def telemetry(request: Request):
        await read_body(request, server.config.max_body_bytes)
        return ok({"status": "accepted"})

    return r


def sessions_router(server: Server) -> APIRouter:
    r, sessions = APIRouter(prefix=API), server.sessions

    @r.post("/create_session")
    async def create_session(request: Request):
        req = await parse(request, P.CreateSessionReq, server.config.max_body_bytes)
        return ok(sessions.create(req.tags, req.user_metadata, owner(request)))

    @r.post("/session_heartbeat")
    async def heartbeat(request: Request):
        req = await parse(request, P.SessionReq, server.config.max_body_bytes)
        return ok(sessions.heartbeat(req.session_id, owner(request)))

    @r.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        await read_body(request, server.config.max_body_bytes)
        return ok(server.finish_session(session_id, owner(request)))

    @r.get("/sessions")
    async def list_sessions(request: Request, limit: int = Query(20, **PAGE), offset: int = Query(0, **PAGE)):
        return ok(sessions.listing(limit, offset, owner(request)))

    @r.get("/sessions/{session_id}")
    async def session(session_id: str, request: Request):
        return ok(server.get_session(session_id, owner(request)))

    return r


def training_router(server: Server) -> APIRouter:
    """Training clients: creation and their operations (each in its model's ``seq_id`` order)."""
    r, training = APIRouter(prefix=API), server.training

    async def parse_op(request: Request, model: type[P.R]) -> P.R:
        return await parse_model_op(request, model, server.config.max_body_bytes, training)

    @r.post("/create_model")
    async def create_model(request: Request):
        req = await parse(request, P.CreateModelReq, server.config.max_body_bytes)
        return ok(training.create_model(req, owner(request)))

    @r.post("/get_info")
    async def get_info(request: Request):
        req = await parse(request, P.ModelReq, server.config.max_body_bytes)
        return ok(await training.get_info(req, owner(request)))

    @r.post("/load_weights")
    async def load_weights(request: Request):
        req = await parse(request, P.LoadWeightsReq, server.config.max_body_bytes)
        return ok(training.load_weights(req, owner(request)))

    @r.post("/forward_backward")
    async def forward_backward(request: Request):
        data = await read_body(request, server.config.max_body_bytes)
        try:
            fb = P.decode_forward_backward(data, server.limits) if len(data) < (1 << 20) else \
                await asyncio.to_thread(P.decode_forward_backward, data, server.limits)
        except RequestError as e:
            ids = P.peek_forward_backward_ids(data)
            if ids is not None and ids[1] >= 1:
                training.refuse_op(ids[0], ids[1], e, owner(request))
            raise
        return ok(training.forward_backward(fb, owner(request)))

    @r.post("/optim_step")
    async def optim_step(request: Request):
        return ok(training.optim_step(await parse_op(request, P.OptimStepReq), owner(request)))

    @r.post("/save_weights")
    async def save_weights(request: Request):
        return ok(training.save_weights(await parse_op(request, P.SaveWeightsReq), owner(request)))

    @r.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        return ok(training.save_for_sampler(await parse_op(request, P.SaveForSamplerReq), owner(request)))

    @r.post("/save_weights_external")
    async def save_weights_external(request: Request):
        return ok(training.save_external(await parse_op(request, P.SaveExternalReq), owner(request)))

    return r


def sampling_router(server: Server) -> APIRouter:
    r, samplers = APIRouter(prefix=API), server.samplers

    @r.post("/create_sampling_session")
    async def create_sampling_session(request: Request):
        req = await parse(request, P.CreateSamplingSessionReq, server.config.max_body_bytes)
        return ok(samplers.create_sampling_session(req, owner(request)))

    @r.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        return ok(samplers.get_sampler(sampler_id, owner(request)))

    @r.post("/asample")
    async def asample(request: Request):
        return ok(samplers.sample(await parse(request, P.SampleReq, server.config.max_body_bytes),
                                  owner(request)))

    return r


def results_router(server: Server) -> APIRouter:
    """``retrieve_future``: any accepted request's result, long-polled."""
    r = APIRouter(prefix=API)

    @r.post("/retrieve_future")
    async def retrieve_future(request: Request):
        req = await parse(request, P.RetrieveFutureReq, server.config.max_body_bytes)
        status, payload = await server.futures.retrieve(req.request_id,
                                                        PROTOBUF in request.headers.get("accept", ""),
                                                        owner(request), server.config.long_poll_s)
        return ok(payload, status)

    return r


def checkpoints_router(server: Server) -> APIRouter:
    """Training runs and their checkpoints (Tinker's REST routes): listings, one checkpoint's lifecycle,
    copies, deletion."""
    r, checkpoints = APIRouter(prefix=API), server.checkpoints
    scope = Query("owned", pattern="^(owned|accessible)$")

    @r.get("/training_runs")
    async def training_runs(request: Request, limit: int = Query(20, **PAGE), offset: int = Query(0, **PAGE),
                            access_scope: str = scope, project_id: str | None = None):
        return ok(checkpoints.training_runs(limit, offset, owner(request), access_scope, project_id))

    @r.get("/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request, access_scope: str = scope):
        return ok(checkpoints.training_run(run_id, owner(request), access_scope))

    @r.get("/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str, request: Request):
        return ok(checkpoints.run_checkpoints(run_id, owner(request)))

    # one checkpoint's lifecycle: {kind}/{name} is its checkpoint id (these come before the DELETE of
    # .../checkpoints/{checkpoint_id:path}, which would also match their paths)
    one = "/training_runs/{run_id}/checkpoints/{kind}/{name}"

    @r.put(one + "/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request):
        req = await parse(request, P.SetTtlReq, server.config.max_body_bytes)
        checkpoints.set_checkpoint_ttl(run_id, kind, name, req, owner(request))
        return ok({})

    @r.post(one + "/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request):
        await read_body(request, server.config.max_body_bytes)
        checkpoints.publish_checkpoint(run_id, kind, name, owner(request), True)
        return ok({})

    @r.delete(one + "/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request):
        checkpoints.publish_checkpoint(run_id, kind, name, owner(request), False)
        return ok({})

    @r.get(one + "/external_weights_urls")
    async def external_weights_urls(run_id: str, kind: str, name: str, request: Request):
        base_url = str(request.base_url)
        return ok(checkpoints.external_weights_urls(run_id, kind, name, owner(request), base_url))

    @r.post("/copy_weights")
    async def copy_weights(request: Request):
        req = await parse(request, P.CopyWeightsReq, server.config.max_body_bytes)
        token = request.headers.get("x-tinker-weights-access-token") or req.weights_access_token
        return ok(checkpoints.copy_weights(req, owner(request), request.headers.get("x-idempotency-key"),
                                           token))

    @r.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        checkpoints.delete_checkpoint(run_id, checkpoint_id, owner(request))
        return ok({})

    @r.get("/checkpoints")
    async def user_checkpoints(request: Request, limit: int = Query(100, **PAGE),
                               offset: int = Query(0, **PAGE)):
        return ok(checkpoints.user_checkpoints(limit, offset, owner(request)))

    @r.post("/weights_info")
    async def weights_info(request: Request):
        req = await parse(request, P.WeightsInfoReq, server.config.max_body_bytes)
        return ok(checkpoints.weights_info(req, owner(request)))

    return r


def weights_files_router(server: Server) -> APIRouter:
    """External weights' files, fetched with a signed URL instead of an API key."""
    r, checkpoints = APIRouter(prefix=Downloads.PREFIX.rstrip("/")), server.checkpoints

    @r.get("/{run_id}/{name}/{file}")
    async def download(run_id: str, name: str, file: str, expires: int = Query(..., ge=0, lt=2**62),
                       signature: str = Query(..., max_length=128),
                       generation: str = Query("", max_length=64),
                       publication: str = Query("", max_length=64)):
        handle = checkpoints.download(run_id, name, file, expires, signature, generation, publication)

        def chunks() -> Iterator[bytes]:  # from the file opened while its checkpoint was checked
            with handle:
                while data := handle.read(1 << 20):
                    yield data

        headers = {"Content-Length": str(os.fstat(handle.fileno()).st_size),
                   "Content-Disposition": f'attachment; filename="{file}"'}
        return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)

    return r


ROUTERS = (setup_router, sessions_router, training_router, sampling_router, results_router,
           checkpoints_router, weights_files_router)
