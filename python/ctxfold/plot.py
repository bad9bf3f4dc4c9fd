"""Occupancy plots of replays: tokens per request, the window and trigger lines, every compaction marked.

Takes report entries in the form :meth:`ctxfold.replay.ReplayReport.to_json` writes (the ``--json``
report of ``ctxfold replay``), so a saved report can be drawn again later. Needs matplotlib (the
``plot`` extra); it draws on its own Agg canvas and never touches pyplot's global state.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MAX_PANELS = 12  # small multiples beyond this are unreadable; the most compacted are drawn

# Marker per compaction kind: shape and colour stay the same in every panel and in the legend.
_KIND_STYLE: dict[str, dict[str, Any]] = {
    "summary": {"marker": "v", "color": "#d62728", "label": "summary (major) compaction"},
    "archive": {"marker": "s", "color": "#1f77b4", "label": "archive (minor) pass"},
    "last_resort": {"marker": "X", "color": "#000000", "label": "oversized result archived (last resort)"},
}
_LINE_COLORS = ("#ff7f0e", "#9467bd", "#2ca02c", "#8c564b")


def require_matplotlib() -> None:
    """Raise ModuleNotFoundError with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise ModuleNotFoundError("matplotlib is not installed, and plots need it: "
                                  "pip install 'ctxfold[plot]'", name="matplotlib") from None


def select(entries: Sequence[Mapping[str, Any]], max_panels: int = MAX_PANELS) -> list[Mapping[str, Any]]:
    """At most ``max_panels`` entries, in their order: the ones with the most applied compactions, then the
    highest peak (the conversations where there is something to see)."""
    if len(entries) <= max_panels:
        return list(entries)

    def weight(e: Mapping[str, Any]) -> tuple[int, int, int]:
        c = e["compactions"]
        return c.get("summary", 0) + c.get("last_resort", 0), sum(c.values()), e["peak_occupancy_tokens"]

    keep = sorted(range(len(entries)), key=lambda i: weight(entries[i]), reverse=True)[:max_panels]
    return [entries[i] for i in sorted(keep)]


def _fmt_tokens(v: float, _pos: object = None) -> str:
    return f"{v / 1000:.1f}".rstrip("0").rstrip(".") + "k" if abs(v) >= 1000 else f"{v:g}"


def plot_replay(entries: Sequence[Mapping[str, Any]], path: str | Path, *, context_tokens: int | None,
                trigger_lines: Mapping[str, int] | None = None, title: str = "ctxfold replay",
                max_panels: int = MAX_PANELS) -> int:
    """Draw one panel per conversation (at most ``max_panels``, see :func:`select`) and save to ``path``
    (.png, .svg or .pdf). Returns the number of panels drawn.

    A conversation without a model request has nothing to draw and gets no panel. Each panel:
    occupancy (prompt + reply reserve, tokens) at each model request; the context window and the
    trigger lines; each compaction as a drop from its tokens before to after, marked by kind
    (a hollow circle when a pass ran but was not applied)."""
    fig, n = figure(entries, context_tokens=context_tokens, trigger_lines=trigger_lines, title=title,
                    max_panels=max_panels)
    fig.savefig(str(path), dpi=110)
    return n


