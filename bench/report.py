"""Render a benchmark run into a results page: docs/benchmarks.md and its plots in docs/bench/.

    python bench/report.py RESULTS_DIR [--out docs/benchmarks.md]   # re-render a finished run

Only a complete run (see ``partial_reasons``) is rendered into ``--out``; the page of a partial one goes to
``--partial-out`` (default ``RESULTS_DIR/partial/benchmarks.md``), so the published page and its plots are
never replaced by a page with holes in it.

RESULTS_DIR holds what ``bench/run.py`` wrote: ``benchmarks.json`` (pytest-benchmark's
``--benchmark-json``), ``junit.xml`` (what was skipped or failed, and why), ``machine.json`` and
``quality.json``, ``serve.json`` and ``serve_fsync_always.json`` (bench/bench_serve.py with the
proxy's default fsync and with ``--fsync always``). Any of them may be missing; the page says what is not there instead.

How each benchmark is read (the convention of bench/README.md):
- ``extra_info["role"]``: "ctxfold" or "baseline". Without it, a test whose name contains one of
  ``BASELINE_HINTS`` is a baseline and anything else is ctxfold.
- ``extra_info["method"]``: the label in tables and plots (default: the test name without
  ``test_`` and its parameters).
- ``extra_info["baseline"]``: on a ctxfold entry, the method (or test name) of the baseline it is
  compared with, or a list of them; without it, every baseline of its group.
- ``extra_info["size"]`` and ``["size_unit"]``: a scaling point; a group with sizes is drawn as a
  log-log plot with a fitted slope per method.
- ``extra_info["nbytes"]``: input bytes; adds a MB/s column.
- ``extra_info["note"]``: a line printed under the group.
- ``extra_info["target_s"]``: the median this entry must stay under; the page says met or missed.
- any other ``extra_info`` key: shown in the group's table as a recorded figure ("MB/s 612").
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# The published page; its plots are in docs/bench/. Only a complete run writes them.
COMMITTED_PAGE = REPO_ROOT / "docs" / "benchmarks.md"

# Lower-case substrings that mark a test as a baseline when it does not say so itself.
BASELINE_HINTS = (
    "baseline",
    "numpy",
    "naive",
    "langchain",
    "trim_messages",
    "chars4",
    "chars_4",
    "json",
    "tokenizers_direct",
    "direct",
    "recount",
    "reference",
    "plain_python",
    "python_ref",
)

# A slope fitted over the largest sizes reads as constant below this and as linear within this band.
CONSTANT_BELOW = 0.25
LINEAR_BAND = (0.75, 1.25)
SLOPE_POINTS = 3  # the largest sizes the slope is fitted over: small sizes measure fixed overhead


@dataclass
class Entry:
    """One benchmark of the run."""

    group: str
    name: str  # test name with parameters, e.g. test_scaling_estimator[1000]
    method: str  # label in tables and plots
    role: str  # "ctxfold" or "baseline"
    median_s: float
    iqr_s: float
    rounds: int
    baseline: str | list[str] | None = None  # what a ctxfold entry is compared with: a name or names
    size: float | None = None
    size_unit: str = ""
    nbytes: int | None = None
    note: str | None = None
    target_s: float | None = None  # an upper bound on the median, from the issue that set it
    extra: dict[str, Any] = field(default_factory=dict)


def _base_name(name: str) -> str:
    base = name.split("[", 1)[0]
    return base.removeprefix("test_")


def role_of(name: str, extra: dict[str, Any]) -> str:
    role = str(extra.get("role", "")).lower()
    if role in ("ctxfold", "baseline"):
        return role
    low = name.lower()
    return "baseline" if any(h in low for h in BASELINE_HINTS) else "ctxfold"


def load_entries(data: dict[str, Any]) -> list[Entry]:
    out = []
    for b in data.get("benchmarks", []):
        stats = b.get("stats") or {}
        if "median" not in stats:
            continue
        extra = dict(b.get("extra_info") or {})
        name = b.get("name", "?")
        size = extra.get("size")
        out.append(
            Entry(
                group=b.get("group") or "(no group)",
                name=name,
                method=str(extra.get("method") or _base_name(name)),
                role=role_of(name, extra),
                median_s=float(stats["median"]),
                iqr_s=float(stats.get("iqr", float("nan"))),
                rounds=int(stats.get("rounds", 0)),
                baseline=extra.get("baseline"),
                size=float(size) if isinstance(size, int | float) else None,
                size_unit=str(extra.get("size_unit", "")),
                nbytes=int(extra["nbytes"]) if isinstance(extra.get("nbytes"), int | float) else None,
                note=extra.get("note"),
                target_s=float(extra["target_s"]) if isinstance(extra.get("target_s"), int | float) else None,
                extra=extra,
            )
        )
    return out


# ---- formatting -----------------------------------------------------------------------------------


def fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            v = seconds / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_ratio(baseline_s: float, entry_s: float) -> str:
    """How many times faster the entry is than the baseline (baseline time / entry time)."""
    if entry_s <= 0 or not math.isfinite(baseline_s):
        return "-"
    r = baseline_s / entry_s
    if r >= 100:
        return f"**{r:,.0f}x faster**"
    if r >= 1:
        return f"**{r:.3g}x faster**" if r >= 1.5 else f"{r:.2f}x faster"
    return f"{1 / r:,.0f}x slower" if 1 / r >= 100 else f"{1 / r:.3g}x slower"


# extra_info keys the page reads itself; any other key is shown as a recorded figure.
RESERVED_KEYS = frozenset({"role", "method", "baseline", "size", "size_unit", "nbytes", "note", "target_s"})


def fmt_figures(e: Entry) -> str:
    """What a benchmark recorded beyond its timing (extra_info keys the page does not read itself)."""
    out = []
    for k, v in e.extra.items():
        if k in RESERVED_KEYS:
            continue
        if isinstance(v, float):
            v = f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        elif isinstance(v, int):
            v = f"{v:,}"
        out.append(f"{k} {v}")
    return "; ".join(out)


def fmt_target(e: Entry) -> str:
    if not e.target_s:
        return ""
    return f"<= {fmt_time(e.target_s)}: " + ("met" if e.median_s <= e.target_s else "**missed**")


def fmt_size(size: float) -> str:
    n = int(size)
    if n >= 1_000_000:
        return f"{n / 1e6:.3g}M"
    if n >= 1_000:
        return f"{n / 1e3:.3g}k"
    return str(n)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |")
    return lines


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ---- groups ------------------------------------------------------------------------------------------


def _matches(entry: Entry, wanted: str) -> bool:
    w = wanted.lower()
    return entry.method.lower() == w or w in entry.name.lower() or w == _base_name(entry.name).lower()


def _named(entry: Entry) -> list[str]:
    value = entry.baseline
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)] if value else []


def baselines_for(entry: Entry, baselines: Sequence[Entry]) -> list[Entry]:
    """The baselines a ctxfold entry is compared with: the ones it names, in its order; every
    baseline of the group when it names none (or none of its names is in this run)."""
    out: list[Entry] = []
    for name in _named(entry):
        out += [b for b in baselines if _matches(b, name) and b not in out]
    return out or list(baselines)


def render_plain_group(group: str, entries: list[Entry]) -> list[str]:
    order = sorted(entries, key=lambda e: (e.role != "ctxfold", e.median_s))
    base = [e for e in order if e.role == "baseline"]
    first = next((e for e in order if e.role == "ctxfold" and e.baseline), None)
    if first is not None:  # the columns of the baselines named first, in the order named
        named = baselines_for(first, base)
        base = named + [b for b in base if b not in named]
    has_mbs = any(e.nbytes for e in entries)
    has_target = any(e.target_s for e in entries)
    headers = ["method", "role", "median", "IQR", "rounds"] + (["MB/s"] if has_mbs else [])
    headers += ["target"] if has_target else []
    has_figures = any(fmt_figures(e) for e in entries)
    headers += ["recorded"] if has_figures else []
    headers += [f"vs {b.method}" for b in base]
    rows = []
    for e in order:
        row: list[Any] = [f"`{e.method}`", e.role, fmt_time(e.median_s), fmt_time(e.iqr_s), e.rounds]
        if has_mbs:
            row.append(f"{e.nbytes / e.median_s / 1e6:,.0f}" if e.nbytes else "")
        if has_target:
            row.append(fmt_target(e))
        if has_figures:
            row.append(fmt_figures(e))
        wanted = baselines_for(e, base) if e.role == "ctxfold" else []
        for b in base:
            row.append(fmt_ratio(b.median_s, e.median_s) if b in wanted else "")
        rows.append(row)
    lines = md_table(headers, rows)
    if not base:
        lines.append("")
        lines.append("_No baseline in this group's run: no ratio._")
    return lines


def render_glance(groups: dict[str, list[Entry]], plain: Sequence[str]) -> list[str]:
    """One line per ctxfold entry of the plain groups: its median, then every baseline of its group
    (the headline one first) with its median and the ratio."""
    rows = []
    for g in plain:
        base = [e for e in groups[g] if e.role == "baseline"]
        for e in sorted((e for e in groups[g] if e.role == "ctxfold"), key=lambda e: e.median_s):
            against = (
                "; ".join(
                    f"`{b.method}` {fmt_time(b.median_s)}: {fmt_ratio(b.median_s, e.median_s)}"
                    for b in baselines_for(e, base)
                )
                or "-"
            )
            rows.append([g, f"`{e.method}`", fmt_time(e.median_s), against, fmt_target(e) or "-"])
    if not rows:
        return []
    headers = ["group", "ctxfold", "median", "against the baselines of the same run", "target"]
    if all(r[-1] == "-" for r in rows):  # nobody set a target: no column of dashes
        headers, rows = headers[:-1], [r[:-1] for r in rows]
    return md_table(headers, rows)


def fit_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(time) against log(size) over the largest ``SLOPE_POINTS`` sizes."""
    pts = sorted(p for p in points if p[0] > 0 and p[1] > 0)[-SLOPE_POINTS:]
    if len(pts) < 2 or pts[0][0] == pts[-1][0]:
        return None
    xs = [math.log10(p[0]) for p in pts]
    ys = [math.log10(p[1]) for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if not sxx:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return 0.0 if abs(slope) < 0.005 else slope  # no "-0.00" on the page


def describe_slope(s: float | None) -> str:
    if s is None:
        return "-"
    if s < CONSTANT_BELOW:
        kind = "constant"
    elif LINEAR_BAND[0] <= s <= LINEAR_BAND[1]:
        kind = "linear"
    elif s < LINEAR_BAND[0]:
        kind = "sublinear"
    else:
        kind = "superlinear"
    return f"{s:.2f} ({kind})"


def _time_iqr(e: Entry) -> str:
    """Median with its spread: the IQR as a share of the median."""
    if not math.isfinite(e.iqr_s) or e.median_s <= 0:
        return fmt_time(e.median_s)
    return f"{fmt_time(e.median_s)} ±{100 * e.iqr_s / e.median_s:.0f}%"


def render_scaling_group(group: str, entries: list[Entry], plot_dir: Path | None, plot_rel: str) -> list[str]:
    unit = next((e.size_unit for e in entries if e.size_unit), "size")
    methods: dict[str, list[Entry]] = defaultdict(list)
    for e in entries:
        methods[e.method].append(e)
    names = sorted(methods, key=lambda m: (methods[m][0].role != "ctxfold", m))
    # Rows are the requested size steps; a method's actual size at a step may differ a little
    # (a transcript "of 1k tokens" ends at a message boundary), so points are matched by test parameter.
    steps: dict[str, dict[str, Entry]] = defaultdict(dict)
    for e in entries:
        step = e.name.split("[", 1)[1].rstrip("]") if "[" in e.name else str(e.size)
        steps[step][e.method] = e

    def step_key(s: str) -> float:
        try:
            return float(s)
        except ValueError:
            return min((x.size or 0.0) for x in steps[s].values())

    ordered = sorted(steps, key=step_key)
    ratio_cols: list[tuple[str, str]] = []
    baseline_names = [b for b in names if methods[b][0].role == "baseline"]
    for m in names:
        first = methods[m][0]
        if first.role == "ctxfold":
            wanted = baselines_for(first, [methods[b][0] for b in baseline_names])
            ratio_cols += [(m, b.method) for b in wanted]
    headers = [unit] + [f"`{m}`" for m in names] + [f"{m} vs {b}" for m, b in ratio_cols]
    rows = []
    for s in ordered:
        cells = steps[s]
        size = max((x.size or 0.0) for x in cells.values())
        row: list[Any] = [fmt_size(size)]
        row += [_time_iqr(cells[m]) if m in cells else "" for m in names]
        for m, b in ratio_cols:
            row.append(fmt_ratio(cells[b].median_s, cells[m].median_s) if m in cells and b in cells else "")
        rows.append(row)
    slopes = {m: fit_slope([(e.size or 0.0, e.median_s) for e in methods[m]]) for m in names}
    rows.append(
        [f"slope (largest {SLOPE_POINTS})"]
        + [describe_slope(slopes[m]) for m in names]
        + [""] * len(ratio_cols)
    )
    lines = md_table(headers, rows)
    if plot_dir is not None:
        png = plot_scaling(group, unit, {m: methods[m] for m in names}, slopes, plot_dir)
        if png is not None:
            lines += ["", f"![{group}]({plot_rel}/{png.name})"]
    return lines


def plot_scaling(
    group: str, unit: str, methods: dict[str, list[Entry]], slopes: dict[str, float | None], plot_dir: Path
) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plot_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for m, es in methods.items():
        pts = sorted((e.size or 0.0, e.median_s) for e in es if (e.size or 0) > 0)
        if not pts:
            continue
        s = slopes.get(m)
        label = f"{m} (slope {s:.2f})" if s is not None else m
        style = "-o" if es[0].role == "ctxfold" else "--s"
        ax.loglog([p[0] for p in pts], [p[1] for p in pts], style, label=label, markersize=4, linewidth=1.5)
    ax.set_xlabel(unit)
    ax.set_ylabel("median time per call (s)")
    ax.set_title(group, fontsize=10)
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.1)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = plot_dir / f"{slug(group)}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


