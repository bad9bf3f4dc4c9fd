"""Tail selection: the C++ core against plain-Python references, invariants, bad input, real traces."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold import _core
from ctxfold.core.tail import (
    DEFAULT_MIN_FILL,
    NO_TAIL,
    RAW_CUT,
    Boundary,
    SegmentTail,
    TailRule,
    align_down_to_page,
    select_cut,
    select_tail,
    select_tail_from_ledger,
    select_token_tail,
    widen_tail,
    widened_preview_chars,
)
from helpers import tail_reference as ref

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


def check_invariants(
    t: list[int], f: list[int], g: list[int], bottom: int, start: int, num: int, budget: int
) -> None:
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
def test_segment_tail_matches_reference(
    table: tuple[list[int], list[int], list[int]], data: st.DataObject, min_fill: float
) -> None:
    t, f, g = table
    bottom = data.draw(st.integers(0, len(t)))
    # Budgets at the limit (exactly some suffix sum, and one less) as well as random ones.
    suffixes = [sum(t[i:bottom]) for i in range(bottom + 1)]
    budget = data.draw(
        st.one_of(
            st.sampled_from(suffixes),
            st.sampled_from(suffixes).map(lambda s: max(s - 1, 0)),
            st.integers(0, 400),
        )
    )
    want = ref.segment_tail(t, f, g, bottom, budget, min_fill)
    got = select_tail(*arrays(t, f, g), bottom=bottom, budget_tokens=budget, min_fill=min_fill)
    assert (got.start, got.num_tokens, int(got.rule)) == want
    check_invariants(t, f, g, bottom, got.start, got.num_tokens, budget)
    if got.found:  # nothing legal is older and still within budget
        assert got.start >= min(i for i in ref.legal_starts(f, g, bottom) if sum(t[i:bottom]) <= budget)

    ledger = _core.Ledger()
    ledger.append_batch(
        np.arange(len(t), dtype=np.uint64),
        *[np.array(x, np.int64) for x in (t,)],
        np.array(f, np.uint32),
        np.array(g, np.int64),
    )
    assert select_tail_from_ledger(ledger, bottom=bottom, budget_tokens=budget, min_fill=min_fill) == got


@settings(max_examples=300, deadline=None)
@given(
    table=st.one_of(conversations(), arbitrary_tables()), data=st.data(), min_fill=st.sampled_from([0.0, 0.9])
)
def test_segment_cut_matches_reference(
    table: tuple[list[int], list[int], list[int]], data: st.DataObject, min_fill: float
) -> None:
    t, f, g = table
    bottom = data.draw(st.integers(0, len(t)))
    total = sum(t[ref.system_floor(f, bottom) : bottom])
    min_free = data.draw(st.one_of(st.integers(0, total + 5), st.just(total), st.just(total + 1)))
    got = select_cut(*arrays(t, f, g), bottom=bottom, min_free_tokens=min_free, min_fill=min_fill)
    assert (got.found, got.cut, got.freed_tokens, int(got.rule)) == ref.segment_cut(
        t, f, g, bottom, min_free, min_fill
    )
    if got.found:
        assert got.freed_tokens >= min_free


def test_segment_tail_examples() -> None:
    S, U, A, C, R, T = (
        ref.SYSTEM,
        ref.USER | ref.USER_TURN,
        ref.ASSISTANT,
        ref.ASSISTANT | ref.TOOL_CALL,
        ref.TOOL_RESULT,
        ref.THINKING,
    )
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
    import torch

    from ctxfold.core._arrays import as_view

    t = torch.tensor([5, 5, 5], dtype=torch.int64)
    f = np.array([ref.USER | ref.USER_TURN, ref.ASSISTANT, ref.USER | ref.USER_TURN], np.uint32)
    g = torch.arange(3, dtype=torch.int32)
    r = select_tail(t, f, g, budget_tokens=10)
    assert (r.start, r.rule) == (1, TailRule.ASSISTANT_TURN)
    view = as_view(t, np.int64, "tokens")
    t[0] = 99  # the numpy view reads the tensor's own memory
    assert view[0] == 99 and view.dtype == np.int64
    ids = torch.tensor([9, 1, 9, 2, 9], dtype=torch.int32)
    assert select_token_tail(ids, budget_tokens=4, boundaries=[9]).start == 2
    with pytest.raises(ValueError, match="ids: expected dtype int32"):
        select_token_tail(ids.to(torch.int64), budget_tokens=4, boundaries=[9])
    with pytest.raises(ValueError, match="C-contiguous"):
        select_token_tail(torch.arange(10, dtype=torch.int32)[::2], budget_tokens=4, boundaries=[9])


# ---- token ids -----------------------------------------------------------------------------------


@st.composite
def token_cases(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(0, 60))
    ids = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    bottom = draw(st.integers(0, n))
    floor = draw(st.integers(0, bottom))
    budget = draw(
        st.one_of(st.integers(0, n + 2), st.just(bottom - floor), st.just(max(bottom - floor - 1, 0)))
    )
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


def test_boundaries_are_read_by_value_each_call() -> None:
    """The boundary arrays are cached by the kinds' values: a list changed between calls, or the
    same id given as a Boundary, an int or a numpy int, is read afresh and the same way."""
    ids = np.array([0, 7, 1, 2, 8, 3, 4, 7, 5, 6], np.int32)
    kinds: list[Boundary | int] = [7, 8]
    first = select_token_tail(ids, budget_tokens=6, boundaries=kinds, floor=1)
    kinds[0] = 8
    second = select_token_tail(ids, budget_tokens=6, boundaries=kinds, floor=1)
    assert (first.start, first.rule) == (4, 1)  # no user turn (7) fits: the assistant turn
    assert (second.start, second.rule) == (4, 0)  # 8 is now the preferred kind
    for same in ([Boundary(8), 7], [np.int32(8), 7], (8, Boundary(7, cut_after=False))):
        r = select_token_tail(ids, budget_tokens=6, boundaries=same, floor=1)
        assert (r.start, r.num_tokens, r.rule) == (4, 6, 0)
    after = select_token_tail(ids, budget_tokens=6, boundaries=[Boundary(7, cut_after=True)], floor=1)
    want = ref.token_tail(ids.tolist(), 10, 1, 6, [7], [1], [], DEFAULT_MIN_FILL)
    assert (after.start, after.num_tokens, after.rule) == want


def test_align_down_to_page() -> None:
    assert [align_down_to_page(p, 16) for p in (0, 15, 16, 17, 1000)] == [0, 0, 16, 16, 992]
    assert align_down_to_page(7, 1) == 7
    with pytest.raises(ValueError, match="page_size_tokens must be >= 1"):
        align_down_to_page(7, 0)
    with pytest.raises(ValueError, match="position must be >= 0"):
        align_down_to_page(-1, 16)


# ---- real traces -------------------------------------------------------------------------------

BUDGETS = range(1_000, 200_001, 500)  # 399 budgets, 1k to 200k tokens


@pytest.fixture(scope="module")
def traces(traces_dir):  # type: ignore[no-untyped-def]
    from helpers import trace_segments
    return trace_segments.load_traces(traces_dir, trace_segments.deepseek_tokenizer())


def _orphans(flags: np.ndarray, groups: np.ndarray, start: int, bottom: int) -> int:
    """Segments of the tail whose group starts before the tail (a result without its call, a
    split thinking block), plus a tail that opens on a tool result."""
    n = int(np.count_nonzero(groups[start:bottom] < start))
    return n + int(start < bottom and bool(flags[start] & ref.TOOL_RESULT))


def test_traces_zero_orphans_and_full_budgets(traces) -> None:  # type: ignore[no-untyped-def]
    utilisation, cutting, best_legal, of_best = [], [], [], []
    rules: dict[str, int] = {}
    orphans = 0
    for tr in traces:
        n = len(tr.tokens)
        available = int(tr.tokens[ref.system_floor(tr.flags.tolist(), n) :].sum())
        for budget in BUDGETS:
            r = select_tail(tr.tokens, tr.flags, tr.groups, budget_tokens=budget)
            assert r.num_tokens <= budget
            orphans += _orphans(tr.flags, tr.groups, r.start, n)
            rules[r.rule.name] = rules.get(r.rule.name, 0) + 1
            utilisation.append(r.num_tokens / min(budget, available))
            if budget < available:  # the tail really has to cut somewhere
                cutting.append(utilisation[-1])
                # The largest tail any legal cut keeps: a call and its results are one unit, so a
                # 2k-token tool result caps what a 2.5k budget can hold, for any message-level cut.
                best = select_tail(tr.tokens, tr.flags, tr.groups, budget_tokens=budget, min_fill=1.0)
                of_best.append(r.num_tokens / best.num_tokens if best.num_tokens else 1.0)
                best_legal.append(best.num_tokens / budget)
    u, c, b, ob = (np.array(x) for x in (utilisation, cutting, best_legal, of_best))
    print(
        f"\nctxfold tail over {len(traces)} traces x {len(BUDGETS)} budgets: orphans={orphans} rules={rules}\n"
        f"  utilisation, all pairs: min={u.min():.3f} p10={np.percentile(u, 10):.3f} median={np.median(u):.3f}\n"
        f"  {len(c)} pairs where budget < conversation: utilisation min={c.min():.3f} "
        f"p10={np.percentile(c, 10):.3f} median={np.median(c):.3f}; the best legal cut's p10="
        f"{np.percentile(b, 10):.3f}; share of the best legal cut kept: min={ob.min():.3f}"
    )
    assert orphans == 0
    assert np.percentile(u, 10) >= 0.90
    assert ob.min() >= 0.90  # preferring a user turn never gives up more than 10% of what fits


def _langchain_messages(tr) -> list:  # type: ignore[no-untyped-def, type-arg]
    """The trace as langchain messages, one per ctxfold message (the system prompt first)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    from ctxfold.chat.messages import Role

    out: list = []  # type: ignore[type-arg]
    if tr.message_of and tr.message_of[0] == -1:
        out.append(SystemMessage(tr.texts[0], id="system"))
    for i, m in enumerate(tr.conversation.messages):
        if m.role is Role.SYSTEM:
            out.append(SystemMessage(m.text, id=str(i)))
        elif m.role is Role.USER:
            out.append(HumanMessage(m.text, id=str(i)))
        elif m.role is Role.ASSISTANT:
            calls = []
            for c in m.tool_calls:
                args = c.parsed_arguments()
                calls.append(
                    {"name": c.name, "args": args if isinstance(args, dict) else {"value": args}, "id": c.id}
                )
            out.append(AIMessage(m.text, tool_calls=calls, id=str(i)))
        else:
            out.append(ToolMessage(m.text, tool_call_id=m.tool_call_id or f"missing{i}", id=str(i)))
    return out


