"""The proxy's HTTP/1.1 client for its upstream: one origin, POST requests, keep-alive connections.

The proxy sends every request to the same URL, with a body it already holds as bytes, and reads the
answer as bytes (whole, or chunk by chunk for an event stream). A general client does much more per
request: aiohttp's builds a request object, merges cookies, checks redirects and proxy settings and
processes the headers; on the benchmark machine that is about 200 µs of CPU per request, this client
about 50 (``bench/bench_serve.py`` measures the proxy whole). The head is prepared once per request
and goes out with the body in one write; llhttp, through httptools (the parser uvicorn uses), reads
the answer: status, headers, and the body, de-chunked.

Errors: :class:`UpstreamUnreachable` (no connection within the connect timeout, refused, TLS failed),
:class:`UpstreamTimeout` (the upstream sent nothing for the read timeout, before the head or between
chunks), :class:`UpstreamCut` (the connection closed before the answer ended), :class:`UpstreamProtocolError`
(the answer is not HTTP/1.1, or is encoded in a way the proxy cannot read), :class:`UpstreamTooLarge`
(a body read whole is larger than the bound it was read with).
A request is never sent twice: a POST may have been acted on (billed, generated) even when its answer
was lost, so the proxy reports the failure and the client decides.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import cast
from urllib.parse import urlsplit

import httptools

from ctxfold.errors import CtxfoldError

# Body bytes read ahead of a slow consumer (a client reading a stream slowly) before the socket is
# paused: the upstream then waits, as TCP makes it.
READ_AHEAD_BYTES = 1 << 20
MAX_IDLE_CONNECTIONS = 256  # kept open for reuse; more are closed once their answer is read


class UpstreamError(CtxfoldError):
    """The upstream could not be asked, or its answer was not read to its end."""


class UpstreamUnreachable(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError, TimeoutError):
    pass


class UpstreamCut(UpstreamError):
    pass


class UpstreamProtocolError(UpstreamError):
    """The upstream's answer is not HTTP/1.1, or its body is encoded in a way the proxy cannot read."""


class UpstreamTooLarge(UpstreamError):
    """A body is larger than the bound it is read with."""


# Content codings the proxy decodes, should an upstream use one although asked for identity.
_DECODABLE = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}
# Decoded bytes made from one piece of input at most: a small compressed chunk can expand a thousandfold.
_DECODE_STEP_BYTES = 1 << 20


