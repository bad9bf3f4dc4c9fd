"""The ``ctxfold`` command.

Each subcommand lives in its own module of this package with two functions:
``add_parser(subparsers) -> argparse.ArgumentParser`` and ``run(args) -> int``.

Exit codes (documented in ``ctxfold --help``):
  0  success
  1  the job ran but found a problem it reports (overflows, orphans, a failed check)
  2  usage error: bad option or argument
  3  input error: a file missing, unreadable or malformed
  4  environment error: a tokenizer, package or endpoint is not available
  5  internal error (a bug: please report it, with --debug output)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ctxfold.errors import ConfigError, CtxfoldError, FormatError, TokenizerError

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_ENVIRONMENT = 4
EXIT_INTERNAL = 5

# Subcommand modules, in the order `ctxfold --help` lists them.
COMMANDS: tuple[str, ...] = ("replay", "count", "compact", "restore", "calibrate", "serve")

EPILOG = """exit codes: 0 success, 1 problem found (overflow, orphan, failed check), 2 usage error,
3 input error (missing or malformed file), 4 environment error (tokenizer, package or endpoint
unavailable), 5 internal error. Add --debug to any command for a traceback."""


class CommandError(Exception):
    """A user-facing failure with its exit code, raised by a subcommand (message: what, where, what to do)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where to read more, exit code 2.

    Subparsers inherit the class (argparse creates them with ``type(parent)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from ctxfold import __version__

    parser = Parser(
        prog="ctxfold",
        description="Context compaction for LLM agents: replay recorded traces through a compaction "
        "policy, count tokens exactly, compact and restore conversations.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ctxfold {__version__}")
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"ctxfold.cli.{name}")
        p = module.add_parser(sub)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show a traceback on errors")
        p.set_defaults(_run=module.run)
    return parser


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, CommandError):
        return exc.exit_code
    if isinstance(exc, (FormatError, FileNotFoundError, IsADirectoryError, PermissionError, UnicodeError)):
        return EXIT_INPUT
    if isinstance(exc, (TokenizerError, ModuleNotFoundError, ConnectionError)):
        return EXIT_ENVIRONMENT
    if isinstance(exc, (ConfigError, ValueError, CtxfoldError, OSError)):
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_INPUT
    return EXIT_INTERNAL


class _CommandLineWarnings(logging.Handler):
    """The library's warnings (a counter that falls back to the estimate, a template rendered whole) as
    the command's own lines, on the stderr of the moment (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"ctxfold: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


def _show_library_warnings() -> None:
    logger = logging.getLogger("ctxfold")
    if not any(isinstance(h, _CommandLineWarnings) for h in logger.handlers):
        logger.addHandler(_CommandLineWarnings(logging.WARNING))  # `serve` replaces it with its own logging


def main(argv: Sequence[str] | None = None) -> int:
    _show_library_warnings()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        print("ctxfold: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (| head): point stdout at devnull so the exit-time flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # the one place errors become exit codes
        if getattr(args, "debug", False):
            raise
        code = _exit_code(exc)
        kind = "internal error" if code == EXIT_INTERNAL else "error"
        print(f"ctxfold: {kind}: {one_line(exc)}", file=sys.stderr)
        return code


def one_line(exc: BaseException) -> str:
    """The exception as one line: its message with newlines folded, or its type when it has none."""
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror}"  # not "[Errno 2] No such file or directory: 'x'"
    if not text or isinstance(exc, (KeyError, AssertionError)) or _exit_code(exc) == EXIT_INTERNAL:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text


if __name__ == "__main__":
    sys.exit(main())
