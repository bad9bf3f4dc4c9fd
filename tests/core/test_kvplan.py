"""The KV re-sync plan: the C++ core against plain-Python references, block tables, bad input."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold.core.kvplan import KvPlan, ShiftSpan, common_prefix, plan_kv_resync
from helpers import tail_reference as ref

ids_lists = st.lists(st.integers(0, 4), max_size=80)


def i32(x: list[int]) -> np.ndarray:
    return np.array(x, np.int32)


@settings(max_examples=400, deadline=None)
@given(a=ids_lists, b=ids_lists, shared=st.integers(0, 40))
def test_common_prefix_matches_reference(a: list[int], b: list[int], shared: int) -> None:
    b = a[:shared] + b  # often a real shared prefix, sometimes the whole of a
    assert common_prefix(i32(a), i32(b)) == ref.common_prefix(a, b)


def test_common_prefix_across_chunk_edges() -> None:
    a = np.arange(5000, dtype=np.int32)
    for k in (0, 1, 1023, 1024, 1025, 2048, 4999):
        b = a.copy()
        b[k] = -1
        assert common_prefix(a, b) == k
    assert common_prefix(a, a) == 5000
    assert common_prefix(a, a[:3000]) == 3000
    assert common_prefix(a[:0], a) == 0


@st.composite
def rebuilds(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """A cached sequence and a rebuild of it: a kept prefix, new tokens (a summary), then verbatim
    runs of the old sequence (the tail), sometimes with edits, sometimes unrelated."""
    old = draw(st.lists(st.integers(0, 5), max_size=120))
    keep = draw(st.integers(0, len(old)))
    summary = draw(st.lists(st.integers(6, 9), max_size=20))
    tail_from = draw(st.integers(keep, len(old)))
    tail = old[tail_from:]
    if tail and draw(st.booleans()):
        at = draw(st.integers(0, len(tail) - 1))
        tail = tail[:at] + [draw(st.integers(0, 9))] + tail[at + 1 :]
    new = old[:keep] + summary + tail
    if draw(st.booleans()):
        new = draw(st.lists(st.integers(0, 9), max_size=120))
    return old, new


@settings(max_examples=500, deadline=None)
@given(case=rebuilds(), page=st.sampled_from([1, 2, 16]), k=st.sampled_from([0, 4, 6]))
def test_plan_matches_reference(case: tuple[list[int], list[int]], page: int, k: int) -> None:
    old, new = case
    plan = plan_kv_resync(i32(old), i32(new), page_size_tokens=page, min_shift_tokens=k)
    lcp = ref.common_prefix(old, new)
    reuse = min(lcp, max(len(new) - 1, 0)) // page * page
    assert (plan.common_prefix_tokens, plan.reuse_tokens, plan.pages_kept) == (lcp, reuse, reuse // page)
    assert plan.cached_pages == -(-len(old) // page)
    assert plan.prefill_tokens == len(new) - reuse
    want = ref.shifts(old, new, reuse, k) if k else []
    assert [(s.old_begin, s.new_begin, s.num_tokens) for s in plan.shifts] == want
    # The shifted runs really are verbatim, and the ranges left to compute tile the rest exactly.
    covered = [False] * len(new)
    for s in plan.shifts:
        assert s.approximate and s.num_tokens >= k
        assert old[s.old_begin : s.old_begin + s.num_tokens] == new[s.new_begin : s.new_begin + s.num_tokens]
        covered[s.new_begin : s.new_begin + s.num_tokens] = [True] * s.num_tokens
    for b, e in plan.prefill_ranges_with_shift:
        assert b < e and not any(covered[b:e])
        covered[b:e] = [True] * (e - b)
    assert all(covered[reuse:]) and not any(covered[:reuse])
    assert plan.prefill_tokens_with_shift == plan.prefill_tokens - plan.shifted_tokens
    assert plan.reused_tokens_with_shift + plan.prefill_tokens_with_shift == len(new)


def test_plan_example_summary_then_verbatim_tail() -> None:
    system = list(range(100, 140))  # 40 tokens
    history = list(range(1000, 1600))  # 600 tokens, of which the last 150 are kept verbatim
    summary = list(range(5000, 5030))
    old, new = system + history, system + summary + history[-150:]
    table = np.arange(100, 100 + 40, dtype=np.int32)  # 640 tokens / 16 = 40 pages
    plan = plan_kv_resync(i32(old), i32(new), page_size_tokens=16, min_shift_tokens=32, block_table=table)
    assert plan.common_prefix_tokens == 40 and plan.reuse_tokens == 32 and plan.pages_kept == 2
    assert plan.kept_blocks is not None and plan.freed_blocks is not None
    assert plan.kept_blocks.tolist() == [100, 101] and len(plan.freed_blocks) == 38
    assert np.shares_memory(plan.kept_blocks, table)  # views, not copies
    assert plan.prefill_tokens == len(new) - 32
    # The verbatim tail moves 420 positions down; the 8 system tokens past the page rounding are
    # too short a run (< 32) to shift, so they are computed again with the summary.
    assert plan.shifts == (ShiftSpan(40 + 450, 40 + 30, 150),)
    assert plan.shifts[0].delta == -420
    assert plan.prefill_ranges_with_shift == ((32, 70),)
    assert plan.prefill_tokens_with_shift == 38
    p1 = plan_kv_resync(i32(old), i32(new), page_size_tokens=1, min_shift_tokens=32)
    assert (p1.reuse_tokens, p1.prefill_tokens, p1.prefill_tokens_with_shift) == (40, 180, 30)


def test_identical_and_empty_sequences() -> None:
    a = i32(list(range(50)))
    plan = plan_kv_resync(a, a)
    assert (plan.reuse_tokens, plan.prefill_tokens) == (49, 1)  # the last token is computed for its logits
    empty = i32([])
    p = plan_kv_resync(empty, empty, min_shift_tokens=4)
    assert isinstance(p, KvPlan) and p.prefill_tokens == 0 and p.prefill_ranges == () and p.shifts == ()
    p = plan_kv_resync(a, empty)
    assert (p.reuse_tokens, p.cached_pages, p.prefill_tokens) == (0, 50, 0)


def test_plan_bad_input_is_a_clear_error() -> None:
    a = i32([1, 2, 3])
    with pytest.raises(ValueError, match="page_size_tokens must be >= 1"):
        plan_kv_resync(a, a, page_size_tokens=0)
    with pytest.raises(ValueError, match="min_shift_tokens must be 0"):
        plan_kv_resync(a, a, min_shift_tokens=2)
    with pytest.raises(ValueError, match="cached: expected dtype int32"):
        plan_kv_resync(a.astype(np.int64), a)
    with pytest.raises(ValueError, match="C-contiguous"):
        plan_kv_resync(a, np.arange(8, dtype=np.int32)[::2])
    with pytest.raises(ValueError, match="expected a 1-D array"):
        plan_kv_resync(a.reshape(1, 3), a)
    with pytest.raises(ValueError, match="cannot map the 3 pages"):
        plan_kv_resync(a, a, block_table=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="block_table"):
        plan_kv_resync(a, a, block_table=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"block_table\[1\] = -1"):
        plan_kv_resync(a, a, block_table=np.array([4, -1, 5], np.int32))
    with pytest.raises(ValueError, match="expected a numpy array"):
        common_prefix("abc", a)


def test_shift_search_is_not_quadratic_on_1m_tokens() -> None:
    """Repetitive and adversarial buffers of 1M tokens each: the search stays linear."""
    rng = np.random.default_rng(0)
    n = 1_000_000
    cases = {
        "constant": (np.zeros(n, np.int32), np.concatenate([i32([7]), np.zeros(n, np.int32)])),
        "period-3": (
            np.tile(i32([1, 2, 3]), n // 3),
            np.concatenate([i32([9]), np.tile(i32([2, 3, 1]), n // 3)]),
        ),
        "random tail kept": (
            (old := rng.integers(0, 50_000, n, dtype=np.int32)),
            np.concatenate([old[:1000], rng.integers(0, 50_000, 2000, dtype=np.int32), old[-50_000:]]),
        ),
    }
    for name, (old_ids, new_ids) in cases.items():
        t0 = time.perf_counter()
        plan = plan_kv_resync(old_ids, new_ids, min_shift_tokens=16)
        elapsed = time.perf_counter() - t0
        assert elapsed < 2.0, f"{name}: {elapsed:.2f}s"
        assert plan.reused_tokens_with_shift + plan.prefill_tokens_with_shift == len(new_ids)
    assert plan.shifted_tokens == 50_000
