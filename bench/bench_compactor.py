"""The compactor's per-request overhead when nothing fires, beside the check Datus makes per request.

A 2,000-message agent conversation (200 user turns of four tool rounds each) under a window so
large that no pass fires. ``before_request`` is measured both as a tool continuation (the common
case: O(1) occupancy from the ledger) and at a turn start (the turn-start archive check runs over
what the window slid past). The baseline is Datus's estimate before every model call: chars/4 of
``json.dumps`` of every item plus the reply reserve.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.tokens.counting import load_counter

GROUP = "compactor before_request, 2,000 messages, nothing fires"


def conversation() -> Conversation:
    msgs = []
    for t in range(200):
        msgs.append(Message(Role.USER, f"question {t}: what does module {t} do?", id=f"u{t}"))
        for k in range(4):
            cid = f"c{t}_{k}"
            msgs.append(Message(Role.ASSISTANT, "", id=cid + "a",
                                tool_calls=(ToolCall(cid, "bash", json.dumps({"command": f"cat mod{t}_{k}.py"})),)))
            msgs.append(Message(Role.TOOL, f"def f{k}():\n    return {t}\n" * 12, id=cid + "r", tool_call_id=cid,
                                name="bash"))
        msgs.append(Message(Role.ASSISTANT, f"module {t} defines four functions", id=f"d{t}"))
    assert len(msgs) == 2000
    return Conversation(msgs, id="bench", system="You are a coding agent.")


@pytest.fixture(scope="module")
def compactor() -> Compactor:
    c = Compactor(conversation(), config=CompactConfig.preset("both", context_tokens=10**8),
                  counter=load_counter("estimate:deepseek-v4"))
    c.before_request()
    return c


@pytest.mark.benchmark(group=GROUP)
def test_ctxfold_before_request_tool_continuation(benchmark: Any, compactor: Compactor) -> None:
    benchmark.extra_info["role"] = "ctxfold"
    assert benchmark(compactor.before_request) is None


@pytest.mark.benchmark(group=GROUP)
def test_ctxfold_before_request_turn_start(benchmark: Any, compactor: Compactor) -> None:
    benchmark.extra_info["role"] = "ctxfold"
    turn = iter(range(10**9))

    def new_turn() -> tuple[tuple[Any, ...], dict[str, Any]]:
        # A new user turn before each round (not timed), so every timed call is a turn start.
        i = next(turn)
        compactor.append(Message(Role.ASSISTANT, "ok", id=f"ok{i}"), Message(Role.USER, f"next {i}", id=f"n{i}"))
        return (), {}

    benchmark.pedantic(compactor.before_request, setup=new_turn, rounds=300, iterations=1)


@pytest.mark.benchmark(group=GROUP)
def test_baseline_datus_chars4_estimate_per_request(benchmark: Any) -> None:
    benchmark.extra_info["role"] = "baseline"
    conv = conversation()
    items = [{"role": m.role.value, "content": m.text,
              **({"tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]}
                 if m.tool_calls else {})} for m in conv.messages]

    def estimate() -> int:
        return sum(len(json.dumps(it, ensure_ascii=False, default=str)) for it in items) // 4 + 8192

    assert benchmark(estimate) > 0
