"""Tail selection: the C++ core against plain-Python references, invariants, bad input, real traces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tail_reference as ref
from ctxfold import _core
from ctxfold.tail import (
    NO_TAIL,
    RAW_CUT,
    Boundary,
    TailRule,
    align_down_to_page,
    select_cut,
    select_tail,
    select_tail_from_ledger,
    select_token_tail,
)

# ---- segment tables -----------------------------------------------------------------------------


@st.composite
def conversations(draw: st.DrawFn, max_units: int = 25) -> tuple[list[int], list[int], list[int]]:
    """Segment tables shaped like real conversations, with the awkward cases mixed in."""
    tokens: list[int] = []
    flags: list[int] = []
    groups: list[int] = []
    count = st.integers(0, 40)

    def add(flag: int, group: int | None = None) -> int:
        i = len(tokens)
        tokens.append(draw(count))
        flags.append(flag)
        groups.append(i if group is None else group)
        return i

    for _ in range(draw(st.integers(0, 2))):
        add(ref.SYSTEM)
    kinds = ["user", "queued", "assistant", "call", "think", "summary", "orphan", "interleaved", "resume"]
    for kind in draw(st.lists(st.sampled_from(kinds), max_size=max_units)):
        if kind == "user":
            add(ref.USER | ref.USER_TURN)
        elif kind == "queued":
            add(ref.USER | ref.QUEUED)
        elif kind == "resume":
            add(ref.USER | ref.RESUME)
        elif kind == "assistant":
            add(ref.ASSISTANT)
        elif kind == "summary":
            add(ref.SUMMARY)
        elif kind == "call":
            g = add(ref.ASSISTANT | ref.TOOL_CALL)
            for _ in range(draw(st.integers(0, 3))):
                add(ref.TOOL_RESULT, g)
        elif kind == "think":
            g = add(ref.THINKING)
            add(ref.ASSISTANT | ref.TOOL_CALL, g)
            add(ref.TOOL_RESULT, g)
        elif kind == "orphan":  # a result whose call was summarized away upstream
            add(ref.TOOL_RESULT)
        elif kind == "interleaved":  # a queued user message lands between a call and its result
            g = add(ref.ASSISTANT | ref.TOOL_CALL)
            add(ref.USER | ref.QUEUED)
            add(ref.TOOL_RESULT, g)
    return tokens, flags, groups


@st.composite
def arbitrary_tables(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Any valid table: random flag bits, any group start in [0, i]."""
    n = draw(st.integers(0, 30))
    tokens = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    flags = draw(st.lists(st.integers(0, (1 << 12) - 1), min_size=n, max_size=n))
    groups = [draw(st.integers(0, i)) for i in range(n)]
    return tokens, flags, groups


