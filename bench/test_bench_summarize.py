"""Speed of the extractive summary and of the stream cutter, each beside a naive baseline in the same run.

Run: ``pytest bench/test_bench_summarize.py --benchmark-enable``. Groups:

- ``extractive-2000``: the extractive summary of 2,000 real messages (tool outputs included) against two
  baselines over the same messages: Datus's request-size estimate (``len(json.dumps(item)) // 4`` per item,
  one pass, what it runs before every request) and the naive "summary" of rendering the transcript and cutting
  it to the cap.
- ``cutter-4096``: a 4,096-token answer streamed through StreamCutter piece by piece, against joining the
  pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat import formats
from ctxfold.chat.messages import Message
from ctxfold.compaction.summarize import StreamCutter, extractive_summary
from ctxfold.compaction.summarize.request import render_plain, to_openai_messages

CAP_TOKENS = 4096


@pytest.fixture(scope="module")
def messages(traces_dir: Path) -> list[Message]:
    convs = [c for d in ("deepseek_sample", "swe_agent", "openhands", "tau_bench")
             for p in sorted((traces_dir / d).rglob("*.*")) if p.suffix in (".json", ".jsonl", ".traj")
             for c in formats.load(p)]
    pool = [m for c in convs if c.source_format in ("mini_swe_agent", "swe_agent", "openhands") for m in c.messages]
    pool += [m for c in convs for m in c.messages]
    return (pool * (2000 // len(pool) + 1))[:2000]


@pytest.mark.benchmark(group="extractive-2000")
def test_extractive_summary(benchmark: Any, messages: list[Message]) -> None:
    text = benchmark(extractive_summary, messages, CAP_TOKENS)
    assert (len(text) + 3) // 4 <= CAP_TOKENS


@pytest.mark.benchmark(group="extractive-2000")
def test_baseline_datus_estimate(benchmark: Any, messages: list[Message]) -> None:
    items = to_openai_messages(messages)
    n = benchmark(lambda: sum(len(json.dumps(i, ensure_ascii=False, default=str)) // 4 for i in items))
    assert n > 0


@pytest.mark.benchmark(group="extractive-2000")
def test_baseline_render_and_truncate(benchmark: Any, messages: list[Message]) -> None:
    text = benchmark(lambda: render_plain(messages)[-CAP_TOKENS * 4:])
    assert len(text) == CAP_TOKENS * 4


PIECES = [f" word{i % 97}" for i in range(4096)]


@pytest.mark.benchmark(group="cutter-4096")
def test_stream_cutter(benchmark: Any) -> None:
    def run() -> str:
        c = StreamCutter(CAP_TOKENS * 2)
        for p in PIECES:
            c.feed(p)
        c.finish()
        return c.text

    assert benchmark(run).strip() == "".join(PIECES).strip()


@pytest.mark.benchmark(group="cutter-4096")
def test_baseline_join(benchmark: Any) -> None:
    assert benchmark(lambda: "".join(PIECES))