def _count(count: dict[str, int], messages: list) -> int:  # type: ignore[type-arg]
    return sum(count[m.id] for m in messages)


def test_traces_compare_with_trim_messages(traces) -> None:  # type: ignore[no-untyped-def]
    """The same data through langchain_core's trim_messages(strategy="last", start_on="human",
    include_system=True), with the same per-message token counts: it never orphans with start_on,
    but throws most of the budget away when a whole turn does not fit."""
    from langchain_core.messages import AIMessage, SystemMessage, ToolMessage, trim_messages

    ours, theirs = [], []
    ours_cut, theirs_cut = [], []  # pairs where the budget is smaller than the conversation
    trim_orphans = 0
    for tr in traces:
        # Per message, the system prompt (message_of == -1) first, as _langchain_messages orders them.
        has_prompt = bool(tr.message_of) and tr.message_of[0] == -1
        per_message = np.zeros(len(tr.conversation.messages) + has_prompt, np.int64)
        np.add.at(per_message, np.array(tr.message_of, np.int64) + has_prompt, tr.tokens)
        lc = _langchain_messages(tr)
        count = {m.id: int(c) for m, c in zip(lc, per_message, strict=True)}
        system_tokens = sum(count[m.id] for m in lc if isinstance(m, SystemMessage))
        counter = functools.partial(_count, count)
        all_call_ids = {c["id"] for m in lc if isinstance(m, AIMessage) for c in m.tool_calls}
        available = int(per_message.sum()) - system_tokens
        n = len(tr.tokens)
        for budget in BUDGETS:
            kept = trim_messages(
                lc,
                max_tokens=budget + system_tokens,
                token_counter=counter,
                strategy="last",
                start_on="human",
                include_system=True,
            )
            body = [m for m in kept if not isinstance(m, SystemMessage)]
            call_ids = {c["id"] for m in body if isinstance(m, AIMessage) for c in m.tool_calls}
            # A result whose call is in the conversation but not in the window (some traces carry
            # results whose call ids match nothing at all: those are not the trimmer's doing).
            trim_orphans += sum(
                1
                for m in body
                if isinstance(m, ToolMessage)
                and m.tool_call_id not in call_ids
                and m.tool_call_id in all_call_ids
            )
            theirs.append(sum(count[m.id] for m in body) / min(budget, available))
            r = select_tail(tr.tokens, tr.flags, tr.groups, budget_tokens=budget)
            ours.append(r.num_tokens / min(budget, available))
            if budget < available:
                ours_cut.append(ours[-1])
                theirs_cut.append(theirs[-1])
            if budget >= available:
                # Every larger budget keeps everything for both: count them without re-running.
                rest = sum(1 for b in BUDGETS if b > budget)
                theirs.extend([theirs[-1]] * rest)
                ours.extend([ours[-1]] * rest)
                break
        assert _orphans(tr.flags, tr.groups, r.start, n) == 0

    def stats(x: list[float]) -> str:
        a = np.array(x)
        return f"min={a.min():.3f} p10={np.percentile(a, 10):.3f} median={np.median(a):.3f}"

    print(
        f"\nall {len(ours)} (trace, budget) pairs: ctxfold {stats(ours)}; trim_messages {stats(theirs)}"
        f"\n{len(ours_cut)} pairs with budget < conversation: ctxfold {stats(ours_cut)}; "
        f"trim_messages {stats(theirs_cut)}; trim_messages orphans={trim_orphans}"
    )
    assert np.percentile(ours, 10) >= 0.90
    assert np.percentile(ours_cut, 10) > np.percentile(theirs_cut, 10) + 0.5


