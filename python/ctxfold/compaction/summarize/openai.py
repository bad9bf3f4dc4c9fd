"""Summaries from any OpenAI-compatible ``/chat/completions`` endpoint with ``stream: true``
(vLLM, SGLang, llama.cpp server, Ollama, OpenAI).

One implementation, async; the sync API runs it on a private event loop, so both share the stream parser,
the timeout and the cancellation. The HTTP exchange goes through a :class:`SummaryTransport`: by default a
new httpx client per call (:class:`HttpxTransport`); ``ctxfold serve`` passes its own pooled client, so
summaries share its connections, timeouts, metrics and the client's credentials. Server errors are results, never exceptions: the
compactor falls back to the extractive summary and counts the failure for its breaker, so this client does not
retry (a 429 is reported with its Retry-After in ``detail``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import httpx

from ctxfold.compaction.summarize._run import run_limited
from ctxfold.compaction.summarize.base import (
    CoroutineSummarizer,
    SummaryResult,
    TokenCallback,
    TokenCounter,
    failed,
    no_room,
)
from ctxfold.compaction.summarize.postprocess import StreamCutter, result_from_cutter
from ctxfold.compaction.summarize.request import SummaryRequest
from ctxfold.errors import ConfigError
from ctxfold.wire.sse import SseReader

_MAX_ERROR_BODY_CHARS = 2000


class SummaryTransportError(Exception):
    """The exchange failed (no connection, a timeout, a cut stream): ``reason`` goes into the failed
    result, so it names what happened in a few words, without details (those go in ``detail``)."""

    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class SummaryAnswer(Protocol):
    """An answer whose head has arrived: ``headers`` with lower-case names; the body read once."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self) -> bytes: ...

    def iter_chunks(self) -> AsyncIterator[bytes]: ...


class SummaryTransport(Protocol):
    """POSTs a summary request (JSON ``body``, ``headers``) to the chat.completions URL. Raises
    SummaryTransportError when the exchange fails; leaving the context closes the stream."""

    def stream(self, body: bytes, headers: Mapping[str, str]) -> AbstractAsyncContextManager[SummaryAnswer]: ...


class _HttpxAnswer:
    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.headers: Mapping[str, str] = resp.headers

    async def read(self) -> bytes:
        return await self._resp.aread()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_bytes():
                yield chunk
        except httpx.HTTPError as e:
            raise _transport_error(e) from None


def _transport_error(e: httpx.HTTPError) -> SummaryTransportError:
    if isinstance(e, httpx.TimeoutException):
        return SummaryTransportError(f"timeout ({type(e).__name__})")
    if isinstance(e, httpx.RemoteProtocolError):
        return SummaryTransportError("connection lost mid-stream", detail=str(e))
    return SummaryTransportError(f"HTTP transport error: {type(e).__name__}: {e}")


class HttpxTransport:
    """A new httpx client per call: thread-safe, nothing shared between calls."""

    def __init__(self, url: str, *, connect_timeout_s: float, timeout_s: float) -> None:
        self.url = url
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)

    @asynccontextmanager
    async def stream(self, body: bytes, headers: Mapping[str, str]) -> AsyncIterator[SummaryAnswer]:
        try:
            async with (
                httpx.AsyncClient(timeout=self._timeout) as client,
                client.stream("POST", self.url, content=body, headers=dict(headers)) as resp,
            ):
                yield _HttpxAnswer(resp)
        except httpx.HTTPError as e:
            raise _transport_error(e) from None


def _data_line(raw: bytes) -> int:
    """The line of an event (its raw bytes) where its data begins, counted from 1."""
    for k, line in enumerate(raw.split(b"\n"), 1):
        if line.startswith(b"data:"):
            return k
    return 1


