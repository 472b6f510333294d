"""Server-side bookkeeping: futures by request id, per-model operation order, sessions, samplers.

Every record carries its ``owner`` (a digest of the API key that made it) and its session, so a
lookup can refuse another key's ids and a finished session can take its records with it.
Everything here is touched from the server's event loop only; the engine's worker thread only
completes ``concurrent.futures.Future`` objects, which are thread-safe.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from polyrl.serve.protocol import RequestError

log = logging.getLogger("polyrl.serve")


def chain(src: Future, dst: Future, fn: Callable[[Any], Any] | None = None) -> None:
    """Complete ``dst`` with ``fn(src.result())`` (or ``src``'s exception) once ``src`` is done."""

    def done(f: Future) -> None:
        if dst.done():
            return
        try:
            dst.set_result(fn(f.result()) if fn else f.result())
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            dst.set_exception(e)

    src.add_done_callback(done)


def failed(error: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(error)
    return fut


def key_owner(key: bytes) -> str:
    """Who owns what a key makes: a digest of the key, so the key itself is never stored."""
    return hashlib.sha256(b"polyrl-serve-owner:" + key).hexdigest()[:32]


def error_body(e: BaseException) -> dict:
    """``{"error", "category"}`` as the SDK's ``retrieve_future`` understands it."""
    if isinstance(e, RequestError):
        return {"error": e.message, "category": e.category}
    status = getattr(e, "status_code", None)  # the store's errors are the SDK's status errors
    if isinstance(e, ValueError) or (isinstance(status, int) and 400 <= status < 500):
        return {"error": str(e), "category": "user"}  # the engine's ValueErrors are the caller's input
    if isinstance(e, OSError) and e.strerror:  # its reason: str(e) names the server's files
        return {"error": f"{type(e).__name__}: {e.strerror}", "category": "server"}
    return {"error": f"{type(e).__name__}: {e}", "category": "server"}


# ---- futures -----------------------------------------------------------------------------------------
@dataclass
class Pending:
    """An accepted request's result, fetched with ``retrieve_future``."""

    future: Future
    to_json: Callable[[Any], dict]
    to_proto: Callable[[Any], bytes] | None = None  # results the SDK decodes from protobuf
    done_at: float | None = None
    owner: str = ""
    session_id: str = ""


class Futures:
    """Accepted requests' results by request id, each its caller's, until ``result_ttl_s`` after they are
    done (:meth:`expire`) or their session ends."""

    def __init__(self) -> None:
        self._items: dict[str, Pending] = {}

    def add(self, future: Future, to_json: Callable[[Any], dict],
            to_proto: Callable[[Any], bytes] | None = None, owner: str = "", session_id: str = "") -> str:
        request_id = uuid.uuid4().hex
        self._items[request_id] = Pending(future, to_json, to_proto, owner=owner, session_id=session_id)
        return request_id

    def get(self, request_id: str) -> Pending | None:
        return self._items.get(request_id)

    def owned(self, request_id: str, owner: str) -> Pending | None:
        """The result ``request_id`` if ``owner`` asked for it; another key's is as unknown as a made-up
        id."""
        p = self._items.get(request_id)
        return p if p is not None and p.owner == owner else None

    async def retrieve(self, request_id: str, accept_proto: bool, owner: str, long_poll_s: float
                       ) -> tuple[int, Any]:
        """``retrieve_future``'s (HTTP status, body): a done result (bytes for protobuf, a dict for JSON) or
        its error, or a 408 ``try_again`` once ``long_poll_s`` seconds pass first."""
        pending = self.owned(request_id, owner)
        if pending is None:
            raise RequestError(404, f"unknown or expired request_id {request_id!r}")
        if not await wait_done(pending.future, long_poll_s):
            return 408, {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        error = pending.future.exception()
        if error is not None:
            body = error_body(error)
            if body["category"] == "server":
                log.error("request %s failed", request_id, exc_info=error)
            return 200, body
        result = pending.future.result()
        if accept_proto and pending.to_proto is not None:
            return 200, pending.to_proto(result)
        return 200, pending.to_json(result)

    def drop_session(self, session_id: str) -> None:
        for rid in [rid for rid, p in self._items.items() if p.session_id == session_id]:
            del self._items[rid]

    def __len__(self) -> int:
        return len(self._items)

    def expire(self, ttl: float, now: float | None = None) -> None:
        """Forget results that completed more than ``ttl`` seconds ago."""
        now = time.monotonic() if now is None else now
        for rid, p in list(self._items.items()):
            if p.future.done():
                if p.done_at is None:
                    p.done_at = now
                elif now - p.done_at > ttl:
                    del self._items[rid]


async def wait_done(future: Future, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``future`` without cancelling it; whether it is done."""
    if future.done():
        return True
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake(_: Future) -> None:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # loop closed while the server shuts down
            pass

    future.add_done_callback(wake)
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        pass
    return future.done()


# ---- per-model ordering ------------------------------------------------------------------------------
class OrderedOps:
    """One model's operations, run in ``seq_id`` order and each exactly once.

    The SDK numbers a training client's requests 1, 2, 3, ...; it may POST the chunks of one
    ``forward_backward`` concurrently (in any order) and retry any POST. An operation waits here
    until every lower ``seq_id`` has been handed to the engine; a repeated ``seq_id`` gets the
    original request id back. A ``seq_id`` that never arrives (its POST was refused) holds up the
    ones after it for at most ``gap_timeout`` seconds; then those are failed, not run out of context.
    A ``seq_id`` more than ``max_ahead`` past the next one is refused outright, so a gap (and what
    it holds and later fails) stays bounded.
    """

    def __init__(self, submit: Callable[[Callable[[], Any]], Future], futures: Futures, first_seq: int = 1,
                 max_ahead: int = 1024, owner: str = "", session_id: str = ""):
        self._submit = submit
        self._futures = futures
        self._tags = {"owner": owner, "session_id": session_id}
        self.max_ahead = max_ahead
        self.next_seq = first_seq
        self.seen: dict[int, str] = {}
        self.refused: dict[int, RequestError] = {}  # seq_id -> why its POST was refused (retries get it too)
        self.waiting: dict[int, tuple[Callable[[], Any], Future]] = {}
        self.gap_since: float | None = None
        self.closed: str | None = None

    def submit(self, seq: int, fn: Callable[[], Any], to_json: Callable[[Any], dict],
               to_proto: Callable[[Any], bytes] | None = None) -> str:
        if seq in self.refused:  # the SDK retries a 409 or 429 with the same seq_id: it gets the same answer
            raise self.refused[seq]
        if seq in self.seen:
            return self.seen[seq]
        if seq < self.next_seq:
            raise RequestError(400, f"seq_id {seq} was already used by this model (next is {self.next_seq})")
        if self.closed:
            raise RequestError(404, self.closed)
        if seq >= self.next_seq + self.max_ahead:
            raise RequestError(400, f"seq_id {seq} is {seq - self.next_seq} ahead of this model's next "
                                    f"operation (seq_id {self.next_seq}); at most {self.max_ahead} may wait "
                                    "for earlier ones")
        fut: Future = Future()
        rid = self._futures.add(fut, to_json, to_proto, **self._tags)
        self.seen[seq] = rid
        self.waiting[seq] = (fn, fut)
        self._drain()
        return rid

    def accepts(self, seq: int) -> bool:
        """Whether ``submit(seq, ...)`` would queue a new operation (not a retry, not a refusal)."""
        ahead = self.next_seq <= seq < self.next_seq + self.max_ahead
        return ahead and seq not in self.seen and not self.closed

    def refuse(self, seq: int, error: RequestError) -> None:
        """Record ``seq`` as failed (its POST was malformed) so later operations need not wait for it."""
        if seq in self.seen or seq < self.next_seq or seq >= self.next_seq + self.max_ahead or self.closed:
            return
        self.seen[seq] = self._futures.add(failed(error), dict, **self._tags)
        self.refused[seq] = error
        self.waiting[seq] = (None, None)  # type: ignore[assignment]
        self._drain()

    def _drain(self) -> None:
        start = self.next_seq
        while self.next_seq in self.waiting:
            fn, fut = self.waiting.pop(self.next_seq)
            self.next_seq += 1
            if fn is not None:
                chain(self._submit(fn), fut)
        if not self.waiting:
            self.gap_since = None
        elif self.gap_since is None or self.next_seq != start:  # a new gap starts now
            self.gap_since = time.monotonic()

    def check_gap(self, timeout: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not self.waiting or self.gap_since is None or now - self.gap_since < timeout:
            return
        first = min(self.waiting)
        missing = list(range(self.next_seq, first))  # at most max_ahead
        named = missing if len(missing) <= 8 else f"{missing[0]}..{missing[-1]}"
        log.warning("seq_id %s never arrived within %.0f s; failing the %d operations queued after it",
                    named, timeout, len(self.waiting))
        for seq in missing:
            self.seen[seq] = self._futures.add(failed(RequestError(408, f"seq_id {seq} never arrived")), dict,
                                               **self._tags)
        err = RequestError(409, f"not run: seq_id(s) {named} of this model never reached the server "
                                f"(waited {timeout:.0f} s)")
        for _, fut in self.waiting.values():
            if fut is not None:
                fut.set_exception(err)
        self.next_seq = max(self.waiting) + 1
        self.waiting.clear()
        self.gap_since = None

    def close(self, reason: str) -> None:
        self.closed = reason
        for _, fut in self.waiting.values():
            if fut is not None and not fut.done():
                fut.set_exception(RequestError(404, reason))
        self.waiting.clear()

    def forget_old(self, keep: int = 4096) -> None:
        for seq in [s for s in self.seen if s < self.next_seq - keep]:
            del self.seen[seq]
            self.refused.pop(seq, None)


# ---- records -----------------------------------------------------------------------------------------
@dataclass
class Session:
    session_id: str
    owner: str
    tags: list[str] = field(default_factory=list)
    user_metadata: dict | None = None
    created: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)


@dataclass
class ModelRecord:
    model_id: str
    session_id: str
    owner: str
    base_model: str
    lora: dict
    user_metadata: dict | None
    ready: Future  # of the engine's TrainerState
    ops: OrderedOps
    create_request_id: str
    last_request: float = field(default_factory=time.time)
    adapter_bytes: int = 0  # what its adapter, gradients and optimizer state hold (the key's memory quota)
    waiting_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens of data behind a gap


@dataclass
class SamplerRecord:
    sampler_id: str
    session_id: str
    owner: str
    base_model: str
    model_path: str | None
    ready: Future  # of the engine's SamplerState
    ephemeral: bool
    last_used: float = field(default_factory=time.monotonic)
    # seq_id -> (request id, sequence ids)
    seen: dict[int, tuple[str, list[str]]] = field(default_factory=dict)


# ---- sampling requests, gathered ---------------------------------------------------------------------
class SampleGate:
    """Hands sampling requests to the engine so that a rollout's requests share one batch.

    In-process, an RL step's ``sample`` calls reach the engine within a millisecond and decode as
    one batch. Through the SDK they arrive one HTTP request at a time, spread over tens of
    milliseconds, and an idle engine would start decoding the first few alone. So while the engine
    is idle, requests are held until none has arrived for ``quiet`` seconds (``burst_quiet`` once
    two or more are waiting: a burst is under way), at most ``max_wait`` after the first. While the
    engine is busy they go straight to its queue, where its next batch collects them anyway.
    """

    def __init__(self, submit: Callable[[Any, Any, str], Future], busy: Callable[[], bool], quiet: float,
                 burst_quiet: float, max_wait: float):
        self._submit = submit
        self._busy = busy
        self.quiet = quiet
        self.burst_quiet = burst_quiet
        self.max_wait = max_wait
        self._held: list[tuple[Any, Any, Future, str]] = []
        self._first = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def add(self, sampler_state: Any, job: Any, out: Future, owner: str = "") -> None:
        self._held.append((sampler_state, job, out, owner))
        if self.quiet <= 0 or self._busy():
            self.flush()
            return
        loop = asyncio.get_running_loop()
        if len(self._held) == 1:
            self._first = loop.time()
        if self._timer is not None:
            self._timer.cancel()
        quiet = self.quiet if len(self._held) == 1 else self.burst_quiet
        delay = min(quiet, self._first + self.max_wait - loop.time())
        if delay <= 0:
            self.flush()
        else:
            self._timer = loop.call_later(delay, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        held, self._held, self._timer = self._held, [], None
        if held:
            log.debug("sampling: %d requests to the engine (busy=%s)", len(held), self._busy)
        for sampler_state, job, out, owner in held:
            chain(self._submit(sampler_state, job, owner), out)


class Outstanding:
    """Counts engine operations submitted and not yet finished (is the engine busy?)."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def track(self, fut: Future) -> Future:
        with self._lock:
            self._n += 1
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _: Future) -> None:
        with self._lock:
            self._n -= 1

    def __bool__(self) -> bool:
        return self._n > 0

    def __repr__(self) -> str:
        return f"Outstanding({self._n})"


class Usage:
    """What each key has in flight (tokens, samples): an amount is held from when a request is accepted
    until its future is done (released by a done callback, a moment after ``done()`` turns true; what it
    limits answers 429, which clients retry). Futures complete on the engine's thread, hence the lock."""

    def __init__(self) -> None:
        self._held: dict[str, Counter] = {}
        self._lock = threading.Lock()

    def hold(self, owner: str, until: Future, **amounts: int) -> None:
        with self._lock:
            self._held.setdefault(owner, Counter()).update(amounts)
        until.add_done_callback(lambda _: self._release(owner, amounts))

    def _release(self, owner: str, amounts: dict[str, int]) -> None:
        with self._lock:
            held = self._held[owner]
            held.subtract(amounts)
            if not +held:
                del self._held[owner]

    def held(self, owner: str, what: str) -> int:
        with self._lock:
            return self._held.get(owner, Counter())[what]
