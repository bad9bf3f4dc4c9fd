"""ctxfold replay: recorded conversations through the compactor, with what it did and the checks."""

from __future__ import annotations

import argparse
import fnmatch
import json
import multiprocessing
import os
import queue
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxfold.cli import EXIT_INPUT, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, CommandError
from ctxfold.cli._common import (
    BANNER,
    DEFAULT_CONTEXT_TOKENS,
    FORMATTER,
    GREEN,
    GREY,
    YELLOW,
    Loaded,
    Terminal,
    Throttle,
    add_counting_options,
    add_format_option,
    add_policy_options,
    bar,
    build_config,
    check_settings,
    check_summarizer_args,
    load_counter,
    load_template,
    load_traces,
    make_summarizer,
    non_negative_int,
    positive_int,
    reply_reserve_config,
    table,
    tokens,
    unique_labels,
    warn,
    with_auto_reserve,
    wrap,
    write_output,
)
from ctxfold.compaction.policy import Policy
from ctxfold.messages import Conversation, Role

if TYPE_CHECKING:
    from ctxfold.compactor import CompactionEvent
    from ctxfold.config import CompactConfig
    from ctxfold.replay import RequestPoint

EPILOG = """examples:
  ctxfold replay --demo                                  the built-in conversation at a 16k window
  ctxfold replay run.traj.json --ctx 32k --policy ds4    one trace, the ds4 policy (soft and hard triggers)
  ctxfold replay traces/*.json --jobs 4 --json report.json --plot occupancy.png
  ctxfold replay session.jsonl --tokenizer deepseek-v4 --template deepseek-v4
  ctxfold replay run.json --summarizer http://127.0.0.1:8000/v1 --model qwen3-8b
  ctxfold replay run.json --config agent.yml --session-dir sessions/

Each assistant message of a trace is one model request. Before it, the messages recorded since
the previous request are appended (tool results through the hard trigger) and the compactor
runs; the recorded answer is then appended as recorded. The table at the end has one row per
conversation: requests, compactions by kind, peak occupancy (prompt + reply reserve), tokens
freed by archiving and by summaries, the KV cache tokens an engine keeps and must prefill again
across the rewrites, orphaned tool results and requests over the window (both must be 0), whether
the session restores the recording byte for byte, and the seconds spent inside ctxfold.

A summary the --summarizer endpoint could not write is replaced by the extractive one: the
COMPACTING line gives the reason and the run ends with a count of them by reason.

exit codes: 0 all checks passed, 1 an overflow, orphan or inexact restore, a request that could
not fit the window at all (not sent), a file skipped by --lenient, or (with --strict-summarizer) a summary that fell back, 2 usage error, 3 input error,
4 tokenizer/package/endpoint unavailable, 5 internal error."""

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "replay", help="replay recorded agent traces through a compaction policy and report what it did",
        description=wrap("Replay recorded agent conversations through ctxfold's compactor: progress, a COMPACTING "
        "line for every compaction with its reason, the summary as it is written, and a table of what "
        "happened. Traces in every format the importers read (OpenAI, Anthropic, Claude Code, tau-bench, "
        "SWE-agent, OpenHands, mini-swe-agent)."),
        epilog=EPILOG, formatter_class=FORMATTER)
    p.add_argument("traces", nargs="*", metavar="TRACE", help="trace files (JSON or JSONL); a file may hold "
                   "many conversations")
    p.add_argument("--demo", action="store_true", help="replay the conversation built into ctxfold (a coding "
                   "agent, ~190 messages) instead of trace files")
    add_format_option(p)
    add_counting_options(p)
    add_policy_options(p)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON (one entry per conversation; "
                   "'-' for stdout, which then gets no table)")
    p.add_argument("--plot", metavar="FILE.png", help="draw occupancy over requests with every compaction "
                   "marked (.png, .svg or .pdf; needs matplotlib: pip install 'ctxfold[plot]')")
    p.add_argument("--plot-only", metavar="PATTERN", action="append", help="plot only conversations whose "
                   "label matches this shell pattern (repeatable; default: up to 12, the most compacted)")
    p.add_argument("--jobs", "-j", type=positive_int, metavar="N", help="conversations replayed in "
                   "parallel processes (default: the number of CPUs, at most one per conversation)")
    p.add_argument("--session-dir", metavar="DIR", help="keep each conversation's session (event log, "
                   "history dumps, archive) under DIR/<conversation>; default: temporary, removed")
    p.add_argument("--summary-lines", type=non_negative_int, default=8, metavar="N",
                   help="lines of each summary shown while it is written (default: 8; 0 hides them)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress and no COMPACTING lines: "
                   "only the table, problems and errors")
    p.add_argument("--verify-with", metavar="TOKENIZER", help="count every request the policy let go also with "
                   "this tokenizer (an exact one, e.g. deepseek-v4; framed with --template), and report "
                   "requests over the window by that count as overflows-verified")
    return p


