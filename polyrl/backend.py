"""The training service behind the Tinker client interface: polyrl's local engine or Tinker's.

The trainer only ever sees a ``ServiceClient`` with the official SDK's methods; which one is one
config field (``backend``). :class:`ServiceGuard` bounds how long it waits on a remote one.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import ssl
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from polyrl.aio import in_daemon_thread
from polyrl.errors import NonFiniteUpdateError, RunStoppedError, ServiceLostError
from polyrl.samplers import VllmSettings

T = TypeVar("T")


def make_service_client(config: Any) -> Any:
    """A ``ServiceClient`` for ``config.backend``: ``local`` (in-process, with the settings of
    ``config.local``) or ``tinker`` (the SDK, hosted or any Tinker-compatible server at ``base_url``, such
    as ``polyrl serve``)."""
    if config.backend == "local":
        from polyrl.local import ServiceClient

        local = config.local
        return ServiceClient(store_dir=local.store_dir, device=local.device, dtype=local.dtype,
                             micro_batch_tokens=local.micro_batch_tokens,
                             gradient_checkpointing=local.gradient_checkpointing,
                             max_store_bytes=local.max_store_bytes, sampler_dtype=local.sampler_dtype,
                             sampler=local.sampler, vllm=vllm_settings(local.vllm, config.lora_rank),
                             attention=local.attention)
    import tinker

    return tinker.ServiceClient(**_sdk_credentials(config))


def vllm_settings(vllm: Any, max_lora_rank: int) -> Any:
    """``local.vllm`` (a :class:`polyrl.config.schema.VllmConfig`) as the engine's settings."""
    return VllmSettings(python=vllm.python, urls=tuple(vllm.urls),
                        gpu_memory_utilization=vllm.gpu_memory_utilization, max_model_len=vllm.max_model_len,
                        max_lora_rank=max_lora_rank, restarts=vllm.restarts,
                        start_timeout_s=vllm.start_timeout_s)


FINISH_WAIT_S = 10.0  # ending a session must not hold up a command


async def finish_session(service: Any, status: str, url: str | None, detail: str | None = None) -> None:
    """End the service's session as ``success``, ``errored`` or ``interrupted``. The SDK tells Tinker
    the reason and stops the session's heartbeats, which otherwise run as long as the process does
    (keeping a hosted session alive after its run); the local engine (``url`` None) has nothing to end.
    Best effort: a service at ``url`` that does not answer is left to expire the session itself, the
    wait is at most FINISH_WAIT_S, and a failure changes nothing about how the command ends."""
    try:
        if url is not None and not await answers(url):
            return
        result = service.close(status, detail)
        if inspect.isawaitable(result):
            await asyncio.wait_for(result, FINISH_WAIT_S)
    except Exception as exc:  # noqa: BLE001
        logging.getLogger(__name__).debug("finishing the session (%s) failed: %s", status, exc)


async def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether the service at ``url`` gives any HTTP answer (busy is not dead)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout) as http:
            await http.get(f"{url}/api/v1/healthz")
        return True
    except httpx.TransportError:
        return False


@contextlib.asynccontextmanager
async def ending_session(service: Any, url: str | None) -> AsyncIterator[None]:
    """Ends ``service``'s session (at ``url``, None for the local engine) with the block: ``success``,
    ``interrupted`` (Ctrl-C, cancelled) or ``errored``."""
    status = "errored"
    try:
        yield
        status = "success"
    except (KeyboardInterrupt, asyncio.CancelledError):
        status = "interrupted"
        raise
    finally:
        await finish_session(service, status, url)


def sampler_precision(config: Any, service: Any) -> list[dict[str, Any]]:
    """What the local engine samples in, for each model it loaded (dtypes, the memory of the sampler's
    copy, a one-line ``note``); nothing for a remote service, whose numerics are its own."""
    return service.sampler_precision() if config.backend == "local" else []


def make_rest_client(config: Any, service: Any) -> Any:
    """A ``RestClient`` (checkpoint listing and deletion) for the same service."""
    if config.backend == "local":
        return service.create_rest_client()
    import tinker

    return tinker.RestClient(**_sdk_credentials(config))


PLACEHOLDER_KEY = "tml-local"  # sent to a base_url when no TINKER_API_KEY is set (see placeholder_key_note)


