"""The benchmark page renderer (bench/report.py): roles, ratios, slopes and what was not measured.

The suite itself runs only under ``bench/run.py``; these tests check that a run's results turn into
the right page, on hand-made pytest-benchmark JSON and junit XML.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report_under_test", BENCH / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def bench(name: str, group: str, median_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "group": group,
        "extra_info": extra,
        "stats": {"median": median_s, "iqr": median_s / 10, "rounds": 7},
    }


def write_run(tmp_path: Path, benchmarks: list[dict[str, Any]], junit: str | None = None) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    (results / "benchmarks.json").write_text(json.dumps({"benchmarks": benchmarks}))
    if junit is not None:
        (results / "junit.xml").write_text(junit)
    return results


def test_roles_from_extra_info_or_names(report: ModuleType) -> None:
    assert report.role_of("test_tail_2000", {}) == "ctxfold"
    assert report.role_of("test_tail_numpy", {}) == "baseline"
    assert report.role_of("test_trim_messages_2000", {}) == "baseline"
    assert report.role_of("test_chars4", {}) == "baseline"
    # extra_info wins over the name
    assert report.role_of("test_numpy_view_wrapper", {"role": "ctxfold"}) == "ctxfold"
    assert report.role_of("test_fast_path", {"role": "Baseline"}) == "baseline"


def test_ratio_against_the_named_baselines_of_the_same_group(report: ModuleType, tmp_path: Path) -> None:
    results = write_run(
        tmp_path,
        [
            bench("test_tail", "tail", 2e-6, baseline="trim_messages"),
            bench("test_tail_both", "tail", 4e-6, baseline=["numpy", "trim_messages"]),
            bench("test_tail_trim_messages", "tail", 7e-4, method="trim_messages"),
            bench("test_tail_numpy", "tail", 2e-5),
            bench("test_other", "other", 1e-3),  # another group: never a ratio against tail's baselines
        ],
    )
    page = report.render(results, tmp_path / "docs" / "benchmarks.md").read_text()
    lines = page.splitlines()
    row = next(line for line in lines if line.startswith("| `tail` "))
    assert "**350x faster**" in row  # 7e-4 / 2e-6, against the baseline it names
    assert "10x" not in row  # not against numpy, which it does not name
    row = next(line for line in lines if line.startswith("| `tail_both` "))
    assert "**175x faster**" in row and "**5x faster**" in row  # both, as listed
    assert "_No baseline in this group's run: no ratio._" in page  # group "other"


def test_every_baseline_without_a_name(report: ModuleType, tmp_path: Path) -> None:
    results = write_run(
        tmp_path,
        [
            bench("test_count", "count", 1e-3),
            bench("test_count_baseline_a", "count", 4e-3),
            bench("test_count_naive", "count", 5e-4),
        ],
    )
    page = report.render(results, tmp_path / "docs" / "benchmarks.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `count` "))
    assert "**4x faster**" in row and "2x slower" in row


@pytest.mark.parametrize(("exponent", "kind"), [(0.0, "constant"), (1.0, "linear"), (2.0, "superlinear")])
def test_slope_of_the_largest_sizes(report: ModuleType, exponent: float, kind: str) -> None:
    # A fixed overhead at the small sizes must not bend the fitted slope.
    points = [(10.0, 1e-3)] + [(float(n), 1e-9 * n**exponent) for n in (1e3, 1e4, 1e5)]
    slope = report.fit_slope(points)
    assert slope == pytest.approx(exponent, abs=1e-9)
    assert kind in report.describe_slope(slope)


def test_scaling_group_table_and_plot(report: ModuleType, tmp_path: Path) -> None:
    sizes = [10, 100, 1000]
    benchmarks = [
        bench(
            f"test_ledger[{n}]",
            "scaling: ledger",
            5e-7,
            method="ledger",
            role="ctxfold",
            baseline="recount",
            size=n,
            size_unit="messages",
        )
        for n in sizes
    ]
    benchmarks += [
        bench(
            f"test_recount[{n}]",
            "scaling: ledger",
            4e-9 * n,
            method="recount",
            role="baseline",
            size=n,
            size_unit="messages",
        )
        for n in sizes
    ]
    out = tmp_path / "docs" / "benchmarks.md"
    page = report.render(write_run(tmp_path, benchmarks), out).read_text()
    assert "| messages | `ledger` | `recount` | ledger vs recount |" in page
    assert "0.00 (constant)" in page and "1.00 (linear)" in page
    assert "**8x faster**" in page  # at 1000 messages: 4e-6 / 5e-7
    assert (out.parent / "bench" / "scaling-ledger.png").stat().st_size > 1000


def test_skips_and_collection_errors_are_listed(report: ModuleType, tmp_path: Path) -> None:
    junit = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>
    <testcase classname="bench.bench_scaling" name="test_a[1]"><skipped message="ctxfold.core.tail is not in this build"/></testcase>
    <testcase classname="bench.bench_scaling" name="test_a[2]"><skipped message="ctxfold.core.tail is not in this build"/></testcase>
    <testcase classname="bench.bench_tail" name="bench.bench_tail"><error message="collection failure">Traceback
E   ImportError: cannot import name 'select_tail'</error></testcase>
    </testsuite></testsuites>"""
    page = report.render(write_run(tmp_path, [], junit), tmp_path / "docs" / "benchmarks.md").read_text()
    assert "- `bench_scaling`: 2 tests: ctxfold.core.tail is not in this build" in page
    assert "ImportError: cannot import name 'select_tail'" in page
    assert "_No benchmark results in this run._" in page


def test_missing_results_render_a_page_not_a_traceback(report: ModuleType, tmp_path: Path) -> None:
    empty = tmp_path / "nothing"
    empty.mkdir()
    page = report.render(empty, tmp_path / "docs" / "benchmarks.md").read_text()
    assert "_Machine information was not recorded._" in page
    assert "_Quality figures were not computed in this run._" in page


def test_targets_and_the_glance_table(report: ModuleType, tmp_path: Path) -> None:
    results = write_run(
        tmp_path,
        [
            bench("test_tail", "tail", 2e-6, target_s=20e-6),
            bench("test_prefix", "prefix", 8e-4, target_s=5e-4),
            bench("test_prefix_numpy", "prefix", 4e-4),
        ],
    )
    page = report.render(results, tmp_path / "docs" / "benchmarks.md").read_text()
    glance = page.split("## At a glance", 1)[1].split("## ", 1)[0]
    assert "| tail | `tail` | 2 us | - | <= 20 us: met |" in glance
    assert (
        "| prefix | `prefix` | 800 us | `prefix_numpy` 400 us: 2x slower | <= 500 us: **missed** |" in glance
    )


def test_other_extra_info_is_shown_as_recorded_figures(report: ModuleType, tmp_path: Path) -> None:
    results = write_run(
        tmp_path,
        [
            bench("test_estimate", "estimate", 1e-3, **{"MB/s": 612.345, "texts": 6214}),
            bench("test_chars4", "estimate", 5e-4),
        ],
    )
    page = report.render(results, tmp_path / "docs" / "benchmarks.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `estimate` "))
    assert "MB/s 612; texts 6,214" in row
