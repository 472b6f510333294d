"""A blocking call awaited from the event loop without holding it up."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new daemon thread, awaited. Unlike ``asyncio.to_thread`` a call
    that never returns (a hung environment, a client retrying a dead server) holds no pool slot that
    others wait for and never keeps the process from exiting; cancelling the await abandons it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def work() -> None:
        try:
            value, error = context.run(fn, *args, **kwargs), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed while the call blocked: nobody is waiting for it
            pass

    threading.Thread(target=work, name=f"polyrl-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future
