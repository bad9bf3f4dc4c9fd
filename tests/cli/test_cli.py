"""The ctxfold command, in process: help, version, usage and input errors, restore.

These run ``ctxfold.cli.main(argv)`` and read what it prints. End-to-end replays through a
subprocess are in test_cli_replay.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxfold import __version__
from ctxfold.chat import formats
from ctxfold.cli import COMMANDS, EXIT_INPUT, EXIT_OK, EXIT_USAGE
from ctxfold.cli._common import positive_int, table, tokens
from ctxfold.compaction.session import Session
from helpers.cli_helpers import one_error_line, run_main
from helpers.subprocess_env import ctxfold_env

REPO = Path(__file__).resolve().parents[2]


# -- help and version -------------------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "--version")
    assert code == EXIT_OK
    assert out.strip() == f"ctxfold {__version__}"


def test_top_help_lists_every_command_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "--help")
    assert code == EXIT_OK
    for name in COMMANDS:
        assert name in out
    assert "exit codes" in out and "3 input error" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_help_stands_on_its_own(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, _ = run_main(capsys, command, "--help")
    assert code == EXIT_OK
    assert out.startswith(f"usage: ctxfold {command}")
    assert "examples:" in out and f"ctxfold {command} " in out.split("examples:")[1]
    assert "exit codes:" in out


def test_no_command_prints_help_and_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys)
    assert code == EXIT_USAGE
    assert "usage: ctxfold" in out


# -- usage errors: one line, exit 2 --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["replay", "--demo", "--ctx", "lots"], "argument --ctx: 'lots' is not a whole number"),
        (["replay", "--demo", "--ctx", "0"], "argument --ctx: '0' must be a positive whole number"),
        (["replay", "--demo", "--jobs", "-3"], "argument --jobs/-j"),
        (["replay", "--demo", "--policy", "fastest"], "argument --policy: invalid choice: 'fastest'"),
        (["replay", "--demo", "--page-size", "1.5"], "argument --page-size"),
        (["replay"], "name at least one trace file, or --demo"),
        (["replay", "--demo", "x.json"], "give trace files or --demo, not both"),
        (["replay", "--demo", "--summarizer", "gpt4"], "--summarizer 'gpt4': expected 'extractive' or an http(s) URL"),
        (["replay", "--demo", "--summarizer", "http://127.0.0.1:9/v1"], "which model? add --model NAME"),
        (["replay", "--demo", "--model", "m"], "--model is for --summarizer URL"),
        (["replay", "--demo", "--plot", "occupancy.txt"], "--plot occupancy.txt: name a .png, .svg or .pdf file"),
        (["count", "x.json", "--format", "csv"], "argument --format: invalid choice: 'csv'"),
        (["compact", "x.json"], "the following arguments are required: -o/--output"),
        (["restore", "s", "-o", "x", "--to", "yaml"], "argument --to: invalid choice: 'yaml'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line_with_exit_2(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                               argv: list[str], expected: str) -> None:
    monkeypatch.delenv("CTXFOLD_SUMMARY_MODEL", raising=False)
    code, out, err = run_main(capsys, *argv)
    assert code == EXIT_USAGE
    line = one_error_line(err)
    assert line.startswith("ctxfold")
    assert expected in line
    assert out == ""


def test_config_file_errors_name_the_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yml"
    cfg.write_text("agent:\n  compact:\n    soft:\n      percent: 185\n")
    code, _, err = run_main(capsys, "replay", "--demo", "--config", str(cfg))
    assert code == EXIT_USAGE
    line = one_error_line(err)
    assert str(cfg) in line and "soft.percent" in line and "185" in line


def test_plot_without_matplotlib_says_how_to_get_it(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ModuleNotFoundError
    code, out, err = run_main(capsys, "replay", "--demo", "--plot", "occupancy.png")
    assert code == 4
    assert "pip install 'ctxfold[plot]'" in one_error_line(err)
    assert out == ""  # checked before any replay work


# -- input errors: one line, exit 3 ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["count"], ["compact", "-o", "out.json"], ["replay"]])
def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "nope.json"
    code, _, err = run_main(capsys, command[0], str(missing), *command[1:])
    assert code == EXIT_INPUT
    assert one_error_line(err) == f"ctxfold: error: {missing}: no such file; expected a trace file (JSON or JSONL)"


def test_directory_instead_of_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "count", str(tmp_path))
    assert code == EXIT_INPUT
    assert "is a directory" in one_error_line(err)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "line 1: invalid JSON"),
        ('{"role": "user", "content": "a"}\n{"role": "assistant", "content": \n', "line 2"),
        ('{"weather": "sunny"}', "cannot tell which trace format this is"),
    ],
)
def test_malformed_trace_names_file_and_place(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str,
                                              expected: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    code, _, err = run_main(capsys, "count", str(bad))
    assert code == EXIT_INPUT
    line = one_error_line(err)
    assert str(bad) in line
    assert expected in line


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"weather": "sunny"}')
    env = ctxfold_env()
    quiet = subprocess.run([sys.executable, "-m", "ctxfold", "count", str(bad)], capture_output=True, text=True, check=False,
                           env=env, timeout=60)
    loud = subprocess.run([sys.executable, "-m", "ctxfold", "count", str(bad), "--debug"], capture_output=True, check=False,
                          text=True, env=env, timeout=60)
    assert quiet.returncode == EXIT_INPUT and "Traceback" not in quiet.stderr
    assert loud.returncode != 0 and "Traceback (most recent call last)" in loud.stderr
    assert "FormatError" in loud.stderr


# -- restore -------------------------------------------------------------------------------------------------


def _session_from_trace(traces_dir: Path, root: Path) -> tuple[Path, formats.Conversation]:
    conv = formats.load(traces_dir / "claude_code" / "session.jsonl")[0]
    s = Session(root, durable=False)
    s.create(conv)
    s.append_messages(conv.messages)
    s.close()
    return root, conv


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
def test_restore_writes_the_original(capsys: pytest.CaptureFixture[str], tmp_path: Path, synthetic_traces_dir: Path,
                                     shape: str) -> None:
    root, conv = _session_from_trace(synthetic_traces_dir, tmp_path / "sessions" / "conv")
    out = tmp_path / "restored.json"
    code, _, err = run_main(capsys, "restore", str(root), "-o", str(out), "--to", shape)
    assert code == EXIT_OK, err
    assert json.loads(out.read_text()) == formats.dump(conv, shape)


def test_restore_to_stdout(capsys: pytest.CaptureFixture[str], tmp_path: Path, synthetic_traces_dir: Path) -> None:
    root, conv = _session_from_trace(synthetic_traces_dir, tmp_path / "s")
    code, out, _ = run_main(capsys, "restore", str(root), "-o", "-")
    assert code == EXIT_OK
    assert json.loads(out) == formats.dump(conv, "openai")


def test_restore_of_a_folder_of_sessions_names_them(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    synthetic_traces_dir: Path) -> None:
    _session_from_trace(synthetic_traces_dir, tmp_path / "sessions" / "first")
    code, _, err = run_main(capsys, "restore", str(tmp_path / "sessions"), "-o", str(tmp_path / "o.json"))
    assert code == EXIT_INPUT
    line = one_error_line(err)
    assert "not a ctxfold session" in line and "holds 1 session (first): name one of them" in line


def test_restore_of_a_missing_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "restore", str(tmp_path / "gone"), "-o", str(tmp_path / "o.json"))
    assert code == EXIT_INPUT
    assert "no such directory" in one_error_line(err)


def test_restore_of_a_corrupt_log(capsys: pytest.CaptureFixture[str], tmp_path: Path, synthetic_traces_dir: Path) -> None:
    root, _ = _session_from_trace(synthetic_traces_dir, tmp_path / "s")
    lines = Session(root).events_path.read_bytes().split(b"\n")
    lines[2] = b"{not json"
    Session(root).events_path.write_bytes(b"\n".join(lines))
    code, _, err = run_main(capsys, "restore", str(root), "-o", str(tmp_path / "o.json"), "--strict")
    assert code == EXIT_INPUT
    assert "line 3: not an event: not JSON" in one_error_line(err)
    # Without --strict, the readable records are salvaged and the line left out is named.
    code, _, err = run_main(capsys, "restore", str(root), "-o", str(tmp_path / "o.json"))
    assert code == EXIT_OK and "line 3: skipped: not an event" in err


# -- small pieces ------------------------------------------------------------------------------------------------


def test_context_sizes_read_as_people_write_them() -> None:
    assert positive_int("16384") == 16384
    assert positive_int("16k") == 16384
    assert positive_int("128K") == 131072
    assert positive_int("1m") == 1048576


def test_token_figures_read_as_people_write_them() -> None:
    assert [tokens(x) for x in (0, 999, 1000, 12345, 1_234_567, None)] == ["0", "999", "1.0k", "12.3k", "1.23M", "-"]


def test_table_aligns_columns_and_adds_a_total() -> None:
    text = table(["name", "n"], [["a", 1], ["bbb", 22]], total=["total", 23])
    assert text.splitlines() == ["name    n", "-----  --", "a       1", "bbb    22", "-----  --", "total  23"]


def test_an_output_in_a_missing_folder_is_refused_not_created(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    out = tmp_path / "no" / "such" / "r.json"
    code, _, err = run_main(capsys, "replay", "--demo", "--quiet", "--json", str(out))
    assert code == EXIT_INPUT and "the folder" in one_error_line(err) and "does not exist" in err
    assert not (tmp_path / "no").exists()
    # Into a folder that exists: written whole, with the permissions open() would give, no temp file left.
    code, _, _ = run_main(capsys, "replay", "--demo", "--quiet", "--json", str(tmp_path / "r.json"))
    assert code == EXIT_OK and json.loads((tmp_path / "r.json").read_text())["conversations"]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
