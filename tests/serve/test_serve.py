"""The compacting proxy over real HTTP on loopback: passthrough, sessions, recall, bad input, faults."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.compaction.archive import make_marker
from ctxfold.compaction.archive.marker import MARKER_PREFIX
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session
from ctxfold.errors import ConfigError
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.sse import AnswerAssembler, SseReader
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from helpers.proxy_helpers import chat, metric, post, settle, start_proxy
from helpers.subprocess_env import ctxfold_env

# -- passthrough -------------------------------------------------------------------------------------

def test_json_answer_comes_back_byte_for_byte(upstream: tuple[ScriptedUpstream, str],
                                              proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    r = post(proxy[1], chat(("user", "hello there")))
    assert r.status_code == 200
    assert r.content == up.sent[-1]
    assert r.json()["choices"][0]["message"]["content"] == "echo: hello there"


def test_stream_passes_through_unchanged(upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    body = chat(("user", "stream me a fairly long answer please " * 5), stream=True)
    with httpx.stream("POST", f"{proxy[1]}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        got = b"".join(r.iter_raw())
    assert got == up.sent[-1]
    assert got.count(b"data: ") > 10 and got.endswith(b"data: [DONE]\n\n")


def test_stream_with_the_recall_tool_offered_is_still_unchanged(upstream: tuple[ScriptedUpstream, str],
                                                                proxy: tuple[ProxyApp, str]) -> None:
    """With tools in the request the recall tool is offered and the stream is read event by event
    (closing events held to the end): an answer without read_archive calls still arrives byte for byte."""
    up, _ = upstream
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    for answer in ({"role": "assistant", "content": "plain text answer " * 4},
                   {"role": "assistant", "content": "running it", "tool_calls": [
                       {"id": "b1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}):
        body = chat(("user", "go"), stream=True, tools=tools, stream_options={"include_usage": True},
                    x_replay_answer=answer)
        with httpx.stream("POST", f"{proxy[1]}/v1/chat/completions", json=body, timeout=30) as r:
            got = b"".join(r.iter_raw())
        assert got == up.sent[-1]
        assert any(t["function"]["name"] == "read_archive" for t in up.received[-1]["tools"])


def test_unknown_top_level_fields_pass_through(upstream: tuple[ScriptedUpstream, str],
                                               proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    r = post(proxy[1], chat(("user", "hi"), temperature=0.3, x_vendor={"a": [1, 2]}, seed=7))
    assert r.status_code == 200
    sent = up.received[-1]
    assert sent["temperature"] == 0.3 and sent["x_vendor"] == {"a": [1, 2]} and sent["seed"] == 7


# -- sessions ----------------------------------------------------------------------------------------

def _sessions(data: Path) -> list[Path]:
    return sorted(p for p in (data / "sessions").glob("*/*") if (p / "events.jsonl").is_file())


def test_a_conversation_continues_its_session_and_records_answers(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    turns: list[tuple[str, str]] = [("user", "first question")]
    for k in range(4):
        r = post(proxy[1], chat(*turns))
        turns.append(("assistant", r.json()["choices"][0]["message"]["content"]))
        turns.append(("user", f"follow-up {k}"))
    post(proxy[1], chat(("user", "another conversation")))
    settle(proxy[0])
    sessions = _sessions(tmp_path / "data")
    assert len(sessions) == 2
    restored = max((Session(p).restore() for p in sessions), key=len)
    assert restored.system == "You are terse."
    # Every message the client sent and every answer, in order (the last follow-up was never sent).
    assert [(m.role.value, m.text) for m in restored.messages] == turns[:-1]


def test_a_rewritten_history_forks_a_new_session(upstream: tuple[ScriptedUpstream, str],
                                                 proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    post(proxy[1], chat(("user", "q")))
    post(proxy[1], chat(("user", "q"), ("assistant", "echo: q"), ("user", "next")))
    # The client edits the assistant's answer: no stored session is a prefix any more.
    post(proxy[1], chat(("user", "q"), ("assistant", "EDITED"), ("user", "next")))
    settle(proxy[0])
    sessions = _sessions(tmp_path / "data")
    assert len(sessions) == 2
    assert sorted(len(Session(p).restore()) for p in sessions) == [4, 4]


def test_history_sent_back_in_another_form_continues_the_session(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    first = post(proxy[1], chat(("user", "q"))).json()["choices"][0]["message"]
    # The answer as clients send it back: keys reordered, fields added or dropped, reasoning left out.
    answer = {"content": first["content"], "role": "assistant", "refusal": None}
    body = chat(("user", "q"))
    body["messages"] += [answer, {"role": "user", "content": "next"}]
    assert post(proxy[1], body).status_code == 200
    body["messages"] += [{"role": "assistant", "content": "echo: next"}, {"role": "user", "content": "third"}]
    assert post(proxy[1], body).status_code == 200  # the forms the session now holds are the client's
    settle(proxy[0])
    sessions = _sessions(tmp_path / "data")
    assert len(sessions) == 1
    assert [m.text for m in Session(sessions[0]).restore().messages] == ["q", first["content"], "next", "echo: next",
                                                                        "third", "echo: third"]


def test_a_lone_surrogate_escape_is_forwarded_and_stored(upstream: tuple[ScriptedUpstream, str],
                                                        proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "half a pair: \\ud83d"}]}'
    r = post(proxy[1], None, raw=raw)
    assert r.status_code == 200, r.text
    assert upstream[0].received[-1]["messages"][0]["content"] == "half a pair: \ud83d"
    settle(proxy[0])
    restored = Session(_sessions(tmp_path / "data")[0]).restore()
    assert restored.messages[0].content == "half a pair: \ud83d"


def test_a_conversation_with_a_lone_surrogate_is_counted_and_goes_on(upstream: tuple[ScriptedUpstream, str],
                                                                    tmp_path: Path) -> None:
    """A lone surrogate escape is valid JSON but no tokenizer takes it: the proxy counts it as U+FFFD
    (once it was a 500 for every request that had to count it: the echoed answer, a long message)."""
    app, srv = start_proxy(upstream[1], tmp_path / "data", compact=CompactConfig(context_tokens=8192))
    try:
        first = '{"role": "user", "content": "half a pair: \\ud83d ' + "word " * 3000 + '"}'
        raw = '{"model": "m", "messages": [' + first + ']}'
        r = post(srv.url, None, raw=raw.encode())
        assert r.status_code == 200, r.text
        settle(app)
        answer = json.dumps(r.json()["choices"][0]["message"])
        raw = '{"model": "m", "messages": [' + first + ", " + answer + ', {"role": "user", "content": "next"}]}'
        r = post(srv.url, None, raw=raw.encode())
        assert r.status_code == 200, r.text
        settle(app)
        assert [m.role.value for m in app.sessions.loaded()[0].compactor.originals] == ["user", "assistant"] * 2
        raw = '{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "a \\udc00 b"}]}'
        r = httpx.post(f"{srv.url}/v1/messages/count_tokens", content=raw.encode(), timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    finally:
        srv.close()


def test_requests_of_one_conversation_are_served_in_turn(upstream: tuple[ScriptedUpstream, str],
                                                         proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    up.delay_s = 0.3
    with httpx.Client() as client:
        import concurrent.futures

        def send(k: int) -> int:
            body = chat(("user", f"turn {k}"))
            return client.post(f"{proxy[1]}/v1/chat/completions", json=body, timeout=30,
                               headers={"X-Ctxfold-Session": "one"}).status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(send, range(4))) == [200] * 4
    assert up.max_in_flight == 1  # the conversation's lock held each request until its answer was stored


def test_session_header_separates_identical_openings(upstream: tuple[ScriptedUpstream, str],
                                                     proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    for key in ("alice", "bob"):
        assert post(proxy[1], chat(("user", "same start")), headers={"X-Ctxfold-Session": key}).status_code == 200
    assert len(_sessions(tmp_path / "data")) == 2
    r = post(proxy[1], chat(("user", "x")), headers={"X-Ctxfold-Session": "k" * 500})
    assert r.status_code == 400 and "X-Ctxfold-Session" in r.json()["error"]["message"]


def test_least_recently_used_conversations_are_closed_and_come_back_from_disk(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    proxy, srv = start_proxy(upstream[1], tmp_path / "data", max_loaded_conversations=2)
    try:
        histories: dict[str, list[tuple[str, str]]] = {f"c{k}": [] for k in range(5)}
        for round_ in range(3):
            for name, turns in histories.items():  # round robin: every conversation is evicted in between
                turns.append(("user", f"{name} question {round_}"))
                r = post(srv.url, chat(*turns), headers={"X-Ctxfold-Session": name})
                assert r.status_code == 200
                turns.append(("assistant", r.json()["choices"][0]["message"]["content"]))
                # The handler trims after the client has its answer (and the answer is recorded): wait for it.
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and (proxy.sessions.num_sessions > 2 or len(proxy.compactors.models) > 2
                                                       or len(proxy.sessions.cache._loaded_locks) > 2):
                    time.sleep(0.001)
                assert proxy.sessions.num_sessions <= 2
                assert len(proxy.compactors.models) <= 2
                assert len(proxy.sessions.cache._loaded_locks) <= 2  # an evicted key's lock goes with its last user
    finally:
        srv.close()
    sessions = _sessions(tmp_path / "data")
    # Each conversation continued its own session after being read back: no fork, nothing missing.
    assert len(sessions) == 5
    assert sorted([(m.role.value, m.text) for m in Session(p).restore().messages] for p in sessions) == sorted(
        histories.values())


def test_restart_resumes_sessions_from_the_data_dir(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    data = tmp_path / "data"
    _, srv = start_proxy(upstream[1], data)
    post(srv.url, chat(("user", "before restart")))
    srv.close()
    _, srv2 = start_proxy(upstream[1], data)
    try:
        post(srv2.url, chat(("user", "before restart"), ("assistant", "echo: before restart"), ("user", "after")))
    finally:
        srv2.close()
    sessions = _sessions(data)
    assert len(sessions) == 1
    assert [m.text for m in Session(sessions[0]).restore().messages] == [
        "before restart", "echo: before restart", "after", "echo: after"]


# -- recall ------------------------------------------------------------------------------------------

def test_a_quiet_request_goes_out_as_sent_and_one_due_for_an_archive_pass_does_not(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, _ = upstream
    compact = CompactConfig.from_mapping({"minor": {"keep_recent_user_turns": 1, "archive_threshold": 100}})
    app, srv = start_proxy(upstream[1], tmp_path / "data", compact=compact)
    big = "output line that is long enough to archive\n" * 50
    try:
        history = chat(("user", "start"))
        post(srv.url, history)
        history["messages"] += [
            {"role": "assistant", "content": "echo: start"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "t0", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "t0", "content": big},
        ]
        assert post(srv.url, history).status_code == 200
        session = app.sessions.loaded()[0]
        # Nothing could fire: its bytes went out as sent, its messages stored.
        assert up.received[-1]["messages"][4]["content"] == big
        history["messages"] += [{"role": "assistant", "content": "echo: start"}, {"role": "user", "content": "next"}]
        assert post(srv.url, history).status_code == 200
        # A turn start with an output behind the kept turn: the archive pass runs before forwarding.
        assert [e.kind for e in session.compactor.events if e.applied] == ["archive"]
        sent = up.received[-1]
        assert sent["messages"][4]["content"].startswith(MARKER_PREFIX)
        assert any(t["function"]["name"] == "read_archive" for t in sent["tools"])
        # Quiet again: the compacted view goes out with the new message as sent.
        history["messages"] += [{"role": "assistant", "content": "echo: next"}, {"role": "user", "content": "more"}]
        assert post(srv.url, history).status_code == 200
        sent = up.received[-1]
        assert sent["messages"][4]["content"].startswith(MARKER_PREFIX)
        assert [m.get("content") for m in sent["messages"][5:]] == ["echo: start", "next", "echo: next", "more"]
    finally:
        srv.close()
    assert [m.text for m in Session(_sessions(tmp_path / "data")[0]).restore().messages][2:] == [
        "", big, "echo: start", "next", "echo: next", "more", "echo: more"]


def test_read_archive_calls_are_answered_by_the_proxy(upstream: tuple[ScriptedUpstream, str],
                                                      proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    up, _ = upstream
    app, url = proxy
    post(url, chat(("user", "start")))
    session = app.sessions.loaded()[0]
    big = "line of archived output\n" * 200
    aid = session.compactor.store.put(big)
    marker = make_marker(aid, big, preview_chars=40)
    answers: Iterator[dict[str, Any]] = iter(())
    up.answer_for = lambda body: next(answers)  # type: ignore[method-assign]
    history = chat(("user", "start"), ("assistant", "echo: start"), ("user", "what did it say?"))
    history["messages"].insert(3, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t0", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]})
    history["messages"].insert(4, {"role": "tool", "tool_call_id": "t0", "content": marker})
    for stream in (False, True):
        # The model first thinks and asks for the archive, then answers with what it read.
        answers = iter([
            {"role": "assistant", "content": None, "reasoning_content": "I should look at the archive.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "read_archive", "arguments": json.dumps({"id": aid, "limit": 50})}}]},
            {"role": "assistant", "content": "the archive says: line of archived output"},
        ])
        n = len(up.received)
        body = dict(history, stream=stream)
        if stream:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
                raw = b"".join(r.iter_raw())
            asm = AnswerAssembler()
            for _, payload in SseReader().feed(raw):
                asm.add(payload)
            text = asm.message()["content"]
            # The client saw the first answer's events but its read_archive call, then the final answer's
            # bytes unchanged.
            assert raw.endswith(up.sent[-1])
            first_part = raw[: len(raw) - len(up.sent[-1])]
            assert b"read_archive" not in first_part and b"[DONE]" not in first_part
            assert asm.message()["reasoning_content"] == "I should look at the archive."
            assert "tool_calls" not in asm.message()
        else:
            text = post(url, body).json()["choices"][0]["message"]["content"]
        assert text == "the archive says: line of archived output"
        assert len(up.received) == n + 2
        first, second = up.received[n], up.received[n + 1]
        assert any(t["function"]["name"] == "read_archive" for t in first["tools"])
        tool_answer = second["messages"][-1]
        assert tool_answer["role"] == "tool" and tool_answer["tool_call_id"] == "c1"
        assert tool_answer["content"].startswith(f"[read_archive id={aid} chars 0-50 of {len(big)}")
    assert app.metrics.recall_calls.get() == 2


# -- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "code", "needle"), [
    (b'{"model": "m", "messages": [', "invalid_json", "not valid JSON"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid_utf8", "not valid UTF-8"),
    (b'[1, 2]', "invalid_type", "must be a JSON object"),
    (b'{"model": "m"}', "invalid_type", "'messages' must be a non-empty array"),
    (b'{"model": "m", "messages": []}', "invalid_type", "non-empty"),
    (b'{"model": "m", "messages": ["hi"]}', "invalid_type", "messages[0] must be an object"),
    (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "invalid_message", "wizard"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "invalid_message", "content"),
    (b'{"model": "m", "messages": [{"role": "tool", "content": "x"}]}', "invalid_message", "tool_call_id"),
    (b'{"model": 3, "messages": [{"role": "user", "content": "x"}]}', "invalid_type", "'model' must be a str"),
    (b'{"stream": "yes", "messages": [{"role": "user", "content": "x"}]}', "invalid_type", "'stream'"),
])
def test_bad_requests_get_a_400_that_says_what_is_wrong(proxy: tuple[ProxyApp, str], raw: bytes, code: str,
                                                        needle: str) -> None:
    r = post(proxy[1], None, raw=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]
    # ...and the proxy keeps serving.
    assert post(proxy[1], chat(("user", "still there?"))).status_code == 200


def test_a_huge_body_is_refused_from_its_headers(proxy: tuple[ProxyApp, str]) -> None:
    """100 MB announced: 413 at once, after a few KB were sent; the proxy never reads the rest."""
    host, port = proxy[1].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n" + b'{"messages": [' + b" " * 4096)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"request_too_large" in body and b"100000000 bytes" in body
    assert post(proxy[1], chat(("user", "still there?"))).status_code == 200


def test_a_chunked_body_over_the_limit_is_cut_off(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    _, srv = start_proxy(upstream[1], tmp_path / "d", max_body_bytes=100_000)
    try:
        def parts() -> Iterator[bytes]:
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(100):
                yield b"x" * 10_000

        r = httpx.post(f"{srv.url}/v1/chat/completions", content=parts(), timeout=30)
        assert r.status_code == 413 and "exceeds 100000 bytes" in r.json()["error"]["message"]
    except httpx.HTTPError:
        pass  # the proxy may close before the client has sent everything: also a refusal
    finally:
        srv.close()


# -- faults ------------------------------------------------------------------------------------------

def test_upstream_down_is_a_502(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connection refused
        _, srv = start_proxy(dead, tmp_path / "d")
        try:
            r = post(srv.url, chat(("user", "anyone?")))
        finally:
            srv.close()
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_unreachable" and "cannot reach the upstream" in err["message"]
    # The client's message is kept: a retry continues the same session.
    assert len(_sessions(tmp_path / "d")) == 1


def test_slow_upstream_is_a_504(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, url = upstream
    up.delay_s = 1.0
    _, srv = start_proxy(url, tmp_path / "d", read_timeout_s=0.3)
    try:
        for stream in (False, True):
            r = post(srv.url, chat(("user", "slow"), stream=stream))
            assert r.status_code == 504
            assert r.json()["error"]["code"] == "upstream_timeout" and "0.3 s" in r.json()["error"]["message"]
    finally:
        srv.close()


def test_a_stream_that_stalls_ends_with_an_error_event(upstream: tuple[ScriptedUpstream, str],
                                                       tmp_path: Path) -> None:
    up, url = upstream
    up.stall_after_chunks, up.stall_s = 2, 1.0
    _, srv = start_proxy(url, tmp_path / "d", read_timeout_s=0.3)
    try:
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=chat(("user", "x" * 40), stream=True),
                          timeout=30) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
    finally:
        srv.close()
    first_two = b"".join(e + b"\n\n" for e in up.sent[-1].split(b"\n\n")[:2])
    assert raw.startswith(first_two) and b"[DONE]" not in raw
    err = json.loads(SseReader().feed(raw)[-1][1] or "")["error"]
    assert err["code"] == "upstream_stream_cut" and "sent nothing for 0.3 s" in err["message"]


def test_upstream_errors_are_passed_through(upstream: tuple[ScriptedUpstream, str],
                                            proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    for stream in (False, True):
        up.fail_status, up.fail_count = 500, 1
        r = post(proxy[1], chat(("user", "boom"), stream=stream))
        assert r.status_code == 500 and r.json()["error"]["message"] == "scripted failure"
    up.fail_status, up.fail_count = 429, 1
    assert post(proxy[1], chat(("user", "boom"))).status_code == 429
    # Not retried: exactly one upstream call per client request; the next one succeeds.
    assert post(proxy[1], chat(("user", "boom"))).status_code == 200
    assert proxy[0].metrics.upstream_errors.get("status") == 3


def test_a_cut_stream_ends_with_an_error_event_and_leaves_the_session_clean(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    up, _ = upstream
    up.cut_after_chunks = 3
    body = chat(("user", "a long answer please " * 10), stream=True)
    with httpx.stream("POST", f"{proxy[1]}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    events = SseReader().feed(raw)
    assert b"[DONE]" not in raw
    err = json.loads(events[-1][1] or "")["error"]
    assert err["code"] == "upstream_stream_cut"
    assert raw.startswith(b"".join(up.sent[-1].split(b"\n\n")[i] + b"\n\n" for i in range(3)))
    # The cut answer is not recorded; the retry continues the same session and records the full one.
    with httpx.stream("POST", f"{proxy[1]}/v1/chat/completions", json=body, timeout=30) as r:
        assert b"".join(r.iter_raw()) == up.sent[-1]
    settle(proxy[0])
    sessions = _sessions(tmp_path / "data")
    assert len(sessions) == 1
    msgs = Session(sessions[0]).restore().messages
    assert [m.role.value for m in msgs] == ["user", "assistant"]
    assert msgs[1].text == "echo: " + ("a long answer please " * 10)[:200]


def test_a_client_that_leaves_mid_stream_is_not_an_upstream_error(upstream: tuple[ScriptedUpstream, str],
                                                                   proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    up.stall_after_chunks, up.stall_s = 2, 0.5  # the client is gone when the proxy writes the next event
    body = chat(("user", "a long answer please " * 10), stream=True)
    with httpx.stream("POST", f"{proxy[1]}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    time.sleep(1.0)
    assert proxy[0].metrics.upstream_errors.get("cut_stream") == 0
    assert post(proxy[1], chat(("user", "still serving"))).status_code == 200


def test_health_and_metrics(upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str]) -> None:
    post(proxy[1], chat(("user", "hi")))
    post(proxy[1], None, raw=b"{")
    h = httpx.get(f"{proxy[1]}/health").json()
    assert h["status"] == "ok" and h["sessions_loaded"] == 1
    text = httpx.get(f"{proxy[1]}/metrics").text
    assert metric(text, "ctxfold_requests_total", stream="false", tenant="anonymous") == 1
    assert metric(text, "ctxfold_responses_total", status="400", tenant="anonymous") == 1
    assert metric(text, "ctxfold_bad_requests_total", reason="invalid_json") == 1
    assert "# TYPE ctxfold_summary_seconds histogram" in text
    assert metric(text, "ctxfold_proxy_overhead_seconds_count") == 1


def test_an_operator_token_guards_metrics_and_health_details(upstream: tuple[ScriptedUpstream, str],
                                                            tmp_path: Path) -> None:
    """/metrics shows every tenant's labels and counts; with a token set, a client without it gets a 404
    there and only the status from /health. The token never goes upstream."""
    up, url = upstream
    token = "operator-secret-0123456789"
    _, srv = start_proxy(url, tmp_path / "data", operator_token=token)
    try:
        assert post(srv.url, chat(("user", "hi")), headers={"Authorization": "Bearer sk-a"}).status_code == 200
        assert httpx.get(f"{srv.url}/metrics", timeout=30).status_code == 404
        assert httpx.get(f"{srv.url}/metrics", timeout=30, headers={"X-Ctxfold-Operator-Token": "wrong"}).status_code == 404
        text = httpx.get(f"{srv.url}/metrics", timeout=30, headers={"X-Ctxfold-Operator-Token": token}).text
        assert re.search(r'ctxfold_responses_total\{status="200",tenant="[0-9a-f]{12}"\} 1\.0', text), text
        assert httpx.get(f"{srv.url}/health", timeout=30).json() == {"status": "ok"}
        details = httpx.get(f"{srv.url}/health", timeout=30, headers={"X-Ctxfold-Operator-Token": token}).json()
        assert details["status"] == "ok" and "upstream" in details and "sessions_loaded" in details
        httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x"}, timeout=30,
                   headers={"X-Ctxfold-Operator-Token": token})
        assert up.other_requests and all(k.lower() != "x-ctxfold-operator-token"
                                         for k, _ in up.other_requests[-1]["headers"])
    finally:
        srv.close()
    with pytest.raises(ConfigError, match="at least 16 characters"):
        ProxyConfig(upstream=url, data_dir=tmp_path / "d", operator_token="short")


def test_health_says_when_the_upstream_cannot_be_reached(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, srv = start_proxy(f"http://127.0.0.1:{port}/v1", tmp_path / "data")
    try:
        h = httpx.get(f"{srv.url}/health", timeout=30)
        assert h.status_code == 503 and h.json()["status"] == "degraded"
        assert f"the upstream http://127.0.0.1:{port}/v1/chat/completions cannot be reached" in h.json()["reason"]
    finally:
        srv.close()


def _archive_one_output(url: str, headers: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """A conversation on the proxy at ``url`` whose tool output the next turn start archives: (its history,
    the archived output)."""
    big = "output line that is long enough to archive\n" * 50
    history = chat(("user", "start"))
    post(url, history, headers=headers)
    history["messages"] += [
        {"role": "assistant", "content": "echo: start"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t0", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t0", "content": big},
        {"role": "assistant", "content": "echo: start"},
        {"role": "user", "content": "next"},
    ]
    assert post(url, history, headers=headers).status_code == 200
    return history, big


def _recall(up: ScriptedUpstream, url: str, history: dict[str, Any], aid: str, headers: dict[str, str] | None = None,
            ) -> str:
    """What the proxy at ``url`` answers the model's read_archive call for ``aid`` with, on the turn after
    ``history``."""
    call = {"id": "c9", "type": "function", "function": {"name": "read_archive", "arguments": json.dumps({"id": aid})}}
    answers = iter([{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "assistant", "content": "done"}])
    up.answer_for = lambda body: next(answers)  # type: ignore[method-assign]
    answered = "echo: " + history["messages"][-1]["content"]  # what the scripted upstream answered it
    body = dict(history, messages=[*history["messages"], {"role": "assistant", "content": answered},
                                   {"role": "user", "content": "recall it"}])
    assert post(url, body, headers=headers).json()["choices"][0]["message"]["content"] == "done"
    return str(up.received[-1]["messages"][-1]["content"])


ARCHIVE_EARLY = CompactConfig.from_mapping({"minor": {"keep_recent_user_turns": 1, "archive_threshold": 100}})


def test_replicas_share_archives_through_an_fsspec_url(upstream: tuple[ScriptedUpstream, str],
                                                       tmp_path: Path) -> None:
    """Two proxies, each with its own data dir, one archive URL: what a pass on one archived, the commit
    of its request wrote to object storage (not the session store), and the other recalls it."""
    import fsspec

    up, url = upstream
    archive_url = f"memory://ctxfold-replicas-{tmp_path.name}"
    a, srv_a = start_proxy(url, tmp_path / "a", archive_url=archive_url, compact=ARCHIVE_EARLY)
    _, srv_b = start_proxy(url, tmp_path / "b", archive_url=archive_url, compact=ARCHIVE_EARLY)
    try:
        history, big = _archive_one_output(srv_a.url)
        (event,) = [e for e in a.sessions.loaded()[0].compactor.events if e.applied]
        aid = event.archived[0].archive_id
        fs = fsspec.filesystem("memory")
        (stored,) = [p for p in fs.find(f"/ctxfold-replicas-{tmp_path.name}") if p.endswith(f"{aid}.txt")]
        assert fs.cat_file(stored) == big.encode()
        assert not list((tmp_path / "a").rglob(f"{aid}.txt"))  # nowhere in the session store
        assert _recall(up, srv_b.url, history, aid).startswith(f"[read_archive id={aid} chars 0-{len(big)} of {len(big)}")
    finally:
        srv_a.close()
        srv_b.close()


def test_an_archive_url_that_refuses_writes_keeps_the_outputs_with_the_session(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Object storage that takes no write: the archived outputs go with the session's own batch, the
    model still recalls them, and the log says why once."""
    up, url = upstream
    (tmp_path / "not-a-folder").write_text("in the way")
    app, srv = start_proxy(url, tmp_path / "data", archive_url=str(tmp_path / "not-a-folder"), compact=ARCHIVE_EARLY)
    try:
        with caplog.at_level("WARNING", logger="ctxfold.serve"):
            history, big = _archive_one_output(srv.url)
        (event,) = [e for e in app.sessions.loaded()[0].compactor.events if e.applied]
        aid = event.archived[0].archive_id
        (kept,) = list((tmp_path / "data").rglob(f"{aid}.txt"))
        assert kept.read_text() == big
        (said,) = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
        assert said.startswith(f"archived outputs cannot be written to {tmp_path / 'not-a-folder'} (")
        assert said.endswith("); they are kept with each session's own log instead, where recalls read them")
        assert _recall(up, srv.url, history, aid).startswith(f"[read_archive id={aid} chars 0-{len(big)} of {len(big)}")
    finally:
        srv.close()