# -- one job, runnable in a worker process ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """What every replay of one command shares (picklable: sent to worker processes)."""

    config: CompactConfig
    tokenizer: str  # counter spec for load_counter
    template: str | None  # chat template spec, None for plain text
    page_size_tokens: int  # KV page size the reuse figures round down to
    kv_plan: str  # "segments" or "tokens" (see Compactor)
    auto_reserve: bool  # reply reserve from each conversation's longest answer (default_reply_reserve)
    session_root: str | None  # keep sessions here, one directory per conversation
    verify_with: str | None = None  # counter spec every request is also counted with (the truth to judge by)


@dataclass(frozen=True, slots=True)
class Job:
    """One conversation to replay."""

    label: str  # unique among the command's conversations: table row, session directory name
    file: str  # the trace file as named on the command line
    format: str  # the importer that read it
    conversation: Conversation


def replay_one(job: Job, settings: Settings, observer: Any = None,
               on_request: Callable[[RequestPoint], None] | None = None) -> dict[str, Any]:
    """Replay one conversation; the report entry for --json (ReplayReport.to_json plus where it came from)."""
    from ctxfold.replay import Verifier, replay_conversation

    counter = load_counter(settings.tokenizer)
    template = load_template(settings.template)
    config = settings.config
    if settings.auto_reserve:
        config = with_auto_reserve(config, job.conversation, counter)
    session_dir = None if settings.session_root is None else Path(settings.session_root) / job.label
    verify = None if settings.verify_with is None else Verifier(load_counter(settings.verify_with), template)
    report = replay_conversation(
        job.conversation, config=config, session_dir=session_dir, observer=observer, on_request=on_request,
        verify=verify, counter=counter, template=template,
        summarizer=make_summarizer(config, counter),
        page_size_tokens=settings.page_size_tokens, kv_plan=settings.kv_plan,
    )
    entry = {"label": job.label, "file": job.file, "format": job.format, **report.to_json()}
    return entry


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
            "kv_tokens_prefilled": event.kv.tokens_to_prefill if event.kv else None}


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


# Worker processes talk to the parent through this queue (set by the pool initializer).
_QUEUE: Any = None


def _init_worker(q: Any) -> None:
    global _QUEUE
    _QUEUE = q
    # Ctrl-C reaches the whole process group; the parent alone handles it (one message, no worker
    # tracebacks) and cancels what has not started.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _QueueObserver:
    """In a worker: finished compactions go to the parent as one-line records."""

    def __init__(self, label: str) -> None:
        self.label = label

    def compaction_started(self, reason: str, kind: str) -> None:
        pass

    def summary_token(self, text: str) -> None:
        pass

    def compaction_finished(self, event: CompactionEvent) -> None:
        _QUEUE.put(("event", self.label, event_record(event)))

    def prefill_progress(self, done_tokens: int, total_tokens: int) -> None:
        pass


