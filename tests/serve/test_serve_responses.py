"""OpenAI's Responses API through the proxy (``/v1/responses``), with the official SDK as the client,
in front of the scripted upstream on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.chat.formats.responses import units_of
from ctxfold.chat.integrity import count_orphans
from ctxfold.chat.messages import Conversation
from ctxfold.compaction.archive import make_marker
from ctxfold.compaction.config import CompactConfig
from ctxfold.serve import ProxyApp
from ctxfold.serve.responses import RESPONSES
from ctxfold.serve.testing import ScriptedUpstream
from helpers.proxy_helpers import metric, settle, start_proxy
from helpers.sdk_clients import openai_client

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "name": "bash", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def client(url: str) -> Any:
    return openai_client(f"{url}/v1")


@pytest.fixture()
def pair(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> Iterator[tuple[ScriptedUpstream, ProxyApp, str]]:
    p, srv = start_proxy(upstream[1], tmp_path / "data")
    try:
        yield upstream[0], p, srv.url
    finally:
        srv.close()


@pytest.fixture()
def small(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> Iterator[tuple[ScriptedUpstream, ProxyApp, str]]:
    """A proxy compacting to a window of 2,048 tokens."""
    p, srv = start_proxy(upstream[1], tmp_path / "data", compact=CompactConfig(context_tokens=2048))
    try:
        yield upstream[0], p, srv.url
    finally:
        srv.close()


def reasoning(turn: int) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{turn}", "summary": [{"type": "summary_text", "text": f"plan {turn}"}],
            "encrypted_content": f"gAAAA{turn:04d}" + "Zm9v" * 40}


def tool_turn(turn: int, output_chars: int = 1200) -> list[dict[str, Any]]:
    """One user turn of an agent: the request, reasoning and a call, its output."""
    return [{"role": "user", "content": f"step {turn}: run it"}, reasoning(turn),
            {"type": "function_call", "id": f"fc_{turn}", "call_id": f"call_{turn}", "name": "bash",
             "arguments": json.dumps({"cmd": f"cat f{turn}"})},
            {"type": "function_call_output", "call_id": f"call_{turn}", "output": f"output {turn} " + "x" * output_chars}]


def as_input(output: list[Any]) -> list[dict[str, Any]]:
    """An answer's output items as the client sends them back."""
    return [item.model_dump(exclude_none=True) for item in output]