# ---- not measured: skips, failures, collection errors -------------------------------------------------


def read_junit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """kind ("skipped", "failed", "error") -> [(test, message)] from pytest's junit XML."""
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    if not path.is_file():
        return out
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return out
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        for kind, tag in (("skipped", "skipped"), ("failed", "failure"), ("error", "error")):
            node = case.find(tag)
            if node is not None:
                lines = (node.text or "").strip().splitlines()
                msg = node.get("message") or ""
                if lines and (msg in ("", "collection failure") or msg.startswith("failed on setup")):
                    msg = f"{msg}: {lines[-1]}" if msg else lines[-1]  # the exception line says why
                out[kind].append((test, msg.strip()))
    return out


def render_not_measured(junit: dict[str, list[tuple[str, str]]]) -> list[str]:
    lines: list[str] = []
    for kind, title in (
        ("error", "could not run (collection or setup error)"),
        ("failed", "failed"),
        ("skipped", "skipped"),
    ):
        items = junit.get(kind, [])
        if not items:
            continue
        by_reason: dict[tuple[str, str], int] = defaultdict(int)
        for test, msg in items:
            module = test.split("::", 1)[0].rsplit(".", 1)[-1] or test
            by_reason[(module, re.sub(r"^Skipped: ", "", msg))] += 1
        lines.append(f"**{title}**:")
        lines.append("")
        for (module, msg), n in sorted(by_reason.items()):
            lines.append(f"- `{module}`: {n} test{'s' if n != 1 else ''}: {msg[:300]}")
        lines.append("")
    return lines


