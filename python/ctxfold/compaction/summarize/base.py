"""The summarizer protocol and its result.

A summarizer turns a :class:`~ctxfold.compaction.summarize.request.SummaryRequest` into a
:class:`SummaryResult`. Every summarizer streams (``on_token`` gets each accepted piece of summary text as it
arrives), can be cancelled (a :class:`threading.Event`, checked between pieces) and honours a timeout over the
whole generation. Expected failures (a timeout, an HTTP error, an empty or garbage answer) come back as a
result with ``ok=False`` and a reason; only misuse of the API raises.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from ctxfold.compaction.summarize._run import run_sync
from ctxfold.compaction.summarize.request import SummaryRequest

CutReason = Literal["eos", "control_boundary", "token_cap", "room", "none"]
"""Why the summary text ends where it does:

- ``eos``: the model finished (end of sequence, ``finish_reason: stop``, the generator ended).
- ``control_boundary``: the model tried to leave the summary (``</think>``, DSML, ``<tool_call>``, tool_calls
  deltas); the text stops before the marker.
- ``token_cap``: cut at ``summary.max_tokens``.
- ``room``: cut at the room left in the context (smaller than the cap).
- ``none``: no generation ended it (a failure before any answer, or a summary built without a model).
"""

TokenCallback = Callable[[str], None]


class TokenCounter(Protocol):
    """Anything with ``count(text) -> int`` (ctxfold's token counters, a tokenizer wrapper)."""

    def count(self, text: str) -> int: ...


def count_tokens(counter: TokenCounter | None, text: str) -> int:
    """Tokens of ``text`` by ``counter``, or ceil(chars/4) when there is none (Datus's estimate)."""
    if counter is not None:
        return int(counter.count(text))
    return (len(text) + 3) // 4


@dataclass(frozen=True, slots=True)
class SummaryResult:
    """What a summarizer produced."""

    text: str  # the summary, post-processed (cut, stripped); "" on failure
    ok: bool  # True when ``text`` is a usable summary
    failure: str | None  # why not, on failure ("timeout after 120 s", "HTTP 429: ...", "empty summary")
    cut_reason: CutReason  # why the text ends where it does (see CutReason)
    num_tokens: int  # tokens of ``text`` (the summarizer's counter, or chars/4)
    seconds: float  # wall time of the whole call
    summarizer: str  # name of the summarizer that produced it ("extractive", "openai:<model>", ...)
    detail: str | None = None  # diagnostics: server error body, the fallback's cause, chunk counts
    primary_failure: str | None = None  # set on a fallback's result: why the summarizer it replaced failed

    @property
    def capped(self) -> bool:
        """The summary was cut by the token cap or the room, so it may be incomplete."""
        return self.cut_reason in ("token_cap", "room")


@runtime_checkable
class Summarizer(Protocol):
    """One protocol for every summarizer. Implementations are safe to call from several threads at once."""

    @property
    def name(self) -> str: ...

    def summarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        """Generate a summary for ``request`` (blocking). ``request.max_tokens`` bounds the answer."""
        ...

    async def asummarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | asyncio.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        """The asyncio variant; cancelling the awaiting task also stops the generation."""
        ...


def failed(name: str, reason: str, seconds: float, *, detail: str | None = None) -> SummaryResult:
    """A failure result. A partial answer is never returned as a summary: the text is empty."""
    return SummaryResult(
        text="", ok=False, failure=reason, cut_reason="none", num_tokens=0, seconds=seconds, summarizer=name,
        detail=detail,
    )


def no_room(name: str, request: SummaryRequest) -> SummaryResult | None:
    """The failure of a request that leaves no tokens for the summary, else None."""
    return failed(name, "no room left for a summary (max_tokens is 0)", 0.0) if request.max_tokens < 1 else None


def is_cancelled(cancel: threading.Event | asyncio.Event | None) -> bool:
    return cancel is not None and cancel.is_set()


class CoroutineSummarizer:
    """Base of summarizers written as coroutines: the blocking API runs ``asummarize`` to completion
    on a private event loop (usable from inside a running loop too)."""

    async def asummarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | asyncio.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        raise NotImplementedError

    def summarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        return run_sync(self.asummarize(request, on_token=on_token, cancel=cancel, timeout_s=timeout_s))
