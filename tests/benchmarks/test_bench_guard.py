"""bench/run.py never replaces the published benchmark page with a partial one.

docs/benchmarks.md and its plots (docs/bench/*.png) are written only by a complete run: the whole suite,
with nothing skipped, failed or not measured. A partial run (no real traces, a package missing, a benchmark
failing, or ``-k``/``--quick``/``--no-quality``/``--no-serve``) writes its page to ``--partial-out`` and says
where and why on stderr; the exit status says whether something was missing (3) or failed (1).

Most tests run ``run.main`` in this process with the three steps (pytest over bench/, quality.py,
bench_serve.py) replaced by fakes that write what the real ones write, and the published page replaced by a
copy in a temporary folder; one runs ``bench/run.py`` itself on one benchmark with no traces. None of them
runs the suite, and the real docs/benchmarks.md is checked to be untouched after each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from helpers.bench_modules import bench_module

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
DOCS = REPO / "docs"

SKIP_TRACES = "real traces not found at /nowhere/traces: the real agent traces are not part of the project"


def _digest(folder: Path) -> dict[str, str]:
    """The published page and its plots, by content."""
    files = [folder / "benchmarks.md", *sorted((folder / "bench").glob("*.png"))]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


@pytest.fixture(scope="module")
def run() -> Iterator[ModuleType]:
    with bench_module("run.py") as module:
        yield module


@pytest.fixture(autouse=True)
def real_page_untouched() -> Iterator[None]:
    before = _digest(DOCS)
    yield
    assert _digest(DOCS) == before, "a test changed the real docs/benchmarks.md or docs/bench/*.png"


@pytest.fixture
def published(run: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the published page and plots, standing in for docs/ (run.py's default --out)."""
    docs = tmp_path / "docs"
    (docs / "bench").mkdir(parents=True)
    shutil.copy2(DOCS / "benchmarks.md", docs / "benchmarks.md")
    for png in (DOCS / "bench").glob("*.png"):
        shutil.copy2(png, docs / "bench" / png.name)
    assert any((docs / "bench").glob("*.png")), "the committed plots are part of what must survive"
    monkeypatch.setattr(run.report, "COMMITTED_PAGE", docs / "benchmarks.md")
    return docs


# ---- fakes of the three steps: they write what the real ones write -----------------------------------


def _junit(cases: list[str]) -> str:
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>' + "".join(cases)
            + "</testsuite></testsuites>")


def _case(name: str, inner: str = "") -> str:
    return f'<testcase classname="bench.bench_tail" name="{name}">{inner}</testcase>'


def _bench(name: str, median_s: float) -> dict[str, Any]:
    return {"name": name, "group": "tail", "extra_info": {},
            "stats": {"median": median_s, "iqr": median_s / 10, "rounds": 7}}


