"""The engine-facing API on a 128k-token sequence: the decision, the tail, the rebuild with its KV plan.

    pytest bench/bench_engine.py --benchmark-enable --benchmark-group-by=group

Each group has the plain-Python way beside it (what an engine would write without ctxfold): summing
segment lengths for the decision, ds4's scan over a Python list of ids for the tail, list splicing
and a Python common-prefix loop for the rebuild.
"""

from __future__ import annotations

import numpy as np
import pytest

from ctxfold.engine import Decision, EngineSequence, SegmentKind

USER, ASSISTANT, EOS, THINK, END_THINK = 128803, 128804, 1, 128821, 128822
CONTEXT_TOKENS = 131072
PAGE = 16


def build(num_tokens: int = 120_000, seed: int = 0) -> tuple[EngineSequence, list[tuple[SegmentKind, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    seq = EngineSequence("bench", context_tokens=CONTEXT_TOKENS, page_size_tokens=PAGE)
    segments: list[tuple[SegmentKind, np.ndarray]] = []

    def add(kind: SegmentKind, ids: np.ndarray) -> None:
        seq.append(ids, kind)
        segments.append((kind, ids))

    add(SegmentKind.SYSTEM, rng.integers(2, 100_000, 2000, dtype=np.int32))
    while seq.num_tokens < num_tokens:
        add(SegmentKind.USER, np.concatenate([[USER], rng.integers(2, 100_000, 200)]).astype(np.int32))
        add(SegmentKind.ASSISTANT, np.array([ASSISTANT], dtype=np.int32))
        add(SegmentKind.THINKING, np.concatenate([[THINK], rng.integers(2, 100_000, 400), [END_THINK]]).astype(np.int32))
        add(SegmentKind.TOOL_CALL, np.concatenate([rng.integers(2, 100_000, 60), [EOS]]).astype(np.int32))
        add(SegmentKind.TOOL_RESULT, np.concatenate([[USER], rng.integers(2, 100_000, 1500)]).astype(np.int32))
    return seq, segments


@pytest.fixture(scope="module")
def sequence() -> tuple[EngineSequence, list[tuple[SegmentKind, np.ndarray]]]:
    return build()


@pytest.mark.benchmark(group="engine-check")
def test_check_ctxfold(benchmark, sequence) -> None:  # type: ignore[no-untyped-def]
    seq, _ = sequence
    assert benchmark(seq.check, 1000) in (Decision.NONE, Decision.SOFT, Decision.HARD)


@pytest.mark.benchmark(group="engine-check")
def test_check_python_sum_of_segments(benchmark, sequence) -> None:  # type: ignore[no-untyped-def]
    _, segments = sequence
    lengths = [len(ids) for _, ids in segments]

    def check() -> bool:
        return sum(lengths) + 1000 + 8192 >= 0.85 * CONTEXT_TOKENS

    benchmark(check)


@pytest.mark.benchmark(group="engine-tail")
def test_tail_ctxfold(benchmark, sequence) -> None:  # type: ignore[no-untyped-def]
    seq, _ = sequence
    t = benchmark(seq.tail, 13_107)
    assert t.at_boundary


@pytest.mark.benchmark(group="engine-tail")
def test_tail_python_ds4_scan(benchmark, sequence) -> None:  # type: ignore[no-untyped-def]
    """ds4's rule over a Python list: the oldest <|User|> inside the budget (no tool-pair checks)."""
    seq, _ = sequence
    ids = seq.ids().tolist()

    def scan() -> int:
        target = max(len(ids) - 13_107, seq.system_tokens)
        for p in range(target, len(ids)):
            if ids[p] == USER:
                return p
        return target

    benchmark(scan)


@pytest.mark.benchmark(group="engine-rebuild")
def test_rebuild_ctxfold(benchmark) -> None:  # type: ignore[no-untyped-def]
    summary = np.concatenate([[USER], np.arange(2, 1500)]).astype(np.int32)

    def setup() -> tuple[tuple[EngineSequence], dict[str, object]]:
        seq, _ = build()
        table = np.arange(-(-seq.num_tokens // PAGE), dtype=np.int32)
        return (seq,), {"table": table}

    def run(seq: EngineSequence, table: np.ndarray) -> None:
        r = seq.rebuild(summary, bottom=seq.num_tokens, block_table=table)
        assert r.kv.pages_kept >= 1

    benchmark.pedantic(run, setup=setup, rounds=10)


@pytest.mark.benchmark(group="engine-rebuild")
def test_rebuild_python_lists(benchmark) -> None:  # type: ignore[no-untyped-def]
    summary = [USER, *range(2, 1500)]

    def setup() -> tuple[tuple[list[int], int, int], dict[str, object]]:
        seq, _ = build()
        return (seq.ids().tolist(), seq.system_tokens, seq.num_tokens - 13_000), {}

    def run(ids: list[int], sys_end: int, tail_start: int) -> None:
        rebuilt = ids[:sys_end] + summary + ids[tail_start:]
        k = 0
        while k < min(len(ids), len(rebuilt)) and ids[k] == rebuilt[k]:
            k += 1
        keep_pages = k // PAGE
        assert keep_pages >= 1

    benchmark.pedantic(run, setup=setup, rounds=10)
