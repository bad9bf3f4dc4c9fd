"""search_archive through the proxy: the model's search calls answered in chat completions and Messages,
JSON and streamed, within the request's recall budget; tenants apart; an archive in Redis searched from
another replica."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.compaction.archive import SEARCH_ARCHIVE
from ctxfold.serve import ProxyApp
from ctxfold.serve.sse import AnswerAssembler, SseReader
from ctxfold.serve.testing import ScriptedUpstream
from helpers.proxy_helpers import chat, post, start_proxy, started_proxies
from helpers.sdk_clients import anthropic_client, openai_client

pytest.importorskip("regex")

# The client offers a tool of its own: the proxy then offers its recall tools beside it.
TOOLS = [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
SECRET = "Traceback: KeyError 'zanzibar-42' in loader.py line 17\n" * 30


def search_call(call_id: str, query: str, **args: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": SEARCH_ARCHIVE, "arguments": json.dumps({"query": query, **args})}}


def answered(session: Any, answers: int) -> None:
    """Wait until ``session`` holds ``answers`` assistant messages: an answer is recorded just after the
    client has it, and a request sent before that would start a branch of its own."""
    deadline = time.monotonic() + 10
    while sum(m.role.value == "assistant" for m in session.compactor.originals) < answers:
        assert time.monotonic() < deadline, "the answer was never recorded"
        time.sleep(0.01)


def archived(app: ProxyApp, text: str, url: str, headers: dict[str, str] | None = None) -> str:
    """``text`` put in the archive of the conversation that opened with "start" (the one loaded), and
    committed by that conversation's next request."""
    session = app.sessions.loaded()[-1]
    answered(session, 1)
    aid = session.compactor.store.put(text)
    post(url, chat(("user", "start"), ("assistant", "echo: start"), ("user", "next")), headers=headers)
    answered(session, 2)
    return aid


def searched_through(up: ScriptedUpstream, url: str, query: str, *, headers: dict[str, str] | None = None,
                     stream: bool = False) -> tuple[str, str, dict[str, Any]]:
    """The conversation goes on, its model searches for ``query`` and then answers: (what the client
    got, the tool answer the proxy sent upstream, the first upstream request)."""
    answers = iter([{"role": "assistant", "content": None, "tool_calls": [search_call("s1", query)]},
                    {"role": "assistant", "content": "found it"}])
    up.answer_for = lambda body: next(answers)  # type: ignore[method-assign]
    n = len(up.received)
    body = chat(("user", "start"), ("assistant", "echo: start"), ("user", "next"), ("assistant", "echo: next"),
                ("user", "what was the error?"), stream=stream, tools=TOOLS)
    if stream:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=30) as r:
            raw = b"".join(r.iter_raw())
        # The client saw no search call: the held events of that round never reached it.
        assert SEARCH_ARCHIVE.encode() not in raw
        asm = AnswerAssembler()
        for _, payload in SseReader().feed(raw):
            asm.add(payload)
        got = str(asm.message()["content"])
        assert "tool_calls" not in asm.message()
    else:
        got = post(url, body, headers=headers).json()["choices"][0]["message"]["content"]
    assert len(up.received) == n + 2
    tool_answer = up.received[n + 1]["messages"][-1]
    assert tool_answer["role"] == "tool" and tool_answer["tool_call_id"] == "s1"
    return got, str(tool_answer["content"]), up.received[n]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_search_calls_are_answered_by_the_proxy(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], stream: bool) -> None:
    up, _ = upstream
    app, url = proxy
    post(url, chat(("user", "start")))
    aid = archived(app, SECRET, url)
    got, tool_answer, first = searched_through(up, url, "zanzibar-42", stream=stream)
    assert got == "found it"
    names = [t["function"]["name"] for t in first["tools"]]
    assert names[-2:] == ["read_archive", SEARCH_ARCHIVE]
    assert tool_answer.startswith('[search_archive "zanzibar-42" (literal, any case): 1 matching texts of ')
    assert f"1. id={aid} tool output, {len(SECRET)} chars, 30 matches" in tool_answer
    assert app.metrics.recall_calls.get() == 1


