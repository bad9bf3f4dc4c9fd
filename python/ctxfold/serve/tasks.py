"""Work a request must finish even when its client leaves (:func:`uncancelled`): a compactor's append and
passes, recording an answer. aiohttp cancels a handler whose client left (:func:`~ctxfold.serve.listener.runner_options`)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar, cast

T = TypeVar("T")


async def uncancelled(work: Coroutine[Any, Any, T], on_cancel: Callable[[], None] | None = None, *,
                      eager: bool = False) -> T:
    """``await work`` to its end even when the awaiting task is cancelled (its client left); the
    cancellation is raised after it. For work that must not stop half way: a compactor's append and
    passes (in a worker thread, which a cancellation would not stop anyway), recording an answer.
    ``on_cancel`` is called at the cancellation: to ask the work to finish early (a summary stops).

    ``eager``: the work's first step runs at once, in the caller (in a copy of its context, as a
    task's would be). A cancellation reaches a coroutine only where it waits, and the usual request's
    work never waits (nothing to load, nothing fires): it ends in that step, with no task and no turn
    of the event loop. Under load each turn waits behind every other connection's callbacks: at 64
    paced conversations the two turns of a task took 0.14 ms (median) of the request's way upstream.
    What waits goes on in a task of its own, as without ``eager``. Only for work whose first step
    starts no timer that cancels "the current task" (``asyncio.timeout``, ``asyncio.wait_for`` on
    3.12, a ``TaskGroup``, redis-py's and aiohttp's client timeouts): that would be the caller, and its
    expiry would read as the client leaving. Worker threads are fine."""
    if eager:
        context = contextvars.copy_context()
        try:
            waiting_on = context.run(work.send, None)
        except StopIteration as done:
            return cast(T, done.value)
        task = asyncio.get_running_loop().create_task(_Resumed(work, waiting_on), context=context)
    else:
        task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            if not cancelled and on_cancel is not None:
                on_cancel()
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class _Resumed(Coroutine[Any, Any, T]):
    """``work`` from where its first step stopped (it yielded ``waiting_on``, what it waits on), for
    a task to drive as any coroutine: the first step yields ``waiting_on``; every other step, and
    anything thrown in (a cancellation before the first step included), goes on to ``work``."""

    __slots__ = ("waiting_on", "work")

    def __init__(self, work: Coroutine[Any, Any, T], waiting_on: Any) -> None:
        self.work = work
        self.waiting_on: Any = waiting_on

    def send(self, value: Any) -> Any:
        if self.waiting_on is not _SENT:
            waiting_on, self.waiting_on = self.waiting_on, _SENT
            return waiting_on
        return self.work.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self.waiting_on = _SENT
        return self.work.throw(typ) if val is None and tb is None else self.work.throw(typ, val, tb)

    def close(self) -> None:
        self.work.close()

    def __await__(self) -> Generator[Any, None, T]:
        raise TypeError("a resumed work is driven by its task, not awaited")


_SENT = object()  # _Resumed's first step is done
