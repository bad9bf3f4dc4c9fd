"""Running the ctxfold command in the test process, and reading what it said."""

from __future__ import annotations

import pytest

from ctxfold.cli import main


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``ctxfold ARGV``; argparse's own exits (usage, --help) included."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: --help, --version and usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The one line a command's error must be, with no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]