class _Connection(asyncio.Protocol):
    """One connection to the upstream, carrying one exchange at a time. Its parser's callbacks fill
    in the answer; the reader waits on :attr:`_wake` for the next thing to happen."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.active = False  # an exchange is under way: bytes from the upstream are its answer
        self._wake: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-case names, the last value of a repeated one
        self.header_list: list[tuple[str, str]] = []  # every header as it came, repeated ones included
        self.expect_body = True  # False for the answer to a HEAD request: it ends with its head
        self.head_done = False
        self.done = False
        self.reusable = False
        self.until_close = False  # no length, not chunked: the body ends when the connection does
        self.chunks: list[bytes] = []
        self.buffered_bytes = 0
        self.error: UpstreamError | None = None
        self.last_data_s = self._loop.time()

    # -- the exchange ---------------------------------------------------------------------------------
    def send(self, data: list[bytes], *, expect_body: bool = True) -> None:
        self._reset()
        self.expect_body = expect_body
        self.active = True
        if self.transport is None:  # connection_made runs before create_connection returns
            raise UpstreamCut("the connection to the upstream closed before the request was sent")
        self.transport.writelines(data)

    async def wait(self, timeout_s: float) -> None:
        """Until the parser has something new (head, body, end) or the connection fails; raises
        UpstreamTimeout after ``timeout_s`` without a byte from the upstream."""
        self._wake = self._loop.create_future()
        self._timer = self._loop.call_at(self.last_data_s + timeout_s, self._on_timer, timeout_s)
        try:
            await self._wake
        finally:
            self._timer.cancel()
            self._wake = self._timer = None

    def _on_timer(self, timeout_s: float) -> None:
        # Checked against the time of the last byte, not reset on each read: a stream of many small
        # chunks costs no timer per chunk.
        due_s = self.last_data_s + timeout_s
        if self._wake is None or self._wake.done():
            return
        if self._loop.time() >= due_s:
            self._wake.set_exception(UpstreamTimeout(f"the upstream sent nothing for {timeout_s:g} s"))
        else:
            self._timer = self._loop.call_at(due_s, self._on_timer, timeout_s)

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def take_chunks(self) -> list[bytes]:
        out, self.chunks = self.chunks, []
        if self.buffered_bytes >= READ_AHEAD_BYTES and self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self.buffered_bytes = 0
        return out

    # -- asyncio.Protocol -----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses

    def data_received(self, data: bytes) -> None:
        if not self.active:  # an idle connection's upstream speaks (a timeout notice): not ours to read
            self.close()
            return
        self.last_data_s = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamProtocolError(f"the upstream's answer is not valid HTTP/1.1: {e}"))
            self.close()

    def eof_received(self) -> bool | None:
        self.closed = True  # now, not a loop step later in connection_lost: no request may pick it
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.until_close and self.head_done and not self.done and exc is None:
            self.done = True  # the body was everything up to an orderly close (a reset cuts it)
        elif not self.done:
            why = f": {exc}" if exc is not None else ""
            self._fail(UpstreamCut(f"the upstream closed the connection before the answer ended{why}"))
        self._notify()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._notify()

    # -- httptools callbacks --------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1"), value.decode("latin-1")
        self.headers[key.lower()] = text
        self.header_list.append((key, text))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an informational answer (103 Early Hints): the real one follows
            self.headers = {}
            self.header_list = []
            return
        self.status = status
        self.head_done = True
        if not self.expect_body:  # HEAD: a Content-Length here describes a body that is not sent
            self.done = True  # the parser would wait for that body: the connection is not reused
            self._notify()
            return
        self.until_close = (status not in (204, 304) and "content-length" not in self.headers
                            and "chunked" not in self.headers.get("transfer-encoding", "").lower())
        self._notify()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered_bytes += len(body)
        if self.buffered_bytes >= READ_AHEAD_BYTES and self.transport is not None:
            self.transport.pause_reading()
        self._notify()

    def on_message_complete(self) -> None:
        if not self.head_done:
            return  # the end of an informational answer
        self.done = True
        self.reusable = self._parser.should_keep_alive()
        self._notify()


class UpstreamResponse:
    """An answer whose head has arrived; read its body once, with :meth:`read` or :meth:`iter_chunks`.
    Its connection goes back to the pool when the body was read to its end, else it is closed."""

    def __init__(self, client: UpstreamClient, conn: _Connection) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers = conn.headers  # lower-case names
        self.header_list = conn.header_list  # as they came, in order, repeated ones included

    async def read(self, *, max_nbytes: int | None = None, decoded: bool = False) -> bytes:
        """The whole body. ``max_nbytes``: UpstreamTooLarge past it (read no further); ``decoded``: see
        :meth:`decoded_chunks`."""
        declared = self.headers.get("content-length", "")
        if max_nbytes is not None and declared.isdigit() and int(declared) > max_nbytes:
            self.release()  # not read: the connection is closed, not reused
            raise UpstreamTooLarge(f"an answer of {int(declared):,} bytes, over {max_nbytes:,}")
        parts: list[bytes] = []
        nbytes = 0
        async for chunk in (self.decoded_chunks() if decoded else self.iter_chunks()):
            nbytes += len(chunk)
            if max_nbytes is not None and nbytes > max_nbytes:
                raise UpstreamTooLarge(f"an answer of over {max_nbytes:,} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def decoded_chunks(self) -> AsyncIterator[bytes]:
        """:meth:`iter_chunks`, decoded when the upstream used a content coding (gzip, deflate) although
        the proxy asked for none; UpstreamProtocolError for a coding it cannot read (br, zstd, ...).
        Decoded in steps of at most _DECODE_STEP_BYTES, so a bound on the caller's side holds."""
        coding = self.headers.get("content-encoding", "identity").strip().lower()
        if coding in ("", "identity"):
            async for chunk in self.iter_chunks():
                yield chunk
            return
        if coding not in _DECODABLE:
            raise UpstreamProtocolError(f"the upstream encoded its answer as {coding!r}, which the proxy cannot "
                                        "read (it asks for identity)")
        inflate = zlib.decompressobj(_DECODABLE[coding])
        try:
            async for chunk in self.iter_chunks():
                data = chunk
                while data:
                    out = inflate.decompress(data, _DECODE_STEP_BYTES)
                    data = inflate.unconsumed_tail
                    if out:
                        yield out
            tail = inflate.flush()
        except zlib.error as e:
            raise UpstreamProtocolError(f"the upstream's {coding} answer cannot be decoded: {e}") from None
        if tail:
            yield tail

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked. Raises UpstreamTimeout or UpstreamCut."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the body of this answer was read already")
        while True:
            if conn.chunks:
                for chunk in conn.take_chunks():
                    yield chunk
                continue
            if conn.done:  # whole, even if junk followed it (then the connection is not reused)
                self.release()
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._client.read_timeout_s)

    def release(self) -> None:
        """Back to the pool when the answer was read whole, else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._release(conn)


class UpstreamClient:
    """POSTs to one upstream URL over a pool of keep-alive connections (as many as requests in flight;
    up to MAX_IDLE_CONNECTIONS stay open between them)."""

    def __init__(self, url: str, *, connect_timeout_s: float, read_timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL {url!r}: expected http(s)://host[:port]/path")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        default_port = self.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_line = f"Host: {host if default_port else f'{host}:{self.port}'}\r\n"
        self._request_line = f"POST {target} HTTP/1.1\r\n{self._host_line}".encode("ascii")
        self._idle: list[_Connection] = []  # most recently used last: the warmest connection is reused
        self._busy: set[_Connection] = set()

    def post(self, body: bytes, headers: Mapping[str, str], *, target: str | None = None
             ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """Send ``body`` with ``headers`` (no Host or Content-Length: this client writes those) to the
        client's URL (or ``target``, a path on its origin) and wait for the head of the answer; read its
        body within the ``async with``."""
        line = self._request_line if target is None else f"POST {target} HTTP/1.1\r\n{self._host_line}".encode(
            "utf-8", "surrogateescape")
        return self._exchange(line, body, headers.items(), expect_body=True)

    def request(self, method: str, target: str, body: bytes, headers: Iterable[tuple[str, str]]
                ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """:meth:`post`, for any method and target (a path and query on the same origin); ``headers``
        as (name, value) pairs, repeated names allowed."""
        if not method.isalpha() or not target.startswith("/") or any(c in target for c in " \r\n"):
            raise ValueError(f"cannot send {method} {target!r} upstream: not a method and a path")
        line = f"{method} {target} HTTP/1.1\r\n{self._host_line}".encode("utf-8", "surrogateescape")
        return self._exchange(line, body, headers, expect_body=method != "HEAD")

    @asynccontextmanager
    async def _exchange(self, request_line: bytes, body: bytes, headers: Iterable[tuple[str, str]], *,
                        expect_body: bool) -> AsyncIterator[UpstreamResponse]:
        head = [request_line]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r}: a line break in a header would split the request")
            head.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        head.append(f"Content-Length: {len(body)}\r\n\r\n".encode("ascii"))
        conn = await self._connection()
        self._busy.add(conn)
        try:
            conn.send([b"".join(head), body], expect_body=expect_body)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_timeout_s)
        except BaseException:
            self._busy.discard(conn)
            conn.close()
            raise
        response = UpstreamResponse(self, conn)
        try:
            yield response
        finally:
            response.release()

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop), self.host, self.port, ssl=self.ssl)
        except TimeoutError:
            raise UpstreamUnreachable(f"no connection to {self.host}:{self.port} within "
                                      f"{self.connect_timeout_s:g} s") from None
        except OSError as e:  # refused, no route, name not resolved, TLS handshake failed
            raise UpstreamUnreachable(f"cannot connect to {self.host}:{self.port} after "
                                      f"{time.monotonic() - t0:.3g} s: {e}") from None
        return conn

    async def unreachable(self) -> str | None:
        """Why the upstream cannot be reached now (None: it can): an idle keep-alive connection says it
        can; else a new one is opened (within the connect timeout) and kept for the next request."""
        if any(not conn.closed for conn in self._idle):
            return None
        try:
            conn = await self._connection()
        except UpstreamUnreachable as e:
            return str(e)
        self._idle.append(conn)
        return None

    def _release(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        conn.active = False
        if conn.done and conn.reusable and not conn.closed and conn.error is None \
                and len(self._idle) < MAX_IDLE_CONNECTIONS:
            self._idle.append(conn)
        else:
            conn.close()

    async def close(self) -> None:
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
        await asyncio.sleep(0)  # let the transports finish closing