def _worker_replay(job: Job, settings: Settings) -> dict[str, Any]:
    throttle = Throttle(0.1)
    done = 0

    def on_request(point: RequestPoint) -> None:
        nonlocal done
        done = point.index + 1
        if throttle():
            _QUEUE.put(("progress", job.label, done))

    return replay_one(job, settings, observer=_QueueObserver(job.label), on_request=on_request)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# -- the command -------------------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> None:
    if args.demo and args.traces:
        raise CommandError("give trace files or --demo, not both", EXIT_USAGE)
    if not args.demo and not args.traces:
        raise CommandError("name at least one trace file, or --demo for the built-in conversation", EXIT_USAGE)
    check_summarizer_args(args)
    if args.plot_only and args.plot is None:
        raise CommandError("--plot-only chooses the conversations of a plot: add --plot FILE.png", EXIT_USAGE)
    if args.plot is not None:
        if Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
            raise CommandError(f"--plot {args.plot}: name a .png, .svg or .pdf file", EXIT_USAGE)
        from ctxfold.plot import require_matplotlib

        require_matplotlib()
    if args.session_dir is not None:
        root = Path(args.session_dir)
        if root.exists() and not root.is_dir():
            raise CommandError(f"--session-dir {root}: exists and is not a directory", EXIT_USAGE)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    term = Terminal(quiet=args.quiet)
    config = build_config(args, default_context_tokens=DEFAULT_CONTEXT_TOKENS)
    config, auto_reserve = reply_reserve_config(config, args.reply_reserve)
    check_settings(args, config)
    jobs: list[Job] = []
    skipped_files: list[str] = []
    if args.demo:
        from ctxfold.demo import demo_conversation

        jobs.append(Job("demo", "(built in)", "builtin", demo_conversation()))
    else:
        loaded, skipped_files = _load(args)
        convs = [(f, c) for f in loaded for c in f.conversations]
        labels = unique_labels([c for _, c in convs])
        jobs = [Job(label, f.path, f.format, c) for label, (f, c) in zip(labels, convs, strict=True)]

    # Load what can fail for the environment before any replay: an unknown tokenizer is exit 4 at once.
    counter = load_counter(args.tokenizer)
    template = load_template(args.template)
    check_settings(args, config, counter=counter)
    if not args.demo and not args.quiet:  # a trace without the system prompt or tools the agent sent replays without them
        from ctxfold.cli.count import trace_header_notes

        for note in trace_header_notes([(j.label, j.format, j.conversation) for j in jobs], counter, template):
            print(f"ctxfold: note: {note}", file=term.stream)

    if args.session_dir is not None:
        for j in jobs:
            d = Path(args.session_dir) / j.label
            if d.exists() and any(d.iterdir()):
                raise CommandError(f"--session-dir: {d} is not empty (a session from an earlier run?); choose "
                                   "another directory or remove it", EXIT_INPUT)

    settings = Settings(config=config, tokenizer=args.tokenizer, template=args.template,
                        page_size_tokens=args.page_size, kv_plan=args.kv_plan,
                        auto_reserve=auto_reserve, session_root=args.session_dir, verify_with=args.verify_with)

    num_workers = min(args.jobs or _cpus(), len(jobs))
    total_requests = sum(1 for j in jobs for m in j.conversation.messages if m.role is Role.ASSISTANT)
    num_files = len(args.traces) - len(skipped_files)
    if not args.quiet:
        what = "the built-in demo conversation" if args.demo else (
            f"{len(jobs)} conversation{'s' if len(jobs) != 1 else ''} from {num_files} "
            f"file{'s' if num_files != 1 else ''}")
        term.line(f"ctxfold replay: {what}, {total_requests} requests; ctx {tokens(config.context_tokens)} "
                  f"tokens, policy {config.policy}, counter {getattr(counter, 'name', args.tokenizer)}, "
                  f"summarizer {config.summarizer.kind}"
                  + (f", {num_workers} processes" if num_workers > 1 else ""))
    progress = Progress(term, total_requests, len(jobs))
    t0 = time.perf_counter()
    try:
        if num_workers <= 1:
            entries = _run_here(jobs, settings, term, progress, args.summary_lines)
        else:
            entries = _run_pool(jobs, settings, term, progress, num_workers)
    finally:
        term.clear_status()
    wall_s = time.perf_counter() - t0
    return _finish(args, term, config, settings, entries, wall_s, num_workers, skipped_files)


