"""The proxy's upstream client against real sockets on loopback, answered by servers that misbehave
on purpose: chunked and close-delimited bodies, stalls, cuts, garbage, early hints, idle closes."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("httptools", reason="the upstream client needs httptools (the serve extra)")

from ctxfold.serve.upstream import (
    READ_AHEAD_BYTES,
    UpstreamClient,
    UpstreamCut,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


class RawServer:
    """Reads each request (head and Content-Length body) and lets ``handler`` answer it with raw bytes;
    the handler returns whether to keep the connection for another request."""

    def __init__(self, handler: Handler, ssl: Any = None) -> None:
        self.handler = handler
        self.ssl = ssl
        self.requests: list[bytes] = []
        self.connections = 0

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl)
        port = self.server.sockets[0].getsockname()[1]
        scheme, host = ("https", "localhost") if self.ssl else ("http", "127.0.0.1")  # TLS checks a name
        return f"{scheme}://{host}:{port}/v1/chat/completions?x=1"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.handler(request, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def client(url: str, **kw: Any) -> UpstreamClient:
    return UpstreamClient(url, connect_timeout_s=kw.pop("connect_timeout_s", 2.0),
                          read_timeout_s=kw.pop("read_timeout_s", 2.0), **kw)


async def post(c: UpstreamClient, body: bytes = b'{"q": 1}') -> tuple[int, dict[str, str], list[bytes]]:
    async with c.post(body, {"Content-Type": "application/json", "Authorization": "Bearer k"}) as r:
        return r.status, r.headers, [chunk async for chunk in r.iter_chunks()]


def json_answer(body: bytes, *, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


def test_requests_go_out_whole_and_connections_are_reused() -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(json_answer(b'{"ok": true}'))
        return True

    async def main() -> None:
        server = RawServer(answer)
        async with server as url:
            c = client(url)
            for _ in range(3):
                assert await post(c) == (200, {"content-type": "application/json", "content-length": "12"},
                                         [b'{"ok": true}'])
            await c.close()
        assert server.connections == 1
        head, body = server.requests[0].split(b"\r\n\r\n")
        port = url.split(":")[2].split("/")[0]
        assert head.split(b"\r\n") == [b"POST /v1/chat/completions?x=1 HTTP/1.1", f"Host: 127.0.0.1:{port}".encode(),
                                       b"Content-Type: application/json", b"Authorization: Bearer k",
                                       b"Content-Length: 8"]
        assert body == b'{"q": 1}'

    run(main())


def test_a_chunked_stream_arrives_piece_by_piece_and_de_chunked() -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for k in range(3):
            event = f"data: {k}\n\n".encode()
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        return True

    async def main() -> None:
        async with RawServer(answer) as url:
            c = client(url)
            status, headers, chunks = await post(c)
            assert status == 200 and headers["content-type"] == "text/event-stream"
            assert chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
            assert len(c._idle) == 1  # read to its end: the connection is kept
            await c.close()

    run(main())


def test_a_body_without_length_ends_with_the_connection() -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\":")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b" 1}")
        return False  # close: the end of the body

    async def main() -> None:
        server = RawServer(answer)
        async with server as url:
            c = client(url)
            for _ in range(2):
                status, _, chunks = await post(c)
                assert status == 200 and b"".join(chunks) == b'{"a": 1}'
            await c.close()
        assert server.connections == 2  # not reusable

    run(main())


def test_silence_times_out_but_a_slow_steady_stream_does_not() -> None:
    async def stall_before_head(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async def stall_mid_body(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
        await asyncio.sleep(5)
        return False

    async def trickle(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
        for k in range(10):  # 1 s in all, never 0.3 s without a byte
            await asyncio.sleep(0.1)
            writer.write(str(k).encode())
        return True

    async def main() -> None:
        for handler in (stall_before_head, stall_mid_body):
            async with RawServer(handler) as url:
                c = client(url, read_timeout_s=0.3)
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(UpstreamTimeout, match="sent nothing for 0.3 s"):
                    await post(c)
                assert 0.25 < loop.time() - t0 < 2
                await c.close()
        async with RawServer(trickle) as url:
            c = client(url, read_timeout_s=0.3)
            assert b"".join((await post(c))[2]) == b"0123456789"
            await c.close()

    run(main())


@pytest.mark.parametrize(("reply", "error", "message"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345", UpstreamCut, "closed the connection before the answer ended"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n", UpstreamCut, "closed the connection before the answer ended"),
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", UpstreamProtocolError, "not valid HTTP/1.1"),
    (b"", UpstreamCut, "closed the connection before the answer ended"),
])
def test_a_cut_or_garbled_answer_is_an_error_that_says_so(reply: bytes, error: type[Exception], message: str) -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(reply)
        return False

    async def main() -> None:
        async with RawServer(answer) as url:
            c = client(url)
            with pytest.raises(error, match=message):
                await post(c)
            assert not c._idle and not c._busy
            await c.close()

    run(main())


def test_nothing_listening_is_unreachable_and_a_header_cannot_split_the_request() -> None:
    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, not listening: refused
            c = client(f"http://127.0.0.1:{port}/v1/chat/completions")
            with pytest.raises(UpstreamUnreachable, match=f"cannot connect to 127.0.0.1:{port}"):
                await post(c)
            with pytest.raises(ValueError, match="line break"):
                async with c.post(b"{}", {"X-Evil": "a\r\nHost: elsewhere"}):
                    pass
            await c.close()

    run(main())


def test_early_hints_are_skipped_and_idle_chatter_retires_a_connection() -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n" + json_answer(b"{}"))
        await writer.drain()
        await asyncio.sleep(0.05)
        # Then, unasked, a timeout notice on the idle connection (as some servers send before closing).
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        return True

    async def main() -> None:
        server = RawServer(answer)
        async with server as url:
            c = client(url)
            assert await post(c) == (200, {"content-type": "application/json", "content-length": "2"}, [b"{}"])
            await asyncio.sleep(0.2)
            assert await post(c) == (200, {"content-type": "application/json", "content-length": "2"}, [b"{}"])
            await c.close()
        assert server.connections == 2  # the first one spoke out of turn: never reused

    run(main())


def test_an_idle_connection_the_upstream_closed_is_not_reused() -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(json_answer(b"{}"))
        await writer.drain()
        return False  # a keep-alive answer, then the server closes the idle connection

    async def main() -> None:
        server = RawServer(answer)
        async with server as url:
            c = client(url)
            for _ in range(3):
                assert (await post(c))[0] == 200
                await asyncio.sleep(0.1)
            await c.close()
        assert server.connections == 3

    run(main())


def test_a_large_answer_read_slowly_pauses_the_socket_and_arrives_whole() -> None:
    size = 4 * READ_AHEAD_BYTES
    payload = bytes(range(256)) * (size // 256)

    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(json_answer(payload))
        await writer.drain()
        return True

    async def main() -> None:
        async with RawServer(answer) as url:
            c = client(url)
            got = bytearray()
            async with c.post(b"{}", {}) as r:
                async for chunk in r.iter_chunks():
                    got += chunk
                    await asyncio.sleep(0.01)  # a slow consumer
            assert bytes(got) == payload
            assert (await post(c))[0] == 200  # and the connection is still good
            await c.close()

    run(main())


def test_an_https_upstream_is_asked_over_tls(tmp_path: Any) -> None:
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl (the command) makes the test's certificate; it is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(json_answer(b'{"tls": true}'))
        return True

    async def main() -> None:
        server = RawServer(answer, ssl=server_ctx)
        async with server as url:
            port = url.split(":")[2].split("/")[0]
            # Verified against the test's own certificate, by host name.
            c = client(url, ssl_context=ssl.create_default_context(cafile=str(cert)))
            assert await post(c) == (200, {"content-type": "application/json", "content-length": "13"},
                                     [b'{"tls": true}'])
            assert f"Host: localhost:{port}".encode() in server.requests[0]
            await c.close()
            # The system's trust store does not know it: the handshake fails, and says so.
            with pytest.raises(UpstreamUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
                await post(client(url))

    run(main())


def test_a_reset_cuts_a_body_that_ends_with_the_connection() -> None:
    import socket
    import struct

    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"partial": ')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # a reset, not an orderly close: the body is not whole
        return False

    async def main() -> None:
        async with RawServer(answer) as url:
            c = client(url)
            with pytest.raises(UpstreamCut, match="closed the connection before the answer ended"):
                await post(c)
            await c.close()

    run(main())


def test_a_whole_answer_followed_by_junk_is_read_and_its_connection_retired() -> None:
    async def answer(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(json_answer(b"ok") + b"JUNK")
        return True

    async def main() -> None:
        server = RawServer(answer)
        async with server as url:
            c = client(url)
            for _ in range(2):
                assert (await post(c))[2] == [b"ok"]
            await c.close()
        assert server.connections == 2

    run(main())