@pytest.mark.parametrize("credential", [None, "Bearer tenant-a"], ids=["anonymous", "tenant"])
def test_a_fork_reads_the_outputs_its_parent_kept_with_its_own_log(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path, credential: str | None) -> None:
    """Object storage refused an output, so the parent keeps it with its own log: a fork of that
    conversation (an edited last turn) gets a copy with its own first batch and recalls it, whether the
    archive is the conversation's own (anonymous) or the key's (a tenant's)."""
    up, url = upstream
    (tmp_path / "not-a-folder").write_text("in the way")
    app, srv = start_proxy(url, tmp_path / "data", archive_url=str(tmp_path / "not-a-folder"), compact=ARCHIVE_EARLY)
    headers = {"Authorization": credential} if credential is not None else None
    try:
        history, big = _archive_one_output(srv.url, headers)
        (event,) = [e for e in app.sessions.loaded()[0].compactor.events if e.applied]
        aid = event.archived[0].archive_id
        history["messages"] += [{"role": "assistant", "content": "echo: next"}, {"role": "user", "content": "more"}]
        assert post(srv.url, history, headers=headers).status_code == 200  # the archive pass is in the prefix now
        forked = dict(history, messages=[*history["messages"][:-1], {"role": "user", "content": "something else"}])
        assert post(srv.url, forked, headers=headers).status_code == 200
        assert app.sessions.num_forks == 1
        assert _recall(up, srv.url, forked, aid, headers).startswith(f"[read_archive id={aid} chars 0-{len(big)} of {len(big)}")
    finally:
        srv.close()