def _load(args: argparse.Namespace) -> tuple[list[Loaded], list[str]]:
    """The trace files, and with --lenient the ones skipped: a file that cannot be read at all
    (missing, empty, no conversation) gets one warning line and the others still run."""
    if not args.lenient:
        return load_traces(args.traces, args.format, warn=warn, system_file=args.system, tools_file=args.tools), []
    from ctxfold.cli import _exit_code, one_line

    # A bad --system or --tools file stops the run here, rather than being blamed on every trace.
    load_traces([], system_file=args.system, tools_file=args.tools)
    loaded: list[Loaded] = []
    skipped: list[str] = []
    for path in args.traces:
        try:
            loaded += load_traces([path], args.format, lenient=True, warn=warn, system_file=args.system,
                                  tools_file=args.tools)
        except Exception as exc:
            if _exit_code(exc) != EXIT_INPUT:
                raise
            text = one_line(exc)
            warn(f"{text if text.startswith(path) else f'{path}: {text}'}; file skipped")
            skipped.append(path)
    if not loaded:
        which = "the file was" if len(skipped) == 1 else f"all {len(skipped)} files were"
        raise CommandError(f"no conversation to replay: {which} skipped", EXIT_INPUT)
    return loaded, skipped


def _run_here(jobs: Sequence[Job], settings: Settings, term: Terminal, progress: Progress,
              summary_lines: int) -> list[dict[str, Any]]:
    entries = []
    many = len(jobs) > 1
    for job in jobs:
        observer = TerminalObserver(term, progress, job.label, many, summary_lines)

        def on_request(point: RequestPoint, label: str = job.label) -> None:
            progress.current = (f"{label + ': ' if many else ''}ctx {tokens(point.occupancy_tokens)}/"
                                f"{tokens(settings.config.context_tokens)}")
            progress.set(label, point.index + 1)

        entry = replay_one(job, settings, observer=observer, on_request=on_request)
        progress.current = ""
        progress.finish(job.label, entry["requests"])
        entries.append(entry)
    return entries


def _run_pool(jobs: Sequence[Job], settings: Settings, term: Terminal, progress: Progress,
              num_workers: int) -> list[dict[str, Any]]:
    # spawn, not fork: the parent may hold threads (tokenizer pools), which fork does not copy safely.
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    entries: dict[str, dict[str, Any]] = {}
    # Longest first, so one long conversation does not start last and run alone.
    order = sorted(jobs, key=lambda j: -sum(len(m.text) for m in j.conversation.messages))
    pool = ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_init_worker, initargs=(q,))
    try:
        futures: dict[Future[dict[str, Any]], Job] = {pool.submit(_worker_replay, j, settings): j for j in order}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            _drain(q, term, progress)
            for f in done:
                job = futures[f]
                try:
                    entry = f.result()
                except Exception as exc:
                    raise _ReplayFailed(job, exc) from exc
                entries[job.label] = entry
                progress.finish(job.label, entry["requests"])
        _drain(q, term, progress)
    finally:
        # On an error or Ctrl-C nothing new starts; running replays end on their own (seconds).
        pool.shutdown(wait=True, cancel_futures=True)
    return [entries[j.label] for j in jobs]


class _ReplayFailed(CommandError):
    """A replay failed in a worker: the original error's message and exit code, naming the conversation."""

    def __init__(self, job: Job, exc: Exception) -> None:
        from ctxfold.cli import _exit_code, one_line

        super().__init__(f"{job.file}: conversation {job.label}: {one_line(exc)}", _exit_code(exc))


def _drain(q: Any, term: Terminal, progress: Progress) -> None:
    while True:
        try:
            kind, label, payload = q.get_nowait()
        except queue.Empty:
            return
        if kind == "progress":
            progress.set(label, payload)
        else:
            for line in describe_event(term, payload, label, True):
                term.line(line)


# -- the end: table, JSON, plot, exit code ------------------------------------------------------------------

_KINDS = ("archive", "summary", "last_resort")


def totals(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    t: dict[str, Any] = {"conversations": len(entries)}
    for key in ("requests", "tokens_archived", "tokens_summarized", "kv_tokens_reused", "kv_tokens_prefilled",
                "overflows", "orphans", "seconds", "seconds_in_ctxfold"):
        t[key] = sum(e[key] for e in entries)
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
               "kv-reused", "kv-prefill", "orphans", "overflows", "restore", "ctxfold-s"]
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
            tokens(e["kv_tokens_reused"]), tokens(e["kv_tokens_prefilled"]), e["orphans"], e["overflows"],
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