def placeholder_key_note(config: Any) -> str | None:
    """What to tell a user whose run will send :data:`PLACEHOLDER_KEY`: with ``backend: tinker``, a
    ``base_url`` and no ``TINKER_API_KEY``, the key only a server started with ``--api-key tml-local``
    accepts (any other answers 401)."""
    if config.backend != "tinker" or not config.base_url or os.environ.get("TINKER_API_KEY"):
        return None
    return (f"no TINKER_API_KEY is set: sending the key {PLACEHOLDER_KEY!r} to {config.base_url} (what "
            f"`polyrl serve --api-key {PLACEHOLDER_KEY}` accepts); set TINKER_API_KEY to the server's key")


def _sdk_credentials(config: Any) -> dict[str, str]:
    kwargs = {"api_key": os.environ.get("TINKER_API_KEY") or (PLACEHOLDER_KEY if config.base_url else None)}
    if config.base_url:
        kwargs["base_url"] = config.base_url
    return kwargs


def service_url(config: Any) -> str | None:
    """Where the remote training service lives; ``None`` for the in-process engine."""
    if config.backend == "local":
        return None
    from tinker.lib.base_url import resolve_base_url

    return resolve_base_url(config.base_url)


class ServiceGuard:
    """Bounds how long the trainer waits on a remote training service that stopped answering.

    The Tinker SDK retries failed requests itself, with backoff, but never gives up on a service
    that is gone: its futures poll forever. While an operation is awaited, the guard probes the
    service's health endpoint, backing off from 1 s to 10 s between probes while it does not answer;
    once it has not answered for ``timeout`` seconds, the operation is abandoned and the run stops
    with :class:`RunStoppedError` naming the service. Any HTTP answer counts as alive (busy is not
    dead). Errors the SDK itself gives up on become one line naming the service and the operation.
    With no ``url`` (the in-process engine) operations are awaited as they are.
    """

    HEALTHY_PROBE_S = 5.0
    MAX_BACKOFF_S = 10.0

    def __init__(self, url: str | None, timeout: float, warn: Callable[[str], None] = lambda _: None):
        self.url, self.timeout, self.warn = url, timeout, warn
        self.name = f"the Tinker service at {url}"
        self._tls: ssl.SSLContext | None = None  # the probes' TLS context, made once
        if url is not None:
            quiet_abandoned_requests()

    async def __call__(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` (``fn`` may return a value, an awaitable or a future) while
        watching the service; ``what`` names the operation in errors ("saving checkpoint 000004")."""
        if self.url is None:
            result = fn(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        async def operation() -> Any:
            # SDK calls may block before they return a future (opening a session retries
            # forever against a dead server), so they run where blocking holds nothing up
            result = await in_daemon_thread(fn, *args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return await self.watch(what, operation())

    async def watch(self, what: str, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` (a whole phase, e.g. every rollout of a step) while watching the service."""
        if self.url is None:
            return await awaitable
        work = asyncio.ensure_future(awaitable)
        probe = asyncio.ensure_future(self._until_unreachable())
        try:
            await asyncio.wait({work, probe}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()
            probe.cancel()
            raise
        if work.done():
            probe.cancel()
            try:
                return work.result()
            except Exception as exc:
                if (lost := service_lost(exc)) is not None:
                    raise ServiceLostError(f"{self.name} lost this run's session or requests while {what} "
                                           f"({lost})") from None
                if _is_service_error(exc):
                    raise RunStoppedError(f"{self.name} failed while {what}: {_one_line(exc)}") from None
                raise
        work.cancel()
        try:
            reason = probe.result()
        except Exception as exc:  # noqa: BLE001 - a probe that cannot even be sent (a malformed URL)
            reason = _one_line(exc)
        raise RunStoppedError(f"{self.name} did not answer for {self.timeout:g}s ({reason}) while {what}")

    async def _until_unreachable(self) -> str:
        """Probe until the service has not answered for ``timeout`` seconds; return the last error."""
        import httpx

        down_since: float | None = None
        backoff = 1.0
        if self._tls is None:  # building one takes ~45 ms of CPU, and every watched phase probes
            self._tls = httpx.create_ssl_context()
        async with httpx.AsyncClient(timeout=min(10.0, self.timeout), verify=self._tls) as http:
            while True:
                try:
                    await http.get(f"{self.url}/api/v1/healthz")
                except httpx.TransportError as exc:
                    now = time.monotonic()
                    if down_since is None:
                        down_since = now
                        self.warn(f"{self.name} does not answer ({_one_line(exc)}); "
                                  f"retrying for up to {self.timeout:g}s")
                    if now - down_since >= self.timeout:
                        return _one_line(exc)
                    await asyncio.sleep(min(backoff, self.timeout - (now - down_since)))
                    backoff = min(2 * backoff, self.MAX_BACKOFF_S)
                    continue
                if down_since is not None:
                    self.warn(f"{self.name} answers again")
                down_since, backoff = None, 1.0
                await asyncio.sleep(self.HEALTHY_PROBE_S)


#: Requests that name this run's session, model, sampler or a pending request: a 404 to one of them
#: means the service no longer has it. Checkpoint lookups (load_weights, weights info) are left out:
#: a missing checkpoint is a wrong path, not a lost session.
SESSION_ENDPOINTS = ("retrieve_future", "retrieve_futures", "forward_backward", "optim_step",
                     "save_weights", "save_weights_for_sampler", "asample", "get_info", "create_model",
                     "create_sampling_session", "session_heartbeat")


def service_lost(exc: BaseException) -> str | None:
    """Why the Tinker service lost this run's session, model, sampler or pending requests, if ``exc``
    (or what caused it) says so: a 404 from a request naming them (the SDK reports a future the service
    no longer knows as a ``ValueError`` caused by that 404), or the SDK's ``RetryableException`` for an
    expired promise (410). None for any other failure."""
    if isinstance(exc, ServiceLostError):
        return str(exc)
    try:
        import tinker
        from tinker.lib.retryable_exception import RetryableException
    except ImportError:  # pragma: no cover - the SDK is a dependency
        return None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RetryableException):
            return _one_line(current)
        if isinstance(current, tinker.NotFoundError):
            try:
                endpoint = current.request.url.path.rstrip("/").rsplit("/", 1)[-1]
            except Exception:  # noqa: BLE001 - an error built without a request
                endpoint = ""
            if endpoint in SESSION_ENDPOINTS:
                body = current.body.get("error") if isinstance(current.body, dict) else None
                return f"{endpoint}: 404 {' '.join(str(body or current.message).split())[:300]}"
        current = current.__cause__ or current.__context__
    return None


class _AbandonedRequestFilter(logging.Filter):
    """Drops asyncio's "exception was never retrieved" reports of requests the service lost.

    When the service loses a run (a restart), the trainer abandons what was in flight and reopens the
    run; the SDK's tasks for those requests still end, with a 404 for the session the service forgot,
    on the SDK's own event loop, where nobody is left to read them. Their tracebacks say nothing the
    recovery warning did not; any other unretrieved failure is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "never retrieved" in record.getMessage() and service_lost(exc))


_ABANDONED_FILTER = _AbandonedRequestFilter()


def quiet_abandoned_requests() -> None:
    """Install :class:`_AbandonedRequestFilter` on asyncio's logger (once per process)."""
    logger = logging.getLogger("asyncio")
    if _ABANDONED_FILTER not in logger.filters:
        logger.addFilter(_ABANDONED_FILTER)


def update_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is an engine's refusal of a non-finite optimizer step: the local engine's
    :class:`NonFiniteUpdateError`, or ``polyrl serve`` reporting it as a failed request
    ("optim_step refused ...")."""
    if isinstance(exc, NonFiniteUpdateError):
        return True
    try:
        import tinker
    except ImportError:  # pragma: no cover - the SDK is a dependency
        return False
    return isinstance(exc, tinker.RequestFailedError) and "optim_step refused" in exc.message


def _is_service_error(exc: BaseException) -> bool:
    """Errors the Tinker SDK raises once it gave up on a request (some as a ``ValueError`` raised from
    the SDK's own error)."""
    try:
        import tinker
        from tinker.lib.retryable_exception import RetryableException
    except ImportError:  # pragma: no cover - the SDK is a dependency
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (tinker.TinkerError, RetryableException)):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"