# ---- machine and quality -----------------------------------------------------------------------------


def render_machine(machine: dict[str, Any]) -> list[str]:
    if not machine:
        return ["_Machine information was not recorded._"]
    rows = [
        [k, machine[k]]
        for k in ("cpu", "cores", "memory", "os", "load_before", "load_after")
        if machine.get(k) not in (None, "")
    ]
    lines = md_table(["machine", ""], rows)
    versions = machine.get("versions", {})
    if versions:
        lines += [""] + md_table(["package", "version"], [[k, v] for k, v in versions.items()])
    return lines


def render_quality(quality: dict[str, Any]) -> list[str]:
    sections = quality.get("sections", [])
    if not sections:
        return ["_Quality figures were not computed in this run._"]
    lines: list[str] = []
    for s in sections:
        lines += [f"### {s['title']}", ""]
        if s.get("status", "ok") != "ok":
            lines += [f"_Not available: {s['status']}_", ""]
            continue
        if s.get("intro"):
            lines += [s["intro"], ""]
        for t in s.get("tables", []):
            if t.get("title"):
                lines += [f"**{t['title']}**", ""]
            lines += md_table(t["headers"], t["rows"]) + [""]
        for n in s.get("notes", []):
            lines.append(f"- {n}")
        if s.get("notes"):
            lines.append("")
    return lines


