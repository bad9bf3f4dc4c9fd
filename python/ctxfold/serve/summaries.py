"""Summaries written by the upstream model, asked through the proxy's own upstream client.

The compactor is synchronous and runs its passes in a worker thread; the proxy's pooled client lives
on the event loop. :class:`UpstreamSummarizer` bridges the two: its blocking ``summarize`` (called in
the worker thread) submits the streaming call to the proxy's loop and waits for it, so a summary
shares the proxy's connections, connect and read timeouts, and metrics, and is sent with credentials:

- ``--summary-api-key-env NAME``: the key in that environment variable, when set;
- else the ``Authorization`` header of the client request that triggered the compaction
  (:data:`CLIENT_AUTHORIZATION`, set per request; worker threads inherit it with the context).

A failed summary is a result, never an exception: the compactor falls back to the extractive summary,
and the proxy logs the reason and counts it by reason (``ctxfold_summary_fallbacks_total``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace

from ctxfold.serve.upstream import UpstreamClient, UpstreamError, UpstreamResponse
from ctxfold.summarize import OpenAICompatibleSummarizer
from ctxfold.summarize.base import SummaryResult, TokenCallback, failed
from ctxfold.summarize.openai import SummaryAnswer, SummaryTransportError
from ctxfold.summarize.request import SummaryRequest

# The Authorization header of the request being handled (None: it sent none). Set by the handler;
# asyncio.to_thread copies the context, so the compactor's worker thread reads the request's own.
CLIENT_AUTHORIZATION: contextvars.ContextVar[str | None] = contextvars.ContextVar("ctxfold_client_authorization",
                                                                                  default=None)
# Set when the client of the request being handled has left: its summaries stop (the compactor falls
# back to the extractive summary) so that its conversation is free at once. An event of the proxy's loop.
CLIENT_LEFT: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("ctxfold_client_left",
                                                                                   default=None)

_GRACE_S = 5.0
CLIENT_LEFT_REASON = "the client left"  # a summary stopped because of it (the fallback's metric label)


class _Answer:
    """An upstream answer as a summarizer reads it: transport failures as SummaryTransportError."""

    def __init__(self, resp: UpstreamResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except UpstreamError as e:
            raise _failure(e) from None

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.iter_chunks():
                yield chunk
        except UpstreamError as e:
            raise _failure(e) from None


def _failure(e: UpstreamError) -> SummaryTransportError:
    reason = "timeout" if isinstance(e, TimeoutError) else "upstream unreachable or cut"
    return SummaryTransportError(reason, detail=str(e))


class UpstreamTransport:
    """Sends summary requests through the proxy's client, with the credentials described above."""

    def __init__(self, client: Callable[[], UpstreamClient], api_key: str | None) -> None:
        self._client = client
        self._api_key = api_key

    @asynccontextmanager
    async def stream(self, body: bytes, headers: Mapping[str, str]) -> AsyncIterator[SummaryAnswer]:
        out = dict(headers)
        authorization = f"Bearer {self._api_key}" if self._api_key else CLIENT_AUTHORIZATION.get()
        if authorization is not None:
            out["Authorization"] = authorization
        try:
            async with self._client().post(body, out) as resp:
                yield _Answer(resp)
        except UpstreamError as e:
            raise _failure(e) from None


class UpstreamSummarizer(OpenAICompatibleSummarizer):
    """:class:`OpenAICompatibleSummarizer` over :class:`UpstreamTransport`, run on the proxy's loop."""

    def __init__(self, base_url: str, model: str, *, loop: Callable[[], asyncio.AbstractEventLoop | None],
                 client: Callable[[], UpstreamClient], api_key: str | None, timeout_s: float) -> None:
        # The key goes through the transport (it chooses between it and the client's header).
        super().__init__(base_url, model, timeout_s=timeout_s, transport=UpstreamTransport(client, api_key))
        self._loop = loop

    def summarize(self, request: SummaryRequest, *, on_token: TokenCallback | None = None,
                  cancel: threading.Event | None = None, timeout_s: float | None = None) -> SummaryResult:
        loop = self._loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or loop.is_closed() or running is loop:
            # Waiting here for the loop would block the loop: the compactor's passes run in a worker thread.
            return failed(self.name, "no event loop to ask the upstream from", 0.0)
        authorization, left = CLIENT_AUTHORIZATION.get(), CLIENT_LEFT.get()

        async def call() -> SummaryResult:
            CLIENT_AUTHORIZATION.set(authorization)  # this task's own context: the request's credentials
            # The compactor passes no cancel flag of its own; one given wins over the client's leaving.
            if cancel is not None or left is None:
                return await self.asummarize(request, on_token=on_token, cancel=cancel, timeout_s=timeout_s)
            result = await self.asummarize(request, on_token=on_token, cancel=left, timeout_s=timeout_s)
            if result.failure == "cancelled":  # a failure, not a cancel: the extractive summary stands in
                result = replace(result, failure=CLIENT_LEFT_REASON)
            return result

        limit_s = self._timeout_s if timeout_s is None else timeout_s
        future = asyncio.run_coroutine_threadsafe(call(), loop)
        try:  # the call times out by itself; this only guards against a loop that stopped meanwhile
            return future.result(limit_s + _GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return failed(self.name, f"timeout after {limit_s:g} s", limit_s + _GRACE_S)