def test_a_search_answer_counts_against_the_requests_recall_budget(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    """Two searches in one answer with room for one: the second is refused and says why."""
    up, upstream_url = upstream
    app, srv = start_proxy(upstream_url, tmp_path / "data", max_recall_chars=1500)
    try:
        post(srv.url, chat(("user", "start")))
        archived(app, SECRET, srv.url)
        answers = iter([{"role": "assistant", "content": None,
                         "tool_calls": [search_call("s1", "zanzibar"), search_call("s2", "loader.py")]},
                        {"role": "assistant", "content": "done"}])
        up.answer_for = lambda body: next(answers)  # type: ignore[method-assign]
        body = chat(("user", "start"), ("assistant", "echo: start"), ("user", "next"), ("assistant", "echo: next"),
                    ("user", "search twice"), tools=TOOLS)
        assert post(srv.url, body).json()["choices"][0]["message"]["content"] == "done"
        first, second = up.received[-1]["messages"][-2:]
        assert first["content"].startswith("[search_archive") and len(first["content"]) <= 1500
        assert second["content"].startswith("Not searched: this answer's read_archive output already reached its "
                                            "limit of 1500 characters")
    finally:
        srv.close()


def test_tenants_search_only_their_own_archive(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, upstream_url = upstream
    app, srv = start_proxy(upstream_url, tmp_path / "data")
    a, b = {"Authorization": "Bearer sk-tenant-a-secret"}, {"Authorization": "Bearer sk-tenant-b-secret"}
    try:
        post(srv.url, chat(("user", "start")), headers=a)
        aid = archived(app, SECRET, srv.url, headers=a)
        post(srv.url, chat(("user", "start")), headers=b)  # the same opening: B's own session and archive
        archived(app, "tenant B's own output, about something else\n", srv.url, headers=b)
        _, seen_by_b, _ = searched_through(up, srv.url, "zanzibar", headers=b)
        assert "Traceback" not in seen_by_b and aid not in seen_by_b
        assert seen_by_b.startswith('[search_archive "zanzibar" (literal, any case): 0 matching texts of 1;')
        # Even a pattern that matches anything finds only B's.
        _, everything, _ = searched_through(up, srv.url, "e", headers=b)
        assert "1 matching texts of 1" in everything and aid not in everything
        _, seen_by_a, _ = searched_through(up, srv.url, "zanzibar", headers=a)
        assert f"id={aid}" in seen_by_a
    finally:
        srv.close()


def test_the_messages_api_search_is_answered_by_the_proxy(upstream: tuple[ScriptedUpstream, str],
                                                        tmp_path: Path) -> None:
    pytest.importorskip("anthropic")
    up, upstream_url = upstream
    app, srv = start_proxy(upstream_url, tmp_path / "data")
    try:
        c = anthropic_client(srv.url)
        c.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "start"}])
        history: list[dict[str, Any]] = [{"role": "user", "content": "start"},
                                         {"role": "assistant", "content": "echo: start"},
                                         {"role": "user", "content": "next"}]
        session = app.sessions.loaded()[-1]
        answered(session, 1)
        aid = session.compactor.store.put(SECRET)
        c.messages.create(model="m", max_tokens=64, messages=history)  # commits the archived output
        answered(session, 2)
        history += [{"role": "assistant", "content": "echo: next"}, {"role": "user", "content": "what failed?"}]
        for stream in (False, True):
            up.messages_script = [
                [{"type": "text", "text": "let me search"},
                 {"type": "tool_use", "id": "q1", "name": SEARCH_ARCHIVE, "input": {"query": "KeyError 'zanzibar"}}],
                [{"type": "text", "text": "loader.py line 17"}]]
            n = len(up.received)
            body: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": history,
                                    "tools": [{"name": "noop", "input_schema": {"type": "object"}}]}
            if stream:
                with c.messages.stream(**body) as s:
                    final = s.get_final_message()
                assert [b.text for b in final.content] == ["let me search", "loader.py line 17"]
            else:
                final = c.messages.create(**body)
                assert [b.text for b in final.content] == ["loader.py line 17"]
            assert len(up.received) == n + 2
            first, second = up.received[n], up.received[n + 1]
            assert [t["name"] for t in first["tools"]][-2:] == ["read_archive", SEARCH_ARCHIVE]
            result = second["messages"][-1]["content"][0]
            assert result["type"] == "tool_result" and result["tool_use_id"] == "q1" and "is_error" not in result
            assert result["content"].startswith('[search_archive "KeyError \'zanzibar" (literal, any case): 1 matching')
            assert f"id={aid}" in result["content"]
    finally:
        srv.close()


