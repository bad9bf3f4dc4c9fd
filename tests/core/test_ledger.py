"""Reading one segment of the ledger without copying a column: in range, out of range, empty,
and against a plain-Python model of the ledger."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold import _core
from helpers import tail_reference as ref

# system, user turn, a call with two results, then a user turn
TOKENS = [5, 10, 20, 30, 40, 50]
FLAGS = [
    ref.SYSTEM,
    ref.USER | ref.USER_TURN,
    ref.ASSISTANT | ref.TOOL_CALL,
    ref.TOOL_RESULT,
    ref.TOOL_RESULT,
]
FLAGS += [ref.USER | ref.USER_TURN]
GROUPS = [0, 1, 2, 2, 2, 5]


def ledger_of(tokens: list[int], flags: list[int], groups: list[int]) -> _core.Ledger:
    ledger = _core.Ledger()
    for i, (n, f, g) in enumerate(zip(tokens, flags, groups, strict=True)):
        ledger.append(100 + i, n, f, g)
    return ledger


def test_element_access_in_range() -> None:
    ledger = ledger_of(TOKENS, FLAGS, GROUPS)
    assert [ledger.num_tokens_at(i) for i in range(6)] == TOKENS
    assert [ledger.flags_at(i) for i in range(6)] == FLAGS
    assert [ledger.group_start_at(i) for i in range(6)] == GROUPS
    assert [ledger.user_turn_at(i) for i in range(6)] == [0, 1, 1, 1, 1, 2]
    assert [ledger.key_at(i) for i in range(6)] == list(range(100, 106))
    ledger.replace(3, 7, 2, ref.TOOL_RESULT)
    assert (ledger.num_tokens_at(3), ledger.key_at(3)) == (2, 7)


@pytest.mark.parametrize(
    "accessor", ["num_tokens_at", "flags_at", "user_turn_at", "group_start_at", "key_at"]
)
def test_element_access_out_of_range_names_index_and_length(accessor: str) -> None:
    empty = _core.Ledger()
    with pytest.raises(
        IndexError, match=re.escape("segment index 0 out of range: the ledger holds 0 segments")
    ):
        getattr(empty, accessor)(0)
    one = ledger_of([3], [ref.USER], [0])
    assert getattr(one, accessor)(0) >= 0
    with pytest.raises(
        IndexError, match=re.escape("segment index 1 out of range: the ledger holds 1 segment")
    ):
        getattr(one, accessor)(1)
    with pytest.raises(IndexError, match=re.escape("segment index -1 out of range")):
        getattr(one, accessor)(-1)  # no Python-style negative indices: the core takes [0, len)
    one.truncate(0)
    with pytest.raises(IndexError, match="holds 0 segments"):
        getattr(one, accessor)(0)


@st.composite
def ledger_ops(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    ops: list[tuple[Any, ...]] = []
    n = 0
    for _ in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(["append", "append", "append", "truncate", "replace", "clear"]))
        if kind == "append":
            ops.append(
                (
                    "append",
                    draw(st.integers(0, 2**64 - 1)),
                    draw(st.integers(0, 10**9)),
                    draw(st.integers(0, 2**12 - 1)),
                    draw(st.integers(0, n)),
                )
            )
            n += 1
        elif kind == "truncate":
            n = draw(st.integers(0, n))
            ops.append(("truncate", n))
        elif kind == "replace" and n:
            ops.append(
                (
                    "replace",
                    draw(st.integers(0, n - 1)),
                    draw(st.integers(0, 2**64 - 1)),
                    draw(st.integers(0, 10**9)),
                )
            )
        elif kind == "clear":
            n = 0
            ops.append(("clear",))
    return ops


@settings(max_examples=200, deadline=None)
@given(ops=ledger_ops(), probe=st.integers(-3, 40))
def test_element_access_matches_a_list_model(ops: list[tuple[Any, ...]], probe: int) -> None:
    """Every read of one value equals the plain-Python model and the column it comes from."""
    ledger = _core.Ledger()
    model: list[list[int]] = []  # [key, tokens, flags, group, user_turn]
    for op in ops:
        if op[0] == "append":
            _, key, n, f, g = op
            turns = (model[-1][4] if model else 0) + (1 if f & ref.USER_TURN else 0)
            ledger.append(key, n, f, g)
            model.append([key, n, f, g, turns])
        elif op[0] == "truncate":
            ledger.truncate(op[1])
            del model[op[1] :]
        elif op[0] == "replace":
            _, i, key, n = op
            ledger.replace(i, key, n, model[i][2])
            model[i][0], model[i][1] = key, n
        else:
            ledger.clear()
            model.clear()
    assert len(ledger) == len(model)
    tokens, flags = ledger.tokens(), ledger.flags()
    for i, (key, n, f, g, turns) in enumerate(model):
        got = (
            ledger.key_at(i),
            ledger.num_tokens_at(i),
            ledger.flags_at(i),
            ledger.group_start_at(i),
            ledger.user_turn_at(i),
        )
        assert got == (key, n, f, g, turns)
        assert (ledger.num_tokens_at(i), ledger.flags_at(i)) == (int(tokens[i]), int(flags[i]))
    if not 0 <= probe < len(model):
        with pytest.raises(
            IndexError, match=f"segment index {probe} out of range: the ledger holds {len(model)} "
        ):
            ledger.num_tokens_at(probe)
