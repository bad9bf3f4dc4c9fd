"""Fail-open: a summarizer whose failures are answered by the extractive summary."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

from ctxfold.compaction.summarize.base import Summarizer, SummaryResult, TokenCallback
from ctxfold.compaction.summarize.extractive import ExtractiveSummarizer
from ctxfold.compaction.summarize.request import SummaryRequest


class FallbackSummarizer:
    """Runs ``primary``; on a failure other than cancellation returns the extractive summary instead, with
    ``primary_failure`` set so the caller can count the failure (the three-failure breaker) while the
    compaction still goes ahead. A cancelled summary stays cancelled: the caller asked to stop.

    Streaming: pieces the primary delivered to ``on_token`` before it failed cannot be taken back; the
    fallback's text then arrives as one piece. A user interface should show the final result's text (and may
    reset its live view when ``primary_failure`` is set)."""

    def __init__(self, primary: Summarizer, fallback: ExtractiveSummarizer | None = None) -> None:
        self._primary = primary
        self._fallback = fallback or ExtractiveSummarizer()

    @property
    def name(self) -> str:
        return self._primary.name

    def _replace(self, first: SummaryResult, request: SummaryRequest, on_token: TokenCallback | None) -> SummaryResult:
        if first.ok or first.failure == "cancelled":
            return first
        r = self._fallback.summarize(request, on_token=on_token)
        why = f"{first.summarizer}: {first.failure}"
        return replace(r, seconds=r.seconds + first.seconds, summarizer=f"{r.summarizer} (fallback)",
                       primary_failure=why, detail=first.detail)

    def summarize(self, request: SummaryRequest, *, on_token: TokenCallback | None = None,
                  cancel: threading.Event | None = None, timeout_s: float | None = None) -> SummaryResult:
        first = self._primary.summarize(request, on_token=on_token, cancel=cancel, timeout_s=timeout_s)
        return self._replace(first, request, on_token)

    async def asummarize(self, request: SummaryRequest, *, on_token: TokenCallback | None = None,
                         cancel: threading.Event | asyncio.Event | None = None,
                         timeout_s: float | None = None) -> SummaryResult:
        first = await self._primary.asummarize(request, on_token=on_token, cancel=cancel, timeout_s=timeout_s)
        return self._replace(first, request, on_token)
