"""The proxy when things go wrong mid-request: a client that leaves, an upstream that needs a key
for summaries, an upstream that refuses a prompt as too long."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.tasks import _Resumed, uncancelled
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from helpers.proxy_helpers import chat, post, serve_in_background, start_proxy


def _wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Seconds until ``check()`` is true (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - t0


# -- cancellation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_the_upstream_call_and_frees_its_conversation(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], tmp_path: Path, stream: bool) -> None:
    up, _ = upstream
    body = chat(("user", "a slow question"), stream=stream)
    if stream:  # the answer starts, then the engine takes its time
        up.stall_after_chunks, up.stall_s = 1, 60.0
        with httpx.stream("POST", f"{proxy[1]}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_raw())
    else:  # nothing comes for a minute: the client gives up first
        up.delay_s = 60.0
        with pytest.raises(httpx.ReadTimeout):
            post(proxy[1], body, timeout=0.5)
    # The upstream sees its connection closed at once: the engine stops generating.
    assert _wait_for(lambda: up.abandoned == 1) < 3.0
    # The conversation is free: its next request does not wait out the abandoned call.
    up.delay_s, up.stall_after_chunks = 0.0, None
    t0 = time.monotonic()
    r = post(proxy[1], chat(("user", "a slow question"), ("assistant", "never mind"), ("user", "next")))
    assert r.status_code == 200 and time.monotonic() - t0 < 5.0
    _wait_for(lambda: proxy[0].sessions.num_locked == 0)
    # What the client sent before leaving is in the session log.
    sessions = sorted((tmp_path / "data" / "sessions").glob("*/[0-9]*"))
    assert len(sessions) == 1
    texts = [m.text for m in Session(sessions[0]).restore().messages]
    assert texts[:3] == ["a slow question", "never mind", "next"]


@pytest.mark.parametrize("eager", [False, True])
def test_work_that_must_finish_runs_to_its_end_when_its_caller_is_cancelled(eager: bool) -> None:
    """What a request must not leave half done (an append, a recording): work that waits runs to its
    end when the caller is cancelled (on_cancel called once, the cancellation raised after it); what
    the work's awaits raise reaches the work, and what it raises reaches the caller. Eager, work that
    never waits ends in the caller's own step (no task, no turn of the event loop); without, in a
    task of its own."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        caller = asyncio.current_task()

        async def at_once() -> asyncio.Task[Any] | None:
            return asyncio.current_task()

        ran_in = await uncancelled(at_once(), eager=eager)
        assert (ran_in is caller) == eager
        gate: asyncio.Future[int] = loop.create_future()
        finished: list[int] = []
        asked: list[str] = []

        async def waits() -> int:
            finished.append(await gate)
            return finished[-1]

        task = asyncio.ensure_future(uncancelled(waits(), lambda: asked.append("stop"), eager=eager))
        await asyncio.sleep(0)
        for _ in range(2):
            task.cancel()
            await asyncio.sleep(0)
        assert not task.done() and asked == ["stop"]
        gate.set_result(7)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [7]

        failing: asyncio.Future[int] = loop.create_future()

        async def catches() -> str:
            try:
                await failing
            except KeyError:
                return "caught"
            return "not raised"

        caught = asyncio.ensure_future(uncancelled(catches(), eager=eager))
        await asyncio.sleep(0)
        failing.set_exception(KeyError("x"))
        assert await caught == "caught"

        async def fails_after_waiting() -> None:
            await asyncio.sleep(0)
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await uncancelled(fails_after_waiting(), eager=eager)
        assert await uncancelled(asyncio.to_thread(lambda: 5), eager=eager) == 5

        # The work has a context of its own, as a task has: what it sets stays there, before its first
        # wait and after (where a reset must find the variable it set).
        where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="caller")

        async def sets() -> str:
            token = where.set("work")
            await asyncio.sleep(0)
            seen = where.get()
            where.reset(token)
            return seen

        assert await uncancelled(sets(), eager=eager) == "work"
        assert where.get() == "caller"

    asyncio.run(main())


