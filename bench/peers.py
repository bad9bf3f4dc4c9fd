"""What people use today to cut a conversation to a budget, as the benchmarks call it.

- langchain-core's ``trim_messages`` (strategy "last", include_system), with and without
  ``start_on="human"``, over LangChain message objects built once from ctxfold messages;
- a plain numpy version of "oldest user turn that fits", vectorised over the whole conversation;
- the naive "drop the oldest messages until it fits", which starts wherever the budget runs out.

All of them see the same per-message token counts as ctxfold (``counts``), so the comparison is
about where they cut and what that costs, not about counting.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

import synth
from ctxfold.chat.messages import Message, Role


def to_langchain(messages: Sequence[Message]) -> list[Any]:
    """LangChain message objects, each with ``id`` = its index (the token counter's key)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    out: list[Any] = []
    for i, m in enumerate(messages):
        mid = str(i)
        if m.role is Role.SYSTEM:
            out.append(SystemMessage(m.text, id=mid))
        elif m.role is Role.USER:
            out.append(HumanMessage(m.text, id=mid))
        elif m.role is Role.ASSISTANT:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.arguments) if c.arguments else {}
                except ValueError:
                    args = {"raw": c.arguments}
                calls.append(
                    {"name": c.name, "args": args if isinstance(args, dict) else {"value": args}, "id": c.id}
                )
            out.append(AIMessage(m.text, id=mid, tool_calls=calls))
        else:
            out.append(ToolMessage(m.text, id=mid, tool_call_id=m.tool_call_id or ""))
    return out


def list_counter(counts: npt.NDArray[np.int64]) -> Any:
    """A list-level token counter over cached per-message counts (the fastest form trim_messages takes)."""
    table = [int(x) for x in counts]

    def count(msgs: Sequence[Any]) -> int:
        return sum(table[int(m.id)] for m in msgs)

    return count


def trim_last(lc_messages: list[Any], counter: Any, budget_tokens: int, *, start_on_human: bool) -> list[Any]:
    from langchain_core.messages import trim_messages

    kwargs: dict[str, Any] = {"start_on": "human"} if start_on_human else {}
    result: list[Any] = trim_messages(
        lc_messages,
        max_tokens=budget_tokens,
        token_counter=counter,
        strategy="last",
        include_system=True,
        **kwargs,
    )
    return result


def kept_indices(lc_kept: Sequence[Any]) -> list[int]:
    return [int(m.id) for m in lc_kept]


def numpy_segment_tail(
    tokens: npt.NDArray[np.int64], flags: npt.NDArray[np.uint32], budget_tokens: int
) -> int:
    """Oldest real user turn whose suffix fits the budget; failing that, the oldest message that is
    not a tool result. Returns the first kept index (len(tokens) when nothing fits). O(n): every
    suffix sum is computed, whatever the budget."""
    suffix = np.cumsum(tokens[::-1])[::-1]
    fits = suffix <= budget_tokens
    cand = np.flatnonzero(fits & ((flags & synth.FLAG_USER_TURN) != 0))
    if cand.size:
        return int(cand[0])
    cand = np.flatnonzero(fits & ((flags & (synth.FLAG_TOOL_RESULT | synth.FLAG_SYSTEM)) == 0))
    return int(cand[0]) if cand.size else len(tokens)


def drop_oldest(tokens: npt.NDArray[np.int64], budget_tokens: int, floor: int = 1) -> int:
    """The naive cut: drop messages after the system prompt, oldest first, until the rest fits.
    Returns the first kept index; the window is [0, floor) + [start, n)."""
    fixed = int(tokens[:floor].sum())
    room = budget_tokens - fixed
    kept = 0
    start = len(tokens)
    while start > floor and kept + int(tokens[start - 1]) <= room:
        start -= 1
        kept += int(tokens[start])
    return start