def test_an_archive_url_of_an_unknown_kind_is_refused_at_startup(tmp_path: Path) -> None:
    from ctxfold.errors import ArchiveError

    with pytest.raises(ArchiveError, match="archive URL 'nosuchstorage://bucket/x'"):
        ProxyApp(ProxyConfig(upstream="http://127.0.0.1:9/v1", data_dir=tmp_path / "data",
                             archive_url="nosuchstorage://bucket/x"))


def test_cli_rejects_bad_settings_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from ctxfold.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--upstream", "ftp://models.example"])
    assert exit_.value.code == 2
    assert "argument --upstream: 'ftp://models.example' is not an http(s) URL" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--upstream", "http://127.0.0.1:1", "--read-timeout-s", "0"])
    assert exit_.value.code == 2
    assert "argument --read-timeout-s: '0' must be a finite number of seconds above 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="fsync: 'sometimes' is not one of compactions, always, never"):
        ProxyConfig(upstream="http://127.0.0.1:1", data_dir=Path("d"), fsync="sometimes")
    with pytest.raises(ConfigError, match=r"max_loaded_conversations: 0 is out of range \[1, inf\)"):
        ProxyConfig(upstream="http://127.0.0.1:1", data_dir=Path("d"), max_loaded_conversations=0)


def test_without_uvloop_auto_falls_back_and_asking_for_it_says_what_to_install(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['uvloop'] = None\n"
            "from ctxfold.cli.serve import event_loop_factory\n"
            "assert event_loop_factory('auto') is None and event_loop_factory('asyncio') is None\n"
            "from ctxfold.cli import main\n"
            f"sys.exit(main(['serve', '--upstream', 'http://127.0.0.1:1', '--event-loop', 'uvloop', "
            f"'--data-dir', {str(tmp_path)!r}]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ctxfold_env({}),
                         check=False)
    assert out.returncode == 2, out.stderr
    assert "uvloop is not installed" in out.stderr and "Traceback" not in out.stderr