def test_resumed_work_gets_a_cancellation_that_comes_before_its_task_ran() -> None:
    """A task cancelled before its first step (the loop shutting down) throws the cancellation into
    the work where its first step stopped, as it would into any coroutine: its cleanup runs."""

    async def main() -> None:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cleaned: list[str] = []

        async def work() -> None:
            try:
                await gate
            finally:
                cleaned.append("finally")

        coro = work()
        task = asyncio.ensure_future(_Resumed(coro, coro.send(None)))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == ["finally"] and gate.cancelled() is False

    asyncio.run(main())


# -- summaries through the proxy's own client --------------------------------------------------------

def _summarizing_proxy(upstream_url: str, data_dir: Path, **kw: Any) -> tuple[ProxyApp, BackgroundServer]:
    """A proxy whose summaries are written by the upstream, in a window small enough for one to fire."""
    cfg = ProxyConfig(upstream=upstream_url, data_dir=data_dir, compact=CompactConfig(context_tokens=4096),
                      summarizer="upstream", fsync="never", **kw)
    proxy = ProxyApp(cfg)
    return proxy, serve_in_background(proxy).__enter__()


def _talk_until_a_summary(url: str, up: ScriptedUpstream, headers: dict[str, str]) -> None:
    turns: list[tuple[str, str]] = []
    for k in range(40):
        turns.append(("user", f"question {k}: " + "tell me more about the build " * 40))
        r = post(url, chat(*turns), headers=headers)
        assert r.status_code == 200, r.text
        turns.append(("assistant", r.json()["choices"][0]["message"]["content"]))
        if up.summary_authorizations:
            return
    raise AssertionError("no summary was asked for")


@pytest.mark.parametrize("configured_key", [None, "sk-summaries"])
def test_summaries_go_with_the_clients_key_or_the_configured_one(upstream: tuple[ScriptedUpstream, str],
                                                                tmp_path: Path, configured_key: str | None) -> None:
    up, url = upstream
    up.api_keys = {"sk-client", "sk-summaries"}
    proxy, srv = _summarizing_proxy(url, tmp_path / "data", summary_api_key=configured_key)
    try:
        _talk_until_a_summary(srv.url, up, {"Authorization": "Bearer sk-client"})
        _wait_for(lambda: proxy.sessions.num_locked == 0)
        assert up.summary_authorizations[0] == f"Bearer {configured_key or 'sk-client'}"
        assert proxy.metrics.summary_fallbacks.values_total() == 0
        assert proxy.metrics.compactions.values_total() >= 1
    finally:
        srv.close()


def test_a_failed_summary_is_logged_and_counted_by_its_reason(upstream: tuple[ScriptedUpstream, str],
                                                               tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    up, url = upstream
    up.api_keys = {"sk-client"}
    proxy, srv = _summarizing_proxy(url, tmp_path / "data", summary_api_key="sk-revoked")
    try:
        with caplog.at_level(logging.WARNING, logger="ctxfold.serve"):
            _talk_until_a_summary(srv.url, up, {"Authorization": "Bearer sk-client"})
            _wait_for(lambda: proxy.sessions.num_locked == 0)
        assert proxy.metrics.summary_fallbacks.get("HTTP 401") >= 1
        assert any("extractive fallback" in r.message and "401" in r.message and "Incorrect API key" in r.message
                   for r in caplog.records)
        assert "sk-revoked" not in caplog.text
    finally:
        srv.close()


# -- an upstream that refuses a prompt as too long -----------------------------------------------------

@pytest.mark.parametrize(("style", "stream"), [("openai", False), ("vllm", True), ("llama.cpp", False)])
def test_a_prompt_the_upstream_finds_too_long_is_compacted_further_and_sent_once_more(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path, style: str, stream: bool) -> None:
    up, url = upstream
    # The upstream's window is a third of what the proxy was told: its requests will be refused.
    up.context_tokens, up.too_long_style = 3000, style
    proxy, srv = start_proxy(url, tmp_path / "data", compact=CompactConfig(context_tokens=9000))
    try:
        turns: list[tuple[str, str]] = []
        for k in range(14):
            turns.append(("user", f"question {k}: " + "tell me more about the build " * 40))
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=chat(*turns, stream=stream),
                              timeout=30) as r:
                raw = b"".join(r.iter_raw())
            assert r.status_code == 200, raw  # the client sees one answer, never the refusal
            events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
            if stream:
                answer = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events
                                 if json.loads(e[6:])["choices"])
            else:
                answer = json.loads(raw)["choices"][0]["message"]["content"]
            assert answer.startswith(f"echo: question {k}:")
            turns.append(("assistant", answer))
        assert up.rejected_over_context >= 1
        assert proxy.metrics.upstream_errors.get("context_length_exceeded") == up.rejected_over_context
        # Once refused, the conversation aims lower: each refusal is followed by an accepted retry.
        assert up.rejected_over_context <= 2
    finally:
        srv.close()


