"""Per-test scripts for the scripted OpenAI-compatible upstream (:mod:`ctxfold.serve.testing`), shared by the
summarizer and compactor tests: each test sets what every chat completion is answered with (SSE ``data:``
lines and ``[DONE]``, an HTTP error, a cut or trickling stream, raw bytes).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ScriptedServer:
    """The scripted upstream on loopback, answering every chat completion with ``handler``; what it was
    sent is in ``bodies`` and ``headers``."""

    def __init__(self) -> None:
        self.handler: Handler = self.stream_pieces(["ok"])
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.disconnects = 0  # streams the client closed before the server finished writing
        upstream = ScriptedUpstream()
        upstream.script = self._dispatch
        self._server = BackgroundServer(upstream.app()).__enter__()
        self.url = f"{self._server.url}/v1"

    def close(self) -> None:
        self._server.close()

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())  # read once by the upstream already: aiohttp keeps the body
        self.headers.append(dict(request.headers))
        return await self.handler(request)

    # ---- scripts ---------------------------------------------------------------------------------

    @staticmethod
    async def _sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    @staticmethod
    def chunk(content: str | None = None, *, reasoning: str | None = None, finish: str | None = None,
              tool_calls: list[dict[str, Any]] | None = None, role: str | None = None) -> bytes:
        delta: dict[str, Any] = {} if role is None else {"role": role}
        if content is not None:
            delta["content"] = content
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        event = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(event)}\n\n".encode()

    def stream_pieces(self, pieces: list[str], *, finish: str = "stop", done: bool = True,
                      delay_s: float = 0.0, reasoning: tuple[str, ...] = ()) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            resp = await self._sse(request)
            try:
                await resp.write(self.chunk(role="assistant"))
                for r in reasoning:
                    await resp.write(self.chunk(reasoning=r))
                for p in pieces:
                    if delay_s:
                        await asyncio.sleep(delay_s)
                    await resp.write(self.chunk(p))
                await resp.write(self.chunk(finish=finish))
                if done:
                    await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except (ConnectionResetError, ConnectionError):
                self.disconnects += 1
            return resp
        return handler

    def raw(self, payload: bytes, *, close_early: bool = False) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            resp = await self._sse(request)
            await resp.write(payload)
            if close_early:  # drop the connection without ending the chunked body
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write_eof()
            return resp
        return handler

    def error(self, status: int, body: str, headers: dict[str, str] | None = None) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return web.Response(status=status, text=body, headers=headers, content_type="application/json")
        return handler

    def trickle(self, every_s: float) -> Handler:
        """A server that never finishes: one token every ``every_s`` seconds."""
        async def handler(request: web.Request) -> web.StreamResponse:
            resp = await self._sse(request)
            try:
                while True:
                    await resp.write(self.chunk("word "))
                    await asyncio.sleep(every_s)
            except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
                self.disconnects += 1
                raise
        return handler

    def stall(self, seconds: float) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            await asyncio.sleep(seconds)
            return web.Response(status=500)
        return handler
