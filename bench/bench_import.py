"""Import of the whole traces folder, against plain json parsing of the same files.

    pytest bench/bench_import.py --benchmark-enable

The baseline reads and parses every file with ``json`` (one ``json.loads`` per JSONL line) and
builds nothing: the ratio is what detection, conversion and ids cost on top of parsing.
Target: the whole folder in under 2 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat import formats

_NOT_TRACES = {"README.md", "LICENSE", "LICENSE.md", "SOURCE.txt"}


@pytest.fixture(scope="module")
def trace_files(traces_dir: Path) -> list[Path]:
    files = sorted(p for p in traces_dir.rglob("*") if p.is_file() and p.name not in _NOT_TRACES)
    assert files
    return files


def _json_baseline(files: list[Path]) -> int:
    n = 0
    for p in files:
        text = p.read_text(encoding="utf-8")
        try:
            value: Any = json.loads(text)
            n += 1 if not isinstance(value, list) else len(value)
        except json.JSONDecodeError:
            n += sum(1 for line in text.splitlines() if line.strip() and json.loads(line) is not None)
    return n


def _import_all(files: list[Path]) -> int:
    return sum(len(c) for p in files for c in formats.load(p))


@pytest.mark.benchmark(group="import")
def test_json_load_baseline(benchmark: Any, trace_files: list[Path]) -> None:
    assert benchmark(_json_baseline, trace_files) > 0


@pytest.mark.benchmark(group="import")
def test_import_all_traces(benchmark: Any, trace_files: list[Path]) -> None:
    messages = benchmark(_import_all, trace_files)
    assert messages > 6000
    if benchmark.stats is not None:  # None when run with --benchmark-disable (the default in CI)
        assert benchmark.stats.stats.median < 2.0, "importing the traces folder must take under 2 s"
