"""How the proxy reads an Anthropic messages or a Responses request: each message converted once per process.

A client sends its whole history with every request. Converting every message again made a request of
400 messages cost 18 ms of the event loop (Anthropic's messages; Responses items: 5 ms; chat completions,
which routes on the client's own dicts: 0.5 ms). The conversions are kept by the message's JSON
(:mod:`ctxfold.serve.memo`): a request converts only what it is the first to send.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ctxfold.serve.anthropic import ANTHROPIC, _converted
from ctxfold.serve.memo import ConversionMemo
from ctxfold.serve.request import BadRequest


def history(turns: int, *, breakpoint_at: int | None = None) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "fix the failing test"}]
    for i in range(turns):
        msgs.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"step {i}", "signature": f"sig{i}"},
            {"type": "tool_use", "id": f"t{i}", "name": "bash", "input": {"command": f"cat f{i}.py"}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"contents of f{i}.py\n" * 5},
            {"type": "text", "text": f"note {i}"}]})
    if breakpoint_at is not None:
        blocks = msgs[breakpoint_at]["content"]
        blocks[-1] = {**blocks[-1], "cache_control": {"type": "ephemeral"}}
    return msgs


def body(msgs: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 64, "system": "You fix code.", "messages": msgs}).encode()


def test_each_message_is_converted_once_and_a_moved_breakpoint_changes_nothing_routing_sees() -> None:
    first = ANTHROPIC.parse(body(history(30, breakpoint_at=60)))
    misses = _converted.misses
    # The next request: the same history, two messages more, the breakpoint moved to the newest one.
    again = ANTHROPIC.parse(body(history(31, breakpoint_at=62)))
    # Converted: the two new messages (the newest with its breakpoint) and the one whose breakpoint
    # went, nothing else.
    assert _converted.misses - misses == 3
    n = len(first.messages)
    assert again.messages[:n] == first.messages  # routing compares these: the breakpoint is not in them
    assert again.units is not None and first.units is not None and again.units[:n] == first.units
    # Ids are positions, given to the new units only, as a fresh parse would number them.
    new = ANTHROPIC.new_messages(again, n)
    assert [m.id for m in new] == [f"m{1 + n + k}" for k in range(len(new))]
    assert [m.role.value for m in new] == ["assistant", "tool", "user"]
    # The client's own blocks go back out as sent (thinking and its signature, the breakpoint).
    assert again.sources.raw[62]["content"][-1]["cache_control"] == {"type": "ephemeral"}


def test_a_bad_message_is_refused_every_time_it_comes() -> None:
    bad = [*history(2), {"role": "user", "content": [{"type": "tool_result"}]}]
    for _ in range(2):  # a refusal is not kept: the same message is refused again, naming where
        with pytest.raises(BadRequest, match=r"messages\[5\]"):
            ANTHROPIC.parse(body(bad))


def test_the_memo_keeps_to_its_bound_least_recently_used_first_out() -> None:
    memo: ConversionMemo[int] = ConversionMemo(max_key_bytes=10)
    memo.put(b"aaaa", 1)
    memo.put(b"bbbb", 2)
    assert memo.get(b"aaaa") == 1  # now the most recently used
    memo.put(b"cccc", 3)  # 12 bytes: the least recently used goes
    assert memo.get(b"bbbb") is None and memo.get(b"aaaa") == 1 and memo.get(b"cccc") == 3
    memo.put(b"x" * 11, 4)  # larger than the bound alone: not kept
    assert len(memo) == 2


def test_a_responses_request_converts_each_unit_once() -> None:
    """The same for the Responses API: a unit (a message, a call's output, the assistant's items between
    them) is converted the first time it comes; ids are given to the new units only."""
    from ctxfold.serve.responses import RESPONSES
    from ctxfold.serve.responses import _converted as converted

    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "fix it"}]
    for i in range(20):
        items += [{"type": "reasoning", "id": f"rs{i}", "summary": [{"type": "summary_text", "text": f"step {i}"}]},
                  {"type": "function_call", "call_id": f"c{i}", "name": "bash", "arguments": f'{{"cmd": "ls {i}"}}'},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": f"f{i}.py"}]

    def parse(n: int) -> Any:
        return RESPONSES.parse(json.dumps({"model": "m", "instructions": "You fix code.", "input": items[:n]}).encode())

    first = parse(1 + 3 * 19)
    misses = converted.misses
    again = parse(1 + 3 * 20)
    assert converted.misses - misses == 2  # the new assistant unit and the new output
    n = len(first.messages)
    assert again.messages[:n] == first.messages and again.units[:n] == first.units
    assert [m.id for m in RESPONSES.new_messages(again, n)] == [f"m{1 + n}", f"m{2 + n}"]
