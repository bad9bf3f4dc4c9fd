"""The Responses dialect's conversion of ``input`` items, on random inputs: nothing ctxfold does not
rewrite is lost, moved or edited."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxfold.chat.formats.openai import message_to_openai
from ctxfold.chat.formats.responses import units_of, written_items
from ctxfold.chat.messages import Role
from ctxfold.serve.responses import RESPONSES, Sources, head_length

text = st.text(max_size=30)
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": text}),
                 min_size=1, max_size=3)


def _message(role: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"type": st.just("message"), "role": st.just(role), "content": st.one_of(text, parts)})


reasoning = st.builds(lambda k, s, e: {"type": "reasoning", "id": f"rs_{k}", "encrypted_content": e,
                                       "summary": [{"type": "summary_text", "text": s}]},
                      st.integers(0, 10**6), text, st.text(min_size=1, max_size=40))
compaction = st.builds(lambda e: {"type": "compaction", "encrypted_content": e}, st.text(min_size=1, max_size=40))
unknown = st.builds(lambda k: {"type": "web_search_call", "id": f"ws_{k}", "status": "completed"}, st.integers(0, 99))


@st.composite
def call_pair(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A call and its output (function or custom tool), with what the model said before the call."""
    call_id = f"call_{draw(st.integers(0, 10**9))}"
    custom = draw(st.booleans())
    before = draw(st.lists(st.one_of(reasoning, _message("assistant"), unknown), max_size=2))
    if custom:
        call = {"type": "custom_tool_call", "call_id": call_id, "name": "patch", "input": draw(text)}
        out = {"type": "custom_tool_call_output", "call_id": call_id, "output": draw(text)}
    else:
        call = {"type": "function_call", "call_id": call_id, "name": "bash", "arguments": json.dumps({"x": draw(text)})}
        out = {"type": "function_call_output", "call_id": call_id, "output": draw(st.one_of(text, parts))}
    return [*before, call, out]


segment = st.one_of(st.lists(_message("user"), min_size=1, max_size=2), st.lists(_message("developer"), max_size=1),
                    call_pair(), st.lists(st.one_of(reasoning, _message("assistant")), min_size=1, max_size=2),
                    st.lists(compaction, min_size=1, max_size=1))


@st.composite
def inputs(draw: st.DrawFn) -> list[dict[str, Any]]:
    items = [i for seg in draw(st.lists(segment, min_size=1, max_size=8)) for i in seg]
    return items or [{"role": "user", "content": "hi"}]


def _parse(items: list[dict[str, Any]]) -> tuple[Any, Sources]:
    parsed = RESPONSES.parse(json.dumps({"model": "m", "input": items}).encode())
    assert isinstance(parsed.sources, Sources)
    return parsed, parsed.sources


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs())
def test_the_items_round_trip_whole(items: list[dict[str, Any]]) -> None:
    parsed, sources = _parse(items)
    units = parsed.units or []
    assert len(units) == len(sources.items_of)
    # Every item is in exactly one place, in order: the head, then each unit's items.
    assert sources.head + [i for unit in sources.items_of for i in unit] == items
    # The view as sent goes out as the client's items, untouched.
    body = RESPONSES.outgoing_messages(parsed, parsed.system, units, range(len(units)), units)
    assert body["input"] == items


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs(), st.data())
def test_rewritten_units_never_edit_what_ctxfold_does_not_write(items: list[dict[str, Any]], data: st.DataObject
                                                                ) -> None:
    parsed, sources = _parse(items)
    units = list(parsed.units or [])
    rewritten = data.draw(st.sets(st.integers(0, max(0, len(units) - 1)), max_size=len(units)))
    view = [replace(m, content="[archived]") if k in rewritten and m.role is Role.TOOL
            else replace(m) if k in rewritten else m for k, m in enumerate(units)]
    out = RESPONSES.outgoing_messages(parsed, parsed.system, view, range(len(units)), units)["input"]
    n = len(sources.head)
    assert out[:n] == items[:n]  # the head, compaction items included, as sent
    compactions = [i for i in items if i.get("type") == "compaction"]
    assert [i for i in out if i.get("type") == "compaction"] == compactions
    for item in out:  # a reasoning item goes out as it came, or not at all
        if item.get("type") == "reasoning":
            assert item in items
    at = n
    for k, unit_items in enumerate(sources.items_of):  # the units kept go out as they came, in order
        if k not in rewritten:
            assert out[at:at + len(unit_items)] == unit_items
            at += len(unit_items)
        else:  # as ctxfold writes it: no reasoning, no item ids
            written = written_items(view[k])
            assert out[at:at + len(written)] == written
            assert all("id" not in i and i.get("type") != "reasoning" for i in written)
            at += len(written)
    assert at == len(out)
    # Calls and their outputs stay paired.
    calls = {i["call_id"] for i in out if i.get("type") in ("function_call", "custom_tool_call")}
    outputs = {i["call_id"] for i in out if i.get("type") in ("function_call_output", "custom_tool_call_output")}
    assert calls == outputs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(reasoning, _message("assistant"), unknown,
                          st.builds(lambda k: {"type": "function_call", "call_id": f"c{k}", "name": "f",
                                               "arguments": "{}"}, st.integers(0, 99))), min_size=1, max_size=5))
def test_an_answer_parses_as_the_client_sends_it_back(output: list[dict[str, Any]]) -> None:
    """Routing compares the recorded answer with the next request's units: the same chat form."""
    recorded = RESPONSES.answer_message({"output": output}, {"input_tokens": 3}, "m9")
    assert recorded is not None
    units, _ = units_of(output)
    assert [message_to_openai(recorded, api=True)] == [message_to_openai(u, api=True) for u in units]


def test_the_head_runs_to_the_last_compaction_item() -> None:
    items = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"},
             {"type": "compaction", "encrypted_content": "x"}, {"role": "user", "content": "v"}]
    assert head_length(items) == 3
    assert head_length(items[:2]) == 1
    assert head_length([{"role": "user", "content": "u"}]) == 0
