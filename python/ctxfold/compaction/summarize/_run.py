"""Running one generation under a timeout and a cancel flag, sync or async."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")

Outcome = Literal["done", "timeout", "cancelled"]

_POLL_S = 0.02  # how often a threading.Event is polled from the event loop (cancel latency)


async def _wait_cancel(cancel: threading.Event | asyncio.Event) -> None:
    if isinstance(cancel, asyncio.Event):
        await cancel.wait()
        return
    while not cancel.is_set():
        await asyncio.sleep(_POLL_S)


async def run_limited(
    work: Callable[[], Awaitable[T]],
    *,
    cancel: threading.Event | asyncio.Event | None,
    timeout_s: float | None,
) -> tuple[Outcome, T | None]:
    """Run ``work()`` until it finishes, the timeout passes or ``cancel`` is set; the work is cancelled
    (its ``finally`` blocks run, so an HTTP stream is closed) in the last two cases."""
    task: asyncio.Task[T] = asyncio.ensure_future(work())
    waiter: asyncio.Task[None] | None = asyncio.ensure_future(_wait_cancel(cancel)) if cancel is not None else None
    try:
        pending = {task} if waiter is None else {task, waiter}
        done, _ = await asyncio.wait(pending, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return "done", task.result()
        outcome: Outcome = "cancelled" if waiter is not None and waiter in done else "timeout"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return outcome, None
    finally:
        if waiter is not None:
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
        if not task.done():  # the caller itself was cancelled: stop the work too
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code. Inside a running event loop (a notebook, a
    server's handler calling the sync API by mistake) it runs on a helper thread instead of failing."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
