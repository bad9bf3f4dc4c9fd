"""What crosses the C++ boundary: result records with named read-only fields, the KV plan's
zero-copy arrays, and one-value reads of the ledger checked against a plain-Python model."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from ctxfold import _core
from ctxfold.core.tail import _TAIL_RULES as TAIL_RULES
from ctxfold.core.tail import TailRule, select_cut, select_tail, select_token_tail
from helpers import tail_reference as ref

# A small conversation: system, user turn, a call with two results, then a user turn.
TOKENS = np.array([5, 10, 20, 30, 40, 50], np.int64)
FLAGS = np.array(
    [
        ref.SYSTEM,
        ref.USER | ref.USER_TURN,
        ref.ASSISTANT | ref.TOOL_CALL,
        ref.TOOL_RESULT,
        ref.TOOL_RESULT,
        ref.USER | ref.USER_TURN,
    ],
    np.uint32,
)
GROUPS = np.array([0, 1, 2, 2, 2, 5], np.int32)
IDS = np.array([0, 7, 1, 2, 8, 3, 4, 7, 5, 6], np.int32)  # 7 starts a user turn, 8 an assistant one
BOUNDARY_IDS = np.array([7, 8], np.int32)
CUT_AFTER = np.zeros(2, np.uint8)
NO_SPANS = np.zeros(0, np.int64)


def segment_tail() -> Any:
    return _core.select_segment_tail(TOKENS, FLAGS, GROUPS, 6, 150, 0.9)


def segment_cut() -> Any:
    return _core.select_segment_cut(TOKENS, FLAGS, GROUPS, 6, 15, 0.0)


def token_tail() -> Any:
    return _core.select_token_tail(IDS, 10, 1, 6, BOUNDARY_IDS, CUT_AFTER, NO_SPANS, 0.9)


def kv_plan() -> Any:
    old = np.arange(200, dtype=np.int32)
    new = np.concatenate([old[:40], np.arange(1000, 1010, dtype=np.int32), old[100:]])
    return _core.plan_kv_resync(old, new, 16, 8)


def test_segment_tail_fields_by_name_match_the_reference() -> None:
    r = segment_tail()
    assert (r.start, r.num_tokens, r.rule) == ref.segment_tail(
        TOKENS.tolist(), FLAGS.tolist(), GROUPS.tolist(), 6, 150, 0.9
    )
    assert (r.start, r.num_tokens, r.rule) == (1, 150, ref.USER_RULE)
    assert type(r.start) is int and type(r.rule) is int
    assert repr(r) == "SegmentTail(start=1, num_tokens=150, rule=1)"


def test_segment_cut_fields_by_name_match_the_reference() -> None:
    r = segment_cut()
    assert (r.found, r.cut, r.freed_tokens, r.rule) == ref.segment_cut(
        TOKENS.tolist(), FLAGS.tolist(), GROUPS.tolist(), 6, 15, 0.0
    )
    assert r.found is True and (r.cut, r.freed_tokens, r.rule) == (5, 100, ref.USER_RULE)
    assert repr(r) == "SegmentCut(found=True, cut=5, freed_tokens=100, rule=1)"
    nothing = _core.select_segment_cut(TOKENS, FLAGS, GROUPS, 6, 10_000, 0.0)
    assert nothing.found is False and repr(nothing).startswith("SegmentCut(found=False, ")


def test_token_tail_fields_by_name_match_the_reference() -> None:
    r = token_tail()
    want = ref.token_tail(IDS.tolist(), 10, 1, 6, BOUNDARY_IDS.tolist(), CUT_AFTER.tolist(), [], 0.9)
    assert (r.start, r.num_tokens, r.rule) == want == (4, 6, 1)
    assert repr(r) == "TokenTail(start=4, num_tokens=6, rule=1)"
    none = _core.select_token_tail(IDS, 10, 1, 0, BOUNDARY_IDS, CUT_AFTER, NO_SPANS, 0.9)
    assert repr(none) == f"TokenTail(start=10, num_tokens=0, rule={_core.NO_TAIL})"


def test_kv_plan_fields_by_name_and_repr() -> None:
    p = kv_plan()
    assert (p.common_prefix_tokens, p.reuse_tokens, p.page_size_tokens) == (40, 32, 16)
    assert (p.pages_kept, p.cached_pages, p.prefill_tokens) == (2, 13, 118)
    new = [*range(40), *range(1000, 1010), *range(100, 200)]
    assert [tuple(s) for s in p.shifts.tolist()] == ref.shifts(list(range(200)), new, 32, 8)
    # The 8 prefix tokens past the page rounding and the verbatim tail move; the summary is computed.
    assert p.shifts.tolist() == [[32, 32, 8], [100, 50, 100]]
    assert p.shifted_tokens == 108 and p.prefill_tokens_with_shift == 10
    assert p.prefill_ranges_with_shift.tolist() == [[40, 50]]
    assert repr(p) == (
        "KvPlan(common_prefix_tokens=40, reuse_tokens=32, page_size_tokens=16, pages_kept=2, cached_pages=13, "
        "prefill_tokens=118, shifts=<2 spans>, shifted_tokens=108, prefill_tokens_with_shift=10, "
        "prefill_ranges_with_shift=<1 range>)"
    )
    empty = _core.plan_kv_resync(np.zeros(0, np.int32), np.zeros(0, np.int32), 1, 0)
    assert "shifts=<0 spans>" in repr(empty) and "prefill_ranges_with_shift=<0 ranges>" in repr(empty)


@pytest.mark.parametrize(
    ("make", "fields"),
    [
        (segment_tail, ["start", "num_tokens", "rule"]),
        (segment_cut, ["found", "cut", "freed_tokens", "rule"]),
        (token_tail, ["start", "num_tokens", "rule"]),
        (
            kv_plan,
            [
                "common_prefix_tokens",
                "reuse_tokens",
                "page_size_tokens",
                "pages_kept",
                "cached_pages",
                "prefill_tokens",
                "shifts",
                "shifted_tokens",
                "prefill_tokens_with_shift",
                "prefill_ranges_with_shift",
            ],
        ),
    ],
)
def test_results_are_read_only(make: Any, fields: list[str]) -> None:
    r = make()
    for name in fields:
        before = repr(getattr(r, name))
        with pytest.raises(AttributeError):
            setattr(r, name, 1)
        with pytest.raises(AttributeError):
            delattr(r, name)
        assert repr(getattr(r, name)) == before
    with pytest.raises(AttributeError):
        r.not_a_field = 1  # no stray attributes either
    with pytest.raises(TypeError):
        type(r)()  # only the core makes results


def test_kv_plan_arrays_are_read_only_views_that_keep_the_plan_alive() -> None:
    p = kv_plan()
    shifts, ranges = p.shifts, p.prefill_ranges_with_shift
    assert shifts.dtype == np.int64 and shifts.shape == (2, 3) and ranges.shape == (1, 2)
    assert np.shares_memory(shifts, p.shifts)  # each read is a view of the plan's own memory, not a copy
    with pytest.raises(ValueError, match="read-only"):
        shifts[0, 0] = 0
    with pytest.raises(ValueError):
        ranges.flags.writeable = True
    del p
    gc.collect()
    assert shifts.tolist() == [[32, 32, 8], [100, 50, 100]] and ranges.tolist() == [
        [40, 50]
    ]  # views hold the plan


def test_tail_rule_lookup_matches_the_enum() -> None:
    assert [TailRule(i) for i in range(len(TailRule))] == list(TAIL_RULES)
    assert [int(r) for r in TAIL_RULES] == [ref.NONE, ref.USER_RULE, ref.ASSISTANT_RULE, ref.GROUP_RULE]


def test_wrappers_read_the_core_fields() -> None:
    t = select_tail(TOKENS, FLAGS, GROUPS, budget_tokens=150)
    assert (t.start, t.num_tokens, t.rule) == (1, 150, TailRule.USER_TURN) and t.rule is TailRule.USER_TURN
    c = select_cut(TOKENS, FLAGS, GROUPS, min_free_tokens=15, min_fill=0.0)
    assert (c.found, c.cut, c.freed_tokens, c.rule) == (True, 5, 100, TailRule.USER_TURN)
    k = select_token_tail(IDS, budget_tokens=6, boundaries=[7, 8], floor=1)
    assert (k.start, k.num_tokens, k.rule) == (4, 6, 1)
