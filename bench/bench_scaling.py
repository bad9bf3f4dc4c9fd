"""Cost against size: which parts of ctxfold grow with the conversation and which stay constant.

    python bench/run.py                       # the whole suite, rendered into docs/benchmarks.md
    pytest bench/bench_scaling.py --benchmark-enable

Every benchmark here is parametrized by size, 1k to 1M tokens or 10 to 100,000 messages, over the
synthetic transcripts of ``synth`` (the real traces repeated), and records ``size`` and
``size_unit`` in ``extra_info``: the results page draws each group as a log-log plot with the
slope fitted per method (1 = linear, 0 = constant). Baselines run in the same groups:

- counting: the C++ estimator and ctxfold's exact counter against the ``tokenizers`` library called
  directly and chars/4;
- ledger: append one message and read the total, against summing the cached per-message counts;
- segment tail (32k budget): ctxfold against a vectorised numpy scan and langchain-core's
  ``trim_messages`` (whose sizes stop at TRIM_MESSAGES_MAX);
- token tail (50k budget) and common prefix: ctxfold against numpy over the whole buffer;
- archive pass: the turn-start pass with nothing to archive, against serialising every message to
  JSON and checking it (what Datus does every turn);
- before_request: the compactor's per-request overhead when nothing fires, against what LangChain's
  summarization middleware does before every call (count the whole list, approximately).

Set CTXFOLD_BENCH_QUICK=1 to drop the largest size of each axis (a smoke run).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import peers
import synth
from ctxfold import _core

QUICK = os.environ.get("CTXFOLD_BENCH_QUICK", "") not in ("", "0")
SIZES_TOKENS = [1_000, 10_000, 100_000, 1_000_000][: 3 if QUICK else None]
SIZES_MESSAGES = [10, 100, 1_000, 10_000, 100_000][: 4 if QUICK else None]
# trim_messages walks the whole list several times a call (about 0.2 s at 100,000 messages, after
# 3 s of converting them to LangChain objects): a smaller cap keeps a slow machine's run short.
TRIM_MESSAGES_MAX = 100_000
SEGMENT_BUDGET_TOKENS = 32_000
TOKEN_BUDGET_TOKENS = 50_000


def _info(
    benchmark: Any,
    *,
    method: str,
    role: str,
    size: int,
    unit: str,
    baseline: str | list[str] | None = None,
    **more: Any,
) -> None:
    benchmark.extra_info.update(method=method, role=role, size=size, size_unit=unit, **more)
    if baseline is not None:
        benchmark.extra_info["baseline"] = baseline


# A call slower than this is timed in SLOW_ROUNDS rounds: at the largest sizes the exact tokenizer
# (seconds per call) and trim_messages would otherwise hold the suite for half a minute each.
SLOW_CALL_S = 0.1
SLOW_ROUNDS = 3


def run(benchmark: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``benchmark(fn, ...)``, or a fixed few rounds when one call is slow (timed once first)."""
    start = time.perf_counter()
    fn(*args, **kwargs)
    if time.perf_counter() - start < SLOW_CALL_S:
        return benchmark(fn, *args, **kwargs)
    return benchmark.pedantic(fn, args=args, kwargs=kwargs, rounds=SLOW_ROUNDS, iterations=1)


def _pool() -> None:
    """The transcripts need the real traces and the DeepSeek V4 tokenizer (the tokenizers extra): skip,
    do not fail."""
    synth.need_traces()
    try:
        synth.pool()
    except ImportError as exc:
        pytest.skip(f"synthetic transcripts unavailable: {exc}")


@functools.cache
def by_tokens(num_tokens: int) -> synth.Transcript:
    _pool()
    return synth.transcript_tokens(num_tokens)


@functools.cache
def by_messages(num_messages: int) -> synth.Transcript:
    _pool()
    return synth.transcript(num_messages)


@functools.cache
def lc_of(num_messages: int) -> list[Any]:
    """The transcript as LangChain message objects (3 s at 100,000 messages: converted once)."""
    return peers.to_langchain(by_messages(num_messages).messages)


@functools.cache
def ids_of(num_tokens: int) -> npt.NDArray[np.int32]:
    _pool()
    return synth.token_ids(num_tokens)


# ---- counting ------------------------------------------------------------------------------------

COUNTING = "scaling: counting"
TOKENIZERS_DIRECT = "tokenizers encode_batch"