# ---- a fuller tail: groups that enter with their results archived ------------------------------------------

@settings(max_examples=300, deadline=None)
@given(table=conversations(), budget=st.integers(0, 400), shrink=st.floats(0.0, 1.0))
def test_widened_tail_is_legal_within_budget_and_never_shorter(table: tuple[list[int], list[int], list[int]],
                                                                budget: int, shrink: float) -> None:
    tokens, flags, groups = table
    t = np.array(tokens, np.int64)
    f = np.array(flags, np.uint32)
    g = np.array(groups, np.int32)
    archived = np.where(f & ref.TOOL_RESULT, (t * shrink).astype(np.int64), t)
    plain = select_tail(t, f, g, budget_tokens=budget)
    wide = widen_tail(t, f, g, archived, tail=plain, budget_tokens=budget)
    assert wide.start <= plain.start and wide.num_tokens >= plain.num_tokens
    kept = set(range(wide.start, len(t)))
    sizes = sum(int(archived[i]) if i in wide.archived else int(t[i]) for i in range(wide.start, len(t)))
    assert sizes == wide.num_tokens
    if wide.start < plain.start:
        assert wide.num_tokens <= budget and wide.archived  # widened only through an archived group
        assert not f[wide.start] & (ref.TOOL_RESULT | ref.SYSTEM)
        assert g[wide.start] == wide.start  # a group's first segment: its results come with it
        assert all(f[i] & ref.TOOL_RESULT and wide.start <= i < plain.start for i in wide.archived)
        # No group is split: every segment of [start, end) has its group start inside.
        assert all(int(g[i]) in kept for i in kept)
    else:
        assert wide.archived == ()