def arrays(t: list[int], f: list[int], g: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array(t, np.int64), np.array(f, np.uint32), np.array(g, np.int32)


def check_invariants(t: list[int], f: list[int], g: list[int], bottom: int, start: int, num: int, budget: int) -> None:
    assert num == sum(t[start:bottom]) and num <= budget
    if start < bottom:
        assert not f[start] & ref.TOOL_RESULT, "tail starts with a tool result"
        assert all(g[j] >= start for j in range(start, bottom)), "a group is split"
        assert all(not f[j] & ref.SYSTEM for j in range(start, bottom)), "tail enters the system prefix"


@settings(max_examples=400, deadline=None)
@given(
    table=st.one_of(conversations(), arbitrary_tables()),
    data=st.data(),
    min_fill=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
def test_segment_tail_matches_reference(table: tuple[list[int], list[int], list[int]], data: st.DataObject,
                                        min_fill: float) -> None:
    t, f, g = table
    bottom = data.draw(st.integers(0, len(t)))
    # Budgets at the limit (exactly some suffix sum, and one less) as well as random ones.
    suffixes = [sum(t[i:bottom]) for i in range(bottom + 1)]
    budget = data.draw(st.one_of(st.sampled_from(suffixes), st.sampled_from(suffixes).map(lambda s: max(s - 1, 0)),
                                 st.integers(0, 400)))
    want = ref.segment_tail(t, f, g, bottom, budget, min_fill)
    got = select_tail(*arrays(t, f, g), bottom=bottom, budget_tokens=budget, min_fill=min_fill)
    assert (got.start, got.num_tokens, int(got.rule)) == want
    check_invariants(t, f, g, bottom, got.start, got.num_tokens, budget)
    if got.found:  # nothing legal is older and still within budget
        assert got.start >= min((i for i in ref.legal_starts(f, g, bottom) if sum(t[i:bottom]) <= budget))

    ledger = _core.Ledger()
    ledger.append_batch(np.arange(len(t), dtype=np.uint64), *[np.array(x, np.int64) for x in (t,)],
                        np.array(f, np.uint32), np.array(g, np.int64))
    assert select_tail_from_ledger(ledger, bottom=bottom, budget_tokens=budget, min_fill=min_fill) == got


@settings(max_examples=300, deadline=None)
@given(table=st.one_of(conversations(), arbitrary_tables()), data=st.data(), min_fill=st.sampled_from([0.0, 0.9]))
def test_segment_cut_matches_reference(table: tuple[list[int], list[int], list[int]], data: st.DataObject,
                                       min_fill: float) -> None:
    t, f, g = table
    bottom = data.draw(st.integers(0, len(t)))
    total = sum(t[ref.system_floor(f, bottom):bottom])
    min_free = data.draw(st.one_of(st.integers(0, total + 5), st.just(total), st.just(total + 1)))
    got = select_cut(*arrays(t, f, g), bottom=bottom, min_free_tokens=min_free, min_fill=min_fill)
    assert (got.found, got.cut, got.freed_tokens, int(got.rule)) == ref.segment_cut(t, f, g, bottom, min_free,
                                                                                       min_fill)
    if got.found:
        assert got.freed_tokens >= min_free


def test_segment_tail_examples() -> None:
    S, U, A, C, R, T = ref.SYSTEM, ref.USER | ref.USER_TURN, ref.ASSISTANT, ref.ASSISTANT | ref.TOOL_CALL, \
        ref.TOOL_RESULT, ref.THINKING
    # system | user | call + 2 results | assistant | user | thinking+call+result
    t = [100, 10, 5, 50, 50, 20, 10, 30, 5, 5]
    f = [S, U, C, R, R, A, U, T, C, R]
    g = [0, 1, 2, 2, 2, 5, 6, 7, 7, 7]
    arr = arrays(t, f, g)
    # Everything fits: the oldest user turn, system never included.
    assert select_tail(*arr, budget_tokens=10_000) == select_tail(*arr, budget_tokens=10_000, min_fill=0.0)
    r = select_tail(*arr, budget_tokens=10_000)
    assert (r.start, r.num_tokens, r.rule) == (1, 185, TailRule.USER_TURN)
    # 170 tokens: the call group at 2 (155 from it) fits, but the user turn at 6 keeps only 50 of
    # 170 possible: min_fill=0.9 refuses that waste; the strict order takes it.
    assert select_tail(*arr, budget_tokens=175).start == 2
    assert select_tail(*arr, budget_tokens=175).rule is TailRule.ASSISTANT_TURN
    assert select_tail(*arr, budget_tokens=175, min_fill=0.0).start == 6
    # 20 tokens: inside the thinking group only; no legal start -> no tail, never a raw cut.
    r = select_tail(*arr, budget_tokens=20)
    assert (r.found, r.start, r.num_tokens) == (False, 10, 0)
    # The reverse question: free at least 60 tokens above the system prefix.
    c = select_cut(*arr, min_free_tokens=60)
    assert (c.found, c.cut, c.freed_tokens) == (True, 5, 115)
    assert not select_cut(*arr, min_free_tokens=186).found


def test_empty_and_single() -> None:
    empty = arrays([], [], [])
    assert select_tail(*empty, budget_tokens=100).found is False
    one = arrays([7], [ref.USER | ref.USER_TURN], [0])
    assert select_tail(*one, budget_tokens=7).start == 0
    assert not select_tail(*one, budget_tokens=6).found
    assert select_tail(*one, budget_tokens=0, bottom=0).num_tokens == 0


def test_segment_bad_input_is_a_clear_error() -> None:
    t, f, g = arrays([1, 2], [0, 0], [0, 1])
    with pytest.raises(ValueError, match="budget_tokens must be >= 0"):
        select_tail(t, f, g, budget_tokens=-1)
    with pytest.raises(IndexError, match=r"bottom must be in \[0, 2\], got 3"):
        select_tail(t, f, g, budget_tokens=5, bottom=3)
    with pytest.raises(ValueError, match="tokens: expected dtype int64"):
        select_tail(t.astype(np.int32), f, g, budget_tokens=5)
    with pytest.raises(ValueError, match="C-contiguous"):
        select_tail(np.arange(4, dtype=np.int64)[::2], f, g, budget_tokens=5)
    with pytest.raises(ValueError, match="one length"):
        select_tail(t, f[:1], g, budget_tokens=5)
    with pytest.raises(ValueError, match="group_start must be in"):
        select_tail(t, f, np.array([0, 5], np.int32), budget_tokens=5)
    with pytest.raises(ValueError, match="token count must be >= 0"):
        select_tail(np.array([1, -2], np.int64), f, g, budget_tokens=5)
    with pytest.raises(ValueError, match="min_fill"):
        select_tail(t, f, g, budget_tokens=5, min_fill=float("nan"))
    with pytest.raises(ValueError, match="min_free_tokens"):
        select_cut(t, f, g, min_free_tokens=-1)


def test_torch_tensors_cross_without_copies() -> None:
    torch = pytest.importorskip("torch")
    t = torch.tensor([5, 5, 5], dtype=torch.int64)
    f = torch.tensor([ref.USER | ref.USER_TURN, ref.ASSISTANT, ref.USER | ref.USER_TURN], dtype=torch.int32)
    g = torch.arange(3, dtype=torch.int32)
    # torch has no uint32 tensors in common use: the flags must be converted once, visibly.
    r = select_tail(t, f.numpy().astype(np.uint32), g, budget_tokens=10)
    assert (r.start, r.rule) == (1, TailRule.ASSISTANT_TURN)
    ids = torch.tensor([9, 1, 9, 2, 9], dtype=torch.int32)
    assert select_token_tail(ids, budget_tokens=4, boundaries=[9]).start == 2
    assert np.shares_memory(np.from_dlpack(ids), np.from_dlpack(ids))


# ---- token ids -----------------------------------------------------------------------------------


@st.composite
def token_cases(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(0, 60))
    ids = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    bottom = draw(st.integers(0, n))
    floor = draw(st.integers(0, bottom))
    budget = draw(st.one_of(st.integers(0, n + 2), st.just(bottom - floor), st.just(max(bottom - floor - 1, 0))))
    k = draw(st.integers(1, 3))
    boundary_ids = draw(st.lists(st.integers(3, 6), min_size=k, max_size=k, unique=True))
    cut_after = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    points = sorted(draw(st.lists(st.integers(0, n), max_size=8, unique=True)))
    spans = [(points[i], points[i + 1]) for i in range(0, len(points) - 1, 2)]
    min_fill = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    return ids, bottom, floor, budget, boundary_ids, cut_after, spans, min_fill


@settings(max_examples=500, deadline=None)
@given(case=token_cases())
def test_token_tail_matches_reference(case: tuple) -> None:
    ids, bottom, floor, budget, boundary_ids, cut_after, spans, min_fill = case
    want = ref.token_tail(ids, bottom, floor, budget, boundary_ids, cut_after, spans, min_fill)
    got = select_token_tail(
        np.array(ids, np.int32),
        bottom=bottom,
        floor=floor,
        budget_tokens=budget,
        boundaries=[Boundary(b, a) for b, a in zip(boundary_ids, cut_after, strict=True)],
        no_entry=np.array(spans, np.int64).reshape(-1, 2),
        min_fill=min_fill,
    )
    assert (got.start, got.num_tokens, got.rule) == want
    # Invariants: in budget, above the floor, never strictly inside a no-entry span.
    assert floor <= got.start <= bottom and got.num_tokens == bottom - got.start <= budget
    assert got.start == bottom or not any(b < got.start < e for b, e in spans)  # an empty tail enters nothing
    if got.rule == RAW_CUT:  # a raw index only when no boundary lies within the budget
        assert ref.token_tail(ids, bottom, floor, budget, boundary_ids, cut_after, spans, 0.0)[2] < 0


def test_token_tail_examples() -> None:
    U, A, E = 128803, 128804, 1  # DeepSeek V4 <｜User｜>, <｜Assistant｜>, EOS
    ids = np.array([0, 5, 5, U, 7, 7, A, 8, 8, E, U, 9, A, 3, 3, 3, E], np.int32)
    kinds = [Boundary(U), Boundary(A), Boundary(E, cut_after=True)]
    r = select_token_tail(ids, budget_tokens=14, boundaries=kinds, floor=3)
    assert (r.start, r.rule) == (3, 0)
    r = select_token_tail(ids, budget_tokens=8, boundaries=kinds)  # oldest cut in [9, 17) is the user marker
    assert (r.start, r.rule) == (10, 0)
    r = select_token_tail(ids, budget_tokens=6, boundaries=kinds)
    assert (r.start, r.rule) == (12, 1)
    # A tool-call span over [11, 16) hides the assistant marker at 12: no boundary is left, and the
    # raw cut at 11 is the span's own start, which enters nothing.
    r = select_token_tail(ids, budget_tokens=6, boundaries=kinds, no_entry=[[11, 16]])
    assert (r.start, r.rule) == (11, RAW_CUT)
    r = select_token_tail(ids, budget_tokens=5, boundaries=kinds, no_entry=[[11, 16]])
    assert (r.start, r.rule) == (16, RAW_CUT)
    # No boundary in budget: a raw cut, moved forward out of a span.
    r = select_token_tail(ids, budget_tokens=3, boundaries=[U])
    assert (r.start, r.rule) == (14, RAW_CUT)
    r = select_token_tail(ids, budget_tokens=3, boundaries=[U], no_entry=[[13, 16]])
    assert (r.start, r.rule) == (16, RAW_CUT)
    assert select_token_tail(ids, budget_tokens=0, boundaries=[U]).rule == NO_TAIL


def test_token_bad_input_is_a_clear_error() -> None:
    ids = np.arange(10, dtype=np.int32)
    with pytest.raises(IndexError, match="bottom must be in"):
        select_token_tail(ids, budget_tokens=5, boundaries=[3], bottom=11)
    with pytest.raises(IndexError, match="floor must be in"):
        select_token_tail(ids, budget_tokens=5, boundaries=[3], floor=11)
    with pytest.raises(ValueError, match="budget_tokens must be >= 0"):
        select_token_tail(ids, budget_tokens=-5, boundaries=[3])
    with pytest.raises(ValueError, match="ids: expected dtype int32"):
        select_token_tail(ids.astype(np.int64), budget_tokens=5, boundaries=[3])
    with pytest.raises(ValueError, match="C-contiguous"):
        select_token_tail(np.arange(20, dtype=np.int32)[::2], budget_tokens=5, boundaries=[3])
    with pytest.raises(ValueError, match="sorted and disjoint"):
        select_token_tail(ids, budget_tokens=5, boundaries=[3], no_entry=[[4, 8], [6, 9]])
    with pytest.raises(ValueError, match="begin <= end"):
        select_token_tail(ids, budget_tokens=5, boundaries=[3], no_entry=[[4, 2]])
    with pytest.raises(IndexError, match="past the end of ids"):
        select_token_tail(ids, budget_tokens=5, boundaries=[3], no_entry=[[4, 12]])
    with pytest.raises(ValueError, match="odd number"):
        select_token_tail(ids, budget_tokens=5, boundaries=[3], no_entry=np.array([1, 2, 3], np.int64))
    with pytest.raises(ValueError, match="at least one boundary"):
        select_token_tail(ids, budget_tokens=5, boundaries=[])
    with pytest.raises(ValueError, match="1 to 16"):
        select_token_tail(ids, budget_tokens=5, boundaries=list(range(17)))
    with pytest.raises(ValueError, match="fit int32"):
        select_token_tail(ids, budget_tokens=5, boundaries=[2**40])


def test_align_down_to_page() -> None:
    assert [align_down_to_page(p, 16) for p in (0, 15, 16, 17, 1000)] == [0, 0, 16, 16, 992]
    assert align_down_to_page(7, 1) == 7
    with pytest.raises(ValueError, match="page_size_tokens must be >= 1"):
        align_down_to_page(7, 0)
    with pytest.raises(ValueError, match="position must be >= 0"):
        align_down_to_page(-1, 16)
