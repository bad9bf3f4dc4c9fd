"""Round trips over generated conversations and small hand-written ones."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold.chat import formats
from ctxfold.chat.integrity import validate
from ctxfold.chat.messages import ContentPart, Conversation, Message, Role, ToolCall, ToolSpec, Usage

_text = st.text(min_size=0, max_size=30)
_nonempty = st.text(min_size=1, max_size=30)
_usage = st.builds(lambda p, c, k: Usage(prompt_tokens=p, completion_tokens=c, cached_prompt_tokens=k),
                   st.integers(0, 10**6), st.integers(0, 10**5), st.none() | st.integers(0, 1000))
_args = st.dictionaries(st.sampled_from(["path", "command", "n"]), st.integers() | _text, max_size=3).map(
    lambda d: json.dumps(d, ensure_ascii=False))
_parts = st.lists(_text, min_size=2, max_size=3).map(
    lambda ts: tuple(ContentPart(type="text", text=t, data={"type": "text"}) for t in ts))


@st.composite
def conversations(draw: st.DrawFn) -> Conversation:
    """Well-formed conversations: every call answered right after it, ids unique."""
    messages: list[Message] = []
    n_calls = 0
    for turn in range(draw(st.integers(1, 4))):
        messages.append(Message(role=Role.USER, content=draw(_text | _parts), id=f"u{turn}"))
        for step in range(draw(st.integers(0, 3))):
            k = draw(st.integers(0, 2))
            calls = tuple(ToolCall(id=f"call_{n_calls + j}", name=draw(st.sampled_from(["bash", "read"])),
                                   arguments=draw(_args)) for j in range(k))
            n_calls += k
            messages.append(Message(role=Role.ASSISTANT, content=draw(_text), id=f"a{turn}.{step}",
                                    tool_calls=calls, reasoning=draw(st.none() | _nonempty),
                                    usage=draw(st.none() | _usage)))
            for c in calls:
                messages.append(Message(role=Role.TOOL, content=draw(_text), id=f"r{c.id}", tool_call_id=c.id))
    tools = (ToolSpec(name="bash", description="run", parameters={"type": "object", "properties": {}}),)
    return Conversation(messages=messages, id="gen", system=draw(st.none() | _nonempty), tools=tools)


def _numbers(u: Usage | None) -> Any:
    return None if u is None else (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)


def _same(a: Conversation, b: Conversation) -> None:
    assert (a.system, a.tools) == (b.system, b.tools)
    assert len(a.messages) == len(b.messages)
    for x, y in zip(a.messages, b.messages, strict=True):
        assert (x.role, x.content, x.id, x.tool_call_id, x.reasoning) == (y.role, y.content, y.id, y.tool_call_id,
                                                                          y.reasoning)
        assert [(c.id, c.name, json.loads(c.arguments)) for c in x.tool_calls] == [
            (c.id, c.name, json.loads(c.arguments)) for c in y.tool_calls]
        assert _numbers(x.usage) == _numbers(y.usage)


@settings(max_examples=150, deadline=None)
@given(conversations(), st.sampled_from(formats.EXPORT_FORMATS))
def test_generated_conversations_round_trip(conv: Conversation, fmt: str) -> None:
    text = formats.dumps(conv, fmt)
    (again,) = formats.loads(text, fmt)
    _same(conv, again)
    assert validate(again) == validate(conv) == []
    assert formats.dumps(again, fmt) == text
    # Through the other format and back: still the same conversation.
    other = "anthropic" if fmt == "openai" else "openai"
    (via,) = formats.loads(formats.dumps(again, other), other)
    _same(conv, via)


@settings(max_examples=100, deadline=None)
@given(conversations())
def test_api_shape_has_only_fields_the_provider_accepts(conv: Conversation) -> None:
    oa = formats.dump(conv, "openai", api=True)
    for m in oa["messages"]:
        assert set(m) <= {"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"}
    an = formats.dump(conv, "anthropic", api=True)
    roles = [m["role"] for m in an["messages"]]
    assert set(roles) <= {"user", "assistant"}
    for m in an["messages"]:
        assert set(m) == {"role", "content"}
    # Consecutive results travel in one user message, as the Messages API wants them.
    for prev, nxt in zip(an["messages"], an["messages"][1:], strict=False):
        prev_results = isinstance(prev["content"], list) and prev["content"] and all(
            b["type"] == "tool_result" for b in prev["content"])
        next_results = isinstance(nxt["content"], list) and nxt["content"] and all(
            b["type"] == "tool_result" for b in nxt["content"])
        assert not (prev_results and next_results)


def test_openai_oddities_come_back_byte_for_byte() -> None:
    msgs = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "index": 0, "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": None, "name": "f"},
        {"role": "assistant", "reasoning_content": "hmm", "content": "ok", "usage": {"prompt_tokens": 9,
                                                                                     "completion_tokens": 2}},
    ]
    (conv,) = formats.loads(json.dumps(msgs), "openai")
    assert conv.system is None  # a developer message is kept as a message, with its role name
    assert conv.messages[0].role is Role.SYSTEM
    assert conv.messages[2].tool_calls[0].arguments == '{"a": 1}'
    assert conv.messages[4].usage == Usage(9, 2, None, {"prompt_tokens": 9, "completion_tokens": 2})
    out = formats.dump(conv, "openai")["messages"]
    for got, want in zip(out, msgs, strict=True):
        got.pop("id")
        assert got == want


@pytest.mark.parametrize("d", [
    {"role": "user", "content": "plain"}, {"role": "system", "content": ""}, {"role": "assistant", "content": "ok"},
    {"content": "x", "role": "user"},
])
def test_a_plain_message_parses_as_it_does_with_any_other_field(d: dict[str, Any]) -> None:
    from ctxfold.chat.formats.openai import message_from_openai

    # Role and text alone take a short path; a field the model ignores takes the general one.
    plain = message_from_openai(d, "m7")
    general = message_from_openai({**d, "name": None}, "m7")
    assert plain == general
    assert message_from_openai({**d, "id": "given"}, "m7").id == "given"


def test_anthropic_blocks_map_to_the_model() -> None:
    doc = {"system": [{"type": "text", "text": "be brief"}], "messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "id": "msg_1", "content": [
            {"type": "thinking", "thinking": "use ls", "signature": "sig"},
            {"type": "text", "text": "Listing."},
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}}],
         "usage": {"input_tokens": 5, "cache_read_input_tokens": 100, "output_tokens": 7}},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "denied", "is_error": True},
            {"type": "text", "text": "try again"}]},
    ]}
    (conv,) = formats.loads(json.dumps(doc))
    assert conv.source_format == "anthropic" and conv.system == "be brief"
    _, a, r, t = conv.messages
    assert (a.id, a.content, a.reasoning) == ("msg_1", "Listing.", "use ls")
    assert a.tool_calls[0].parsed_arguments() == {"command": "ls"}
    assert a.usage is not None and (a.usage.prompt_tokens, a.usage.cached_prompt_tokens) == (105, 100)
    assert (r.role, r.tool_call_id, r.is_error, r.content) == (Role.TOOL, "toolu_1", True, "denied")
    assert (t.role, t.content, t.is_user_turn) == (Role.USER, "try again", True)
    assert formats.dump(conv, "anthropic")["system"] == doc["system"]
    (again,) = formats.loads(formats.dumps(conv, "anthropic"))
    assert again.messages == conv.messages


def test_jsonl_of_conversations_yields_each() -> None:
    convs = [{"id": f"c{k}", "messages": [{"role": "user", "content": f"q{k}"},
                                          {"role": "assistant", "content": f"a{k}"}]} for k in range(3)]
    got = formats.loads("\n".join(json.dumps(c) for c in convs))
    assert [c.id for c in got] == ["c0", "c1", "c2"]
    assert [m.text for c in got for m in c.messages] == ["q0", "a0", "q1", "a1", "q2", "a2"]
    anth = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]},
                          {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n",
                                                             "input": {}}]}]}] * 2
    got = formats.loads("\n".join(json.dumps(c) for c in anth))
    assert [c.source_format for c in got] == ["anthropic", "anthropic"]
    assert got[0].messages[1].tool_calls[0].id == "t"
