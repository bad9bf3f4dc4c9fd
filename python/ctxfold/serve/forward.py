"""Forwarding a chat completion and bringing its answer back, with recall: one loop over an answer
source that is JSON or an event stream.

Each round posts the request upstream and reads the answer through its source: :class:`JsonAnswer`
reads it whole; :class:`StreamAnswer` passes the events through as they arrive, byte for byte, and
holds back only what the proxy may have to keep from the client (the deltas of ``read_archive`` calls
and the closing events). An answer that is nothing but read_archive calls is answered by the proxy
(:mod:`ctxfold.serve.recall`) and the upstream asked again, at most ``max_recall_rounds`` times; any
other answer is finished (the JSON body, or the held events) and returned for recording.

Errors: upstream unreachable -> 502, upstream too slow -> 504, an upstream error status is passed
through as it came (not retried: a retry could bill and generate twice; the client decides), except
a first-round refusal of the prompt as too long, which raises :class:`PromptTooLong` for the caller to
compact further and retry once. A stream cut mid-way -> an SSE ``error`` event, the stream closes
without ``[DONE]``. A client that leaves cancels the handler: the upstream connection is closed when
the cancellation leaves the ``async with`` (the engine stops generating).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from ctxfold import fastjson
from ctxfold.compaction.archive import ArchiveStore
from ctxfold.errors import CtxfoldError
from ctxfold.serve.config import ProxyConfig, redact_url
from ctxfold.serve.dialect import OPENAI, Dialect
from ctxfold.serve.metrics import ProxyMetrics
from ctxfold.serve.recall import recall_results
from ctxfold.serve.request import OWN_ANSWER_HEADERS, relayed_headers
from ctxfold.serve.sse import SseEventTooLarge, SseReader
from ctxfold.serve.upstream import (
    UpstreamClient,
    UpstreamCut,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamTooLarge,
)

log = logging.getLogger("ctxfold.serve")


@dataclass(frozen=True, slots=True)
class Answer:
    """An answer the client has whole: what the proxy records."""

    message: dict[str, Any]  # choices[0].message, or Anthropic's message (assembled from a stream's events)
    usage: Any  # the upstream's usage object, when it sent one
    rounds: int  # read_archive rounds the proxy answered before it: 0 means the answer is to the view as sent
    dialect: Dialect = field(default=OPENAI)  # the API it is in: how it is recorded


class PromptTooLong(CtxfoldError):
    """The upstream refused the request's prompt as longer than its window (400), before anything
    reached the client. ``prompt_tokens`` and ``limit_tokens``: the engine's figures, when it gave them."""

    def __init__(self, message: str, prompt_tokens: int | None, limit_tokens: int | None) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit_tokens = limit_tokens
        self.answer: web.Response | None = None  # the upstream's 400 as it came, to pass on if no retry is made


# How engines say a prompt does not fit (OpenAI's code aside): vLLM, llama.cpp, Anthropic-style, SGLang.
_TOO_LONG = re.compile(r"maximum context length is|exceeds the available context size|prompt is too long|"
                       r"context length exceeded|longer than the model's context length|too many tokens",
                       re.IGNORECASE)
_NUMBERS = re.compile(r"\d[\d,]*")
# Where the engine names its window: OpenAI and vLLM ("maximum context length is 4096 tokens"),
# Anthropic-style ("210000 tokens > 200000 maximum").
_LIMIT = re.compile(r"maximum context length is\s*(\d[\d,]*)|(\d[\d,]*)\s*(?:tokens\s*)?maximum", re.IGNORECASE)


# A window named in a refusal is believed only within this range: an engine's window is at least a few
# hundred tokens (the proxy refuses --context-tokens under 512), and none is over 16M.
_SANE_WINDOW_TOKENS = (64, 1 << 24)