def _coefficients() -> npt.NDArray[np.float64]:
    """A built-in calibration's coefficients when ctxfold.tokens.counting has them; the cost of the
    estimator does not depend on their values, so any finite vector times it as well."""
    try:
        from ctxfold.tokens.counting import builtin_calibration, builtin_calibrations

        names = builtin_calibrations()
        if names:
            return np.ascontiguousarray(builtin_calibration(names[0]).coefficients, np.float64)
    except ImportError:
        pass
    return np.full(_core.NUM_FEATURES, 0.25, np.float64)


@pytest.mark.benchmark(group=COUNTING)
@pytest.mark.parametrize("num_tokens", SIZES_TOKENS)
def test_scaling_estimator(benchmark: Any, num_tokens: int) -> None:
    t = by_tokens(num_tokens)
    coef = _coefficients()
    _info(
        benchmark,
        method="ctxfold estimator",
        role="ctxfold",
        size=t.num_tokens,
        unit="tokens",
        baseline=[TOKENIZERS_DIRECT, "chars/4"],
        nbytes=t.nbytes,
    )
    counts = benchmark(_core.estimate_batch, t.texts, coef)
    assert len(counts) == len(t.texts)


@pytest.mark.benchmark(group=COUNTING)
@pytest.mark.parametrize("num_tokens", SIZES_TOKENS)
def test_scaling_exact_ctxfold(benchmark: Any, num_tokens: int) -> None:
    counting = pytest.importorskip("ctxfold.tokens.counting", reason="ctxfold.tokens.counting is not in this build")
    counter = counting.load_counter("deepseek-v4")
    t = by_tokens(num_tokens)
    _info(
        benchmark,
        method="ctxfold exact (deepseek-v4)",
        role="ctxfold",
        size=t.num_tokens,
        unit="tokens",
        baseline=TOKENIZERS_DIRECT,
        nbytes=t.nbytes,
    )
    counts = run(benchmark, counter.count_batch, t.texts)
    assert int(counts.sum()) == t.num_tokens - synth.PER_MESSAGE_TOKENS * len(t.texts)


@pytest.mark.benchmark(group=COUNTING)
@pytest.mark.parametrize("num_tokens", SIZES_TOKENS)
def test_scaling_tokenizers_baseline(benchmark: Any, num_tokens: int) -> None:
    tok = synth.deepseek_tokenizer()
    t = by_tokens(num_tokens)
    _info(
        benchmark,
        method=TOKENIZERS_DIRECT,
        role="baseline",
        size=t.num_tokens,
        unit="tokens",
        nbytes=t.nbytes,
    )

    def count() -> list[int]:
        return [len(e.ids) for e in tok.encode_batch(t.texts, add_special_tokens=False)]

    counts = run(benchmark, count)
    assert sum(counts) == t.num_tokens - synth.PER_MESSAGE_TOKENS * len(t.texts)


