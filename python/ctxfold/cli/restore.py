"""ctxfold restore: the original conversation, byte for byte, from a session directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ctxfold.cli import EXIT_ENVIRONMENT, EXIT_INPUT, EXIT_OK, CommandError
from ctxfold.cli._common import FORMATTER, wrap, write_output
from ctxfold.compaction.session import EVENTS_FILE, Session

EPILOG = """examples:
  ctxfold restore sessions/demo -o original.json
  ctxfold restore sessions/demo -o original.json --to anthropic
  ctxfold restore sessions/demo -o -  | jq '.messages | length'

A session directory is what ctxfold replay --session-dir and ctxfold compact --session-dir keep
(and what a Compactor with session_dir= writes): an append-only event log, the history dumps
written before each rewrite, and the archive of tool outputs. Restore reads the log and returns
every message as it was appended, through any number of compactions.

With --store, SESSION_DIR is a session's id in a session store (what ctxfold serve --store keeps):
the same records, read from Redis or Valkey.

A log with unreadable records (a disk fault, a hand edit) is salvaged: every readable message comes
back, and each record left out is named on stderr with the reason (a lost message is lost alone).
--strict refuses such a log instead.

exit codes: 0 success (salvaged or not: see stderr), 2 usage error, 3 not a session, one with no
readable message, or a corrupt one with --strict, 4 the store cannot be reached, 5 internal error."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from ctxfold.chat.formats import EXPORT_FORMATS

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
    from ctxfold.chat.formats import dumps

    salvage = not args.strict
    if args.store is not None:
        from ctxfold.compaction.store import StoreUnavailable, read_from_store

        where = f"{args.store} {args.session_dir}"
        try:
            resumed = read_from_store(args.store, args.session_dir, salvage=salvage)
        except StoreUnavailable as e:
            raise CommandError(str(e), EXIT_ENVIRONMENT) from e
    else:
        session = _session(Path(args.session_dir))
        where = str(session.events_path)
        resumed = session.load(salvage=salvage)
        resumed.conversation.messages = resumed.originals
    for location, why in resumed.skipped:
        print(f"ctxfold restore: {where}, {location}: skipped: {why}", file=sys.stderr)
    if not resumed.originals:
        left_out = f" ({_records(len(resumed.skipped))} left out)" if resumed.skipped else ""
        raise CommandError(f"{where}: no message could be read{left_out}; nothing written", EXIT_INPUT)
    if resumed.skipped:
        print(f"ctxfold restore: salvaged {len(resumed.originals)} messages; {_records(len(resumed.skipped))} "
              "left out (--strict refuses such a log)", file=sys.stderr)
    write_output(args.output, dumps(resumed.conversation, args.output_format, indent=1) + "\n")
    return EXIT_OK


def _session(root: Path) -> Session:
    if root.is_file():
        folder = f"; restore the folder that holds it: {root.parent}" if root.name == EVENTS_FILE else ""
        raise CommandError(f"{root}: a file, not a session directory{folder}", EXIT_INPUT)
    if not root.is_dir():
        raise CommandError(f"{root}: no such directory; expected a session directory kept with --session-dir",
                           EXIT_INPUT)
    session = Session(root)
    if not session.exists():
        inside = sorted(d.name for d in root.iterdir() if Session(d).exists())
        hint = (f"; it holds {len(inside)} session{'s' if len(inside) != 1 else ''} ({', '.join(inside[:5])}"
                f"{', ...' if len(inside) > 5 else ''}): name one of them" if inside
                else "; expected a directory kept with --session-dir")
        raise CommandError(f"{root}: not a ctxfold session (no {session.events_path.name}){hint}", EXIT_INPUT)
    return session


def _records(n: int) -> str:
    return f"{n} record{'s' if n != 1 else ''}"
