"""Structural checks of a message list: tool calls and their results.

Every compaction ends with these checks and the tests run them over every real trace. A
provider rejects a request whose tool results do not pair with calls (OpenAI: "messages with
role 'tool' must be a response to a preceding message with 'tool_calls'"; Anthropic: "unexpected
tool_use_id"), so a tail that cuts a pair in two is a bug, not a style issue.

All checks are one pass over the messages, O(messages + calls).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.errors import IntegrityError


class ViolationKind(StrEnum):
    STARTS_WITH_RESULT = "starts_with_result"  # the first message is a tool result
    ORPHAN_RESULT = "orphan_result"  # a result whose call is not earlier in the list
    RESULT_WITHOUT_ID = "result_without_id"  # a tool message with no tool_call_id
    DUPLICATE_RESULT = "duplicate_result"  # a second result for the same call
    MISSING_RESULT = "missing_result"  # a call with no result that is not the last call in flight
    DUPLICATE_CALL_ID = "duplicate_call_id"  # two calls share one id, so results cannot pair
    CALL_WITHOUT_ID = "call_without_id"  # a tool call whose id is empty
    SPLIT_PAIR = "split_pair"  # a user or assistant message sits between a call and its result


@dataclass(frozen=True, slots=True)
class Violation:
    index: int  # index in the message list of the message at fault
    kind: ViolationKind
    message: str  # what is wrong, with the ids involved

    def __str__(self) -> str:
        return f"message {self.index}: {self.kind}: {self.message}"


def _messages(conv: Conversation | Sequence[Message]) -> Sequence[Message]:
    return conv.messages if isinstance(conv, Conversation) else conv


def _last_assistant(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role is Role.ASSISTANT:
            return i
    return -1


def validate(conv: Conversation | Sequence[Message]) -> list[Violation]:
    """Every violation, in message order.

    Calls of the final assistant message may be unanswered: that is a turn in flight. Any other
    call needs exactly one result, after it, with no user or assistant message in between.
    """
    messages = _messages(conv)
    out: list[Violation] = []
    if messages and messages[0].role is Role.TOOL:
        out.append(
            Violation(0, ViolationKind.STARTS_WITH_RESULT, f"conversation starts with the result of call "
                      f"{messages[0].tool_call_id!r}, whose call is not in the list")
        )
    last_assistant = _last_assistant(messages)
    call_at: dict[str, int] = {}  # call id -> index of the assistant message that made it
    answered: dict[str, int] = {}  # call id -> index of its first result
    # index of the assistant message whose results may follow now; a user or assistant message ends it
    open_block = -1
    for i, m in enumerate(messages):
        if m.role is Role.TOOL:
            cid = m.tool_call_id
            if not cid:
                out.append(Violation(i, ViolationKind.RESULT_WITHOUT_ID, "tool result has no tool_call_id"))
                continue
            if cid in answered:
                out.append(Violation(i, ViolationKind.DUPLICATE_RESULT,
                                     f"second result for call {cid!r} (first at message {answered[cid]})"))
                continue
            if cid not in call_at:
                if i != 0:  # index 0 is already reported as STARTS_WITH_RESULT
                    out.append(Violation(i, ViolationKind.ORPHAN_RESULT,
                                         f"result for call {cid!r}, which no earlier assistant message made"))
                continue
            answered[cid] = i
            if call_at[cid] != open_block:
                out.append(Violation(i, ViolationKind.SPLIT_PAIR,
                                     f"result for call {cid!r} (made at message {call_at[cid]}) comes after a "
                                     "later user or assistant message"))
            continue
        open_block = i if m.tool_calls else -1
        for c in m.tool_calls:
            if not c.id:
                out.append(Violation(i, ViolationKind.CALL_WITHOUT_ID, f"call of {c.name!r} has an empty id"))
            elif c.id in call_at:
                out.append(Violation(i, ViolationKind.DUPLICATE_CALL_ID,
                                     f"call id {c.id!r} already used at message {call_at[c.id]}"))
            else:
                call_at[c.id] = i
    for cid, i in call_at.items():
        if cid not in answered and i != last_assistant:
            out.append(Violation(i, ViolationKind.MISSING_RESULT, f"call {cid!r} has no result"))
    out.sort(key=lambda v: v.index)  # stable: message order, then the order found
    return out


def count_orphans(messages: Iterable[Message]) -> int:
    """Tool results whose call is not earlier in ``messages``: what a badly cut tail produces.

    Cheaper than :func:`validate` (no strings, no list): one set, one pass.
    """
    seen: set[str] = set()
    orphans = 0
    for m in messages:
        if m.role is Role.TOOL:
            if m.tool_call_id not in seen:
                orphans += 1
        elif m.tool_calls:
            seen.update(c.id for c in m.tool_calls)
    return orphans


def check(conv: Conversation | Sequence[Message], *, what: str = "conversation") -> None:
    """Raise :class:`IntegrityError` listing every violation, if there is any."""
    found = validate(conv)
    if found:
        shown = "; ".join(str(v) for v in found[:10])
        more = f" (and {len(found) - 10} more)" if len(found) > 10 else ""
        raise IntegrityError(f"{what} breaks tool-call pairing: {shown}{more}")