def prompt_too_long(raw: bytes, *, sent: bytes = b"") -> PromptTooLong | None:
    """The refusal in a 400 body when it says the prompt is too long, with the prompt's tokens and the
    window when it gives them; None for any other 400.

    Believed from the upstream's own fields: OpenAI's ``context_length_exceeded`` code, llama.cpp's
    ``n_prompt_tokens`` over ``n_ctx``. Else from the message vLLM, SGLang and others write ("maximum
    context length is 4096 tokens"), but only when the error names no other code, the phrase is not in
    what the client ``sent`` (an upstream echoes the client's strings in its errors), and the window it
    names is sane (_SANE_WINDOW_TOKENS)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past what Python reads: not a refusal we know
        return None
    err = data.get("error", data) if isinstance(data, dict) else None
    if isinstance(err, str):
        err = {"message": err}
    if not isinstance(err, dict):
        return None
    message = err.get("message")
    if not isinstance(message, str):
        message = ""
    code = err.get("code")
    coded = code == "context_length_exceeded"
    if isinstance(code, str) and code and not coded:
        return None  # the upstream says what else is wrong (invalid_value, ...): its message may quote the client
    prompt, limit = err.get("n_prompt_tokens"), err.get("n_ctx")  # llama.cpp says them apart from its message
    if isinstance(prompt, int) and isinstance(limit, int) and _sane(limit) and prompt > limit:
        return PromptTooLong(message[:300], prompt, limit)
    found = _TOO_LONG.search(message)
    if not coded and (found is None or _quoted(message, found.start(), sent)):
        return None
    figures = _LIMIT.search(message)
    if figures is None or _quoted(message, figures.start(), sent):
        return PromptTooLong(message[:300], None, None)  # a refusal whose figures are unknown
    window = _number(next(g for g in figures.groups() if g is not None))
    if not _sane(window):
        return PromptTooLong(message[:300], None, None)
    # The prompt: the largest other figure (vLLM: "you requested 5000 tokens (4000 in the messages, 1000
    # in the completion)": what was asked for in all, the completion included).
    others = [n for n in map(_number, _NUMBERS.findall(message)) if n != window]
    return PromptTooLong(message[:300], max(others) if others else None, window)


def _sane(window_tokens: int) -> bool:
    return _SANE_WINDOW_TOKENS[0] <= window_tokens <= _SANE_WINDOW_TOKENS[1]


def _quoted(message: str, at: int, sent: bytes) -> bool:
    """Whether the words of ``message`` from ``at`` on (to the end of the figure after them) are in the
    request the client sent: then they are the client's, echoed, not the upstream's verdict."""
    figure = _NUMBERS.search(message, at)
    fragment = message[at : figure.end() if figure is not None else len(message)]
    return bool(sent) and fragment.encode("utf-8", "replace") in sent


def with_stream_usage(body: dict[str, Any]) -> dict[str, Any] | None:
    """``body`` asking for usage in the stream (``stream_options.include_usage``), or None when it asks
    already (or its ``stream_options`` is not an object: the upstream judges that as it is)."""
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    out = dict(body)
    out["stream_options"] = {**options, "include_usage": True}
    return out


# The "usage": null every chunk carries once usage is asked for (OpenAI's shape), removed from the events of
# a client that did not ask. A quote inside a JSON string is escaped, so neither pattern matches in one.
_NULL_USAGE = re.compile(rb',\s*"usage"\s*:\s*null|"usage"\s*:\s*null\s*,?\s*')


def strip_null_usage(raw_event: bytes) -> bytes:
    """An event without the ``"usage": null`` the proxy's asking for usage added to it."""
    return _NULL_USAGE.sub(b"", raw_event)


def _number(text: str) -> int:
    return int(text.replace(",", "")[:12])


class _Source:
    """How one kind of answer (JSON or an event stream) is read, finished and failed."""

    resp: web.StreamResponse | None
    message: dict[str, Any]
    usage: Any

    async def read(self, up: UpstreamResponse) -> web.StreamResponse | None:
        """Read one round's answer (status 200); a response to end with when it cannot be used."""
        raise NotImplementedError

    async def refused(self, status: int, raw: bytes, headers: list[tuple[str, str]]) -> web.StreamResponse:
        """The upstream answered ``status`` (not 200) with ``raw``."""
        raise NotImplementedError

    @property
    def started(self) -> bool:
        """Whether bytes of the answer went out: a failure can only end it with an error event."""
        return False

    async def cut(self, reason: str, *, code: str = "upstream_stream_cut") -> web.StreamResponse:
        """End an answer that was started (see :attr:`started`) with an error event."""
        raise NotImplementedError

    def next_round(self) -> None:
        """The answer was a recall round: the next one is read afresh."""

    async def finish(self) -> bool:
        """Send the rest of the answer; False when the client has gone."""
        raise NotImplementedError