@pytest.mark.benchmark(group=COUNTING)
@pytest.mark.parametrize("num_tokens", SIZES_TOKENS)
def test_scaling_chars4_baseline(benchmark: Any, num_tokens: int) -> None:
    t = by_tokens(num_tokens)
    _info(benchmark, method="chars/4", role="baseline", size=t.num_tokens, unit="tokens", nbytes=t.nbytes)
    counts = benchmark(lambda: [len(x) // 4 for x in t.texts])
    assert len(counts) == len(t.texts)


# ---- ledger: O(1) totals -------------------------------------------------------------------------

LEDGER = "scaling: ledger append + total"


@functools.cache
def _ledger_arrays(num_messages: int) -> tuple[Any, ...]:
    t = by_messages(num_messages)
    keys = np.arange(1, num_messages + 1, dtype=np.uint64)
    return keys, t.tokens, t.flags, t.groups.astype(np.int64)


@pytest.mark.benchmark(group=LEDGER)
@pytest.mark.parametrize("num_messages", SIZES_MESSAGES)
def test_scaling_ledger(benchmark: Any, num_messages: int) -> None:
    keys, tokens, flags, groups = _ledger_arrays(num_messages)
    ledger = _core.Ledger()
    ledger.append_batch(keys, tokens, flags, groups)
    n = len(ledger)
    _info(benchmark, method="ctxfold Ledger", role="ctxfold", size=n, unit="messages", baseline="recount")

    def step() -> int:
        # One new message arrives, the request is counted, and the ledger is put back.
        ledger.append(0, 57, synth.FLAG_USER | synth.FLAG_USER_TURN, n)
        total: int = ledger.total_tokens
        ledger.truncate(n)
        return total

    assert benchmark(step) == int(tokens.sum()) + 57


@pytest.mark.benchmark(group=LEDGER)
@pytest.mark.parametrize("num_messages", SIZES_MESSAGES)
def test_scaling_recount_baseline(benchmark: Any, num_messages: int) -> None:
    _, tokens, _, _ = _ledger_arrays(num_messages)
    counts = [int(x) for x in tokens]
    _info(benchmark, method="recount", role="baseline", size=len(counts), unit="messages")

    def step() -> int:
        # Even with every message's count cached, the total is summed again for each request.
        counts.append(57)
        total = sum(counts)
        counts.pop()
        return total

    assert benchmark(step) == int(tokens.sum()) + 57


# ---- segment tail ------------------------------------------------------------------------------

SEGMENT_TAIL = "scaling: segment tail (32k budget)"


@pytest.mark.benchmark(group=SEGMENT_TAIL)
@pytest.mark.parametrize("num_messages", SIZES_MESSAGES)
def test_scaling_segment_tail(benchmark: Any, num_messages: int) -> None:
    tail = pytest.importorskip("ctxfold.core.tail", reason="ctxfold.core.tail is not in this build")
    t = by_messages(num_messages)
    _info(
        benchmark,
        method="ctxfold select_tail",
        role="ctxfold",
        size=num_messages,
        unit="messages",
        baseline=["trim_messages start_on=human", "numpy suffix scan"],
    )
    result = benchmark(tail.select_tail, t.tokens, t.flags, t.groups, budget_tokens=SEGMENT_BUDGET_TOKENS)
    assert result.num_tokens <= SEGMENT_BUDGET_TOKENS


@pytest.mark.benchmark(group=SEGMENT_TAIL)
@pytest.mark.parametrize("num_messages", SIZES_MESSAGES)
def test_scaling_segment_tail_numpy_baseline(benchmark: Any, num_messages: int) -> None:
    t = by_messages(num_messages)
    _info(benchmark, method="numpy suffix scan", role="baseline", size=num_messages, unit="messages")
    start = benchmark(peers.numpy_segment_tail, t.tokens, t.flags, SEGMENT_BUDGET_TOKENS)
    assert int(t.tokens[start:].sum()) <= SEGMENT_BUDGET_TOKENS or start == len(t.tokens)


@pytest.mark.benchmark(group=SEGMENT_TAIL)
@pytest.mark.parametrize("num_messages", [n for n in SIZES_MESSAGES if n <= TRIM_MESSAGES_MAX])
def test_scaling_trim_messages_baseline(benchmark: Any, num_messages: int) -> None:
    pytest.importorskip("langchain_core", reason="langchain-core is not installed")
    t = by_messages(num_messages)
    lc = lc_of(num_messages)
    counter = peers.list_counter(t.tokens)
    _info(
        benchmark, method="trim_messages start_on=human", role="baseline", size=num_messages, unit="messages"
    )
    if max(SIZES_MESSAGES) > TRIM_MESSAGES_MAX:
        benchmark.extra_info["note"] = (
            f"trim_messages stops at {TRIM_MESSAGES_MAX:,} messages: each call walks the whole list"
        )
    kept = run(benchmark, peers.trim_last, lc, counter, SEGMENT_BUDGET_TOKENS, start_on_human=True)
    assert counter(kept) <= SEGMENT_BUDGET_TOKENS


# ---- token tail ---------------------------------------------------------------------------------

TOKEN_TAIL = "scaling: token tail (50k budget)"


@pytest.mark.benchmark(group=TOKEN_TAIL)
@pytest.mark.parametrize("num_tokens", SIZES_TOKENS)
def test_scaling_token_tail(benchmark: Any, num_tokens: int) -> None:
    tail = pytest.importorskip("ctxfold.core.tail", reason="ctxfold.core.tail is not in this build")
    ids = ids_of(num_tokens)
    floor = min(synth.system_prefix_tokens(), len(ids))
    _info(
        benchmark,
        method="ctxfold select_token_tail",
        role="ctxfold",
        size=len(ids),
        unit="tokens",
        baseline="numpy where + searchsorted",
    )
    result = benchmark(
        tail.select_token_tail,
        ids,
        budget_tokens=TOKEN_BUDGET_TOKENS,
        boundaries=[synth.USER_ID],
        floor=floor,
    )
    assert result.num_tokens <= TOKEN_BUDGET_TOKENS


def numpy_token_tail(ids: npt.NDArray[np.int32], budget_tokens: int, boundary_id: int, floor: int) -> int:
    """Oldest boundary within the budget, the numpy way: find every boundary, then search."""
    bottom = len(ids)
    pos = np.flatnonzero(ids == boundary_id)
    i = int(np.searchsorted(pos, max(floor, bottom - budget_tokens)))
    return int(pos[i]) if i < len(pos) else max(floor, bottom - budget_tokens)


@pytest.mark.benchmark(group=TOKEN_TAIL)
@pytest.mark.parametrize("num_tokens", SIZES_TOKENS)
def test_scaling_token_tail_numpy_baseline(benchmark: Any, num_tokens: int) -> None:
    ids = ids_of(num_tokens)
    floor = min(synth.system_prefix_tokens(), len(ids))
    _info(benchmark, method="numpy where + searchsorted", role="baseline", size=len(ids), unit="tokens")
    start = benchmark(numpy_token_tail, ids, TOKEN_BUDGET_TOKENS, synth.USER_ID, floor)
    assert len(ids) - start <= TOKEN_BUDGET_TOKENS


# ---- common prefix ------------------------------------------------------------------------------

PREFIX = "scaling: common prefix"


@functools.cache
def _prefix_pair(num_tokens: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    a = ids_of(num_tokens)
    b = a.copy()
    b[-1] += 1  # the worst case: equal up to the last token
    return a, b


@pytest.mark.benchmark(group=PREFIX)
@pytest.mark.parametrize("num_tokens", SIZES_TOKENS)
def test_scaling_common_prefix(benchmark: Any, num_tokens: int) -> None:
    kvplan = pytest.importorskip("ctxfold.core.kvplan", reason="ctxfold.core.kvplan is not in this build")
    a, b = _prefix_pair(num_tokens)
    _info(
        benchmark,
        method="ctxfold common_prefix",
        role="ctxfold",
        size=len(a),
        unit="tokens",
        baseline="numpy mismatch",
    )
    assert benchmark(kvplan.common_prefix, a, b) == len(a) - 1


def numpy_common_prefix(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


@pytest.mark.benchmark(group=PREFIX)
@pytest.mark.parametrize("num_tokens", SIZES_TOKENS)
def test_scaling_common_prefix_numpy_baseline(benchmark: Any, num_tokens: int) -> None:
    a, b = _prefix_pair(num_tokens)
    _info(benchmark, method="numpy mismatch", role="baseline", size=len(a), unit="tokens")
    assert benchmark(numpy_common_prefix, a, b) == len(a) - 1


# ---- turn-start archive pass with nothing to do --------------------------------------------------

ARCHIVE = "scaling: archive pass, nothing to do"


@pytest.fixture(scope="module")
def archive_steady(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Per size, the transcript after one turn-start pass (old bulky outputs are markers now) and its
    store: the steady state every later turn sees."""
    archive = pytest.importorskip("ctxfold.compaction.archive", reason="ctxfold.compaction.archive is not in this build")
    cache: dict[int, tuple[list[Any], Any, Any]] = {}

    def get(num_messages: int) -> tuple[list[Any], Any, Any]:
        if num_messages not in cache:
            params = archive.ArchiveParams()
            store = archive.ArchiveStore(tmp_path_factory.mktemp(f"archive{num_messages}"))
            msgs, _ = archive.archive_turn_start(by_messages(num_messages).messages, store, params)
            cache[num_messages] = (msgs, store, params)
        return cache[num_messages]

    return get


@pytest.mark.benchmark(group=ARCHIVE)
@pytest.mark.parametrize("num_messages", SIZES_MESSAGES)
def test_scaling_archive_turn_start(benchmark: Any, archive_steady: Any, num_messages: int) -> None:
    from ctxfold.compaction.archive import archive_turn_start

    msgs, store, params = archive_steady(num_messages)
    _info(
        benchmark,
        method="ctxfold archive_turn_start",
        role="ctxfold",
        size=num_messages,
        unit="messages",
        baseline="json scan (Datus)",
    )
    result = benchmark(archive_turn_start, msgs, store, params)
    assert result.report.archived == ()


def json_scan(
    items: list[dict[str, Any]], keep_recent_user_turns: int, threshold_chars: int, prefix: str
) -> int:
    """The Datus way: serialise every item to size it, find the cutoff turn, check each old output."""
    sizes = [len(json.dumps(item, ensure_ascii=False, default=str)) for item in items]
    users = [i for i, item in enumerate(items) if item.get("role") == "user"]
    if len(users) <= keep_recent_user_turns:
        return 0
    cutoff = users[-keep_recent_user_turns]
    found = 0
    for item, size in zip(items[:cutoff], sizes, strict=False):
        out = item.get("content")
        if item.get("role") == "tool" and isinstance(out, str) and size >= threshold_chars:
            found += len(out) >= threshold_chars and not out.startswith(prefix)
    return found


@pytest.mark.benchmark(group=ARCHIVE)
@pytest.mark.parametrize("num_messages", SIZES_MESSAGES)
def test_scaling_archive_json_baseline(benchmark: Any, archive_steady: Any, num_messages: int) -> None:
    from ctxfold.chat.formats.openai import message_to_openai
    from ctxfold.compaction.archive import MARKER_PREFIX

    msgs, _, params = archive_steady(num_messages)
    items = [message_to_openai(m, api=True) for m in msgs]
    _info(benchmark, method="json scan (Datus)", role="baseline", size=num_messages, unit="messages")
    run(
        benchmark,
        json_scan,
        items,
        params.keep_recent_user_turns,
        params.archive_threshold_chars,
        MARKER_PREFIX,
    )


# ---- the compactor when nothing fires -------------------------------------------------------------

BEFORE_REQUEST = "scaling: before_request, nothing fires"


@functools.cache
def _compactor(num_messages: int) -> Any:
    """A compactor holding the transcript, past its first request: the turn-start archive pass has
    run, and the window is four times the conversation, so no token trigger can fire."""
    from ctxfold.chat.messages import Conversation
    from ctxfold.compaction.compactor import Compactor
    from ctxfold.compaction.config import CompactConfig
    from ctxfold.tokens.templates import DEEPSEEK_V4

    t = by_messages(num_messages)
    conv = Conversation(messages=t.messages[1:], system=t.messages[0].text)
    # The model's own chat template, as a server running DeepSeek V4 would configure it; the
    # counter stays the default (the calibrated estimator).
    config = CompactConfig(context_tokens=max(4 * t.num_tokens, 65_536))
    compactor = Compactor(conv, config=config, template=DEEPSEEK_V4)
    compactor.before_request()
    return compactor


@pytest.mark.benchmark(group=BEFORE_REQUEST)
@pytest.mark.parametrize("num_messages", SIZES_MESSAGES)
def test_scaling_before_request(benchmark: Any, num_messages: int) -> None:
    pytest.importorskip("ctxfold.compaction.compactor", reason="ctxfold.compaction.compactor is not in this build")
    compactor = _compactor(num_messages)
    events = len(compactor.events)
    _info(
        benchmark,
        method="ctxfold before_request",
        role="ctxfold",
        size=num_messages,
        unit="messages",
        baseline=LANGCHAIN_CHECK,
    )
    # The next request of a running turn: nothing new appended, nothing due.
    assert benchmark(compactor.before_request) is None
    assert len(compactor.events) == events


LANGCHAIN_CHECK = "count_tokens_approximately"


@pytest.mark.benchmark(group=BEFORE_REQUEST)
@pytest.mark.parametrize("num_messages", SIZES_MESSAGES)
def test_scaling_before_request_langchain_baseline(benchmark: Any, num_messages: int) -> None:
    """What LangChain's summarization middleware does before every model call to decide whether to
    summarize: count the whole message list again (its default counter)."""
    pytest.importorskip("langchain_core", reason="langchain-core is not installed")
    from langchain_core.messages.utils import count_tokens_approximately

    lc = lc_of(num_messages)
    _info(benchmark, method=LANGCHAIN_CHECK, role="baseline", size=num_messages, unit="messages")
    assert run(benchmark, count_tokens_approximately, lc) > 0
