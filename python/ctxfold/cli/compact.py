"""ctxfold compact: one manual compaction of each conversation of a trace, written out."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from ctxfold.cli import EXIT_INPUT, EXIT_OK, EXIT_PROBLEM, CommandError
from ctxfold.cli._common import (
    DEFAULT_CONTEXT_TOKENS,
    FORMATTER,
    Terminal,
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
    reply_reserve_config,
    tokens,
    unique_labels,
    warn,
    with_auto_reserve,
    wrap,
    write_output,
)

EPILOG = """examples:
  ctxfold compact session.jsonl -o compacted.json
  ctxfold compact run.json -o out.json --to anthropic --ctx 32k
  ctxfold compact run.json -o out.json --session-dir sessions/    keep the session, then:
  ctxfold restore sessions/<conversation> -o original.json        rebuild the original
  ctxfold compact run.json -o out.json --summarizer http://127.0.0.1:8000/v1 --model qwen3-8b

The output holds each conversation as the next request would send it: system prompt and tools,
the framed summary, the verbatim tail. One conversation is written as one JSON document, several
as JSON lines (one conversation a line); both read back with every ctxfold command.

exit codes: 0 compacted, 1 a conversation could not be compacted (written unchanged, reason on
stderr) or, with --strict-summarizer, its summary fell back to the extractive one, 2 usage error, 3 input error, 4 tokenizer/package/endpoint unavailable, 5 internal error."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from ctxfold.chat.formats import EXPORT_FORMATS

    p: argparse.ArgumentParser = sub.add_parser(
        "compact", help="compact each conversation of a trace once (a manual compaction) and write it out",
        description=wrap("Run one manual compaction (always a summary pass, as /compact does) on every conversation "
        "in a trace file and write the compacted conversations."),
        epilog=EPILOG, formatter_class=FORMATTER)
    p.add_argument("file", metavar="FILE", help="a trace file in any format the importers read")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write ('-' for stdout)")
    p.add_argument("--to", choices=EXPORT_FORMATS, default="openai", dest="output_format",
                   help="output shape (default: openai)")
    add_format_option(p)
    add_counting_options(p)
    add_policy_options(p)
    p.add_argument("--reason", default="manual compaction", help="the reason given to the summarizer")
    p.add_argument("--session-dir", metavar="DIR", help="keep each conversation's session (event log, history "
                   "dump, archive) under DIR/<conversation>, for ctxfold restore")
    p.add_argument("--quiet", "-q", action="store_true", help="no per-conversation lines on stderr")
    return p


def run(args: argparse.Namespace) -> int:
    from ctxfold.chat.formats import dumps

    check_summarizer_args(args)
    term = Terminal(quiet=args.quiet)
    config = build_config(args, default_context_tokens=DEFAULT_CONTEXT_TOKENS)
    config, auto_reserve = reply_reserve_config(config, args.reply_reserve)
    check_settings(args, config)
    loaded = load_traces([args.file], args.format, lenient=args.lenient, warn=warn,
                         system_file=args.system, tools_file=args.tools)
    from ctxfold.compaction.compactor import Compactor

    counter = load_counter(args.tokenizer)
    template = load_template(args.template)
    check_settings(args, config, counter=counter)
    convs = [c for f in loaded for c in f.conversations]
    labels = unique_labels(convs)
    from ctxfold.cli.count import trace_header_notes

    for note in [] if args.quiet else trace_header_notes(
            [(label, loaded[0].format, c) for label, c in zip(labels, convs, strict=True)], counter, template):
        print(f"ctxfold: note: {note}", file=term.stream)
    if args.session_dir is not None:
        for label in labels:
            d = Path(args.session_dir) / label
            if d.exists() and any(d.iterdir()):
                raise CommandError(f"--session-dir: {d} is not empty (a session from an earlier run?); choose "
                                   "another directory or remove it", EXIT_INPUT)
    out: list[str] = []
    failed = fell_back = 0
    for label, conv in zip(labels, convs, strict=True):
        cfg = with_auto_reserve(config, conv, counter) if auto_reserve else config
        session_dir = None if args.session_dir is None else Path(args.session_dir) / label
        compactor = Compactor(conv, config=cfg, counter=counter, template=template,
                              summarizer=make_summarizer(cfg, counter),
                              session_dir=session_dir, page_size_tokens=args.page_size,
                              kv_plan=args.kv_plan)
        try:
            event = compactor.compact_now(args.reason)
            result = compactor.conversation()
        except BaseException:
            with contextlib.suppress(OSError):  # the error in flight is the one to report
                compactor.close()
            raise
        compactor.close()  # OSError when --session-dir could not be written: an error, not a success
        if event.applied:
            # The summarizer's name says "(fallback)" already; the reason goes in its place.
            summarizer, fallback = (event.summarizer or "").removesuffix(" (fallback)"), ""
            if event.summary_fallback:
                fell_back += 1
                fallback = f" (fallback: {event.summary_failure})" if event.summary_failure else " (fallback)"
                if args.strict_summarizer:
                    print(f"ctxfold: problem: {label}: the summarizer failed ({event.summary_failure}); the "
                          "extractive summary stood in (--strict-summarizer)", file=term.stream)
            kv = f", KV keep {tokens(event.kv.tokens_reused)} prefill {tokens(event.kv.tokens_to_prefill)}" \
                if event.kv is not None else ""
            term.line(f"{label}: {len(conv.messages)} -> {len(result.messages)} messages, "
                      f"{tokens(event.tokens_before)} -> {tokens(event.tokens_after)} tokens; summary by "
                      f"{summarizer}{fallback}, tail "
                      f"{tokens(event.tail_tokens)} tokens ({event.tail_rule}){kv}")
        else:
            failed += 1
            print(f"ctxfold: problem: {label}: not compacted ({event.failure}); written unchanged",
                  file=term.stream)
        out.append(dumps(result, args.output_format, indent=1 if len(convs) == 1 else None))
    write_output(args.output, "\n".join(out) + "\n")
    if args.session_dir is not None:
        term.line(f"sessions in {args.session_dir}; ctxfold restore {Path(args.session_dir) / labels[0]} -o FILE "
                  "rebuilds the original")
    return EXIT_PROBLEM if failed or (fell_back and args.strict_summarizer) else EXIT_OK
