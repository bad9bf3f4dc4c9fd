"""OpenAICompatibleSummarizer against a real HTTP server on loopback.

The server is aiohttp on 127.0.0.1 with an ephemeral port, in its own thread and event loop, speaking the
OpenAI chat.completions streaming protocol (SSE ``data:`` lines, ``[DONE]``) from a script per test: the
client's real httpx stack, real sockets, real chunked transfer, real disconnects.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.summarize import (
    SUMMARY_CONTRACT,
    OpenAICompatibleSummarizer,
    build_summary_request,
    make_summarizer,
)
from helpers.scripted_server import ScriptedServer

GOOD_SUMMARY = (
    "Goal: fix the rounding bug in src/marshmallow/fields.py (TimeDelta serialization). "
    "Ran `python reproduce.py` -> printed 344, expected 345. Next: run the test suite."
)


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    s = ScriptedServer()
    yield s
    s.close()


@pytest.fixture
def srv(server: ScriptedServer) -> ScriptedServer:
    server.bodies.clear()
    server.headers.clear()
    server.disconnects = 0
    return server


def conversation() -> Conversation:
    return Conversation(
        system="You are a coding agent.",
        tools=(ToolSpec(name="bash", description="run a command",
                        parameters={"type": "object", "properties": {"command": {"type": "string"}}}),),
        messages=[
            Message(Role.USER, "Fix the TimeDelta rounding bug."),
            Message(Role.ASSISTANT, "", tool_calls=(ToolCall("c1", "bash", '{"command": "python reproduce.py"}'),)),
            Message(Role.TOOL, "344", tool_call_id="c1", name="bash"),
            Message(Role.ASSISTANT, "", tool_calls=(ToolCall("c2", "bash", '{"command": "pytest"}'),)),
        ],
    )


def summarizer(srv: ScriptedServer, **kw: Any) -> OpenAICompatibleSummarizer:
    return OpenAICompatibleSummarizer(srv.url, "m", api_key="sk-test", **kw)


def test_streaming_happy_path(srv: ScriptedServer) -> None:
    pieces = ["Goal: fix the rounding bug in src/marshmallow/", "fields.py (TimeDelta serialization). Ran `py",
              "thon reproduce.py` -> printed 344, expected 345. Next: run the test suite."]
    srv.handler = srv.stream_pieces(pieces, reasoning=("Let me think about", " what matters"))
    streamed: list[str] = []
    req = build_summary_request(conversation(), reason="soft limit before user turn", cap_tokens=4096,
                                room_tokens=1000)
    r = summarizer(srv).summarize(req, on_token=streamed.append)
    assert r.ok, r
    assert r.text == GOOD_SUMMARY and "".join(streamed) == GOOD_SUMMARY
    assert len(streamed) >= 2  # streamed as it arrived, not in one piece at the end
    assert r.cut_reason == "eos" and r.failure is None and r.summarizer == "openai:m"
    assert r.num_tokens == (len(GOOD_SUMMARY) + 3) // 4
    body = srv.bodies[0]
    assert body["stream"] is True and body["model"] == "m"
    assert body["max_tokens"] == 1000  # min(cap 4096, room 1000)
    assert body["messages"][0] == {"role": "system", "content": "You are a coding agent."}
    assert body["messages"][-1]["role"] == "user"
    assert body["messages"][-1]["content"].startswith(SUMMARY_CONTRACT)
    assert "Compaction reason: soft limit before user turn" in body["messages"][-1]["content"]
    assert body["tools"][0]["function"]["name"] == "bash" and body["tool_choice"] == "none"
    # BOTTOM cut the last tool round in half: the waiting call gets a placeholder result, so strict
    # servers accept the request.
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                     "user"]
    assert body["messages"][5]["tool_call_id"] == "c2"
    assert srv.headers[0]["Authorization"] == "Bearer sk-test"


def test_async_variant(srv: ScriptedServer) -> None:
    srv.handler = srv.stream_pieces([GOOD_SUMMARY[:40], GOOD_SUMMARY[40:]])
    req = build_summary_request(conversation(), reason="manual")

    async def go() -> Any:
        return await summarizer(srv).asummarize(req)

    r = asyncio.run(go())
    assert r.ok and r.text == GOOD_SUMMARY and r.cut_reason == "eos"


def test_stream_without_done_but_with_finish_is_fine(srv: ScriptedServer) -> None:
    srv.handler = srv.stream_pieces([GOOD_SUMMARY], done=False)
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert r.ok and r.text == GOOD_SUMMARY


def test_sse_comments_blank_lines_and_crlf(srv: ScriptedServer) -> None:
    c = ScriptedServer.chunk
    payload = (b": keep-alive\r\n\r\nevent: message\r\n" + c(GOOD_SUMMARY[:30]).replace(b"\n", b"\r\n")
               + b"id: 7\n" + c(GOOD_SUMMARY[30:]) + c(finish="stop") + b"data: [DONE]\n\n")
    srv.handler = srv.raw(payload)
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert r.ok and r.text == GOOD_SUMMARY


def test_malformed_stream_line_is_a_failure(srv: ScriptedServer) -> None:
    srv.handler = srv.raw(ScriptedServer.chunk("Goal: fix it") + b'data: {"choices": [{"delta": {"content"\n\n'
                          + b"data: [DONE]\n\n")
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert not r.ok and r.text == ""
    assert r.failure == "malformed stream: line 3 is not JSON"
    assert r.cut_reason == "none"


def test_disconnect_mid_stream_is_a_failure(srv: ScriptedServer) -> None:
    srv.handler = srv.raw(ScriptedServer.chunk("Goal: fix the rounding bug in "), close_early=True)
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert not r.ok
    assert r.failure in ("connection lost mid-stream",
                         "stream ended before the answer finished (no finish_reason, no [DONE])")


def test_stream_that_ends_without_finish_is_a_failure(srv: ScriptedServer) -> None:
    srv.handler = srv.raw(ScriptedServer.chunk(GOOD_SUMMARY))  # clean EOF, no finish_reason, no [DONE]
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert not r.ok and r.failure is not None and r.failure.startswith("stream ended before the answer finished")


def test_http_429_and_500(srv: ScriptedServer) -> None:
    srv.handler = srv.error(429, json.dumps({"error": {"message": "Rate limit reached", "type": "rate_limit"}}),
                            headers={"Retry-After": "7"})
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert not r.ok and r.failure == "HTTP 429: Rate limit reached" and r.detail == "retry-after: 7"
    srv.handler = srv.error(500, "upstream exploded")
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert not r.ok and r.failure == "HTTP 500: upstream exploded"
    srv.handler = srv.error(400, json.dumps({"object": "error", "message": "max_tokens too large", "code": 400}))
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert r.failure == "HTTP 400: max_tokens too large"  # vLLM's error shape


def test_error_event_inside_the_stream(srv: ScriptedServer) -> None:
    srv.handler = srv.raw(ScriptedServer.chunk("Goal") + b'data: {"error": {"message": "engine overloaded"}}\n\n')
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert not r.ok and r.failure == "server error in stream: engine overloaded"


def test_timeout_on_a_stalled_server(srv: ScriptedServer) -> None:
    srv.handler = srv.stall(5.0)
    t0 = time.perf_counter()
    r = summarizer(srv).summarize(build_summary_request(conversation()), timeout_s=0.5)
    assert time.perf_counter() - t0 < 4.0  # not the server's 5 s
    assert not r.ok and r.failure == "timeout after 0.5 s"


def test_timeout_on_a_trickling_server(srv: ScriptedServer) -> None:
    # Bytes keep arriving, so no read timeout fires: the deadline is over the whole generation.
    srv.handler = srv.trickle(0.05)
    t0 = time.perf_counter()
    r = summarizer(srv).summarize(build_summary_request(conversation()), timeout_s=0.6)
    assert 0.5 < time.perf_counter() - t0 < 4.0
    assert not r.ok and r.failure == "timeout after 0.6 s"


def test_config_timeout_is_the_default(srv: ScriptedServer) -> None:
    srv.handler = srv.trickle(0.05)
    cfg = CompactConfig.from_mapping({"summary": {"timeout_s": 0.4},
                                      "summarizer": {"kind": "openai", "base_url": srv.url, "model": "m"}})
    r = make_summarizer(cfg, environ={}).summarize(build_summary_request(conversation()))
    assert r.failure == "timeout after 0.4 s"


def test_cancel_from_another_thread(srv: ScriptedServer) -> None:
    srv.handler = srv.trickle(0.05)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t0 = time.perf_counter()
    r = summarizer(srv).summarize(build_summary_request(conversation()), cancel=cancel, timeout_s=10)
    assert time.perf_counter() - t0 < 4.0  # not the 10 s timeout
    assert not r.ok and r.failure == "cancelled"
    deadline = time.monotonic() + 5
    while srv.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.disconnects == 1  # the stream was closed, so the server stops generating


def test_cancel_with_asyncio_event_and_task_cancellation(srv: ScriptedServer) -> None:
    srv.handler = srv.trickle(0.05)

    async def go() -> tuple[Any, bool]:
        ev = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, ev.set)
        r = await summarizer(srv).asummarize(build_summary_request(conversation()), cancel=ev, timeout_s=10)
        task = asyncio.ensure_future(summarizer(srv).asummarize(build_summary_request(conversation()),
                                                                timeout_s=10))
        await asyncio.sleep(0.2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return r, True
        return r, False

    r, task_cancelled = asyncio.run(go())
    assert r.failure == "cancelled"
    assert task_cancelled  # cancelling the awaiting task propagates, as asyncio code expects


@pytest.mark.parametrize(
    ("pieces", "text", "cut"),
    [
        (["Goal: fix fields.py rounding. Next: run tests.", "</th", "ink>and then I will call the tool"],
         "Goal: fix fields.py rounding. Next: run tests.", "control_boundary"),
        (["Goal: fix fields.py rounding. Next: run tests.\n<", "｜DSML｜tool_calls>"],
         "Goal: fix fields.py rounding. Next: run tests.", "control_boundary"),
        (["Goal: fix fields.py rounding. Next: run tests.</", "｜DSML｜invoke>"],
         "Goal: fix fields.py rounding. Next: run tests.", "control_boundary"),
        (["Goal: fix fields.py rounding. Next: run tests.<tool_call>{\"name\": \"bash\"}"],
         "Goal: fix fields.py rounding. Next: run tests.", "control_boundary"),
        (["Goal: fix fields.py rounding. Next: run tests.<|im_end|>garbage after eos"],
         "Goal: fix fields.py rounding. Next: run tests.", "eos"),
        (["<think>The user wants", " a summary.</think>", "Goal: fix fields.py rounding. Next: run tests."],
         "Goal: fix fields.py rounding. Next: run tests.", "eos"),
    ],
    ids=["think-end-split", "dsml-open", "dsml-close", "tool_call", "eos-text", "leading-thinking-skipped"],
)
def test_control_boundaries_over_http(srv: ScriptedServer, pieces: list[str], text: str, cut: str) -> None:
    srv.handler = srv.stream_pieces(pieces)
    streamed: list[str] = []
    r = summarizer(srv).summarize(build_summary_request(conversation()), on_token=streamed.append)
    assert r.ok, r
    assert r.text == text and r.cut_reason == cut
    assert "".join(streamed).strip() == text  # nothing past the boundary was ever streamed


def test_tool_calls_delta_is_a_control_boundary(srv: ScriptedServer) -> None:
    c = ScriptedServer.chunk
    srv.handler = srv.raw(c(GOOD_SUMMARY) + c(tool_calls=[{"index": 0, "id": "x", "type": "function",
                                                           "function": {"name": "bash", "arguments": ""}}])
                          + c(finish="tool_calls") + b"data: [DONE]\n\n")
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert r.ok and r.text == GOOD_SUMMARY and r.cut_reason == "control_boundary"


def test_cap_cut_by_us_and_by_the_server(srv: ScriptedServer) -> None:
    # Our cutter: cap 10 tokens (chars/4) -> at most 40 chars, even though the server goes on.
    srv.handler = srv.stream_pieces([GOOD_SUMMARY, GOOD_SUMMARY])
    r = summarizer(srv).summarize(build_summary_request(conversation(), cap_tokens=10))
    assert r.ok and r.cut_reason == "token_cap" and r.capped
    assert r.text == GOOD_SUMMARY[:40].strip() and r.num_tokens <= 10
    # The server stops at max_tokens (finish_reason "length"); the room was the binding limit.
    srv.handler = srv.stream_pieces([GOOD_SUMMARY], finish="length")
    r = summarizer(srv).summarize(build_summary_request(conversation(), cap_tokens=4096, room_tokens=300))
    assert r.ok and r.cut_reason == "room" and srv.bodies[-1]["max_tokens"] == 300


@pytest.mark.parametrize(
    ("pieces", "reason"),
    [
        ([], "empty summary"),
        (["   \n\t  "], "empty summary"),
        (["<think>only reasoning, never closed"], "empty summary"),
        (["<b></b> <i>--</i>"], "summary has no text (markup or punctuation only)"),
        (["the same line again\n" * 40], "summary is a repetition loop"),
        (["next step: run tests. " * 60], "summary is a repetition loop"),
        (["</think>"], "empty summary"),
        # Gemma 3 270M (base) at a 64-token cap, verbatim: it parrots the last assistant message.
        (["The output is 344; the division truncates. I will use round(). mendatang\nで購入\n" * 3],
         "summary is a repetition loop"),
    ],
    ids=["no-content", "whitespace", "reasoning-only", "markup-only", "line-loop", "phrase-loop", "boundary-first",
         "short-loop"],
)
def test_garbage_answers_are_failures(srv: ScriptedServer, pieces: list[str], reason: str) -> None:
    srv.handler = srv.stream_pieces(pieces)
    r = summarizer(srv).summarize(build_summary_request(conversation()))
    assert not r.ok and r.text == ""
    assert r.failure is not None and r.failure.startswith(reason), r.failure


def test_connection_refused_is_a_failure() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = OpenAICompatibleSummarizer(f"http://127.0.0.1:{port}/v1", "m").summarize(
        build_summary_request(conversation()), timeout_s=5)
    assert not r.ok and r.failure is not None and r.failure.startswith("HTTP transport error: ConnectError")


def test_sync_api_inside_a_running_loop(srv: ScriptedServer) -> None:
    srv.handler = srv.stream_pieces([GOOD_SUMMARY])

    async def go() -> Any:
        return summarizer(srv).summarize(build_summary_request(conversation()))  # runs on a helper thread

    assert asyncio.run(go()).text == GOOD_SUMMARY


def test_from_config_reads_the_environment(srv: ScriptedServer) -> None:
    srv.handler = srv.stream_pieces([GOOD_SUMMARY])
    cfg = CompactConfig.from_mapping({"summarizer": {"kind": "openai", "send_tools": False,
                                                     "extra_body": {"top_p": 0.5}}})
    env = {"OPENAI_BASE_URL": srv.url, "OPENAI_API_KEY": "sk-env", "CTXFOLD_SUMMARY_MODEL": "env-model"}
    s = make_summarizer(cfg, environ=env)
    assert s.name == "openai:env-model"
    r = s.summarize(build_summary_request(conversation()))
    assert r.ok
    assert srv.bodies[-1]["model"] == "env-model" and srv.bodies[-1]["top_p"] == 0.5
    assert "tools" not in srv.bodies[-1]
    assert srv.headers[-1]["Authorization"] == "Bearer sk-env"
    from ctxfold.errors import ConfigError

    with pytest.raises(ConfigError, match="summarizer.base_url: not set; set it in the config or in OPENAI_BASE_URL"):
        make_summarizer(cfg, environ={})
    with pytest.raises(ConfigError, match="summarizer.model: not set"):
        make_summarizer(cfg, environ={"OPENAI_BASE_URL": srv.url})