class Steps:
    """What each fake step writes; a test changes the parts it is about."""

    def __init__(self) -> None:
        self.benchmarks = [_bench("test_tail", 2e-6), _bench("test_tail_numpy", 2e-5)]
        self.junit = [_case("test_tail"), _case("test_tail_numpy")]
        self.pytest_rc = 0
        self.quality: dict[str, Any] = {"sections": [{"title": "Tail selection", "intro": "ok", "tables": []}]}
        self.serve_traces: dict[str, Any] = {"direct": {}}  # a phase that ran; {"status": ...} when not

    def install(self, run: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
        def fake_pytest(results: Path, env: dict[str, str], args: Any) -> int:
            (results / "benchmarks.json").write_text(json.dumps({"benchmarks": self.benchmarks}))
            (results / "junit.xml").write_text(_junit(self.junit))
            return self.pytest_rc

        def fake_quality(results: Path, env: dict[str, str], timeout_s: float) -> None:
            (results / "quality.json").write_text(json.dumps(self.quality))

        def fake_serve(results: Path, env: dict[str, str], timeout_s: float) -> None:
            for name in ("serve.json", "serve_fsync_always.json"):
                (results / name).write_text(json.dumps({"conversations": 64, "traces": self.serve_traces}))

        monkeypatch.setattr(run, "_check_import", lambda env: None)
        monkeypatch.setattr(run, "run_pytest", fake_pytest)
        monkeypatch.setattr(run, "run_quality", fake_quality)
        monkeypatch.setattr(run, "run_serve", fake_serve)
        monkeypatch.setattr(run.report, "render_serve", lambda runs: ["(proxy latency)"])


def no_traces(steps: Steps, run: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a fresh clone without ../shared/traces gets from the real steps."""
    monkeypatch.setattr(run, "TRACES_DIR", tmp_path / "no-traces")
    steps.benchmarks = [_bench("test_token_tail", 1e-6)]  # the ones that need no traces
    steps.junit = [_case("test_token_tail")] + [
        _case(f"test_segment_tail_{i}", f'<skipped message="{SKIP_TRACES}"/>') for i in range(3)
    ]
    steps.quality = {"sections": [{"title": "Quality figures", "status": "bench/quality.py exited with status 2"}]}
    steps.serve_traces = {"status": f"no traces at {tmp_path / 'no-traces'}"}


@pytest.fixture
def steps(run: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Steps:
    traces = tmp_path / "traces"
    traces.mkdir()
    monkeypatch.setattr(run, "TRACES_DIR", traces)
    s = Steps()
    s.install(run, monkeypatch)
    return s


# ---- the tests ------------------------------------------------------------------------------------------


def test_run_without_traces_leaves_the_published_page_and_says_why(
    run: ModuleType, steps: Steps, published: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`python bench/run.py` in a fresh clone: no --out, no traces beside it."""
    no_traces(steps, run, monkeypatch, tmp_path)
    before = _digest(published)
    results = tmp_path / "results"

    rc = run.main(["--results", str(results)])

    err = capsys.readouterr().err
    assert rc == 3
    assert _digest(published) == before  # page and plots, byte for byte
    assert len(before) > 1  # ... and there were plots to lose
    partial = results / "partial" / "benchmarks.md"
    assert f"its page goes to {partial}" in err  # said before the run starts
    assert "run: partial run: " in err and "were left as they were; only a complete run writes them" in err
    assert f"run: this run's page: {partial}" in err
    assert f"run:   not measured: real traces not found at {tmp_path / 'no-traces'}" in err
    assert f"run:   not measured: 3 benchmarks skipped: {SKIP_TRACES}" in err
    assert "run:   not measured: quality figures: bench/quality.py exited with status 2" in err
    assert "run:   not measured: proxy latency (default fsync), traces phase: no traces at" in err
    page = partial.read_text()
    assert "> **Partial run**, not the published page: not measured: real traces not found" in page
    assert "`token_tail`" in page  # what did run is on it


def test_complete_run_publishes(
    run: ModuleType, steps: Steps, published: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _digest(published)
    rc = run.main(["--results", str(tmp_path / "results")])
    captured = capsys.readouterr()
    assert rc == 0
    assert "partial" not in captured.err
    assert f"wrote {published / 'benchmarks.md'}" in captured.out
    page = (published / "benchmarks.md").read_text()
    assert _digest(published) != before and "Partial run" not in page and "`tail`" in page
    assert not (tmp_path / "results" / "partial").exists()


def test_failed_benchmark_is_exit_1_and_not_published(
    run: ModuleType, steps: Steps, published: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps.junit[1] = _case("test_tail_numpy", '<failure message="AssertionError: target missed"/>')
    steps.pytest_rc = 1
    before = _digest(published)
    rc = run.main(["--results", str(tmp_path / "results")])
    err = capsys.readouterr().err
    assert rc == 1
    assert _digest(published) == before
    assert "run:   not measured: pytest exited with status 1" in err
    assert "run:   not measured: 1 benchmark failed: AssertionError: target missed" in err


def test_missing_package_is_exit_3_and_not_published(
    run: ModuleType, steps: Steps, published: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps.junit.append(_case("test_tail_trim_messages", '<skipped message="could not import \'langchain_core\'"/>'))
    before = _digest(published)
    rc = run.main(["--results", str(tmp_path / "results")])
    assert rc == 3
    assert _digest(published) == before
    assert "not measured: 1 benchmark skipped: could not import 'langchain_core'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["-k", "tail"], "-k 'tail'"),
        (["--quick"], "--quick (fewer rounds, largest sizes left out)"),
        (["--no-quality"], "--no-quality"),
        (["--no-serve"], "--no-serve"),
        (["--", "-x"], "pytest arguments -x"),
    ],
)
def test_a_run_told_to_leave_something_out_is_partial_but_exit_0(
    run: ModuleType, steps: Steps, published: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    flags: list[str], said: str,
) -> None:
    before = _digest(published)
    partial = tmp_path / "elsewhere" / "page.md"
    rc = run.main(["--results", str(tmp_path / "results"), "--partial-out", str(partial), *flags])
    err = capsys.readouterr().err
    assert rc == 0  # everything it was asked to run ran
    assert _digest(published) == before
    assert f"run: partial run ({said}): its page goes to {partial}" in err
    assert f"run:   left out: {said}" in err
    assert "not measured" not in err
    assert f"left out: {said}" in partial.read_text()


def test_partial_out_beside_the_published_page_is_refused(
    run: ModuleType, steps: Steps, published: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _digest(published)
    rc = run.main(["--results", str(tmp_path / "results"), "--partial-out", str(published / "partial.md")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "--partial-out must be in another folder than --out" in err
    assert _digest(published) == before
    assert not (tmp_path / "results").exists()  # refused before anything ran


def test_render_only_and_report_keep_the_rule(
    run: ModuleType, steps: Steps, published: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    no_traces(steps, run, monkeypatch, tmp_path)
    results = tmp_path / "results"
    run.main(["--results", str(results)])
    (results / "partial").rename(tmp_path / "first")
    capsys.readouterr()
    before = _digest(published)

    assert run.main(["--results", str(results), "--render-only"]) == 3
    assert "run:   not measured: real traces not found" in capsys.readouterr().err
    assert run.report.main([str(results), "--out", str(published / "benchmarks.md")]) == 3
    assert "report:   not measured: real traces not found" in capsys.readouterr().err
    assert _digest(published) == before
    assert (results / "partial" / "benchmarks.md").is_file()


def test_partial_reasons_of_a_complete_run_are_empty(
    run: ModuleType, steps: Steps, published: Path, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    assert run.main(["--results", str(results)]) == 0
    assert run.report.partial_reasons(results) == ([], [])
    (results / "serve_fsync_always.json").unlink()
    assert run.report.partial_reasons(results) == ([], ["proxy latency (--fsync always) not measured"])


def test_help_says_when_the_page_is_published() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "run.py"), "--help"], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert "Only a complete run writes --out (docs/benchmarks.md) and its plots" in out
    assert "--partial-out PATH" in out
    assert "3  something was skipped or not measured (no real traces" in out


@pytest.mark.slow
def test_bench_run_py_without_traces(tmp_path: Path) -> None:
    """The real command on one benchmark that needs the traces, with none: pytest over bench/ runs, the
    benchmark skips, and the page (here a copy standing in for the published one) is not touched."""
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy2(DOCS / "benchmarks.md", docs / "benchmarks.md")
    before = _digest(docs)
    env = {k: v for k, v in os.environ.items() if k != "CTXFOLD_REQUIRE_TRACES"}
    env["CTXFOLD_TRACES"] = str(tmp_path / "no-traces")
    r = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "-k", "test_segment_tail_trim_messages", "--no-quality",
         "--no-serve", "--results", str(tmp_path / "results"), "--out", str(docs / "benchmarks.md")],
        capture_output=True, text=True, check=False, cwd=REPO, env=env, timeout=300,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert _digest(docs) == before
    partial = tmp_path / "results" / "partial" / "benchmarks.md"
    assert f"run: this run's page: {partial}" in r.stderr
    assert f"not measured: real traces not found at {tmp_path / 'no-traces'}" in r.stderr
    assert "not measured: 1 benchmark skipped: real traces not found" in r.stderr
    assert partial.is_file()
