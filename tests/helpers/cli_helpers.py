"""Running the ctxfold command in the test process, and reading what it said.

In-process is the default: a subprocess pays an interpreter start and a tokenizer load per call (about
3 s for DeepSeek V4's), which made the command-line tests most of the fast tier's time. The few tests
about the process itself (the installed entry point, a terminal, signals, a listening port, ``--jobs``)
run it as one with :func:`ctxfold_process`.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stderr, redirect_stdout

import pytest

from ctxfold.cli import main
from helpers.subprocess_env import ctxfold_env


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


def run_ctxfold(*argv: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ctxfold ARGV`` in this process, as a subprocess would report it: exit code, stdout, stderr.
    ``env``: variables set for the call only."""
    out, err = io.StringIO(), io.StringIO()
    with _environment(env or {}), redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: --help, --version and usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["ctxfold", *argv], code, out.getvalue(), err.getvalue())


def ctxfold_process(*argv: str, timeout: float = 300, env: Mapping[str, str] | None = None,
                    ) -> subprocess.CompletedProcess[str]:
    """``python -m ctxfold ARGV`` as a process of its own (see the module docstring for when)."""
    return subprocess.run([sys.executable, "-m", "ctxfold", *argv], capture_output=True, text=True,
                          env=ctxfold_env(**dict(env or {})), timeout=timeout, check=False)


@contextmanager
def _environment(extra: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