class _StreamFailure(Exception):
    """An expected failure inside the stream reader; becomes a failed result."""

    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def _error_message(body: str) -> str:
    """The human part of an error body: OpenAI's ``{"error": {"message": ...}}``, vLLM's and llama.cpp's
    variants, or the raw text, shortened."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("msg") or err.get("detail")
            if isinstance(msg, str):
                return msg[:300]
        elif isinstance(err, str):
            return err[:300]
        detail = data.get("detail")
        if isinstance(detail, str):
            return detail[:300]
    return body.strip()[:300]


class OpenAICompatibleSummarizer(CoroutineSummarizer):
    """Streams a summary from an OpenAI-compatible chat.completions endpoint.

    ``base_url`` ends where ``/chat/completions`` is appended (``http://127.0.0.1:8000/v1``). Thread-safe
    with the default transport: each call opens its own connection. ``transport``: how the request is
    sent instead (the proxy's pooled client); ``api_key`` is sent through it all the same.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        counter: TokenCounter | None = None,
        temperature: float = 0.0,
        send_tools: bool = True,
        connect_timeout_s: float = 10.0,
        timeout_s: float = 120.0,
        extra_body: Mapping[str, Any] | None = None,
        transport: SummaryTransport | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {base_url!r} is not an http(s) URL; expected e.g. http://127.0.0.1:8000/v1")
        if not model:
            raise ValueError("model is empty; give the model name the endpoint serves")
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._model = model
        self._api_key = api_key
        self._counter = counter
        self._temperature = temperature
        self._send_tools = send_tools
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._extra_body = dict(extra_body or {})
        self._transport: SummaryTransport = transport or HttpxTransport(
            self._url, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)

    @classmethod
    def from_config(cls, cfg: Any, *, counter: TokenCounter | None = None,
                    environ: Mapping[str, str] | None = None) -> OpenAICompatibleSummarizer:
        """From a :class:`~ctxfold.compaction.config.CompactConfig` (or its ``summarizer`` section), with unset endpoint
        fields taken from ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``CTXFOLD_SUMMARY_MODEL``."""
        from ctxfold.compaction.config import CompactConfig, SummarizerConfig

        timeout_s = 120.0
        if isinstance(cfg, CompactConfig):
            timeout_s = cfg.summary.timeout_s
            cfg = cfg.summarizer
        if not isinstance(cfg, SummarizerConfig):
            raise TypeError(f"expected a CompactConfig or SummarizerConfig, got {type(cfg).__name__}")
        r = cfg.resolved(environ)
        if not r.base_url:
            raise ConfigError("summarizer.base_url: not set; set it in the config or in OPENAI_BASE_URL "
                              "(e.g. http://127.0.0.1:8000/v1)")
        if not r.model:
            raise ConfigError("summarizer.model: not set; set it in the config or in CTXFOLD_SUMMARY_MODEL")
        return cls(r.base_url, r.model, api_key=r.api_key, counter=counter, temperature=r.temperature,
                   send_tools=r.send_tools, connect_timeout_s=r.connect_timeout_s, timeout_s=timeout_s,
                   extra_body=r.extra_body)

    @property
    def name(self) -> str:
        return f"openai:{self._model}"

    def _body(self, request: SummaryRequest) -> dict[str, Any]:
        body = request.to_openai(include_tools=self._send_tools)
        body.update(model=self._model, stream=True, max_tokens=request.max_tokens,
                    temperature=self._temperature)
        body.update(self._extra_body)
        return body

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
        cutter = StreamCutter(request.max_tokens, counter=self._counter, limit_reason=request.limit_reason)

        async def work() -> str | None:
            await self._stream(request, cutter, on_token)
            return None

        try:
            outcome, _ = await run_limited(work, cancel=cancel, timeout_s=limit_s)
        except _StreamFailure as e:
            return failed(self.name, e.reason, time.perf_counter() - t0, detail=e.detail)
        seconds = time.perf_counter() - t0
        if outcome == "timeout":
            return failed(self.name, f"timeout after {limit_s:g} s", seconds,
                          detail=f"{len(cutter.text)} chars had arrived")
        if outcome == "cancelled":
            return failed(self.name, "cancelled", seconds)
        return result_from_cutter(cutter, self.name, seconds, self._counter)

    async def _stream(self, request: SummaryRequest, cutter: StreamCutter, on_token: TokenCallback | None) -> None:
        headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        body = json.dumps(self._body(request)).encode()
        try:
            async with self._transport.stream(body, headers) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode("utf-8", "replace")[:_MAX_ERROR_BODY_CHARS]
                    retry = resp.headers.get("retry-after")
                    raise _StreamFailure(
                        f"HTTP {resp.status}: {_error_message(text) or 'no message'}",
                        detail=f"retry-after: {retry}" if retry else None,
                    )
                await self._read_sse(resp.iter_chunks(), cutter, on_token)
        except SummaryTransportError as e:
            raise _StreamFailure(e.reason, detail=e.detail) from None

    async def _read_sse(self, chunks: AsyncIterator[bytes], cutter: StreamCutter, on_token: TokenCallback | None
                        ) -> None:
        reader = SseReader()
        line_no = 0  # lines before the event being read, for the error message
        finished = False
        async for chunk in chunks:
            for raw, data in reader.feed(chunk):
                if data is not None and self._handle_data(data, line_no + _data_line(raw), cutter, on_token):
                    finished = True
                    break
                line_no += raw.count(b"\n")
            if finished or cutter.stopped:
                break  # leaving the `async with` closes the stream: the server stops generating
        if not finished and not cutter.stopped:  # an unterminated last event ends with the stream
            for raw, data in reader.feed(b"\n\n"):
                if data is not None and self._handle_data(data, line_no + _data_line(raw), cutter, on_token):
                    finished = True
        if cutter.stopped:
            return
        if not finished:
            raise _StreamFailure("stream ended before the answer finished (no finish_reason, no [DONE])",
                                 detail=f"{len(cutter.text)} chars had arrived")
        piece = cutter.finish("eos")
        if piece and on_token is not None:
            on_token(piece)

    def _handle_data(self, data: str, line_no: int, cutter: StreamCutter, on_token: TokenCallback | None) -> bool:
        """One event's data; returns True at the end of the answer ([DONE] or a finish_reason)."""
        data = data.strip()
        if data == "[DONE]":
            return True
        try:
            event = json.loads(data)
        except ValueError:
            raise _StreamFailure(f"malformed stream: line {line_no} is not JSON", detail=data[:200]) from None
        if not isinstance(event, dict):
            raise _StreamFailure(f"malformed stream: line {line_no} is not a JSON object", detail=data[:200])
        if "error" in event:
            err = event["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise _StreamFailure(f"server error in stream: {msg}")
        choices = event.get("choices") or []
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return False  # usage-only chunks and the like
        choice = choices[0]
        delta = choice.get("delta") or {}
        if isinstance(delta, dict):
            # reasoning_content / reasoning: thinking, never part of the summary
            if delta.get("tool_calls"):  # the answer tries to call a tool: the summary ends here
                piece = cutter.finish("control_boundary")
                if piece and on_token is not None:
                    on_token(piece)
                return True
            content = delta.get("content")
            if isinstance(content, str) and content:
                piece = cutter.feed(content)
                if piece and on_token is not None:
                    on_token(piece)
                if cutter.stopped:
                    return True
        finish = choice.get("finish_reason")
        if finish:
            if finish == "length":  # the server applied max_tokens = min(cap, room)
                piece = cutter.finish(cutter.limit_reason)
            elif finish == "tool_calls":
                piece = cutter.finish("control_boundary")
            else:
                piece = cutter.finish("eos")
            if piece and on_token is not None:
                on_token(piece)
            return True
        return False
