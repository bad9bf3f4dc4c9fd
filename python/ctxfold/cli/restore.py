"""ctxfold restore: the original conversation, byte for byte, from a session directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ctxfold.cli import EXIT_INPUT, EXIT_OK, CommandError
from ctxfold.cli._common import FORMATTER, wrap, write_output

EPILOG = """examples:
  ctxfold restore sessions/demo -o original.json
  ctxfold restore sessions/demo -o original.json --to anthropic
  ctxfold restore sessions/demo -o -  | jq '.messages | length'

A session directory is what ctxfold replay --session-dir and ctxfold compact --session-dir keep
(and what a Compactor with session_dir= writes): an append-only event log, the history dumps
written before each rewrite, and the archive of tool outputs. Restore reads the log and returns
every message as it was appended, through any number of compactions.

A log with unreadable lines (a disk fault, a hand edit) is salvaged: every readable message comes
back, and each line left out is named on stderr with the reason (a lost message is lost alone).
--strict refuses such a log instead.

exit codes: 0 success (salvaged or not: see stderr), 2 usage error, 3 not a session, or a corrupt one
with --strict, 5 internal error."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from ctxfold.formats import EXPORT_FORMATS

    p: argparse.ArgumentParser = sub.add_parser(
        "restore", help="rebuild the original conversation from a session directory",
        description=wrap("Rebuild the full original conversation from a session directory (its event log), "
        "undoing every compaction, and write it out."), epilog=EPILOG, formatter_class=FORMATTER)
    p.add_argument("session_dir", metavar="SESSION_DIR", help="a session directory (holds events.jsonl)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write ('-' for stdout)")
    p.add_argument("--to", choices=EXPORT_FORMATS, default="openai", dest="output_format",
                   help="output shape (default: openai)")
    p.add_argument("--store", metavar="URL", help="read the session from this session store (redis://..., "
                   "valkey://...): SESSION_DIR is then the session's id in it")
    p.add_argument("--strict", action="store_true",
                   help="refuse a log with any unreadable line instead of salvaging the readable records")
    return p


def run(args: argparse.Namespace) -> int:
    from ctxfold.formats import dumps
    from ctxfold.session import Session

    if args.store is not None:
        from ctxfold.store import restore_from_store

        write_output(args.output, dumps(restore_from_store(args.store, args.session_dir), args.output_format,
                                        indent=1) + "\n")
        return EXIT_OK
    root = Path(args.session_dir)
    if not root.is_dir():
        raise CommandError(f"{root}: no such directory; expected a session directory kept with --session-dir",
                           EXIT_INPUT)
    session = Session(root)
    if not session.exists():
        inside = sorted(d.name for d in root.iterdir() if Session(d).exists()) if root.is_dir() else []
        hint = (f"; it holds {len(inside)} session{'s' if len(inside) != 1 else ''} ({', '.join(inside[:5])}"
                f"{', ...' if len(inside) > 5 else ''}): name one of them" if inside
                else "; expected a directory kept with --session-dir")
        raise CommandError(f"{root}: not a ctxfold session (no {session.events_path.name}){hint}", EXIT_INPUT)
    if args.strict:
        conv = session.restore()
    else:
        resumed = session.load(salvage=True)
        conv = resumed.conversation
        conv.messages = resumed.originals
        for line, why in resumed.skipped:
            print(f"ctxfold restore: {session.events_path}, line {line}: skipped: {why}", file=sys.stderr)
        if resumed.skipped:
            print(f"ctxfold restore: salvaged {len(conv.messages)} messages; {len(resumed.skipped)} "
                  f"line{'s' if len(resumed.skipped) != 1 else ''} left out (--strict refuses such a log)",
                  file=sys.stderr)
    write_output(args.output, dumps(conv, args.output_format, indent=1) + "\n")
    return EXIT_OK