class JsonAnswer(_Source):
    def __init__(self, request: web.Request, metrics: ProxyMetrics, max_answer_bytes: int,
                 extra_headers: Callable[[], Sequence[tuple[str, str]]] = tuple, dialect: Dialect = OPENAI) -> None:
        self.message, self.usage = {}, None
        self.dialect = dialect
        self.request = request
        self.metrics = metrics
        self.max_answer_bytes = max_answer_bytes
        self.resp = None
        self._raw = b""
        self._headers: list[tuple[str, str]] = []
        self._extra_headers = extra_headers

    async def read(self, up: UpstreamResponse) -> web.StreamResponse | None:
        self._raw = await up.read(max_nbytes=self.max_answer_bytes, decoded=True)
        self._headers = relayed_headers(up.header_list, OWN_ANSWER_HEADERS) + list(self._extra_headers())
        try:
            message, usage = self.dialect.answer_of(fastjson.loads(self._raw))
        except (ValueError, RecursionError):  # nested past what Python reads too
            message, usage = None, None
        if message is None:
            self.metrics.upstream_errors.inc("bad_body")
            return self.dialect.error(502, f"the upstream answered 200 with a body that is not an answer of "
                                           f"{self.dialect.path}", kind="upstream_error", code="bad_upstream_body")
        self.message, self.usage = message, usage
        return None

    async def refused(self, status: int, raw: bytes, headers: list[tuple[str, str]]) -> web.StreamResponse:
        return web.Response(body=raw, status=status, headers=headers)

    async def finish(self) -> bool:
        self.resp = web.Response(body=self._raw, status=200, headers=self._headers)
        try:
            await self.resp.prepare(self.request)
            await self.resp.write_eof()
        except (ConnectionError, RuntimeError):
            return False  # the client went away without the answer: its retry will not carry it
        return True


