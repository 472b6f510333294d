"""The ``polyrl serve`` web app: :func:`create_app` wires the routers of :mod:`~polyrl.serve.routes`, the
API-key check, the error answers and the background tasks over a :class:`~polyrl.serve.server.Server`.

Every route needs a valid ``X-API-Key``, whose digest is the caller's ``owner``; bodies are capped
at ``max_body_bytes`` (413); refused requests get a 4xx with ``{"error": ..., "category": "user"}``
and the server keeps serving. :func:`read_timeout_protocol` closes connections whose request
headers or body do not arrive in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

import h11
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from polyrl.serve.lifecycle import Downloads
from polyrl.serve.protocol import RequestError
from polyrl.serve.routes import ROUTERS
from polyrl.serve.server import Server
from polyrl.serve.state import key_owner

log = logging.getLogger("polyrl.serve")


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


# ---- errors, as the SDK reads them ---------------------------------------------------------------------
async def refused(request: Request, e: RequestError) -> JSONResponse:
    headers = {"Retry-After": f"{e.retry_after:g}"} if e.retry_after is not None else None
    return JSONResponse({"error": e.message, "category": e.category}, e.status, headers=headers)


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    msg = f"{request.method} {request.url.path} is not an endpoint of polyrl serve" \
        if e.status_code in (404, 405) else str(e.detail)
    return JSONResponse({"error": msg, "category": "user"}, e.status_code)


async def bad_params(request: Request, e: RequestValidationError) -> JSONResponse:
    msg = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:3])
    return JSONResponse({"error": f"invalid request: {msg}", "category": "user"}, 400)


async def crashed(request: Request, e: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path)
    return JSONResponse({"error": f"{type(e).__name__}: {e}", "category": "server"}, 500)


ERROR_HANDLERS = ((RequestError, refused), (StarletteHTTPException, http_error),
                  (RequestValidationError, bad_params), (Exception, crashed))


# ---- background tasks -----------------------------------------------------------------------------------
async def housekeeping(server: Server) -> None:
    """``server.tick()`` about once a second."""
    while True:
        await asyncio.sleep(1.0)
        try:
            server.tick()
        except Exception:  # noqa: BLE001 - housekeeping must keep running
            log.exception("housekeeping failed")


async def sweeping(server: Server) -> None:
    """Expired checkpoints removed every ``sweep_interval_s``, off the event loop (it reads the whole
    store)."""
    while True:
        await asyncio.sleep(server.config.sweep_interval_s)
        try:
            await asyncio.to_thread(server.checkpoints.sweep)
        except Exception:  # noqa: BLE001 - the sweep must keep running
            log.exception("sweeping expired checkpoints failed")


def lifespan(server: Server):
    """The app's lifespan: the served models loaded (with ``preload``), then the background tasks run."""

    @contextlib.asynccontextmanager
    async def run(app: FastAPI):
        if server.config.preload:
            await asyncio.to_thread(server.bases.preload)
        tasks = [asyncio.create_task(housekeeping(server)), asyncio.create_task(sweeping(server))]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    return run


def create_app(server: Server) -> FastAPI:
    """The web app over ``server``: its routers, the API-key check, the error answers and, while it runs,
    the background tasks."""
    app = FastAPI(title="polyrl serve", lifespan=lifespan(server), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(ApiKeyMiddleware, keys=server.config.api_keys)
    for exception, handler in ERROR_HANDLERS:
        app.add_exception_handler(exception, handler)  # type: ignore[arg-type]
    for router in ROUTERS:
        app.include_router(router(server))
    return app
