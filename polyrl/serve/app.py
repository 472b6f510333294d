"""HTTP routes: Tinker's ``/api/v1`` endpoints over :class:`~polyrl.serve.server.Server`.

Every route needs a valid ``X-API-Key``, whose digest is the caller's ``owner``; bodies are capped
at ``max_body_bytes`` (413); refused requests get a 4xx with ``{"error": ..., "category": "user"}``
and the server keeps serving. :func:`read_timeout_protocol` closes connections whose request
headers or body do not arrive in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import logging
import os
from typing import Any, Iterator

import h11

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from polyrl.serve import protocol as P
from polyrl.serve.lifecycle import Downloads
from polyrl.serve.protocol import RequestError
from polyrl.serve.server import Server
from polyrl.serve.state import key_owner

log = logging.getLogger("polyrl.serve")
PROTOBUF = "application/x-protobuf"
SDK_CHUNK_BYTES = 5_000_000  # the SDK's own limit on a forward_backward request's estimated size
MIN_BYTES_PER_TOKEN = 12  # in the SDK's estimate: an int32 token and at least an int64 target per token


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


class ApiKeyMiddleware:
    """Answers 401 to any request without one of ``keys`` in its ``X-API-Key`` header, and tells the
    routes whose request it is (``request.state.owner``)."""

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(Downloads.PREFIX):
            scope.setdefault("state", {})["owner"] = ""  # a signed download URL: the route checks it
        elif scope["type"] == "http":
            given = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
            if not any(hmac.compare_digest(given, k) for k in self.keys):
                msg = "missing or invalid X-API-Key" if given else "this server needs an X-API-Key header"
                await JSONResponse({"error": msg, "category": "user"}, 401)(scope, receive, send)
                return
            scope.setdefault("state", {})["owner"] = key_owner(given)
        await self.app(scope, receive, send)


def read_timeout_protocol(header_s: float, body_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take more than ``header_s``
    seconds (from the connection's start, or the next request's first byte) or whose body takes more than
    ``body_s`` (from the end of its headers). Deadlines, not idle timers: a client dripping a byte a
    second is closed too. An idle kept-alive connection is left to uvicorn's keep-alive timeout."""

    class ReadTimeoutProtocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase: str | None = None  # "headers" or "body" while a deadline runs

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm("headers", header_s)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch(arrived=True)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch(arrived=False)

        def connection_lost(self, exc: Exception | None) -> None:
            self._arm(None, 0)
            super().connection_lost(exc)

        def _watch(self, arrived: bool) -> None:
            """Follow the request's progress (h11's state of the client's side) after bytes came or a response
            went out: a request begun but without all its headers, one still sending its body, or neither."""
            state = self.conn.their_state
            if state is h11.IDLE and (arrived or self.conn.trailing_data[0]):
                self._arm("headers", header_s)
            elif state is h11.SEND_BODY:
                self._arm("body", body_s)
            elif state is not h11.IDLE:
                self._arm(None, 0)

        def _arm(self, phase: str | None, seconds: float) -> None:
            if phase == self._phase:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._phase, self._timer = phase, None
            if phase is not None:
                self._timer = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            phase, self._timer = self._phase, None
            if self.transport.is_closing():
                return
            seconds = header_s if phase == "headers" else body_s
            log.debug("closing %s: its request %s took more than %.0f s", self.client, phase, seconds)
            if phase == "headers" and self.conn.our_state is h11.IDLE:
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
                                     b"content-length: 0\r\n\r\n")
            self.transport.close()

    return ReadTimeoutProtocol