def figure(entries: Sequence[Mapping[str, Any]], *, context_tokens: int | None,
           trigger_lines: Mapping[str, int] | None = None, title: str = "ctxfold replay",
           max_panels: int = MAX_PANELS) -> tuple[Any, int]:
    """The figure :func:`plot_replay` saves (a matplotlib ``Figure`` on an Agg canvas) and its number
    of panels."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    drawable = [e for e in entries if e["occupancy"]]
    if not drawable:
        raise ValueError("nothing to plot: no conversation in the report has a model request")
    shown = select(drawable, max_panels)
    n = len(shown)
    ncols = 1 if n == 1 else 2 if n <= 4 else 3
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(6.4 * ncols if n > 1 else 10, 3.6 * nrows + 1.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    # Trigger lines at the same level (ds4's soft line and Datus's mid-turn line are both 75 % at 16k)
    # are drawn once, with both names.
    lines: dict[str, int] = {}
    for level in sorted(set((trigger_lines or {}).values()), reverse=True):
        lines[" = ".join(n for n, v in (trigger_lines or {}).items() if v == level)] = level
    kinds_seen: set[str] = set()
    not_applied_seen = False
    for k, entry in enumerate(shown):
        kinds, not_applied = _draw_panel(axes[k // ncols][k % ncols], entry, k, ncols, context_tokens, lines)
        kinds_seen |= kinds
        not_applied_seen = not_applied_seen or not_applied
    for k in range(n, nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)

    handles = _legend_handles(context_tokens, lines, kinds_seen, not_applied_seen)
    suffix = f" ({n} of {len(drawable)} conversations, the most compacted)" if n < len(drawable) else ""
    fig.suptitle(title + suffix, fontsize=12)
    fig.legend(handles=handles, loc="outside lower center", ncols=min(2 if ncols == 1 else 3, len(handles)), fontsize=8,
               frameon=False)
    return fig, n


def _draw_panel(ax: Any, entry: Mapping[str, Any], k: int, ncols: int, context_tokens: int | None,
                lines: Mapping[str, int]) -> tuple[set[str], bool]:
    """Panel ``k`` of :func:`figure`: one conversation's occupancy, the window and trigger lines, its
    compactions; the kinds of compaction drawn, and whether one not applied was (for the legend)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    kinds_seen: set[str] = set()
    not_applied_seen = False
    occ = list(entry["occupancy"])
    xs = list(range(len(occ)))
    ax.plot(xs, occ, color="#444444", linewidth=1.2, marker="." if len(occ) <= 80 else None, markersize=3,
            zorder=2)
    if context_tokens:
        ax.axhline(context_tokens, color="black", linewidth=1.4, zorder=1)
    for (name, level), color in zip(lines.items(), _LINE_COLORS, strict=False):
        ax.axhline(level, color=color, linewidth=1.0, linestyle="--", zorder=1)
    for ev in entry["events"]:
        x = min(ev["request"], max(len(occ) - 1, 0))
        kind = ev["kind"]
        if not ev["applied"]:
            not_applied_seen = True
            ax.plot([x], [ev["tokens_before"]], marker="o", markerfacecolor="none", color="#7f7f7f",
                    markersize=7, zorder=3)
            continue
        style = _KIND_STYLE.get(kind, {"marker": "o", "color": "#7f7f7f"})
        kinds_seen.add(kind)
        ax.vlines(x, ev["tokens_after"], ev["tokens_before"], color=style["color"], linewidth=1.2, alpha=0.7,
                  zorder=3)
        ax.plot([x], [ev["tokens_after"]], marker=style["marker"], color=style["color"], markersize=7,
                linestyle="none", zorder=4)
    counts = entry.get("compactions", {})
    what = ", ".join(f"{v} {kk.replace('_', ' ')}" for kk, v in sorted(counts.items()) if v) or "no compaction"
    problems = []
    if entry.get("overflows"):
        problems.append(f"{entry['overflows']} over the window")
    if entry.get("orphans"):
        problems.append(f"{entry['orphans']} orphans")
    label = str(entry.get("label") or entry.get("conversation") or f"conversation {k}")
    # Wrapped to the panel's width (about 64 characters at this size, 110 in a single panel), so a
    # long label or a list of problems stays above its own panel.
    panel_title = f"{label}: {what}" + (f" [{'; '.join(problems)}]" if problems else "")
    ax.set_title(textwrap.fill(panel_title, 110 if ncols == 1 else 64), fontsize=9,
                 color="#b00000" if problems else "black", loc="left")
    ax.set_xlabel("model request (assistant turn)")
    if k % ncols == 0:
        ax.set_ylabel("occupancy (tokens)")
    ax.yaxis.set_major_formatter(FuncFormatter(_fmt_tokens))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0, top=max([context_tokens or 0, *occ, *(e["tokens_before"] for e in entry["events"])])
                * 1.08 or 1)
    ax.set_xlim(-0.5, max(len(occ) - 0.5, 0.5))
    ax.grid(True, axis="y", color="#e5e5e5", linewidth=0.6)
    return kinds_seen, not_applied_seen


def _legend_handles(context_tokens: int | None, lines: Mapping[str, int], kinds_seen: set[str],
                    not_applied_seen: bool) -> list[Any]:
    """The legend of :func:`figure`: what its panels draw."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="#444444", marker=".", label="occupancy at each request (prompt + reply reserve)")]
    if context_tokens:
        handles.append(Line2D([], [], color="black", linewidth=1.4, label=f"context window ({_fmt_tokens(context_tokens)})"))
    for (name, level), color in zip(lines.items(), _LINE_COLORS, strict=False):
        handles.append(Line2D([], [], color=color, linestyle="--", label=f"{name} ({_fmt_tokens(level)})"))
    for kind, style in _KIND_STYLE.items():
        if kind in kinds_seen:
            handles.append(Line2D([], [], color=style["color"], marker=style["marker"], linestyle="-",
                                  label=f"{style['label']}: drop from before to after"))
    if not_applied_seen:
        handles.append(Line2D([], [], color="#7f7f7f", marker="o", markerfacecolor="none", linestyle="none",
                              label="compaction attempted, not applied"))
    return handles
