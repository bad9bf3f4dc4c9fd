"""A relay between ``ctxfold serve`` and a real engine that keeps what the engine was asked and said
about each request: the body, and the engine's log written while it answered.

The proxy sends its summary requests upstream on its own; to send the same request again cold, and
to read the engine's cache figures for that one request, the bench and tests put this relay where the
proxy's ``--upstream`` points. It forwards every request byte for byte (streams chunk by chunk), one at
a time, so the engine's log between the start and the end of a request belongs to that request alone.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from ctxfold.compaction.summarize.request import SUMMARY_CONTRACT

# llama-cpp-python's verbose lines for one completion: the tokens it found in its cache and those it
# evaluated, and llama.cpp's own timing of that evaluation.
PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
SUMMARY_OPENING = SUMMARY_CONTRACT.splitlines()[0]


@dataclass
class EngineFigures:
    """What the engine's log says about one request. A request whose prompt shares nothing with the
    cache logs no prefix-match line: ``cached_tokens`` 0."""

    cached_tokens: int = 0  # the prefix-match hit: prompt tokens served from the engine's cache
    evaluated_tokens: int | None = None  # the prompt tokens the engine evaluated (its "remaining")
    prompt_eval_ms: float | None = None  # llama.cpp's prompt eval time for them

    @property
    def prompt_tokens(self) -> int | None:
        return None if self.evaluated_tokens is None else self.cached_tokens + self.evaluated_tokens

    @property
    def cached_share(self) -> float | None:
        total = self.prompt_tokens
        return None if not total else self.cached_tokens / total


def engine_figures(log_text: str) -> EngineFigures:
    """The figures of the one completion logged in ``log_text`` (the last, where there are several)."""
    hits = PREFIX_HIT.findall(log_text)
    evals = PROMPT_EVAL.findall(log_text)
    out = EngineFigures()
    if hits:
        out.cached_tokens, out.evaluated_tokens = int(hits[-1][0]), int(hits[-1][1])
    if evals:
        out.prompt_eval_ms = float(evals[-1][0])
        if out.evaluated_tokens is None:  # nothing cached: every prompt token was evaluated
            out.evaluated_tokens = int(evals[-1][1])
    return out


@dataclass
class Relayed:
    """One request the relay forwarded."""

    path: str
    body: dict[str, Any]
    status: int
    engine: EngineFigures

    @property
    def is_summary(self) -> bool:
        """A ctxfold summary request: its last message is the summary contract."""
        messages = self.body.get("messages") or []
        last = messages[-1] if messages else {}
        return isinstance(last, dict) and str(last.get("content") or "").startswith(SUMMARY_OPENING)


@dataclass
class RecordingRelay:
    """``RecordingRelay(engine_url, engine_log).app()`` served with ``BackgroundServer``; ``engine_url``
    is the engine's origin (``http://127.0.0.1:PORT``), paths are relayed as they come."""

    engine_url: str
    engine_log: Path
    relayed: list[Relayed] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 28)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        app.cleanup_ctx.append(self._session)
        return app

    async def _session(self, app: web.Application) -> Any:
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=900))
        self._one_at_a_time = asyncio.Lock()
        yield
        await self._client.close()

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization", "accept")}
        async with self._one_at_a_time:
            start = self.engine_log.stat().st_size
            async with self._client.request(request.method, self.engine_url + request.path_qs, data=raw,
                                            headers=headers) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json")})
                await resp.prepare(request)
                client_left = False
                async for chunk in up.content.iter_any():
                    try:
                        await resp.write(chunk)
                    except ConnectionError:
                        # The proxy stops reading a summary at its cap or a control boundary and
                        # closes the connection: the engine is told by closing ours.
                        client_left = True
                        break
            # llama-cpp-python prints its timings about when it sends the answer's last byte: wait for them,
            # and end the answer once the request is recorded, so a client that has it finds the record.
            log_text = await self._log_since(start)
            if request.method == "POST" and raw:
                self.relayed.append(Relayed(request.path, json.loads(raw), up.status, engine_figures(log_text)))
            if not client_left:
                await resp.write_eof()
        return resp

    async def _log_since(self, start: int, wait_s: float = 2.0) -> str:
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            with self.engine_log.open("rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
            if PROMPT_EVAL.search(text) or asyncio.get_running_loop().time() > deadline:
                return text
            await asyncio.sleep(0.05)


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        r.read()


def send_cold(engine_url: str, engine_log: Path, body: dict[str, Any]) -> EngineFigures:
    """``body`` sent again to the engine (its origin, ``http://127.0.0.1:PORT``) as a first request would
    find it: after a one-line request, so its cache holds only the chat format's opening. Sent as it was,
    but not streamed and with ``max_tokens`` 1: the prompt is what is measured."""
    _post(engine_url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello."}], "max_tokens": 1})
    start = engine_log.stat().st_size
    sent = {k: v for k, v in body.items() if k != "stream_options"}
    _post(engine_url + "/v1/chat/completions", {**sent, "stream": False, "max_tokens": 1})
    deadline = time.monotonic() + 5.0
    while True:
        with engine_log.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        if PROMPT_EVAL.search(text) or time.monotonic() > deadline:
            return engine_figures(text)
        time.sleep(0.05)
