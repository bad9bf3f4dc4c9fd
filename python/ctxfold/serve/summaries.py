"""Summaries written by the upstream model, asked through the proxy's own upstream client.

The compaction driver awaits a summary on the proxy's event loop (:mod:`ctxfold.compaction.effects`), so
:class:`UpstreamSummarizer` sends it through the proxy's pooled client: a summary shares the proxy's
connections, connect and read timeouts, and metrics, and is sent with credentials:

- ``--summary-api-key-env NAME``: the key in that environment variable, when set;
- else the ``Authorization`` header of the client request that triggered the compaction: the proxy
  hands it to the conversation's summarizer before it runs the request's compaction
  (:attr:`UpstreamSummarizer.client_authorization`; one request of a conversation runs at a time).

A failed summary is a result, never an exception: the compactor falls back to the extractive summary,
and the proxy logs the reason and counts it by reason (``ctxfold_summary_fallbacks_total``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace

from ctxfold.compaction.summarize import OpenAICompatibleSummarizer
from ctxfold.compaction.summarize.base import SummaryResult, TokenCallback, failed
from ctxfold.compaction.summarize.openai import SummaryAnswer, SummaryTransportError
from ctxfold.compaction.summarize.request import SummaryRequest
from ctxfold.serve.upstream import UpstreamClient, UpstreamError, UpstreamResponse

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
        self.client_authorization: str | None = None  # the request being handled's (None: it sent none)

    @asynccontextmanager
    async def stream(self, body: bytes, headers: Mapping[str, str]) -> AsyncIterator[SummaryAnswer]:
        out = dict(headers)
        authorization = f"Bearer {self._api_key}" if self._api_key else self.client_authorization
        if authorization is not None:
            out["Authorization"] = authorization
        try:
            async with self._client().post(body, out) as resp:
                yield _Answer(resp)
        except UpstreamError as e:
            raise _failure(e) from None


class UpstreamSummarizer(OpenAICompatibleSummarizer):
    """:class:`OpenAICompatibleSummarizer` over :class:`UpstreamTransport`, awaited on the proxy's loop by
    the compaction driver (:func:`ctxfold.compaction.effects.run_async`)."""

    def __init__(self, base_url: str, model: str, *, client: Callable[[], UpstreamClient], api_key: str | None,
                 timeout_s: float) -> None:
        # The key goes through the transport (it chooses between it and the client's header).
        self._upstream = UpstreamTransport(client, api_key)
        super().__init__(base_url, model, timeout_s=timeout_s, transport=self._upstream)

    @property
    def client_authorization(self) -> str | None:
        """The ``Authorization`` header of the client request whose compaction runs now: the summaries it
        triggers are sent with it (unless the proxy has a key of its own for them)."""
        return self._upstream.client_authorization

    @client_authorization.setter
    def client_authorization(self, value: str | None) -> None:
        self._upstream.client_authorization = value

    def summarize(self, request: SummaryRequest, *, on_token: TokenCallback | None = None,
                  cancel: threading.Event | None = None, timeout_s: float | None = None) -> SummaryResult:
        # The proxy's client lives on its event loop: a blocking call from elsewhere has no loop to ask on.
        return failed(self.name, "summaries through the proxy's upstream client are awaited on its event loop", 0.0)

    async def asummarize(self, request: SummaryRequest, *, on_token: TokenCallback | None = None,
                         cancel: threading.Event | asyncio.Event | None = None,
                         timeout_s: float | None = None) -> SummaryResult:
        result = await super().asummarize(request, on_token=on_token, cancel=cancel, timeout_s=timeout_s)
        if result.failure == "cancelled":  # its client left: a failure, so the extractive summary stands in
            result = replace(result, failure=CLIENT_LEFT_REASON)
        return result