def test_another_400_reaches_the_client_as_it_came_and_is_not_retried(upstream: tuple[ScriptedUpstream, str],
                                                                      proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    up.fail_status, up.fail_count = 400, 1
    r = post(proxy[1], chat(("user", "hi")))
    assert r.status_code == 400 and r.json()["error"]["message"] == "scripted failure"
    assert len(up.received) == 1


def test_the_summary_key_comes_from_the_environment_and_never_shows(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    from ctxfold.cli import build_parser, main
    from ctxfold.cli.serve import build_config

    argv = ["serve", "--upstream", "http://127.0.0.1:9/v1", "--data-dir", str(tmp_path / "d"),
            "--summary-api-key-env", "CTXFOLD_TEST_SUMMARY_KEY"]
    monkeypatch.delenv("CTXFOLD_TEST_SUMMARY_KEY", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CTXFOLD_TEST_SUMMARY_KEY" in err and "not set" in err
    monkeypatch.setenv("CTXFOLD_TEST_SUMMARY_KEY", "sk-secret-summaries")
    config = build_config(build_parser().parse_args(argv))
    assert config.summary_api_key == "sk-secret-summaries" and "sk-secret" not in repr(config)


# -- relay and slow clients ----------------------------------------------------------------------------

RATE_HEADERS = [("Retry-After", "7"), ("x-ratelimit-remaining-requests", "0"), ("x-request-id", "req-abc"),
                ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("Keep-Alive", "timeout=5")]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/embeddings"])
def test_relayed_paths_bring_back_every_header(upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str],
                                               path: str) -> None:
    up, _ = upstream
    up.answer_headers = RATE_HEADERS
    r = httpx.get(f"{proxy[1]}{path}", timeout=30)
    assert r.status_code in (200, 201)
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]
    assert (r.headers["retry-after"], r.headers["x-ratelimit-remaining-requests"], r.headers["x-request-id"]) == (
        "7", "0", "req-abc")
    assert "keep-alive" not in r.headers  # hop-by-hop: this connection's, not the answer's


def test_forty_half_sent_heads_are_closed_within_the_client_timeout(upstream: tuple[ScriptedUpstream, str],
                                                                     tmp_path: Path) -> None:
    cfg = ProxyConfig(upstream=upstream[1], data_dir=tmp_path / "d", summarizer="extractive", fsync="never",
                      client_timeout_s=1.0)
    proxy = ProxyApp(cfg)
    with serve_in_background(proxy) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        conns = [socket.create_connection((host, int(port)), timeout=10) for _ in range(40)]
        try:
            t0 = time.monotonic()
            for s in conns:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            for s in conns:
                s.settimeout(max(0.1, 6.0 - (time.monotonic() - t0)))
                try:
                    while s.recv(65536):
                        pass
                except ConnectionResetError:
                    pass
            assert time.monotonic() - t0 < 6.0  # closed by the proxy (recv would time out otherwise)
        finally:
            for s in conns:
                s.close()
        assert post(srv.url, chat(("user", "still serving"))).status_code == 200


@pytest.mark.parametrize(("body", "figures"), [
    ({"error": {"message": "This model's maximum context length is 16384 tokens. However, your messages resulted "
                           "in 16,091 tokens.", "type": "invalid_request_error", "code": "context_length_exceeded"}},
     (16091, 16384)),
    ({"object": "error", "message": "This model's maximum context length is 4096 tokens. However, you requested "
                                    "5000 tokens (4000 in the messages, 1000 in the completion).", "code": 400},
     (5000, 4096)),
    ({"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192,
                "message": "the request exceeds the available context size, try increasing it"}}, (9000, 8192)),
    ({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing the "
                                        "context size or enable context shift"}}, (None, None)),
    ({"error": {"type": "invalid_request_error", "message": "prompt is too long: 210000 tokens > 200000 maximum"}},
     (210000, 200000)),
    ({"error": {"message": "Invalid value for 'temperature': 3000 is greater than the maximum of 2"}}, None),
    ({"error": "model not found"}, None),
    # A string the client sent, echoed in an error of another kind: not a refusal of the prompt.
    ({"error": {"message": "Invalid 'stop': 'maximum context length is 10 tokens' is not a valid stop sequence",
                "type": "invalid_request_error", "code": "invalid_value"}}, None),
    # The same echo without a code: the words are the client's (they are in what it sent).
    ({"error": {"message": "unknown field 'note': maximum context length is 10 tokens"}}, None),
    # A window no engine has: a refusal, but its figures are not believed.
    ({"error": {"message": "This model's maximum context length is 3 tokens. However, you requested 9 tokens.",
                "code": "context_length_exceeded"}}, (None, None)),
])
def test_refusals_of_a_long_prompt_are_told_from_other_400s(body: dict[str, Any],
                                                            figures: tuple[int | None, int | None] | None) -> None:
    from ctxfold.serve.forward import prompt_too_long

    sent = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": ["maximum context length is 10 tokens"],
                       "note": "maximum context length is 10 tokens"}).encode()
    got = prompt_too_long(json.dumps(body).encode(), sent=sent)
    if figures is None:
        assert got is None
    else:
        assert got is not None and (got.prompt_tokens, got.limit_tokens) == figures