def create_app(server: Server) -> FastAPI:
    cfg = server.config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if cfg.preload:
            await asyncio.to_thread(server.preload)

        async def housekeeping() -> None:
            while True:
                await asyncio.sleep(1.0)
                try:
                    server.tick()
                except Exception:  # noqa: BLE001 - housekeeping must keep running
                    log.exception("housekeeping failed")

        async def sweeping() -> None:  # expired checkpoints, off the event loop (it reads the whole store)
            while True:
                await asyncio.sleep(cfg.sweep_interval_s)
                try:
                    await asyncio.to_thread(server.sweep)
                except Exception:  # noqa: BLE001 - the sweep must keep running
                    log.exception("sweeping expired checkpoints failed")

        tasks = [asyncio.create_task(housekeeping()), asyncio.create_task(sweeping())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    app = FastAPI(title="polyrl serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ApiKeyMiddleware, keys=cfg.api_keys)

    @app.exception_handler(RequestError)
    async def refused(request: Request, e: RequestError):
        headers = {"Retry-After": f"{e.retry_after:g}"} if e.retry_after is not None else None
        return JSONResponse({"error": e.message, "category": e.category}, e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        msg = f"{request.method} {request.url.path} is not an endpoint of polyrl serve" \
            if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse({"error": msg, "category": "user"}, e.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_params(request: Request, e: RequestValidationError):
        msg = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:3])
        return JSONResponse({"error": f"invalid request: {msg}", "category": "user"}, 400)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse({"error": f"{type(e).__name__}: {e}", "category": "server"}, 500)

    async def body(request: Request) -> bytes:
        limit = cfg.max_body_bytes
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

    async def parse(request: Request, model: type[P.R]) -> P.R:
        return P.parse_json(model, await body(request))

    def owner(request: Request) -> str:
        return request.state.owner

    def ok(payload: Any, status: int = 200) -> Response:
        if isinstance(payload, bytes):
            return Response(payload, status, media_type=PROTOBUF)
        return JSONResponse(payload, status)

    api = "/api/v1"

    page = {"ge": 0, "lt": 2**31}  # limits and offsets of listings

    # ---- client set-up, sessions, telemetry -------------------------------------------------------
    @app.post(f"{api}/client/config")
    async def client_config(request: Request):
        return ok(sdk_config(server.limits))

    @app.post(f"{api}/client/dynamic_config")
    async def dynamic_config(request: Request):
        return ok({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    @app.get(f"{api}/healthz")
    async def healthz():
        return ok({"status": "ok"})

    @app.get(f"{api}/get_server_capabilities")
    async def capabilities():
        return ok(server.capabilities())

    @app.post(f"{api}/create_session")
    async def create_session(request: Request):
        return ok(server.create_session(await parse(request, P.CreateSessionReq), owner(request)))

    @app.post(f"{api}/session_heartbeat")
    async def heartbeat(request: Request):
        return ok(server.heartbeat(await parse(request, P.SessionReq), owner(request)))

    @app.post(api + "/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        await body(request)
        return ok(server.finish_session(session_id, owner(request)))

    @app.get(f"{api}/sessions")
    async def sessions(request: Request, limit: int = Query(20, **page), offset: int = Query(0, **page)):
        return ok(server.list_sessions(limit, offset, owner(request)))

    @app.get(api + "/sessions/{session_id}")
    async def session(session_id: str, request: Request):
        return ok(server.get_session(session_id, owner(request)))

    @app.post(f"{api}/telemetry")
    async def telemetry(request: Request):
        await body(request)
        return ok({"status": "accepted"})

    # ---- training ----------------------------------------------------------------------------------
    @app.post(f"{api}/create_model")
    async def create_model(request: Request):
        return ok(server.create_model(await parse(request, P.CreateModelReq), owner(request)))

    @app.post(f"{api}/get_info")
    async def get_info(request: Request):
        return ok(await server.get_info(await parse(request, P.ModelReq), owner(request)))

    @app.post(f"{api}/load_weights")
    async def load_weights(request: Request):
        return ok(server.load_weights(await parse(request, P.LoadWeightsReq), owner(request)))

    @app.post(f"{api}/forward_backward")
    async def forward_backward(request: Request):
        data = await body(request)
        try:
            fb = P.decode_forward_backward(data, server.limits) if len(data) < (1 << 20) else \
                await asyncio.to_thread(P.decode_forward_backward, data, server.limits)
        except RequestError as e:
            ids = P.peek_forward_backward_ids(data)
            if ids is not None and ids[1] >= 1:
                server.refuse_op(ids[0], ids[1], e, owner(request))
            raise
        return ok(server.forward_backward(fb, owner(request)))

    @app.post(f"{api}/optim_step")
    async def optim_step(request: Request):
        return ok(server.optim_step(await parse_op(request, P.OptimStepReq), owner(request)))

    @app.post(f"{api}/save_weights")
    async def save_weights(request: Request):
        return ok(server.save_weights(await parse_op(request, P.SaveWeightsReq), owner(request)))

    @app.post(f"{api}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        return ok(server.save_for_sampler(await parse_op(request, P.SaveForSamplerReq), owner(request)))

    @app.post(f"{api}/save_weights_external")
    async def save_weights_external(request: Request):
        return ok(server.save_external(await parse_op(request, P.SaveExternalReq), owner(request)))

    async def parse_op(request: Request, model: type[P.R]) -> P.R:
        """Like ``parse``, but a malformed body that names its model and seq_id still uses up that seq_id."""
        data = await body(request)
        try:
            return P.parse_json(model, data)
        except RequestError as e:
            ids = P.peek_json_ids(data)
            if ids is not None:
                server.refuse_op(ids[0], ids[1], e, owner(request))
            raise

    # ---- sampling ----------------------------------------------------------------------------------
    @app.post(f"{api}/create_sampling_session")
    async def create_sampling_session(request: Request):
        return ok(server.create_sampling_session(await parse(request, P.CreateSamplingSessionReq),
                                                 owner(request)))

    @app.get(api + "/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        return ok(server.get_sampler(sampler_id, owner(request)))

    @app.post(f"{api}/asample")
    async def asample(request: Request):
        return ok(server.sample(await parse(request, P.SampleReq), owner(request)))

    @app.post(f"{api}/retrieve_future")
    async def retrieve_future(request: Request):
        req = await parse(request, P.RetrieveFutureReq)
        status, payload = await server.retrieve(req, PROTOBUF in request.headers.get("accept", ""),
                                                owner(request))
        return ok(payload, status)

    # ---- training runs and checkpoints (REST) --------------------------------------------------------

    scope = Query("owned", pattern="^(owned|accessible)$")

    @app.get(f"{api}/training_runs")
    async def training_runs(request: Request, limit: int = Query(20, **page), offset: int = Query(0, **page),
                            access_scope: str = scope, project_id: str | None = None):
        return ok(server.training_runs(limit, offset, owner(request), access_scope, project_id))

    @app.get(api + "/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request, access_scope: str = scope):
        return ok(server.training_run(run_id, owner(request), access_scope))

    @app.get(api + "/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str, request: Request):
        return ok(server.checkpoints(run_id, owner(request)))

    # one checkpoint's lifecycle: {kind}/{name} is its checkpoint id (these come before the DELETE of
    # .../checkpoints/{checkpoint_id:path}, which would also match their paths)
    one = api + "/training_runs/{run_id}/checkpoints/{kind}/{name}"

    @app.put(one + "/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request):
        server.set_checkpoint_ttl(run_id, kind, name, await parse(request, P.SetTtlReq), owner(request))
        return ok({})

    @app.post(one + "/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request):
        await body(request)
        server.publish_checkpoint(run_id, kind, name, owner(request), True)
        return ok({})

    @app.delete(one + "/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request):
        server.publish_checkpoint(run_id, kind, name, owner(request), False)
        return ok({})

    @app.get(one + "/external_weights_urls")
    async def external_weights_urls(run_id: str, kind: str, name: str, request: Request):
        return ok(server.external_weights_urls(run_id, kind, name, owner(request), str(request.base_url)))

    @app.get(Downloads.PREFIX + "{run_id}/{name}/{file}")
    async def download(run_id: str, name: str, file: str, expires: int = Query(..., ge=0, lt=2**62),
                       signature: str = Query(..., max_length=128),
                       generation: str = Query("", max_length=64),
                       publication: str = Query("", max_length=64)):
        handle = server.download(run_id, name, file, expires, signature, generation, publication)

        def chunks() -> Iterator[bytes]:  # from the file opened while its checkpoint was checked
            with handle:
                while data := handle.read(1 << 20):
                    yield data

        headers = {"Content-Length": str(os.fstat(handle.fileno()).st_size),
                   "Content-Disposition": f'attachment; filename="{file}"'}
        return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)

    @app.post(f"{api}/copy_weights")
    async def copy_weights(request: Request):
        req = await parse(request, P.CopyWeightsReq)
        token = request.headers.get("x-tinker-weights-access-token") or req.weights_access_token
        return ok(server.copy_weights(req, owner(request), request.headers.get("x-idempotency-key"), token))

    @app.delete(api + "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        server.delete_checkpoint(run_id, checkpoint_id, owner(request))
        return ok({})

    @app.get(f"{api}/checkpoints")
    async def user_checkpoints(request: Request, limit: int = Query(100, **page),
                               offset: int = Query(0, **page)):
        return ok(server.user_checkpoints(limit, offset, owner(request)))

    @app.post(f"{api}/weights_info")
    async def weights_info(request: Request):
        return ok(server.weights_info(await parse(request, P.WeightsInfoReq), owner(request)))

    return app