@pytest.fixture()
def two_replicas(upstream: tuple[ScriptedUpstream, str], tmp_path: Path,
                 redis_server: Any) -> Iterator[list[tuple[ProxyApp, str]]]:
    pytest.importorskip("redis")
    key_file = tmp_path / "tenant.key"  # one tenant key for both: a tenant is the same on every replica
    key_file.write_text("3" * 64)
    with started_proxies(upstream[1], tmp_path, 2, store_url=redis_server.url, lease_ms=2000,
                         tenant_key_file=key_file) as apps:
        yield apps


def test_an_archive_in_redis_is_searched_from_another_replica(upstream: tuple[ScriptedUpstream, str],
                                                               two_replicas: list[tuple[ProxyApp, str]]) -> None:
    """Replica 0 archives; replica 1, whose index is a cache of its own process, lists the archive in
    Redis and indexes what it lacks."""
    up, _ = upstream
    (app0, url0), (_, url1) = two_replicas
    key = {"Authorization": "Bearer sk-tenant-r"}
    post(url0, chat(("user", "start")), headers=key)
    aid = archived(app0, SECRET, url0, headers=key)
    _, tool_answer, _ = searched_through(up, url1, "zanzibar-42", headers=key)
    assert f"1. id={aid} tool output" in tool_answer


def test_the_responses_api_search_is_answered_by_the_proxy(upstream: tuple[ScriptedUpstream, str],
                                                         tmp_path: Path) -> None:
    pytest.importorskip("openai")
    up, upstream_url = upstream
    app, srv = start_proxy(upstream_url, tmp_path / "data")
    try:
        c = openai_client(f"{srv.url}/v1")
        c.responses.create(model="m", input="start")
        aid = app.sessions.loaded()[-1].compactor.store.put(SECRET)
        history: list[dict[str, Any]] = [
            {"role": "user", "content": "start"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "echo: start"}]},
            {"role": "user", "content": "what failed?"}]
        tools = [{"type": "function", "name": "noop", "parameters": {"type": "object"}}]
        for stream in (False, True):
            up.responses_script = [
                [{"type": "function_call", "call_id": "q1", "name": SEARCH_ARCHIVE,
                  "arguments": json.dumps({"query": "zanzibar-\\d+", "regex": True})}],
                [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "loader.py"}]}]]
            n = len(up.received)
            if stream:
                with c.responses.stream(model="m", input=history, tools=tools) as s:
                    events = list(s)
                    final = s.get_final_response()
                assert not any(e.type == "response.output_item.added" and e.item.type == "function_call"
                               for e in events)
            else:
                final = c.responses.create(model="m", input=history, tools=tools)
            assert final.output_text == "loader.py"
            assert len(up.received) == n + 2
            result = up.received[n + 1]["input"][-1]
            assert result["type"] == "function_call_output" and result["call_id"] == "q1"
            assert result["output"].startswith('[search_archive "zanzibar-\\\\d+" (regex, any case): 1 matching')
            assert f"1. id={aid} tool output, {len(SECRET)} chars, 30 matches" in result["output"]
    finally:
        srv.close()
