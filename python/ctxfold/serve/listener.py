"""Accepting client connections: the aiohttp runner's options and a listener that bounds the connections
open at once (``max_connections``), answering 503 past it before anything is read."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from ctxfold.serve.config import ProxyConfig

# After an answer to a request whose body was not read (413, 408), aiohttp reads and drops what the client
# still sends for this long, so the client sees the answer rather than a reset; then it closes.
LINGER_S = 2.0

def runner_options(config: ProxyConfig) -> dict[str, Any]:
    """The options of the proxy's aiohttp runner. aiohttp's keep-alive timer also runs from the moment
    a connection opens until a request's head has arrived: with ``client_timeout_s`` it times out
    half-sent heads (and idle connections), where aiohttp's default would wait an hour. A handler is
    cancelled when its client leaves: its upstream call is closed at once (the engine stops) and its
    conversation is free for the next request (see :func:`uncancelled` for what still runs to its end)."""
    return {"access_log": None, "handle_signals": False, "keepalive_timeout": config.client_timeout_s,
            "lingering_time": LINGER_S, "handler_cancellation": True}


_BUSY_BODY = json.dumps({"error": {
    "message": "ctxfold serve has as many client connections open as it accepts (--max-connections); retry shortly",
    "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
         b"Connection: close\r\nContent-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class _Gate(asyncio.Protocol):
    """One client connection: counted by its site, handed to aiohttp's protocol when under the limit,
    else answered 503 and closed before anything is read. Counted from connection_made to
    connection_lost, which asyncio calls in pairs and one at a time, so the count is exact."""

    __slots__ = ("_inner", "_site")

    def __init__(self, site: BoundedListener) -> None:
        self._site = site
        self._inner: asyncio.Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        site = self._site
        if site.open_connections >= site.max_connections or site.factory is None:
            site.refused += 1
            cast(asyncio.Transport, transport).write(_BUSY)
            transport.close()  # after the write is flushed
            return
        site.open_connections += 1
        self._inner = site.factory()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            self._site.open_connections -= 1
            self._inner.connection_lost(exc)


# Connections the kernel queues before the proxy accepts them (it caps this at net.core.somaxconn).
LISTEN_BACKLOG = 1024


class BoundedListener:
    """The proxy's listening socket, with at most ``max_connections`` client connections open at once:
    each accepted connection goes to aiohttp's protocol (the runner's public ``server`` factory) through
    a :class:`_Gate`. Public APIs only (asyncio's ``create_server`` and the runner's ``server``): no
    subclass of aiohttp's sites, whose internals change between releases. With ``sock``, it accepts on
    that listening socket (bound by a parent, shared by several workers)."""

    def __init__(self, runner: web.AppRunner, *, max_connections: int) -> None:
        self.runner = runner
        self.max_connections = max_connections
        self.open_connections = 0
        self.refused = 0  # connections answered 503 since the start
        self.factory: Callable[[], asyncio.Protocol] | None = None
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, *, sock: socket.socket | None = None) -> int:
        """Listen (or accept on ``sock``); returns the port bound."""
        server = self.runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        self.factory = server
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(lambda: _Gate(self), sock=sock, backlog=LISTEN_BACKLOG)
        else:
            self._server = await loop.create_server(lambda: _Gate(self), host, port, backlog=LISTEN_BACKLOG,
                                                    reuse_address=True)
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self) -> None:
        """Accept no more connections (those open are closed by the runner's cleanup)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