def test_a_client_that_leaves_during_a_summary_stops_it_and_frees_its_conversation(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, url = upstream
    up.summary_delay_s = 60.0
    proxy, srv = _summarizing_proxy(url, tmp_path / "data")
    try:
        turns: list[tuple[str, str]] = []
        for k in range(40):
            turns.append(("user", f"question {k}: " + "tell me more about the build " * 40))
            try:
                r = post(srv.url, chat(*turns), timeout=3.0)
            except httpx.ReadTimeout:
                break  # the summary this request triggered is slow: the client gives up
            turns.append(("assistant", r.json()["choices"][0]["message"]["content"]))
        else:
            raise AssertionError("no summary was asked for")
        assert up.summary_authorizations
        # The summary's upstream connection is closed, and the conversation is free at once.
        assert _wait_for(lambda: up.abandoned == 1) < 3.0
        t0 = time.monotonic()
        turns += [("assistant", "never mind"), ("user", "next")]
        assert post(srv.url, chat(*turns), timeout=30).status_code == 200
        assert time.monotonic() - t0 < 5.0
        # The extractive summary stood in (a stopped summary is not an empty one).
        assert proxy.metrics.summary_fallbacks.values == {("the client left",): 1}
        summaries = [m for m in up.received[-1]["messages"] if "extracted without a model" in str(m.get("content"))]
        assert len(summaries) == 1 and "question 0" in summaries[0]["content"]
    finally:
        srv.close()


@pytest.mark.parametrize(("prompt_tokens", "limit_tokens"), [(10**9, 4096), (5000, 64), (None, 64)])
def test_a_refusal_with_odd_figures_never_sets_a_window_under_the_floor(
        tmp_path: Path, prompt_tokens: int | None, limit_tokens: int) -> None:
    """Before: figures that put the window under one token were a ConfigError, and the client got 500."""
    from ctxfold.chat.messages import Conversation
    from ctxfold.compaction.compactor import Compactor
    from ctxfold.compaction.config import CompactConfig
    from ctxfold.serve.routing import ProxySession
    from ctxfold.serve.window import MIN_WINDOW_TOKENS, calibrate, lower_after_refusal

    base = CompactConfig(context_tokens=8192)
    session = ProxySession("k", tmp_path, Compactor(Conversation(messages=[]), config=base, durable=False))
    for _ in range(5):  # refused again and again: the factor grows each time
        assert lower_after_refusal(session, base, prompt_tokens, limit_tokens, sent_tokens=100)
    ctx = session.compactor.config.context_tokens
    assert ctx is not None and min(limit_tokens, MIN_WINDOW_TOKENS) <= ctx <= limit_tokens
    calibrate(session, base, reported=10**9, estimate=1)  # usage no engine gives
    assert (session.compactor.config.context_tokens or 0) >= min(8192, MIN_WINDOW_TOKENS)