def test_without_aiohttp_the_cli_works_and_serve_says_what_to_install() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['aiohttp'] = None\n"
            "from ctxfold.cli import main\n"
            "assert main(['serve', '--help']) == 0\n")
    env = ctxfold_env({})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0 and "ctxfold serve --upstream" in out.stdout, out.stderr
    code = ("import sys; sys.modules['aiohttp'] = None\n"
            "from ctxfold.cli import main\n"
            "sys.exit(main(['serve', '--upstream', 'http://127.0.0.1:1']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 4
    assert "pip install 'ctxfold[serve]'" in out.stderr and "Traceback" not in out.stderr


# -- the window guard in the proxy ------------------------------------------------------------------------

def test_a_request_whose_max_tokens_cannot_fit_is_refused_before_the_upstream(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, url = upstream
    _, srv = start_proxy(url, tmp_path / "data", compact=CompactConfig(context_tokens=4096))
    try:
        before = len(up.received)
        r = post(srv.url, chat(("user", "hello"), max_tokens=5000))
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["message"].startswith("the request cannot fit the 4,096-token context window: ")
        assert "reply reserve 5,000" in error["message"]
        assert len(up.received) == before  # said before the request, never after
        r = post(srv.url, chat(("user", "hello"), max_completion_tokens=1000))  # the same conversation, asking less
        assert r.status_code == 200
    finally:
        srv.close()


def test_a_pasted_file_larger_than_the_window_goes_upstream_as_a_marker(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, url = upstream
    _, srv = start_proxy(url, tmp_path / "data", compact=CompactConfig(context_tokens=4096))
    try:
        r = post(srv.url, chat(("user", "Here is the file:\n" + "line of the file\n" * 4000), max_tokens=256))
        assert r.status_code == 200
        sent = up.received[-1]["messages"][-1]["content"]
        assert sent.startswith("[ctxfold archived id=") and len(sent) < 2000
    finally:
        srv.close()


def _tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": f"tool_{k}", "description": f"Tool number {k}: looks things up in the catalogue " * 3,
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"},
                                                        "limit": {"type": "integer"}}, "required": ["query"]}}}
        for k in range(n)]


