"""The engine-facing API over token ids: feeding, the O(1) decision, the tail, the rebuild and KV plan."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold.compaction.config import CompactConfig
from ctxfold.core.tail import DEFAULT_MIN_FILL, NO_TAIL, RAW_CUT
from ctxfold.engine import DEEPSEEK_V4, Decision, EngineSequence, SegmentKind, SequenceRegistry
from helpers.subprocess_env import ctxfold_env

REPO = Path(__file__).resolve().parents[2]
USER, ASSISTANT, EOS, END_THINK = 128803, 128804, 1, 128822


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def conversation(seq: EngineSequence, turns: int, *, body: int = 50, tools: bool = True) -> None:
    """system, then per turn: user, assistant (thinking, text, tool call), tool result."""
    seq.append(ids(0, *range(10, 30)), SegmentKind.SYSTEM)
    for _ in range(turns):
        seq.append(ids(USER, *([7] * body)), SegmentKind.USER)
        seq.append(ids(ASSISTANT), SegmentKind.ASSISTANT)
        seq.append(ids(128821, *([8] * body), END_THINK), SegmentKind.THINKING)
        seq.append(ids(*([9] * 5)), SegmentKind.ASSISTANT)
        if tools:
            seq.append(ids(*([11] * body), EOS), SegmentKind.TOOL_CALL)
            seq.append(ids(USER, *([12] * body)), SegmentKind.TOOL_RESULT)
            seq.append(ids(ASSISTANT, END_THINK, 13, 13, EOS), SegmentKind.ASSISTANT)
        else:
            seq.append_token(EOS)


def test_feeding_tracks_tokens_segments_and_system_prefix() -> None:
    s = EngineSequence("a", context_tokens=1000)
    with pytest.raises(ValueError, match="first append must name its segment kind"):
        s.append(ids(1, 2))
    s.append([0, 5, 6], SegmentKind.SYSTEM)
    s.append(ids(7))  # continues the system segment
    assert s.system_tokens == 4
    s.append(ids(USER, 3), SegmentKind.USER)
    s.append_token(4)
    assert s.num_tokens == 7 and s.system_tokens == 4
    assert s.segments() == [(0, 4, SegmentKind.SYSTEM), (4, 7, SegmentKind.USER)]
    assert s.ids().tolist() == [0, 5, 6, 7, USER, 3, 4]
    with pytest.raises(ValueError, match="int32"):
        s.append(np.zeros(3, dtype=np.int64))


def test_check_fires_exactly_at_the_configured_lines() -> None:
    cfg = CompactConfig(context_tokens=100_000, reply_reserve_tokens=1000)
    s = EngineSequence("a", context_tokens=100_000, config=cfg)
    s.append(np.zeros(83_999, dtype=np.int32), SegmentKind.SYSTEM)
    # Soft: held + next + reserve >= 85% of 100k (the free-token line, min(8192, 25k) free, is later).
    assert s.check() is Decision.NONE  # 84_999 used
    assert s.check(1) is Decision.SOFT  # 85_000
    assert s.check(15_001) is Decision.SOFT  # exactly 100_000: still fits
    assert s.check(15_002) is Decision.HARD  # 100_001: does not fit
    assert EngineSequence("u", context_tokens=None).check(10**9) is Decision.UNKNOWN_CONTEXT


def test_small_windows_fire_on_free_tokens() -> None:
    cfg = CompactConfig(context_tokens=10_000, reply_reserve_tokens=1000)
    s = EngineSequence("a", context_tokens=10_000, config=cfg)
    s.append(np.zeros(6499, dtype=np.int32), SegmentKind.SYSTEM)
    # free <= min(8192, 10k / 4) = 2500 fires before the 85% line (8500).
    assert s.check() is Decision.NONE  # 7499 used, 2501 free
    assert s.check(1) is Decision.SOFT  # 2500 free
    off = EngineSequence("b", context_tokens=10_000,
                         config=CompactConfig.preset("both", context_tokens=10_000, soft={"enabled": False},
                                                     hard={"enabled": False}))
    off.append(np.zeros(9999, dtype=np.int32), SegmentKind.SYSTEM)
    assert off.check(10**6) is Decision.NONE


def _legal(seq: EngineSequence, start: int, bottom: int) -> bool:
    spans = seq.no_entry_spans()
    return all(not (b < start < e) for b, e in spans.tolist())


@settings(max_examples=60, deadline=None)
@given(turns=st.integers(1, 12), body=st.integers(1, 40), budget=st.integers(0, 600), tools=st.booleans())
def test_tail_starts_at_a_boundary_and_never_inside_a_no_entry_span(
    turns: int, body: int, budget: int, tools: bool
) -> None:
    s = EngineSequence("h", context_tokens=100_000)
    conversation(s, turns, body=body, tools=tools)
    t = s.tail(budget)
    all_ids = s.ids()
    assert s.system_tokens <= t.start <= s.num_tokens
    assert t.num_tokens == s.num_tokens - t.start <= budget
    assert _legal(s, t.start, s.num_tokens)
    if t.at_boundary and t.num_tokens:
        kind = DEEPSEEK_V4.boundaries[t.rule]
        marker = all_ids[t.start - 1] if kind.cut_after else all_ids[t.start]
        assert marker == kind.token_id
    # The best start by the plain rule: the oldest user marker (outside tool groups) within the budget.
    users = [p for p in range(s.system_tokens, s.num_tokens) if all_ids[p] == USER
             and s.num_tokens - p <= budget and _legal(s, p, s.num_tokens)]
    if users and t.rule == 0:
        assert t.start == min(users)


def test_tool_results_are_never_orphaned_by_the_tail() -> None:
    s = EngineSequence("t", context_tokens=100_000)
    conversation(s, 3, body=30)
    segs = s.segments()
    # A budget that reaches just into the last tool result: the <|User|> of the result must not be chosen.
    result_begin = [b for b, _, k in segs if k is SegmentKind.TOOL_RESULT][-1]
    t = s.tail(s.num_tokens - result_begin)
    assert t.start != result_begin
    assert _legal(s, t.start, s.num_tokens)


def _message_starts(seq: EngineSequence) -> list[int]:
    return [b for b, _, _ in seq.segments()]


def test_a_control_token_typed_inside_a_user_message_never_starts_the_tail() -> None:
    # A user who types the literal "<｜User｜>" gets the special id from an HF or vLLM tokenizer (special
    # tokens are parsed by default), so the marker appears inside the message, not only at its start.
    s = EngineSequence("typed", context_tokens=100_000)
    s.append(ids(0, *range(10, 30)), SegmentKind.SYSTEM)
    s.append(ids(USER, *([7] * 20)), SegmentKind.USER)
    s.append(ids(ASSISTANT, *([8] * 20), EOS), SegmentKind.ASSISTANT)
    typed_start = s.num_tokens
    s.append(ids(USER, *([7] * 10), USER, *([7] * 10)), SegmentKind.USER)  # the typed marker at +11
    answer_start = s.num_tokens
    s.append(ids(ASSISTANT, *([9] * 5), EOS), SegmentKind.ASSISTANT)
    # 20 tokens reach the typed marker (18 from the end) but not the message start (29 from the end):
    # a scan of raw ids takes the typed marker as a user turn and splits the message.
    t = s.tail(20)
    assert t.start in _message_starts(s), f"tail starts at {t.start}, inside the message at {typed_start}"
    assert (t.start, t.num_tokens, t.rule) == (answer_start, 7, 1)  # the assistant turn that fits
    # With room for the whole message the tail starts at its real user marker.
    assert s.tail(29).start == typed_start and s.tail(29).rule == 0
    # The rebuild keeps whole messages: the tail's first segment is the answer, right after the summary.
    r = s.rebuild(ids(USER, 5, 5), bottom=s.num_tokens, tail=t)
    assert s.segments()[-1] == (s.system_tokens + 3, len(r.ids), SegmentKind.ASSISTANT)


_SPECIALS = (USER, ASSISTANT, EOS, END_THINK)
_KINDS = tuple(k for k in SegmentKind if k is not SegmentKind.SYSTEM)


@st.composite
def _messages(draw: st.DrawFn) -> list[tuple[SegmentKind, list[int], int]]:
    """(kind, ids, chunk size) per message: framed as the template frames it, with the special
    boundary ids also scattered inside the text (typed by the user, or quoted by a tool)."""
    out: list[tuple[SegmentKind, list[int], int]] = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(_KINDS))
        text = draw(st.lists(st.integers(2, 40), min_size=1, max_size=30))
        for _ in range(draw(st.integers(0, 3))):
            text.insert(draw(st.integers(1, len(text))), draw(st.sampled_from(_SPECIALS)))
        lead = {SegmentKind.USER: [USER], SegmentKind.ASSISTANT: [ASSISTANT]}.get(kind, [])
        tail = [EOS] if draw(st.booleans()) else []
        out.append((kind, lead + text + tail, draw(st.integers(1, 8))))
    return out


def _reference_tail(seq: EngineSequence, bottom: int, budget_tokens: int) -> tuple[int, int, int]:
    """The old contract (boundary order, min_fill, no-entry spans, raw cut), with the recorded message
    starts as the only candidate cuts."""
    all_ids = seq.ids().tolist()
    spans = seq.no_entry_spans().tolist()
    lowest = max(seq.system_tokens, bottom - budget_tokens)
    cuts = [c for c in _message_starts(seq) if lowest <= c < bottom and not any(b < c < e for b, e in spans)]
    oldest: dict[int, int] = {}
    for c in cuts:
        for r, kind in enumerate(DEEPSEEK_V4.boundaries):
            marker = all_ids[c - 1] if kind.cut_after else all_ids[c]
            if marker == kind.token_id and r not in oldest:
                oldest[r] = c
    if oldest:
        want = DEFAULT_MIN_FILL * float(bottom - min(oldest.values()))
        r = min(r for r, c in oldest.items() if float(bottom - c) >= want)
        return oldest[r], bottom - oldest[r], r
    return (cuts[0], bottom - cuts[0], RAW_CUT) if cuts else (bottom, 0, NO_TAIL)


@settings(max_examples=300, deadline=None)
@given(messages=_messages(), data=st.data())
def test_tail_starts_only_at_recorded_message_starts(
    messages: list[tuple[SegmentKind, list[int], int]], data: st.DataObject
) -> None:
    s = EngineSequence("p", context_tokens=100_000)
    s.append(ids(0, USER, 3, ASSISTANT), SegmentKind.SYSTEM)  # markers in the prefix never start a tail
    for kind, message, chunk_tokens in messages:
        s.append(ids(*message[:chunk_tokens]), kind)  # prompt chunks and sampled tokens continue it
        for p in range(chunk_tokens, len(message), chunk_tokens):
            s.append(ids(*message[p : p + chunk_tokens]))
    bottom = data.draw(st.integers(s.system_tokens, s.num_tokens), label="bottom")
    budget_tokens = data.draw(st.integers(0, s.num_tokens + 5), label="budget_tokens")
    t = s.tail(budget_tokens, bottom=bottom)
    assert t.start in _message_starts(s) or (t.start == bottom and t.num_tokens == 0)
    assert s.system_tokens <= t.start <= bottom
    assert t.num_tokens == bottom - t.start <= budget_tokens
    assert t.num_tokens == 0 or _legal(s, t.start, bottom)  # an empty tail starts at bottom, wherever it is
    assert (t.start, t.num_tokens, t.rule) == _reference_tail(s, bottom, budget_tokens)


def test_rebuild_splices_system_summary_tail_and_plans_the_kv() -> None:
    s = EngineSequence("r", context_tokens=4000, page_size_tokens=16)
    conversation(s, 10, body=40)
    old = s.ids()
    bottom = s.num_tokens
    tail = s.tail(400, bottom=bottom)
    s.append(ids(USER, 99, 99), SegmentKind.USER)  # queued while the summary was written
    summary = ids(USER, 5, 5, 5, 5)
    pages = -(-s.num_tokens // 16)
    table = np.arange(100, 100 + pages, dtype=np.int32)
    r = s.rebuild(summary, bottom=bottom, tail=tail, block_table=table)
    expected = np.concatenate([old[: s.system_tokens], summary, old[tail.start:bottom], ids(USER, 99, 99)])
    assert r.ids.tolist() == expected.tolist()
    assert s.ids().tolist() == expected.tolist()
    assert r.appended_after_bottom_tokens == 3
    # The KV keeps the page-aligned common prefix: the system prefix (21 ids) and the <|User|> the
    # summary shares with the first turn -> one page of 16.
    assert r.kv.common_prefix_tokens == s.system_tokens + 1
    assert r.kv.reuse_tokens == 16 and r.kv.pages_kept == 1
    assert r.kv.kept_blocks is not None and r.kv.kept_blocks.tolist() == [100]
    assert r.kv.freed_blocks is not None and len(r.kv.freed_blocks) == pages - 1
    assert r.kv.prefill_tokens == len(r.ids) - 16
    # Segments after the rebuild: system, summary, then the tail's own segments, shifted.
    segs = s.segments()
    assert segs[0][2] is SegmentKind.SYSTEM and segs[1] == (s.system_tokens, s.system_tokens + 5, SegmentKind.SUMMARY)
    assert segs[-1][2] is SegmentKind.USER and segs[-1][1] == len(r.ids)
    assert s.num_compactions == 1
    # A second compaction works on the rebuilt buffer.
    r2 = s.rebuild(ids(USER, 6), bottom=s.num_tokens)
    assert r2.ids[: s.system_tokens].tolist() == old[: s.system_tokens].tolist()


def test_rebuild_rejects_a_tail_from_another_bottom() -> None:
    s = EngineSequence("r", context_tokens=4000)
    conversation(s, 3)
    t = s.tail(100)
    with pytest.raises(ValueError, match="compute the tail with the same bottom"):
        s.rebuild(ids(USER), bottom=s.system_tokens, tail=t)
    with pytest.raises(IndexError, match="bottom"):
        s.rebuild(ids(USER), bottom=s.num_tokens + 1)


def test_registry_many_sequences_from_many_threads() -> None:
    reg = SequenceRegistry(context_tokens=3000, config=CompactConfig(context_tokens=3000, reply_reserve_tokens=200))
    errors: list[BaseException] = []

    def engine_thread(k: int) -> None:
        try:
            s = reg.open(f"seq-{k}")
            s.append(ids(0, 1, 2, 3), SegmentKind.SYSTEM)
            for turn in range(60):
                chunk = np.full(40, k, dtype=np.int32)
                chunk[0] = USER
                if s.check(len(chunk)) is not Decision.NONE:
                    s.rebuild(ids(USER, k, k), bottom=s.num_tokens)
                s.append(chunk, SegmentKind.USER)
                assert s.num_tokens <= 3000
            # Nothing of another sequence leaked in: every id is this thread's, a marker or the prefix.
            assert set(s.ids().tolist()) <= {0, 1, 2, 3, USER, k}
        except BaseException as e:  # noqa: BLE001 - collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=engine_thread, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(reg) == 16
    assert all(s.num_compactions >= 1 for s in reg)
    with pytest.raises(ValueError, match="already open"):
        reg.open("seq-0")
    reg.close("seq-0")
    assert "seq-0" not in reg


def _example(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "examples" / "engine_example.py"), *argv],
                          capture_output=True, text=True, env=ctxfold_env(), timeout=120, check=False)


def test_worked_example_runs_on_the_demo_conversation() -> None:
    out = _example("--context-tokens", "16384")
    assert out.returncode == 0, out.stderr
    assert "compaction" in out.stdout and "tokens held of 16384" in out.stdout


def test_worked_example_reads_a_trace_file(synthetic_traces: dict[Path, Any]) -> None:
    trace = next(p for p in synthetic_traces if p.name.endswith(".traj.json"))
    out = _example(str(trace), "--context-tokens", "8192")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(trace.name.removesuffix(".traj.json")) and "compaction" in out.stdout


def test_worked_example_on_a_missing_file_says_so_in_one_line(tmp_path: Path) -> None:
    out = _example(str(tmp_path / "nope.json"))
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("engine_example: error: ") and "nope.json" in line
