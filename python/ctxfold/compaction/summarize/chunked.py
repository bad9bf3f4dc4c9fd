"""Chunked (rolling) summarization, for when even the summary request does not fit the window.

Peers fail here: a summary request over a transcript at 90 % of the window plus a 4000-token answer overflows
(Datus, Claude Code, Codex and LangChain users all report it). ctxfold splits transcript[:BOTTOM] at message
boundaries into chunks that fit, and summarizes them in turn, each request carrying the summary so far and the
next chunk as plain text. The chunk requests are no longer prefixes of what the model saw, so they do not hit
the cache; they are only used when the cached request cannot be sent at all. Any failure of a chunk falls back
to the extractive summary of the whole transcript, so the caller always gets a summary.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from ctxfold.chat.messages import Message, Role
from ctxfold.compaction.summarize.base import (
    CoroutineSummarizer,
    Summarizer,
    SummaryResult,
    TokenCallback,
    TokenCounter,
    count_tokens,
)
from ctxfold.compaction.summarize.extractive import ExtractiveSummarizer
from ctxfold.compaction.summarize.postprocess import trim_to_tokens
from ctxfold.compaction.summarize.request import (
    SummaryRequest,
    build_summary_request,
    contract_text,
    render_plain,
)

_FRAME = ("Summary of the conversation so far:\n{summary}\n\n"
          "Next part of the conversation (part {k} of {n}), as a transcript:\n{chunk}\n\n"
          "Update the summary so it covers everything so far, earlier parts included.")
_MARGIN_TOKENS = 64  # chat template overhead of the two messages, with room to spare


def split_into_chunks(messages: Sequence[Message], count: Callable[[str], int],
                      budget_tokens: int) -> list[list[Message]]:
    """Split ``messages`` at message boundaries into chunks whose plain rendering has at most
    ``budget_tokens`` tokens. A message larger than the budget forms a chunk alone (it is shortened when
    rendered, see :func:`render_chunk`). Raises ValueError when the budget is below 1."""
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    chunks: list[list[Message]] = []
    current: list[Message] = []
    used = 0
    for m in messages:
        n = count(render_plain([m])) + 1  # + the newline joining it to the previous one
        if current and used + n > budget_tokens:
            chunks.append(current)
            current, used = [], 0
        current.append(m)
        used += n
    if current:
        chunks.append(current)
    return chunks


def render_chunk(chunk: Sequence[Message], budget_tokens: int, counter: TokenCounter | None) -> str:
    """The chunk as a transcript of at most ``budget_tokens`` tokens: a single oversized message keeps its
    head and tail."""
    text = render_plain(chunk)
    if count_tokens(counter, text) <= budget_tokens:
        return text
    per_message = max(200, budget_tokens * 3 // max(1, len(chunk)))  # ~3 chars a token: conservative
    text = render_plain(chunk, max_chars_per_message=per_message)
    return trim_to_tokens(text, budget_tokens, counter)


class ChunkedSummarizer(CoroutineSummarizer):
    """Wraps a summarizer; summarizes transcript[:BOTTOM] chunk by chunk within ``window_tokens``.

    The answer of every chunk request is capped at ``request.cap_tokens``; the chunk budget is what the window
    leaves after the contract, the previous summary (at most the cap) and that answer. Only the last chunk's
    summary is streamed to ``on_token``. Thread-safe if the inner summarizer is.
    """

    def __init__(self, inner: Summarizer, *, window_tokens: int, counter: TokenCounter | None = None,
                 fallback: ExtractiveSummarizer | None = None, min_chunk_tokens: int = 256) -> None:
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        self._inner = inner
        self._window_tokens = window_tokens
        self._counter = counter
        self._fallback = fallback or ExtractiveSummarizer(counter=counter)
        self._min_chunk_tokens = min_chunk_tokens

    @property
    def name(self) -> str:
        return f"chunked:{self._inner.name}"

    def chunk_budget_tokens(self, request: SummaryRequest) -> int:
        fixed = count_tokens(self._counter, contract_text(request.reason) + _FRAME)
        return self._window_tokens - fixed - 2 * request.cap_tokens - _MARGIN_TOKENS

    async def asummarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | asyncio.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        t0 = time.perf_counter()
        transcript = request.transcript
        budget = self.chunk_budget_tokens(request)
        if budget < self._min_chunk_tokens:
            return self._fall_back(transcript, request.max_tokens, t0,
                                   f"window of {self._window_tokens} tokens leaves {budget} tokens per chunk")
        chunks = split_into_chunks(transcript, lambda s: count_tokens(self._counter, s), budget)
        summary = ""
        last: SummaryResult | None = None
        for k, chunk in enumerate(chunks, start=1):
            prompt = _FRAME.format(summary=summary or "(none yet)", k=k, n=len(chunks),
                                   chunk=render_chunk(chunk, budget, self._counter))
            sub = build_summary_request([Message(role=Role.USER, content=prompt)], reason=request.reason,
                                        cap_tokens=request.cap_tokens)
            left = None if timeout_s is None else timeout_s - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                return self._fall_back(transcript, request.max_tokens, t0, f"timeout before chunk {k}/{len(chunks)}")
            last = await self._inner.asummarize(sub, on_token=on_token if k == len(chunks) else None,
                                                cancel=cancel, timeout_s=left)
            if not last.ok:
                if last.failure == "cancelled":
                    return last
                return self._fall_back(transcript, request.max_tokens, t0,
                                       f"chunk {k}/{len(chunks)} failed: {last.failure}")
            summary = last.text
        if last is None:
            return self._fall_back(transcript, request.max_tokens, t0, "nothing to summarize")
        text = trim_to_tokens(summary, request.max_tokens, self._counter)
        return SummaryResult(
            text=text, ok=True, failure=None,
            cut_reason=last.cut_reason if text == summary else request.limit_reason,
            num_tokens=count_tokens(self._counter, text), seconds=time.perf_counter() - t0, summarizer=self.name,
            detail=f"{len(chunks)} chunks of <= {budget} tokens",
        )

    def _fall_back(self, transcript: Sequence[Message], max_tokens: int, t0: float, why: str) -> SummaryResult:
        r = self._fallback.summarize_messages(transcript, max_tokens)
        return replace(r, seconds=time.perf_counter() - t0, summarizer=f"{self._fallback.name} (fallback)",
                       detail=why, primary_failure=why)