def test_tools_added_after_the_first_request_are_counted(tmp_path: Path) -> None:
    """80 tools arrive with the conversation's ninth request, when its history is already long: every
    request that goes out still fits, counted with the tools it offers."""
    from ctxfold.serve.testing import deepseek_counter

    up = ScriptedUpstream(context_tokens=16_000, count_tokens=deepseek_counter())
    with BackgroundServer(up.app()) as upstream_srv:
        _, srv = start_proxy(upstream_srv.url, tmp_path / "data",
                             compact=CompactConfig(context_tokens=16_000, reply_reserve_tokens=1024))
        try:
            turns: list[tuple[str, str]] = []
            for k in range(24):
                turns.append(("user", f"question {k}: " + "please read this section of the manual. " * 120))
                body = chat(*turns, tools=_tools(80) if k >= 8 else [], max_tokens=256)
                r = post(srv.url, body)
                assert r.status_code == 200, r.text
                turns.append(("assistant", r.json()["choices"][0]["message"]["content"]))
        finally:
            srv.close()
    assert up.rejected_over_context == 0
    assert max(up.prompt_tokens_seen) <= 16_000 - 256


def test_a_large_new_message_is_counted_off_the_event_loop() -> None:
    """An exact count of a 100 kB tool output takes milliseconds: the other conversations on the loop
    must not wait it out, so it goes to the worker thread even when nothing can fire."""
    from ctxfold.chat.messages import Conversation, Message, Role
    from ctxfold.compaction.compactor import Compactor
    from ctxfold.compaction.config import CompactConfig
    from ctxfold.serve.compaction import INLINE_NEW_BYTES, CompactionStep

    c = Compactor(Conversation(messages=[Message(Role.USER, "hi")]),
                  config=CompactConfig.preset("both", context_tokens=1_000_000))
    small = [Message(Role.USER, "x" * 1000)]
    large = [Message(Role.USER, "x" * (INLINE_NEW_BYTES + 1))]
    assert c.quiet(large)  # nothing can fire in a million-token window
    assert CompactionStep.inline(c, small)
    assert not CompactionStep.inline(c, large)