class StreamAnswer(_Source):
    """With the recall tool offered, every event still goes out as it arrives except the deltas of
    ``read_archive`` calls and the closing events (finish reason, usage, ``[DONE]``), held to the end of
    the answer. A recall round's text and reasoning reach the client; then the next answer's events.
    Any other answer gets its held events, in order: the bytes the client receives are the upstream's."""

    def __init__(self, request: web.Request, *, recall: bool, read_timeout_s: float, max_answer_bytes: int,
                 max_event_bytes: int, strip_usage: bool = False,
                 extra_headers: Callable[[], Sequence[tuple[str, str]]] = tuple, dialect: Dialect = OPENAI) -> None:
        self.request = request
        self.dialect = dialect
        self.max_answer_bytes = max_answer_bytes
        self.max_event_bytes = max_event_bytes
        self.answer_nbytes = 0  # of every round's stream together
        self.recall = recall
        # The proxy asked for usage the client did not: the usage event and the chunks' "usage": null stay here.
        self.strip_usage = strip_usage
        self.extra_headers = extra_headers
        self.read_timeout_s = read_timeout_s
        self.resp = web.StreamResponse(status=200)
        self.message, self.usage = {}, None
        self.next_round()

    def next_round(self) -> None:
        self.reader, self.answer = SseReader(self.max_event_bytes), self.dialect.assembler()
        self.held: list[bytes] = []
        if not hasattr(self, "filter"):  # one filter for every round: it numbers what the client has seen
            self.filter = self.dialect.stream_filter()
        self.filter.next_round()

    async def _send(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:
            raise RuntimeError("no stream response")  # not reached: set in __init__
        if not resp.prepared:
            await resp.prepare(self.request)
        await resp.write(data)

    async def read(self, up: UpstreamResponse) -> web.StreamResponse | None:
        resp = self.resp
        if resp is not None and not resp.prepared:  # the first round's head is the one the client gets
            for name, value in relayed_headers(up.header_list, OWN_ANSWER_HEADERS):
                resp.headers.add(name, value)
            for name, value in self.extra_headers():
                resp.headers[name] = value
            resp.headers.setdefault("Content-Type", "text/event-stream")
            resp.headers.setdefault("Cache-Control", "no-cache")
        reader, answer = self.reader, self.answer
        try:
            async for chunk in up.decoded_chunks():
                self.answer_nbytes += len(chunk)
                if self.answer_nbytes > self.max_answer_bytes:
                    return await self.cut(f"the upstream's answer is over {self.max_answer_bytes:,} bytes "
                                          "(--max-answer-bytes)", code="upstream_answer_too_large")
                if not self.recall and not self.strip_usage:
                    for _, data in reader.feed(chunk):
                        answer.add(data)
                    await self._send(chunk)
                    continue
                out: list[bytes] = []
                for raw_event, data in reader.feed(chunk):
                    parsed = answer.add(data)
                    if self.strip_usage:
                        if parsed is not None and parsed.get("choices") == [] and isinstance(parsed.get("usage"), dict):
                            continue  # the usage event the client did not ask for
                        raw_event = strip_null_usage(raw_event)
                    if self.recall:
                        hold, routed = self.filter.route(raw_event, data, parsed)
                        if routed is not None:
                            (self.held if hold else out).append(routed)
                    else:
                        out.append(raw_event)
                if out:
                    await self._send(b"".join(out))
        except SseEventTooLarge as e:
            return await self.cut(f"the upstream sent {e} (--max-event-bytes)", code="upstream_event_too_large")
        except UpstreamTimeout:
            return await self.cut(f"the upstream sent nothing for {self.read_timeout_s:g} s (--read-timeout-s)")
        except UpstreamProtocolError as e:
            return await self.cut(str(e), code="upstream_protocol_error")
        except UpstreamCut as e:
            return await self.cut(f"the upstream stream was cut: {e}")
        if not answer.done:
            return await self.cut("the upstream stream ended before its last event")
        self.message, self.usage = answer.message(), answer.usage
        return None

    async def cut(self, reason: str, *, code: str = "upstream_stream_cut") -> web.StreamResponse:
        resp = self.resp
        if resp is None or (not resp.prepared and not self.recall and not self.answer.chunks):
            return self.dialect.error(502, reason, kind="upstream_error", code=code)
        if not resp.prepared:
            await resp.prepare(self.request)
        await _write_error(resp, self.dialect.stream_error(reason, code))
        return resp

    async def refused(self, status: int, raw: bytes, headers: list[tuple[str, str]]) -> web.StreamResponse:
        if self.resp is not None and self.resp.prepared:  # a later recall round failed after bytes went out
            await _write_error(self.resp, self.dialect.stream_error(f"the upstream answered {status}: {raw[:300]!r}",
                                                                    "upstream_stream_cut"))
            return self.resp
        return web.Response(body=raw, status=status, headers=headers)

    @property
    def started(self) -> bool:
        return self.resp is not None and self.resp.prepared

    async def finish(self) -> bool:
        tail = self.filter.release(self.held) if self.recall else b"".join(self.held)
        tail += self.reader.rest()
        try:
            if tail or self.resp is None or not self.resp.prepared:
                await self._send(tail)
            if self.resp is not None:
                await self.resp.write_eof()
        except (ConnectionError, RuntimeError):
            return False  # the client went away without the whole answer
        return True


class Forwarder:
    """Sends a completion upstream and its answer back (see the module's docstring)."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics, client: Callable[[], UpstreamClient]) -> None:
        self.config = config
        self.metrics = metrics
        self._client = client
        self.stream_usage_missing = False  # the upstream sent no usage in a stream that asked for it (said once)

    async def forward(self, request: web.Request, store: ArchiveStore, body: dict[str, Any], payload: bytes,
                      headers: dict[str, str], *, stream: bool, recall: bool, too_long_raises: bool,
                      extra_headers: Callable[[], Sequence[tuple[str, str]]] = tuple,
                      dialect: Dialect = OPENAI
                      ) -> tuple[web.StreamResponse, Answer | None]:
        """The response the client gets and, when the client has an answer whole, that answer.
        ``too_long_raises``: a first-round 400 that says the prompt is too long raises PromptTooLong.
        ``extra_headers``: the proxy's own headers on a successful answer, asked for when its head is
        built. A stream whose client did not ask for usage asks for it
        (``ProxyConfig.stream_usage``) and keeps it from the client."""
        upstream = self._client()
        strip_usage = False
        if stream and self.config.stream_usage and dialect.asks_stream_usage:
            asking = with_stream_usage(body)
            if asking is not None:
                body, payload, strip_usage = asking, fastjson.dumps(asking), True
        cfg = self.config
        source: _Source = (StreamAnswer(request, recall=recall, read_timeout_s=cfg.read_timeout_s,
                                        max_answer_bytes=cfg.max_answer_bytes, max_event_bytes=cfg.max_event_bytes,
                                        strip_usage=strip_usage, extra_headers=extra_headers, dialect=dialect)
                           if stream else JsonAnswer(request, self.metrics, cfg.max_answer_bytes, extra_headers,
                                                     dialect))
        # None: the client's URL (chat completions); else the dialect's path under the upstream's base.
        target = None if dialect is OPENAI else dialect.upstream_target(urlsplit(cfg.base_url).path)
        rounds = 0
        recall_left = [self.config.max_recall_chars]  # read_archive output this request may still add
        while True:
            too_long: PromptTooLong | None = None
            try:
                async with upstream.post(payload, headers, target=target) as up:
                    if up.status != 200:
                        raw = await up.read(max_nbytes=cfg.max_answer_bytes, decoded=True)
                        self.metrics.upstream_errors.inc("status")
                        if rounds == 0 and too_long_raises and up.status == 400:
                            too_long = prompt_too_long(raw, sent=payload)
                        if too_long is not None:
                            too_long.answer = web.Response(body=raw, status=up.status, headers=relayed_headers(
                                up.header_list, OWN_ANSWER_HEADERS))
                        else:
                            return await source.refused(up.status, raw,
                                                        relayed_headers(up.header_list, OWN_ANSWER_HEADERS)), None
                    else:
                        ended = await source.read(up)
                        if ended is not None:
                            if stream:
                                self.metrics.upstream_errors.inc("cut_stream")
                            return ended, None
            except ConnectionError:  # the client went away mid-stream (the upstream's failures are UpstreamError)
                return source.resp or web.Response(status=499), None
            except Exception as e:  # noqa: BLE001 - connection or timeout: 502/504 (an error event mid-stream)
                if not source.started:
                    return self.upstream_failure(e, dialect), None
                self.metrics.upstream_errors.inc("cut_stream")
                return await source.cut(f"the upstream failed: {e}"), None
            if too_long is not None:
                raise too_long
            if recall and rounds < self.config.max_recall_rounds and dialect.is_recall_round(source.message):
                rounds += 1
                results = await recall_results(store, dialect.recall_calls(source.message), recall_left,
                                               max_chars=self.config.max_recall_chars, metrics=self.metrics)
                body = dialect.with_recall_answers(body, source.message, results)
                payload = fastjson.dumps(body)
                source.next_round()
                continue
            if not await source.finish():
                return source.resp or web.Response(status=499), None
            resp = source.resp
            if resp is None:
                raise RuntimeError("an answer finished without a response")  # not reached: finish sets it
            if stream and source.usage is None and not self.stream_usage_missing and (
                    strip_usage or isinstance(body.get("stream_options"), dict)):
                self.stream_usage_missing = True
                log.warning("the upstream sends no usage in streamed answers, although asked "
                            "(stream_options.include_usage): streamed answers do not calibrate the token "
                            "estimate, answers that are not streamed do (said once)")
            return resp, Answer(source.message, source.usage, rounds, dialect)

    def upstream_failure(self, e: BaseException, dialect: Dialect = OPENAI) -> web.Response:
        error_response = dialect.error
        if isinstance(e, UpstreamTooLarge):
            self.metrics.upstream_errors.inc("too_large")
            return error_response(502, f"the upstream {redact_url(self.config.completions_url)} sent {e} "
                                       "(--max-answer-bytes)", kind="upstream_error", code="upstream_answer_too_large")
        if isinstance(e, UpstreamProtocolError):
            self.metrics.upstream_errors.inc("protocol")
            return error_response(502, f"the upstream {redact_url(self.config.completions_url)}: {e}",
                                  kind="upstream_error", code="upstream_protocol_error")
        if isinstance(e, TimeoutError):
            self.metrics.upstream_errors.inc("timeout")
            return error_response(504, f"the upstream {redact_url(self.config.completions_url)} did not answer within "
                                       f"{self.config.read_timeout_s:g} s (--read-timeout-s)",
                                  kind="upstream_error", code="upstream_timeout")
        self.metrics.upstream_errors.inc("connect")
        return error_response(502, f"cannot reach the upstream {redact_url(self.config.completions_url)}: {e}",
                              kind="upstream_error", code="upstream_unreachable")


async def _write_error(resp: web.StreamResponse, event: bytes) -> None:
    try:
        await resp.write(event)
        await resp.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client went away too
