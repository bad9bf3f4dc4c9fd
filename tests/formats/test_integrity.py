"""validate() and count_orphans() against hand-built cases and a plain reference over random lists."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold.chat.integrity import ViolationKind, check, count_orphans, validate
from ctxfold.chat.messages import Message, Role, ToolCall
from ctxfold.errors import IntegrityError

K = ViolationKind


def user(text: str = "hi") -> Message:
    return Message(role=Role.USER, content=text)


def calls(*ids: str) -> Message:
    return Message(role=Role.ASSISTANT, tool_calls=tuple(ToolCall(id=i, name="t", arguments="{}") for i in ids))


def result(cid: str | None) -> Message:
    return Message(role=Role.TOOL, content="out", tool_call_id=cid)


def kinds(messages: list[Message]) -> list[tuple[int, ViolationKind]]:
    return [(v.index, v.kind) for v in validate(messages)]


def test_clean_conversations_have_no_violation() -> None:
    assert validate([]) == []
    assert validate([user(), calls("a", "b"), result("a"), result("b"), Message(role=Role.ASSISTANT)]) == []
    # The final assistant message's calls may be unanswered (in flight), fully or in part.
    assert validate([user(), calls("a", "b")]) == []
    assert validate([user(), calls("a", "b"), result("b")]) == []


def test_each_kind_is_reported_at_its_message() -> None:
    assert kinds([result("a"), user()]) == [(0, K.STARTS_WITH_RESULT)]
    assert kinds([user(), result("zz")]) == [(1, K.ORPHAN_RESULT)]
    assert kinds([user(), calls("a"), result("a"), result("a")]) == [(3, K.DUPLICATE_RESULT)]
    assert kinds([user(), calls("a"), user(), calls("b")]) == [(1, K.MISSING_RESULT)]
    assert kinds([user(), calls("a"), result("a"), calls("a"), result("a")]) == [
        (3, K.DUPLICATE_CALL_ID), (4, K.DUPLICATE_RESULT)]
    assert kinds([user(), calls(""), user()]) == [(1, K.CALL_WITHOUT_ID)]
    assert kinds([user(), calls("a"), result(None)]) == [(2, K.RESULT_WITHOUT_ID)]
    assert kinds([user(), calls("a"), user("wait"), result("a")]) == [(3, K.SPLIT_PAIR)]
    # A result before its call is an orphan where it stands; the call then misses its result.
    later = Message(role=Role.ASSISTANT, content="done")
    assert kinds([user(), result("a"), calls("a"), user(), later]) == [(1, K.ORPHAN_RESULT), (2, K.MISSING_RESULT)]


def test_messages_name_the_call_ids() -> None:
    (v,) = validate([user(), result("call_42")])
    assert str(v) == "message 1: orphan_result: result for call 'call_42', which no earlier assistant message made"


def test_check_raises_with_every_violation_listed() -> None:
    check([user(), calls("a"), result("a")])
    with pytest.raises(IntegrityError, match=r"tail breaks tool-call pairing: message 0: starts_with_result"):
        check([result("a"), result("b")], what="tail")


def test_count_orphans_counts_results_without_an_earlier_call() -> None:
    assert count_orphans([]) == 0
    assert count_orphans([result("a"), calls("a"), result("a"), result("b"), result(None)]) == 3


def _reference_orphans(messages: list[Message]) -> int:
    orphans = 0
    for i, m in enumerate(messages):
        if m.role is Role.TOOL:
            made = [c.id for p in messages[:i] for c in p.tool_calls]
            orphans += m.tool_call_id not in made
    return orphans


_ids = st.sampled_from(["a", "b", "c"])
_message = st.one_of(
    st.builds(user),
    st.lists(_ids, min_size=1, max_size=3, unique=True).map(lambda ids: calls(*ids)),
    _ids.map(result),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_message, max_size=12))
def test_count_orphans_matches_the_plain_reference(messages: list[Message]) -> None:
    assert count_orphans(messages) == _reference_orphans(messages)
    orphan_kinds = {K.ORPHAN_RESULT, K.STARTS_WITH_RESULT}
    found = validate(messages)
    # Every orphan is reported once (a result at index 0 as the start of the list).
    assert sum(v.kind in orphan_kinds for v in found) == count_orphans(messages)
    assert all(0 <= v.index < len(messages) for v in found)
    assert [v.index for v in found] == sorted(v.index for v in found)