def test_a_result_bigger_than_the_budget_enters_as_a_marker_instead_of_an_empty_window() -> None:
    # [user, call, result 5000 tokens]: the plain cut keeps nothing at a 1000-token budget.
    t = np.array([20, 30, 5000], np.int64)
    f = np.array([ref.USER | ref.USER_TURN, ref.ASSISTANT | ref.TOOL_CALL, ref.TOOL_RESULT], np.uint32)
    g = np.array([0, 1, 1], np.int32)
    plain = select_tail(t, f, g, budget_tokens=1000)
    assert plain.start == 3 and plain.num_tokens == 0
    wide = widen_tail(t, f, g, np.array([20, 30, 120], np.int64), tail=plain, budget_tokens=1000)
    assert (wide.start, wide.num_tokens, wide.archived) == (0, 170, (2,))


def test_a_group_the_plain_cut_left_out_on_purpose_is_not_taken_alone() -> None:
    t = np.array([10, 10, 10], np.int64)
    f = np.array([ref.USER | ref.USER_TURN, ref.ASSISTANT, ref.USER | ref.USER_TURN], np.uint32)
    g = np.array([0, 1, 2], np.int32)
    plain = SegmentTail(2, 10, TailRule.USER_TURN)  # aligned to the user turn, though one more would fit
    assert widen_tail(t, f, g, t, tail=plain, budget_tokens=100).start == 2


def test_the_widened_preview_follows_the_budget() -> None:
    assert widened_preview_chars(100_000, 1000) == 1000
    assert widened_preview_chars(2000, 1000) == 500
    assert widened_preview_chars(100, 1000) == 200
    with pytest.raises(ValueError, match="differ in length"):
        widen_tail(np.zeros(2, np.int64), np.zeros(2, np.uint32), np.zeros(2, np.int32), np.zeros(1, np.int64),
                   tail=SegmentTail(2, 0, TailRule.NONE), budget_tokens=10)
