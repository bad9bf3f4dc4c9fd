"""Summaries from an in-process generator: for engines that generate themselves (a ds4-like engine, a
transformers model, llama-cpp-python).

The callable gets the :class:`~ctxfold.compaction.summarize.request.SummaryRequest` (its ``messages``, ``system``,
``tools`` and ``max_tokens``; ``to_openai()`` renders it as chat messages) and returns an iterable of text
pieces or an async iterable of them; token strings work too. The pieces go through the same cutter as the HTTP
client. When the summary ends early (a control boundary, the cap, cancellation, the timeout) the generator is
closed so the engine stops generating.

Limits: a synchronous generator is checked for the deadline and the cancel flag between pieces; one piece that
blocks forever cannot be interrupted from here (run the engine with its own limits).
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator

from ctxfold.compaction.summarize._run import run_limited, run_sync
from ctxfold.compaction.summarize.base import (
    CutReason,
    SummaryResult,
    TokenCallback,
    TokenCounter,
    count_tokens,
    failed,
    no_room,
)
from ctxfold.compaction.summarize.postprocess import StreamCutter, result_from_cutter
from ctxfold.compaction.summarize.request import SummaryRequest

GenerateFn = Callable[[SummaryRequest], Iterable[str] | AsyncIterable[str]]

_DONE = object()


def _describe(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].name}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


class CallableSummarizer:
    """A summarizer over a generate callable. Thread-safe if the callable is."""

    def __init__(self, generate: GenerateFn, *, name: str = "callable", counter: TokenCounter | None = None,
                 timeout_s: float = 120.0) -> None:
        if not callable(generate):
            raise TypeError(f"generate must be callable, got {type(generate).__name__}")
        self._generate = generate
        self._name = name
        self._counter = counter
        self._timeout_s = timeout_s

    @property
    def name(self) -> str:
        return self._name

    def _end_reason(self, cutter: StreamCutter, request: SummaryRequest) -> CutReason:
        """A generator has no finish_reason: one that stopped with the answer at the cap was cut by it."""
        if count_tokens(self._counter, cutter.text) >= request.max_tokens:
            return cutter.limit_reason
        return "eos"

    def _cutter(self, request: SummaryRequest) -> StreamCutter:
        return StreamCutter(request.max_tokens, counter=self._counter, limit_reason=request.limit_reason)

    def summarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        t0 = time.perf_counter()
        limit_s = self._timeout_s if timeout_s is None else timeout_s
        if (refused := no_room(self.name, request)) is not None:
            return refused
        try:
            pieces = self._generate(request)
        except Exception as e:  # noqa: BLE001 - an engine error is an expected failure in a serving loop
            return failed(self.name, "generator failed", time.perf_counter() - t0, detail=_describe(e))
        if isinstance(pieces, AsyncIterable):  # an async generator: drive it on a private loop
            return run_sync(self._aconsume(pieces, request, on_token, cancel, limit_s, t0))
        cutter = self._cutter(request)
        deadline = t0 + limit_s
        it: Iterator[str] = iter(pieces)
        try:
            for piece in it:
                if cancel is not None and cancel.is_set():
                    return failed(self.name, "cancelled", time.perf_counter() - t0)
                if time.perf_counter() > deadline:
                    return failed(self.name, f"timeout after {limit_s:g} s", time.perf_counter() - t0)
                out = cutter.feed(str(piece))
                if out and on_token is not None:
                    on_token(out)
                if cutter.stopped:
                    break
            else:
                out = cutter.finish(self._end_reason(cutter, request))
                if out and on_token is not None:
                    on_token(out)
        except Exception as e:  # noqa: BLE001 - as above: the engine's error becomes a result
            return failed(self.name, "generator failed", time.perf_counter() - t0, detail=_describe(e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        return result_from_cutter(cutter, self.name, time.perf_counter() - t0, self._counter)

    async def asummarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | asyncio.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        t0 = time.perf_counter()
        limit_s = self._timeout_s if timeout_s is None else timeout_s
        if (refused := no_room(self.name, request)) is not None:
            return refused
        try:
            pieces = self._generate(request)
        except Exception as e:  # noqa: BLE001 - as above: the engine's error becomes a result
            return failed(self.name, "generator failed", time.perf_counter() - t0, detail=_describe(e))
        if not isinstance(pieces, AsyncIterable):
            pieces = _threaded(iter(pieces))
        return await self._aconsume(pieces, request, on_token, cancel, limit_s, t0)

    async def _aconsume(self, pieces: AsyncIterable[str], request: SummaryRequest,
                        on_token: TokenCallback | None, cancel: threading.Event | asyncio.Event | None,
                        limit_s: float, t0: float) -> SummaryResult:
        cutter = self._cutter(request)
        ait = aiter(pieces)

        async def work() -> None:
            try:
                async for piece in ait:
                    out = cutter.feed(str(piece))
                    if out and on_token is not None:
                        on_token(out)
                    if cutter.stopped:
                        return
                out = cutter.finish(self._end_reason(cutter, request))
                if out and on_token is not None:
                    on_token(out)
            finally:
                aclose = getattr(ait, "aclose", None)
                if aclose is not None:
                    await aclose()

        try:
            outcome, _ = await run_limited(work, cancel=cancel, timeout_s=limit_s)
        except Exception as e:  # noqa: BLE001 - as above: the engine's error becomes a result
            return failed(self.name, "generator failed", time.perf_counter() - t0, detail=_describe(e))
        seconds = time.perf_counter() - t0
        if outcome == "timeout":
            return failed(self.name, f"timeout after {limit_s:g} s", seconds)
        if outcome == "cancelled":
            return failed(self.name, "cancelled", seconds)
        return result_from_cutter(cutter, self.name, seconds, self._counter)


async def _threaded(it: Iterator[str]) -> AsyncIterator[str]:
    """A sync generator pulled on worker threads so a slow engine does not block the event loop."""
    try:
        while True:
            piece = await asyncio.to_thread(next, it, _DONE)
            if piece is _DONE:
                return
            yield str(piece)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # "generator already executing": a worker thread still holds it
                pass
