"""The asyncio driver of a :class:`~ctxfold.compaction.compactor.Compactor` (imported from there as
:class:`AsyncCompactor`): summaries awaited on the running loop, the compactor's own work in a worker
thread, its session directory committed after each operation (:mod:`ctxfold.compaction.log_writer`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from ctxfold.chat.messages import Message, ToolSpec
from ctxfold.compaction.effects import Step, run_async
from ctxfold.compaction.events import AppendResult, CompactionEvent

if TYPE_CHECKING:
    from ctxfold.compaction.compactor import Compactor

T = TypeVar("T")


class AsyncCompactor:
    """The asyncio driver of a :class:`Compactor`: summaries awaited on the running loop (the
    summarizer's ``asummarize``), the compactor's own work (counting, its log's writes) in a worker
    thread, one operation at a time under an asyncio lock. ``cancel``: an event that, once set, stops
    a summary in progress (the extractive summary stands in), e.g. when the caller's client left."""

    def __init__(self, compactor: Compactor) -> None:
        self.sync = compactor
        self._lock = asyncio.Lock()

    async def _run(self, step: Step[T], cancel: asyncio.Event | None = None) -> T:
        async with self._lock:
            log = self.sync._log
            if not log.commits:  # nothing to persist here: the journal's owner commits it, if any
                return await run_async(step, self.sync._lock, cancel=cancel)
            # One call of the compactor across the worker threads the step runs in (LogWriter.call):
            # refused before it starts while a refusing log holds too much, committed when it ends.
            await asyncio.to_thread(self._locked, log.enter)
            try:
                return await run_async(step, self.sync._lock, cancel=cancel)
            finally:
                await asyncio.to_thread(self._locked, log.exit)

    def _locked(self, work: Callable[[], None]) -> None:
        with self.sync._lock:
            work()

    async def before_request(self, queued: Sequence[Message] = (), *, max_reply_tokens: int | None = None,
                             cancel: asyncio.Event | None = None) -> CompactionEvent | None:
        return await self._run(self.sync.before_request_step(queued, max_reply_tokens=max_reply_tokens), cancel)

    async def run(self, step: Step[T], *, cancel: asyncio.Event | None = None) -> T:
        """Drive a step the caller put together from the compactor's ``*_step`` methods (the
        asynchronous twin of :meth:`Compactor.run`)."""
        return await self._run(step, cancel)

    async def append(self, *messages: Message) -> None:
        async with self._lock:
            await asyncio.to_thread(self.sync.append, *messages)

    async def append_tool_result(self, result: Message, *, cancel: asyncio.Event | None = None) -> AppendResult:
        return await self._run(self.sync.append_tool_result_step(result), cancel)

    async def compact_now(self, reason: str = "manual compaction", *,
                          cancel: asyncio.Event | None = None) -> CompactionEvent:
        return await self._run(self.sync.compact_now_step(reason), cancel)

    def expect_reply(self, max_tokens: int | None) -> None:
        self.sync.expect_reply(max_tokens)

    async def update_tools(self, tools: Sequence[ToolSpec]) -> None:
        async with self._lock:
            await asyncio.to_thread(self.sync.update_tools, tools)