def test_json_and_stream_answers_come_back(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, app, url = pair
    c = client(url)
    r = c.responses.create(model="m", instructions="Be terse.", input="hi")
    assert r.output_text == "echo: hi" and r.usage.input_tokens == up.prompt_tokens_seen[-1]
    assert up.received[-1]["instructions"] == "Be terse." and up.received[-1]["input"] == "hi"
    events = list(c.responses.create(model="m", input=[{"role": "user", "content": "hello there"}], stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "echo: hello there"
    with c.responses.stream(model="m", input="hello again") as s:
        final = s.get_final_response()
    assert final.output_text == "echo: hello again"
    settle(app)
    assert len(app.sessions.loaded()) == 3  # three conversations, each recorded with its answer
    for session in app.sessions.loaded():
        assert [m.role.value for m in session.compactor.originals] == ["user", "assistant"]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_stream_is_relayed_byte_for_byte(pair: tuple[ScriptedUpstream, ProxyApp, str],
                                           tools: list[Any] | None) -> None:
    """With the recall tool offered (a request with tools) or not, the events are the upstream's bytes."""
    up, _, url = pair
    body: dict[str, Any] = {"model": "m", "input": "count to three", "stream": True}
    if tools:
        body["tools"] = tools
        up.responses_script = [[{"type": "reasoning", "summary": []},
                                {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": '{"cmd": "ls"}'}]]
    with httpx.stream("POST", f"{url}/v1/responses", json=body, headers={"Authorization": "Bearer k"}) as r:
        got = b"".join(r.iter_bytes())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert got == up.sent[-1]
    if tools:  # the recall tools went upstream in the Responses function-tool shape
        assert [t["name"] for t in up.received[-1]["tools"][-2:]] == ["read_archive", "search_archive"]
        assert all(t["type"] == "function" and "function" not in t for t in up.received[-1]["tools"][-2:])


def test_a_tool_round_trip_continues_one_session(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    _, app, url = pair
    c = client(url)
    call = [reasoning(0), {"type": "function_call", "call_id": "call_0", "name": "bash", "arguments": '{"cmd": "ls"}'}]
    history: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    r = c.responses.create(model="m", tools=TOOLS, input=history, extra_body={"x_replay_answer": call})
    assert r.output[1].type == "function_call" and r.output[1].arguments == '{"cmd": "ls"}'
    settle(app)
    history += as_input(r.output) + [{"type": "function_call_output", "call_id": "call_0", "output": "a.txt"}]
    c.responses.create(model="m", tools=TOOLS, input=history)
    settle(app)
    assert len(app.sessions.loaded()) == 1
    originals = app.sessions.loaded()[0].compactor.originals
    assert [m.role.value for m in originals] == ["user", "assistant", "tool", "assistant"]
    assert originals[1].tool_calls[0].id == "call_0" and originals[1].reasoning == "plan 0"


def _check_sent(app: ProxyApp, sent: dict[str, Any], window_tokens: int) -> None:
    """The request within the window, no orphan, no call without its output."""
    units, _ = units_of(sent["input"])
    conv = Conversation(messages=units, system=sent.get("instructions"), tools=RESPONSES.tool_specs(sent))
    assert app.compactors.count_view(conv, units) <= window_tokens
    assert count_orphans(units) == 0
    calls = {i["call_id"] for i in sent["input"] if i.get("type") == "function_call"}
    outputs = {i["call_id"] for i in sent["input"] if i.get("type") == "function_call_output"}
    assert calls == outputs


def test_compaction_keeps_pairs_and_reasoning_whole(small: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, app, url = small
    c = client(url)
    history: list[dict[str, Any]] = []
    sent_reasoning: dict[str, dict[str, Any]] = {}
    for turn in range(12):
        history += tool_turn(turn)
        sent_reasoning[f"rs_{turn}"] = reasoning(turn)
        r = c.responses.create(model="m", tools=TOOLS, instructions="Be terse.", input=history)
        history += as_input(r.output)
    for body in up.received:
        _check_sent(app, body, 2048)
        items = body["input"]
        for k, item in enumerate(items):
            if item.get("type") == "reasoning":  # verbatim, and followed by the call it came with
                assert item == sent_reasoning[item["id"]]
                assert items[k + 1] == next(i for i in history if i.get("call_id") == f"call_{item['id'][3:]}"
                                            and i.get("type") == "function_call")
    assert len(json.dumps(up.received[-1]["input"])) < len(json.dumps(history))  # compacted


def test_compaction_items_are_left_intact(small: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, _, url = small
    c = client(url)
    compaction = {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAAAB" + "c2VjcmV0" * 30}
    head = [{"role": "developer", "content": "You run shell commands."},
            {"role": "user", "content": "the task so far"}, compaction]
    history: list[dict[str, Any]] = list(head)
    for turn in range(10):
        history += tool_turn(turn)
        r = c.responses.create(model="m", tools=TOOLS, input=history)
        history += as_input(r.output)
    for body in up.received:
        assert body["input"][:3] == head  # the compaction item and all before it, as sent, first
        assert sum(1 for i in body["input"] if i.get("type") == "compaction") == 1
    assert len(up.received[-1]["input"]) < len(history)  # what follows it was compacted


def test_previous_response_id_is_relayed_and_labelled(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, app, url = pair
    c = client(url)
    for extra in ({"previous_response_id": "resp_1"}, {"conversation": "conv_1"}):
        raw = c.responses.with_raw_response.create(model="m", input=[{"role": "user", "content": "go on"}], **extra)
        assert raw.parse().output_text == "echo: go on"
        assert "not compacted" in raw.headers["x-ctxfold-warning"]
        assert next(iter(extra)) in raw.headers["x-ctxfold-warning"]
        assert up.received[-1] == {"model": "m", "input": [{"role": "user", "content": "go on"}], **extra}
    assert app.sessions.loaded() == []  # nothing stored: the history is upstream
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "ctxfold_bad_requests_total", reason="upstream_state") == 2


def test_usage_calibrates_the_estimate(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, upstream_url = upstream
    up.cached_tokens = 100
    app, srv = start_proxy(upstream_url, tmp_path / "data", compact=CompactConfig(context_tokens=4096))
    try:
        c = client(srv.url)
        history: list[dict[str, Any]] = []
        for turn in range(4):
            history += tool_turn(turn, output_chars=600)
            raw = c.responses.with_raw_response.create(model="m", tools=TOOLS, input=history)
            history += as_input(raw.parse().output)
            settle(app)
        session = app.sessions.loaded()[0]
        answer = session.compactor.originals[-1]
        assert answer.usage is not None and answer.usage.prompt_tokens == up.prompt_tokens_seen[-1]
        assert answer.usage.cached_prompt_tokens == 100 and answer.usage.completion_tokens is not None
        # The upstream counts otherwise than ctxfold: the factor moved toward its figures over ctxfold's.
        observed = up.prompt_tokens_seen[-1] / int(raw.headers["x-ctxfold-prompt-tokens"])
        assert session.calibration != 1.0
        assert (session.calibration - 1.0) * (observed - 1.0) > 0
    finally:
        srv.close()


def test_the_recall_tool_is_answered_by_the_proxy(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, app, url = pair
    c = client(url)
    c.responses.create(model="m", input="start")
    session = app.sessions.loaded()[0]
    big = "line of archived output\n" * 200
    aid = session.compactor.store.put(big)
    history = [{"role": "user", "content": "start"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "echo: start"}]},
               {"role": "user", "content": "look"},
               {"type": "function_call", "call_id": "t0", "name": "bash", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "t0", "output": make_marker(aid, big, preview_chars=40)}]
    for stream in (False, True):
        up.responses_script = [
            [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
             {"type": "function_call", "call_id": "r1", "name": "read_archive",
              "arguments": json.dumps({"id": aid, "limit": 50})}],
            [{"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "the archive says: line of archived output"}]}]]
        n = len(up.received)
        if stream:
            with c.responses.stream(model="m", input=history) as s:
                events = list(s)
                final = s.get_final_response()
            texts = [e.text for e in events if e.type == "response.output_text.done"]
            # The client sees one response: the first round's text, then the second round's, numbered on.
            assert texts == ["let me look", "the archive says: line of archived output"]
            added = [e.output_index for e in events if e.type == "response.output_item.added"]
            assert added == [0, 1]
            seqs = [e.sequence_number for e in events]
            assert seqs == sorted(set(seqs))
            assert final.id == events[0].response.id
            assert not any(e.type == "response.output_item.added" and e.item.type == "function_call" for e in events)
        else:
            final = c.responses.create(model="m", input=history)
        assert final.output_text == "the archive says: line of archived output"
        assert len(up.received) == n + 2
        first, second = up.received[n], up.received[n + 1]
        assert any(t.get("name") == "read_archive" and t["type"] == "function" for t in first["tools"])
        result = second["input"][-1]
        assert result["type"] == "function_call_output" and result["call_id"] == "r1"
        assert result["output"].startswith(f"[read_archive id={aid} chars 0-50 of {len(big)}")
        assert second["input"][-2]["type"] == "function_call" and second["input"][-2]["name"] == "read_archive"
    assert app.metrics.recall_calls.get() == 2


def test_errors_come_back_in_openais_shape(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, _, url = pair
    up.fail_status, up.fail_count = 500, 1
    with pytest.raises(openai.InternalServerError) as e:
        client(url).responses.create(model="m", input="hi")
    assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
    r = httpx.post(f"{url}/v1/responses", content=b'{"model": "m", "input": []}')
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == "input"
    r = httpx.post(f"{url}/v1/responses", json={"model": "m", "input": [{"type": "function_call", "name": "x"}]})
    assert r.status_code == 400 and "input[0]" in r.json()["error"]["message"]
    # A text part whose text is not a string is the client's mistake: a 400 that names it, not a forward.
    sent = len(up.received)
    r = httpx.post(f"{url}/v1/responses", json={"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": 5}]}]})
    assert r.status_code == 400 and "content[0].text must be a string" in r.json()["error"]["message"]
    assert len(up.received) == sent


def test_a_dead_upstream_and_a_cut_stream(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    _, srv = start_proxy("http://127.0.0.1:9", tmp_path / "dead")
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client(srv.url).responses.create(model="m", input="hi")
        assert e.value.status_code == 502 and e.value.body["code"] == "upstream_unreachable"
    finally:
        srv.close()
    up, upstream_url = upstream
    _, srv = start_proxy(upstream_url, tmp_path / "data")
    try:
        up.cut_after_chunks = 4
        events = list(client(srv.url).responses.create(model="m", input="tell me a story", stream=True))
        assert events[-1].type == "error" and events[-1].code == "upstream_stream_cut"
    finally:
        srv.close()


def test_a_client_that_leaves_mid_stream(pair: tuple[ScriptedUpstream, ProxyApp, str]) -> None:
    up, app, url = pair
    up.stall_after_chunks, up.stall_s = 3, 10.0
    with httpx.stream("POST", f"{url}/v1/responses", json={"model": "m", "input": "go", "stream": True}) as r:
        first = next(r.iter_bytes())
    assert b"response.created" in first
    deadline = time.monotonic() + 5
    while up.abandoned == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert up.abandoned == 1  # the proxy closed its upstream call: the engine stops generating
    # The conversation's message was kept; the proxy goes on serving it.
    r2 = client(url).responses.create(model="m", input="go")
    assert r2.output_text == "echo: go"
    assert any(m.text == "go" for s in app.sessions.loaded() for m in s.compactor.originals)