def _finish(args: argparse.Namespace, term: Terminal, config: CompactConfig, settings: Settings,
            entries: list[dict[str, Any]], wall_s: float, num_workers: int, skipped_files: Sequence[str]) -> int:
    from ctxfold import __version__

    if args.json != "-":
        print(render_table(term, entries, config.context_tokens), end="", flush=True)
    bad = [(e["label"], problems(e)) for e in entries if problems(e)]
    if args.json is not None:
        doc = {
            "ctxfold_version": __version__,
            "settings": {"context_tokens": config.context_tokens, "policy": config.policy,
                         "tokenizer": settings.tokenizer, "template": settings.template,
                         "summarizer": config.summarizer.kind, "summarizer_url": config.summarizer.base_url,
                         "model": config.summarizer.model,
                         "page_size_tokens": settings.page_size_tokens,
                         "reply_reserve_tokens": "per conversation" if settings.auto_reserve
                         else config.reply_reserve(), "processes": num_workers, "trigger_lines": trigger_lines(config)},
            "wall_seconds": round(wall_s, 3),
            "total": totals(entries),
            "conversations": entries,
        }
        write_output(args.json, json.dumps(doc, indent=1) + "\n")
    if args.plot is not None:
        from ctxfold.plot import plot_replay

        chosen = entries
        if args.plot_only:
            chosen = [e for e in entries if any(fnmatch.fnmatchcase(e["label"], pat) for pat in args.plot_only)]
            if not chosen:
                raise CommandError(f"--plot-only {' '.join(args.plot_only)}: matches no conversation "
                                   f"(labels are like {entries[0]['label']!r})", EXIT_USAGE)
        empty = sum(1 for e in chosen if not e["requests"])
        if empty == len(chosen):
            warn(f"--plot {args.plot}: not drawn, no conversation has a model request")
        else:
            shown = plot_replay(chosen, args.plot, context_tokens=config.context_tokens,
                                trigger_lines=trigger_lines(config),
                                title=f"ctxfold replay: policy {config.policy}, ctx {tokens(config.context_tokens)}")
            if not args.quiet:
                term.line(f"plot: {args.plot} ({shown} of {len(chosen)} conversations"
                          + (f"; {empty} without a model request not drawn)" if empty else ")"))
    if not args.quiet:
        term.line(f"done in {wall_s:.1f} s" + ("" if not args.session_dir else f"; sessions in {args.session_dir}"))
    # Not sent, so not an overflow, but not a pass either: said apart, with the reason, and a problem.
    unsent = [e for e in entries if e["unfittable"]]
    fell_back = fallback_summary(entries)
    if fell_back is not None and not args.strict_summarizer:
        warn(fell_back)
    if bad or skipped_files or unsent or (fell_back is not None and args.strict_summarizer):
        for label, what in bad:
            print(f"ctxfold: problem: {label}: {', '.join(what)}", file=term.stream)
        for e in unsent:
            n, first = len(e["unfittable"]), e["unfittable"][0]
            print(f"ctxfold: problem: {e['label']}: {n} of {n + e['requests']} request{'s' if n != 1 else ''} "
                  f"could not be sent (first at message {first['message']}: {first['reason']})", file=term.stream)
        if skipped_files:
            n = len(skipped_files)
            print(f"ctxfold: problem: {n} file{'s' if n != 1 else ''} skipped (unreadable or no conversation): "
                  f"{', '.join(skipped_files)}", file=term.stream)
        if fell_back is not None and args.strict_summarizer:
            print(f"ctxfold: problem: --strict-summarizer: {fell_back}", file=term.stream)
        return EXIT_PROBLEM
    if not args.quiet and term.color:
        term.line(term.style("all checks passed: no overflow, no orphan, every restore exact", GREEN))
    elif not args.quiet:
        term.line("all checks passed: no overflow, no orphan, every restore exact")
    return EXIT_OK