def render_serve(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The proxy's latency (bench/bench_serve.py): per run (an fsync mode) and phase,
    the direct call's median and p99, what a bare pass-through proxy and ctxfold add to them, and the
    CPU each proxy spends per request."""
    if not runs:
        return ["_The proxy benchmark did not run._"]
    intro = ("The same load straight at a scripted upstream, through a bare pass-through (the cost "
             "of the extra hop alone) and through `ctxfold serve`, in alternating slices "
             "(`bench/bench_serve.py`). *Added* is the side's median (p99) minus the direct call's, in ms. "
             "*sequential*: one synthetic conversation, one request at a time; *paced*: 64 synthetic "
             "conversations, each pausing between requests; *traces*: 64 conversations replaying the real "
             "traces (tool calls and outputs) at the same pace, cut well under the proxy's 128k window; "
             "*saturated*: 64 synthetic conversations without pauses (throughput, not added latency). "
             "Compactions: what the proxy applied in the phase (the rule-based archive pass of real "
             "conversations; no summary). Every answer is checked against its conversation.")
    lines = [intro, ""]
    for run in runs:
        if run.get("status", "ok") != "ok":
            lines += [f"_Not available: {run['status']}_", ""]
            continue
        title = (f"**{run['conversations']} conversations, think {run['think_ms']:g} ms (paced), "
                 f"`--fsync {run['fsync']}`, {run['event_loop']} event loop**")
        lines += [title, ""]
        rows = []
        for phase in ("sequential", "paced", "traces", "saturated"):
            r = run.get(phase)
            if not r:
                continue
            if "status" in r:
                rows.append([phase, f"not run: {r['status']}", *[""] * 7])
                continue
            d, b, c = r["direct"], r["passthrough"], r["ctxfold"]
            problems = sum(x["errors"] + x["mismatches"] for x in (d, b, c))
            rows.append([
                phase, c["requests"], f"{c['median_body_kb']:.1f}", f"{d['median_ms']:.2f} / {d['p99_ms']:.2f}",
                f"{b['added_median_ms']:+.2f} / {b['added_p99_ms']:+.2f}",
                f"{c['added_median_ms']:+.2f} / {c['added_p99_ms']:+.2f}",
                f"{c['cpu_ms_per_request']:.2f} ({b['cpu_ms_per_request']:.2f})", r.get("compactions", "-"), problems,
            ])
        lines += md_table(["phase", "requests via ctxfold", "median body KB", "direct median / p99",
                           "pass-through added", "ctxfold added", "CPU ms/request: ctxfold (pass-through)",
                           "compactions", "errors + mismatches"], rows) + [""]
    return lines


# ---- complete or partial ------------------------------------------------------------------------------

REASON_CHARS = 200  # one reason, cut to a line


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def partial_reasons(results: Path) -> tuple[list[str], list[str]]:
    """Why the run in RESULTS is not the whole suite, as ``(left_out, not_measured)``: what the run was
    told to leave out (``-k``, ``--quick``, ``--no-quality``, ``--no-serve``, extra pytest arguments) and
    what it was meant to measure but did not (real traces missing, benchmarks skipped, failed or not
    importable, quality figures or proxy latency not computed). Both empty: a complete run, the only
    kind whose page is published."""
    machine = _read_json(results / "machine.json")
    run = machine.get("run", {}) if isinstance(machine.get("run"), dict) else {}
    left_out = [str(x) for x in run.get("left_out", [])]
    if "left_out" not in run and run.get("quick"):  # results of an older run.py
        left_out.append("--quick (fewer rounds, largest sizes left out)")
    missing: list[str] = []
    if not machine:
        missing.append("no machine.json: not a bench/run.py run")
    if run.get("traces_found") is False:
        missing.append(
            f"real traces not found at {run.get('traces', '?')} "
            "(put them in ../shared/traces beside the clone or set CTXFOLD_TRACES)"
        )
    rc = run.get("pytest_rc")
    if rc not in (None, 0, 5):  # 5: nothing collected, said below as "no benchmark results"
        missing.append(f"pytest exited with status {rc}")
    if not load_entries(_read_json(results / "benchmarks.json")):
        missing.append("no benchmark results (benchmarks.json missing or empty)")
    junit = read_junit(results / "junit.xml")
    for kind, what in (("error", "could not run"), ("failed", "failed"), ("skipped", "skipped")):
        items = junit.get(kind, [])
        if items:
            reasons = list(dict.fromkeys(re.sub(r"^Skipped: ", "", m) or "no reason given" for _, m in items))
            n, others = len(items), len(reasons) - 1
            more = f" (and {others} other reason{'s' if others > 1 else ''})" if others else ""
            missing.append(_cut(f"{n} benchmark{'s' if n != 1 else ''} {what}{more}: {reasons[0]}"))
    if run.get("quality", True):
        sections = _read_json(results / "quality.json").get("sections", [])
        if not sections:
            missing.append("quality figures not computed")
        for sec in sections:
            if sec.get("status", "ok") != "ok":
                title = str(sec.get("title", "?"))
                what = "quality figures" + ("" if title.lower() == "quality figures" else f", {title}")
                missing.append(_cut(f"{what}: {sec['status']}"))
    if run.get("serve", True):
        for name, label in (("serve.json", "default fsync"), ("serve_fsync_always.json", "--fsync always")):
            r = _read_json(results / name)
            if not r:
                missing.append(f"proxy latency ({label}) not measured")
            elif r.get("status", "ok") != "ok":
                missing.append(_cut(f"proxy latency ({label}): {r['status']}"))
            else:
                for phase, v in r.items():
                    if isinstance(v, dict) and "status" in v:
                        missing.append(_cut(f"proxy latency ({label}), {phase} phase: {v['status']}"))
    return left_out, missing


def shown(path: Path) -> str:
    """A path as the user would type it: relative to the current folder when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def same_folder(out: Path, partial_out: Path) -> bool:
    """True when the two pages would share a plots folder (``bench/`` beside the page), so that writing one
    would delete the other's plots."""
    return out.resolve().parent == partial_out.resolve().parent


def publish(results: Path, out: Path, partial_out: Path) -> tuple[Path, list[str], list[str]]:
    """Render RESULTS into OUT when the run was complete, else into PARTIAL_OUT, leaving OUT and its plots
    as they were. Returns the page written and ``partial_reasons(results)``."""
    left_out, missing = partial_reasons(results)
    page = render(results, partial_out if left_out or missing else out)
    return page, left_out, missing


def explain(prog: str, out: Path, page: Path, left_out: Sequence[str], missing: Sequence[str]) -> list[str]:
    """What a partial run tells the user (stderr): the published page untouched, where this one went, why."""
    if not left_out and not missing:
        return []
    plots = shown(out.parent / "bench")
    lines = [
        f"{prog}: partial run: {shown(out)} and its plots ({plots}/) were left as they were; "
        + "only a complete run writes them",
        f"{prog}: this run's page: {shown(page)}",
    ]
    lines += [f"{prog}:   left out: {r}" for r in left_out]
    lines += [f"{prog}:   not measured: {r}" for r in missing]
    return lines


# ---- the page ---------------------------------------------------------------------------------------


def render(results: Path, out: Path) -> Path:
    def read(name: str) -> dict[str, Any]:
        p = results / name
        try:
            value = json.loads(p.read_text(encoding="utf-8"))
            return value if isinstance(value, dict) else {}
        except (OSError, ValueError):
            return {}

    bench = read("benchmarks.json")
    machine = read("machine.json")
    quality = read("quality.json")
    serve = [r for r in (read("serve.json"), read("serve_fsync_always.json")) if r]
    junit = read_junit(results / "junit.xml")
    entries = load_entries(bench)
    plot_dir = out.parent / "bench"
    plot_rel = "bench"
    for old in plot_dir.glob("*.png") if plot_dir.is_dir() else ():
        old.unlink()  # plots of groups that no longer exist must not linger

    groups: dict[str, list[Entry]] = defaultdict(list)
    for e in entries:
        groups[e.group].append(e)
    scaling = sorted(g for g, es in groups.items() if all(e.size is not None for e in es))
    plain = sorted(g for g in groups if g not in scaling)

    run = machine.get("run", {})
    left_out, missing = partial_reasons(results)
    banner = [
        "> **Partial run**, not the published page: "
        + "; ".join([f"left out: {r}" for r in left_out] + [f"not measured: {r}" for r in missing]),
        "",
    ]
    lines = [
        "# Benchmarks",
        "",
        *(banner if left_out or missing else []),
        (
            "Generated by `python bench/run.py` "
            f"({run.get('date', 'date unknown')}; suite took {run.get('wall_s', '?')} s"
            f"{'; quick mode' if run.get('quick') else ''}). Do not edit by hand: rerun the command."
        ),
        "",
        (
            "Every time is the **median** of pytest-benchmark's rounds, with the interquartile range (IQR) "
            "and the number of rounds beside it. Every ctxfold entry is compared with the baselines "
            "measured **in the same run**: `Nx faster` is the baseline's median divided by ctxfold's. "
            "Scaling groups fit the slope of log(time) against log(size) over the largest "
            f"{SLOPE_POINTS} sizes: about 1 is linear, about 0 is constant. How to add a benchmark: "
            "`bench/README.md`."
        ),
        "",
        "## Machine and versions",
        "",
        *render_machine(machine),
        "",
    ]
    if run.get("pytest_rc") not in (None, 0):
        lines += [f"> pytest exited with status {run['pytest_rc']}: see *Not measured* below.", ""]
    if not entries:
        lines += ["_No benchmark results in this run._", ""]
    glance = render_glance(groups, plain)
    if glance:
        lines += ["## At a glance", "", *glance, ""]
    lines += ["## Speed against the baselines", ""]
    for g in plain:
        lines += [f"### {g}", "", *render_plain_group(g, groups[g]), ""]
        lines += [f"- {n}" for n in sorted({e.note for e in groups[g] if e.note})]
        lines.append("")
    lines += ["## Scaling: cost against size", ""]
    for g in scaling:
        lines += [f"### {g}", "", *render_scaling_group(g, groups[g], plot_dir, plot_rel), ""]
        lines += [f"- {n}" for n in sorted({e.note for e in groups[g] if e.note})]
        lines.append("")
    lines += ["## Proxy latency", "", *render_serve(serve), ""]
    lines += ["## Quality beside speed", "", *render_quality(quality), ""]
    nm = render_not_measured(junit)
    lines += ["## Not measured in this run", ""] + (nm or ["Everything in bench/ ran.", ""])
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines).rstrip() + "\n"
    out.write_text(re.sub(r"\n{3,}", "\n\n", text), encoding="utf-8")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("results", type=Path, help="the folder bench/run.py wrote its results into")
    ap.add_argument(
        "--out",
        type=Path,
        default=COMMITTED_PAGE,
        help="the page of a complete run (plots go to bench/ beside it); default docs/benchmarks.md",
    )
    ap.add_argument(
        "--partial-out",
        type=Path,
        help="the page of a partial run, which never goes to --out; default RESULTS/partial/benchmarks.md",
    )
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        print(
            f"report: {args.results} is not a folder of results; run `python bench/run.py` first",
            file=sys.stderr,
        )
        return 2
    partial_out = args.partial_out or args.results / "partial" / "benchmarks.md"
    if same_folder(args.out, partial_out):
        print(f"report: --partial-out must be in another folder than --out ({args.out.parent}): "
              "its plots would replace the published ones", file=sys.stderr)
        return 2
    page, left_out, missing = publish(args.results, args.out, partial_out)
    for line in explain("report", args.out, page, left_out, missing):
        print(line, file=sys.stderr)
    print(page)
    return 3 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
