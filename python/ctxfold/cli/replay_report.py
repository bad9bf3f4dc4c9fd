"""What ``ctxfold replay`` shows: the live line and the COMPACTING lines while it runs, the table and
the report's figures at the end (:mod:`ctxfold.cli.replay` runs the command)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ctxfold.cli._common import BANNER, GREY, YELLOW, Terminal, Throttle, bar, table, tokens
from ctxfold.compaction.policy import Policy

if TYPE_CHECKING:
    from ctxfold.compaction.compactor import CompactionEvent
    from ctxfold.compaction.config import CompactConfig


# -- what the user sees while it runs ----------------------------------------------------------------------


class Progress:
    """The live line: a bar over all requests of all conversations, and what is running."""

    def __init__(self, term: Terminal, total_requests: int, num_conversations: int) -> None:
        self.term = term
        self.total = total_requests
        self.num_conversations = num_conversations
        self.done_by_label: dict[str, int] = {}
        self.finished = 0
        self.t0 = time.monotonic()
        self.throttle = Throttle(0.1)
        self.current = ""  # what the one in-process replay is doing (label, occupancy)

    def set(self, label: str, done: int) -> None:
        self.done_by_label[label] = done
        self.draw()

    def finish(self, label: str, requests: int) -> None:
        self.done_by_label[label] = requests
        self.finished += 1
        self.draw(force=True)

    def draw(self, force: bool = False) -> None:
        if not self.term.live or not self.throttle(force):
            return
        done = sum(self.done_by_label.values())
        pct = 100 * done // self.total if self.total else 100
        text = f"replay [{bar(done, self.total)}] {done}/{self.total} requests {pct:3d}%  "
        if self.num_conversations > 1:
            text += f"{self.finished}/{self.num_conversations} conversations  "
        text += f"{time.monotonic() - self.t0:.1f} s"
        if self.current:
            text += f"  {self.current}"
        self.term.status(text)


def _prefix(label: str, many: bool) -> str:
    return f"[{label}] " if many else ""


def event_record(event: CompactionEvent) -> dict[str, Any]:
    """What the COMPACTING lines need from an event, as plain data (it crosses process boundaries)."""
    return {"kind": event.kind, "reason": event.reason, "applied": event.applied, "failure": event.failure,
            "tokens_before": event.tokens_before, "tokens_after": event.tokens_after,
            "archived": len(event.archived), "tail_tokens": event.tail_tokens,
            "summary_fallback": event.summary_fallback, "summary_failure": event.summary_failure,
            "kv_tokens_reused": event.kv.tokens_reused if event.kv else None,
            "kv_tokens_prefilled": event.kv.tokens_to_prefill if event.kv else None,
            "cost": event.cost.to_json() if event.cost else None}


def describe_event(term: Terminal, e: dict[str, Any], label: str, many: bool) -> list[str]:
    """The COMPACTING lines for one finished compaction (ds4's wording where ds4 has one)."""
    before, after = e["tokens_before"], e["tokens_after"]
    prefix = _prefix(label, many) + term.style("COMPACTING", BANNER)
    if not e["applied"]:
        return [f"{prefix} {e['reason']}: {term.style('not applied', YELLOW)} ({e['failure'] or 'no change'})"]
    if e["kind"] == "archive":
        n = e["archived"]
        return [(f"{prefix} {e['reason']}: archived {n} tool output{'s' if n != 1 else ''}, "
                f"old={tokens(before)} new={tokens(after)}")]
    if e["kind"] == "last_resort":
        return [(f"{prefix} {e['reason']}: result archived, the model gets a marker and a tool error "
                f"(old={tokens(before)} new={tokens(after)})")]
    fallback = ""
    if e["summary_fallback"]:
        fallback = f" (extractive fallback: {e['summary_failure']})" if e["summary_failure"] else " (extractive fallback)"
    lines = [(f"{prefix} rebuilding context: old={tokens(before)} summary+tail={tokens(after)} "
             f"tail={tokens(e['tail_tokens'])}{fallback}")]
    if e["kv_tokens_reused"] is not None:
        lines.append(f"{prefix} KV plan: keep {tokens(e['kv_tokens_reused'])} cached tokens, "
                     f"prefill {tokens(e['kv_tokens_prefilled'])}")
    cost = e.get("cost")
    if cost is not None:
        lines.append(f"{prefix} cost: {tokens(cost['cache_tokens_written'])} cache tokens written, "
                     f"{tokens(cost['saving_tokens'])} fewer read over {cost['horizon_requests']} requests")
    return lines


class TerminalObserver:
    """The compactor's observer for an in-process replay: ds4's banner, the summary streaming in grey
    (its first ``summary_lines`` lines), the rebuild figures and the prefill bar."""

    def __init__(self, term: Terminal, progress: Progress, label: str, many: bool, summary_lines: int) -> None:
        self.term = term
        self.progress = progress
        self.label = label
        self.many = many
        self.summary_lines = summary_lines
        self._lines_shown = 0
        self._hidden_lines = 0
        self._chars = 0

    def compaction_started(self, reason: str, kind: str) -> None:
        self._lines_shown = self._hidden_lines = self._chars = 0
        what = "summarizing durable task state" if kind == "summary" else f"{kind} pass"
        self.term.line(f"{_prefix(self.label, self.many)}{self.term.style('COMPACTING', BANNER)} {reason}: {what}")

    def summary_token(self, text: str) -> None:
        self._chars += len(text)
        if self._lines_shown >= self.summary_lines:
            self._hidden_lines += text.count("\n")
            return
        # Show whole lines up to the limit; the rest is only counted.
        pieces = text.split("\n")
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            if self._lines_shown >= self.summary_lines:
                self._hidden_lines += 0 if last else 1
                continue
            self.term.stream_text(piece + ("" if last else "\n"), GREY)
            if not last:
                self._lines_shown += 1

    def compaction_finished(self, event: CompactionEvent) -> None:
        self.term.end_text()
        if event.kind == "summary" and self._hidden_lines:
            self.term.line(self.term.style(f"  ... {self._hidden_lines} more lines of summary "
                                           f"({self._chars} chars)", GREY))
        for line in describe_event(self.term, event_record(event), self.label, self.many):
            self.term.line(line)

    def prefill_progress(self, done_tokens: int, total_tokens: int) -> None:
        if total_tokens <= 0:
            return  # ds4 shows nothing when there is nothing to prefill
        pct = 100 * done_tokens // total_tokens
        self.term.status(f"prefill [{bar(done_tokens, total_tokens, 20, '▶', '·')}] "
                         f"{done_tokens}/{total_tokens} {pct}%")


# -- the end: the table and the report's figures ---------------------------------------------------------

_KINDS = ("archive", "summary", "last_resort")


def totals(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    t: dict[str, Any] = {"conversations": len(entries)}
    for key in ("requests", "tokens_archived", "tokens_summarized", "kv_tokens_reused", "kv_tokens_prefilled",
                "cache_tokens_written", "saving_tokens", "summary_prompt_tokens", "summary_cached_tokens",
                "summary_output_tokens", "min_gain_waits", "overflows", "orphans", "seconds", "seconds_in_ctxfold"):
        t[key] = sum(e[key] for e in entries)
    money = [e["money"] for e in entries if e.get("money")]
    if money:
        t["money"] = {"currency": money[0]["currency"],
                      **{k: round(sum(m[k] for m in money), 6) for k in ("invalidated", "saving", "net")}}
    verified = [e["overflows_verified"] for e in entries if e["overflows_verified"] is not None]
    t["overflows_verified"] = sum(verified) if verified else None
    t["unfittable"] = sum(len(e["unfittable"]) for e in entries)
    t["guard_steps"] = dict(sum((Counter(e["guard_steps"]) for e in entries), Counter()))
    t["seconds"] = round(t["seconds"], 4)
    t["seconds_in_ctxfold"] = round(t["seconds_in_ctxfold"], 4)
    t["compactions"] = {k: sum(e["compactions"].get(k, 0) for e in entries) for k in _KINDS}
    t["peak_occupancy_tokens"] = max((e["peak_occupancy_tokens"] for e in entries), default=0)
    t["restore_exact"] = all(e["restore_exact"] for e in entries)
    return t


def problems(entry: dict[str, Any]) -> list[str]:
    out = []
    if entry["overflows"]:
        out.append(f"{entry['overflows']} request{'s' if entry['overflows'] != 1 else ''} over the window")
    if entry["overflows_verified"]:
        n = entry["overflows_verified"]
        out.append(f"{n} request{'s' if n != 1 else ''} over the window counted with {entry['verified_by']}")
    if entry.get("over_window"):
        first = entry["over_window"][0]
        out.append(f"the first at message {first['message']}, with a reply reserve of "
                   f"{first['reply_reserve_tokens']:,} tokens")
    if entry["orphans"]:
        out.append(f"{entry['orphans']} orphaned tool result{'s' if entry['orphans'] != 1 else ''}")
    if not entry["restore_exact"]:
        out.append("restore not byte-exact")
    return out


def shorten(label: str, width: int = 44) -> str:
    """A label cut in the middle to fit a table column (the JSON report keeps it whole)."""
    return label if len(label) <= width else label[: width // 2 - 1] + "…" + label[-(width - width // 2):]


def render_table(term: Terminal, entries: Sequence[dict[str, Any]], context_tokens: int | None) -> str:
    headers = ["conversation", "requests", "archive", "summary", "last-resort", "peak", "archived", "summarized",
               "kv-reused", "kv-prefill", "cache-written", "saving", "waits", "orphans", "overflows", "restore", "ctxfold-s"]
    # With --verify-with, the overflows that count are the verifying tokenizer's: a column beside them.
    verified = any(e.get("overflows_verified") is not None for e in entries)
    if verified:
        headers.insert(headers.index("overflows") + 1, "verified")

    def peak(n: int) -> str:
        return f"{tokens(n)} ({100 * n // context_tokens}%)" if context_tokens else tokens(n)

    def row(label: str, e: dict[str, Any]) -> list[object]:
        c = e["compactions"]
        out: list[object] = [
            label, e["requests"], c.get("archive", 0), c.get("summary", 0), c.get("last_resort", 0),
            peak(e["peak_occupancy_tokens"]), tokens(e["tokens_archived"]), tokens(e["tokens_summarized"]),
            tokens(e["kv_tokens_reused"]), tokens(e["kv_tokens_prefilled"]), tokens(e["cache_tokens_written"]),
            tokens(e["saving_tokens"]), e["min_gain_waits"], e["orphans"], e["overflows"],
            "exact" if e["restore_exact"] else "FAILED", f"{e['seconds_in_ctxfold']:.2f}"]
        if verified:
            v = e.get("overflows_verified")
            out.insert(headers.index("verified"), "-" if v is None else v)
        return out

    tot = totals(entries)
    return table(headers, [row(shorten(e["label"]), e) for e in entries],
                 total=row(f"total ({len(entries)})", tot) if len(entries) > 1 else None)


def trigger_lines(config: CompactConfig) -> dict[str, int]:
    """Occupancy levels at which the configured passes fire (for the plot): the passes' own lines."""
    ctx = config.context_tokens
    return {} if ctx is None else Policy(config).lines(ctx)


def fallback_summary(entries: Sequence[dict[str, Any]]) -> str | None:
    """One line on the summaries the extractive summarizer wrote because the configured one failed:
    how many, and each distinct reason with its count; None when there were none."""
    reasons = Counter(ev.get("summary_failure") or "no reason recorded"
                      for e in entries for ev in e["events"] if ev.get("summary_fallback"))
    n = sum(reasons.values())
    if not n:
        return None
    total = sum(1 for e in entries for ev in e["events"] if ev["kind"] == "summary" and ev["applied"])
    why = "; ".join(f"{reason} ({'once' if k == 1 else f'{k} times'})" for reason, k in reasons.most_common())
    return (f"{n} of {total} summar{'ies' if total != 1 else 'y'} fell back to the extractive summary "
            f"because the summarizer failed: {why}")
