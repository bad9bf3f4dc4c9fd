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
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxfold.chat.messages import Conversation, Role
from ctxfold.cli import EXIT_INPUT, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, CommandError
from ctxfold.cli._common import (
    DEFAULT_CONTEXT_TOKENS,
    FORMATTER,
    GREEN,
    Loaded,
    Terminal,
    Throttle,
    add_counting_options,
    add_format_option,
    add_policy_options,
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
    tokens,
    unique_labels,
    warn,
    with_auto_reserve,
    wrap,
    write_output,
)
from ctxfold.cli.replay_report import (
    Progress,
    TerminalObserver,
    describe_event,
    event_record,
    fallback_summary,
    problems,
    render_table,
    shorten,
    totals,
    trigger_lines,
)

if TYPE_CHECKING:
    from ctxfold.compaction.compactor import CompactionEvent
    from ctxfold.compaction.config import CompactConfig
    from ctxfold.replay import RequestPoint

__all__ = [
    "EPILOG",
    "PLOT_SUFFIXES",
    "Job",
    "Progress",
    "Settings",
    "TerminalObserver",
    "add_parser",
    "describe_event",
    "event_record",
    "fallback_summary",
    "problems",
    "render_table",
    "replay_one",
    "run",
    "shorten",
    "totals",
    "trigger_lines",
]

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
across the rewrites, the cache tokens the compactions wrote beyond what the requests would have
written anyway and the cached tokens they save later (docs/cost.md), the summaries the minimum-gain
rule put off, orphaned tool results and requests over the window (both must be 0), whether
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
    p.add_argument("--prices", metavar="FILE", help="price the compactions' cost figures with this table "
                   "(JSON or TOML: input, cached, write, output per million tokens, and currency); it weighs "
                   "the minimum-gain rule too. Default: the config's cost section (relative weights)")
    p.add_argument("--price", metavar="input=..,cached=..,write=..,output=..", help="the same table on the "
                   "command line, e.g. input=3,cached=0.3,write=3.75,output=15 (cached and write default to "
                   "input; currency=USD unless given)")
    p.add_argument("--min-gain", choices=("on", "off"), help="the minimum-gain rule: an automatic summary "
                   "whose expected saving is below what it invalidates waits while the next request fits "
                   "(default: on, or the config's cost.min_gain)")
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


def _cost_config(args: argparse.Namespace, config: CompactConfig) -> CompactConfig:
    """The config's cost section with --prices or --price and --min-gain over it."""
    from dataclasses import replace

    from ctxfold.compaction.cost import PriceTable, priced
    from ctxfold.errors import ConfigError

    if args.prices is not None and args.price is not None:
        raise CommandError("give --prices FILE or --price input=..,output=.., not both", EXIT_USAGE)
    cost = config.cost
    if args.min_gain is not None:
        cost = replace(cost, min_gain=args.min_gain == "on")
    table = None
    if args.prices is not None:
        try:
            table = PriceTable.load(args.prices)
        except ConfigError as exc:
            raise CommandError(f"--prices {exc}", EXIT_USAGE) from None
    elif args.price is not None:
        try:
            table = PriceTable.parse(args.price)
        except ConfigError as exc:
            raise CommandError(f"--price {args.price}: {exc}", EXIT_USAGE) from None
    if table is not None:
        cost = priced(cost, table)
    return replace(config, cost=cost)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    term = Terminal(quiet=args.quiet)
    config = build_config(args, default_context_tokens=DEFAULT_CONTEXT_TOKENS)
    config, auto_reserve = reply_reserve_config(config, args.reply_reserve)
    config = _cost_config(args, config)
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


# -- the end: JSON, plot, exit code --------------------------------------------------------------------


def _finish(args: argparse.Namespace, term: Terminal, config: CompactConfig, settings: Settings,
            entries: list[dict[str, Any]], wall_s: float, num_workers: int, skipped_files: Sequence[str]) -> int:
    from ctxfold import __version__
    from ctxfold.compaction.cost import PriceTable

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
                         "min_gain": config.cost.min_gain, "horizon_requests": config.cost.horizon_requests,
                         "prices": PriceTable.from_config(config.cost).to_json(),
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

