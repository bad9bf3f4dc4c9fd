"""What the compaction core asks of the world, and the drivers that do it.

The core (the compactor's passes) never calls a model itself: a pass that wants a summary yields a
:class:`SummaryCall` and is resumed with the summarizer's :class:`SummaryResult` (or has the summarizer's
exception raised at the ``yield``). It writes nothing either: its records and blobs go into the
conversation's journal (:mod:`ctxfold.compaction.journal`), which the driver's owner persists. Each
operation is a generator, a :data:`Step`, and a driver runs it:

- :func:`run_sync` (or :func:`drive_sync` under a lock the caller holds) calls ``summarizer.summarize`` in
  the calling thread (the library's ``Compactor``);
- :func:`run_async` awaits ``summarizer.asummarize`` on the running event loop, and runs the core's own
  work between two summaries (counting, rendering) in a worker thread when asked to, so that a long
  count never stalls the loop (the proxy, ``AsyncCompactor``).

Both take the compactor's lock around each piece of the core's work, never across a summary's wait in
the asynchronous driver, so a summary of one conversation does not hold readers of its figures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

from ctxfold.compaction.summarize.base import Summarizer, SummaryResult, TokenCallback
from ctxfold.compaction.summarize.request import SummaryRequest

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SummaryCall:
    """A summary the core waits for: ``summarizer`` (it falls back by itself where it can) on ``request``."""

    summarizer: Summarizer
    request: SummaryRequest
    timeout_s: float | None
    on_token: TokenCallback | None = None


# One operation of the core: yields the summaries it needs, returns its outcome.
Step = Generator[SummaryCall, SummaryResult, T]


def no_calls(step: Step[T]) -> T:
    """Run a step that asks for no summary (the window guard's passes): its outcome, at once."""
    try:
        call = next(step)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    step.close()
    raise RuntimeError(f"a step that asks no model asked for a summary from {call.summarizer.name}")


def run_sync(step: Step[T], lock: AbstractContextManager[object] | None = None) -> T:
    """Drive ``step`` in this thread: each summary through the summarizer's blocking ``summarize``."""
    if lock is None:
        return drive_sync(step)
    with lock:
        return drive_sync(step)


def drive_sync(step: Step[T]) -> T:
    """:func:`run_sync` for a caller that holds the compactor's lock already (every request of the
    library's ``Compactor``: one call fewer on its hottest path)."""
    outcome: SummaryResult | None = None
    failure: Exception | None = None
    while True:
        try:
            call = step.throw(failure) if failure is not None else step.send(outcome)  # type: ignore[arg-type]
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        outcome, failure = None, None
        try:
            outcome = call.summarizer.summarize(call.request, on_token=call.on_token, timeout_s=call.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the core decides what a summarizer's failure means
            failure = exc


async def run_async(step: Step[T], lock: AbstractContextManager[object] | None = None, *,
                    in_thread: bool = True, cancel: asyncio.Event | None = None) -> T:
    """Drive ``step`` on the running loop: each summary awaited (``asummarize``, stopped early when
    ``cancel`` is set); the core's work between them in a worker thread when ``in_thread``, else inline
    (work known to be short: nothing to count, nothing to flush)."""
    outcome: SummaryResult | None = None
    failure: Exception | None = None
    while True:
        advance = _advance(step, outcome, failure, lock)
        finished, value = await asyncio.to_thread(advance) if in_thread else advance()
        if finished:
            return value  # type: ignore[return-value]
        call: SummaryCall = value  # type: ignore[assignment]
        outcome, failure = None, None
        try:
            outcome = await call.summarizer.asummarize(call.request, on_token=call.on_token, cancel=cancel,
                                                       timeout_s=call.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the core decides what a summarizer's failure means
            failure = exc


def _advance(step: Step[T], outcome: SummaryResult | None, failure: Exception | None,
             lock: AbstractContextManager[object] | None) -> Callable[[], tuple[bool, object]]:
    """One piece of the core's work as a call that returns (finished, outcome or next call): a
    StopIteration cannot cross a thread's future."""
    def piece() -> tuple[bool, object]:
        with lock if lock is not None else nullcontext():
            try:
                return False, step.throw(failure) if failure is not None else step.send(outcome)  # type: ignore[arg-type]
            except StopIteration as done:
                return True, done.value
    return piece
