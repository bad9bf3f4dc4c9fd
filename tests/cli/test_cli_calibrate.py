"""``ctxfold calibrate`` on what a user may give it: files it must refuse, and what it says it measured.

A file that is not UTF-8 text, JSON that is no trace, or a trace cut short must stop the run with one
line naming the file and what is wrong (exit 3), not be fitted as if it were text. The error the
command prints must be measured on what it says, on screen and in the file alike.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from ctxfold.cli import EXIT_INPUT, EXIT_OK
from helpers.cli_helpers import one_error_line, run_main

TOKENIZER = "o200k_base"  # tiktoken's encoding: exact and available offline


def conversation(i: int) -> dict[str, object]:
    return {"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Question {i}: how much did rainfall change in region {i} last year?"},
        {"role": "assistant", "content": f"Rainfall in region {i} rose by {i + 3}% over the year. " * 4},
    ]}


def write_conversations(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"conv{i}.json"
        p.write_text(json.dumps(conversation(i)))
        paths.append(p)
    return paths


def binary_file(p: Path) -> None:
    p.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)  # an executable's header and bytes


def random_bytes_with_nul(p: Path) -> None:
    data = bytearray(random.Random(0).randbytes(4096))
    data[100] = 0
    p.write_bytes(bytes(data))


def json_not_a_trace(p: Path) -> None:
    p.write_text(json.dumps({"name": "my-package", "version": "1.0.0", "dependencies": {"left-pad": "^1.3.0"},
                             "description": "a package manifest, with text in it but no conversation"}))


def truncated_jsonl(p: Path) -> None:
    lines = [json.dumps({"role": role, "content": f"message {i} about the weather in Paris"})
             for i, role in enumerate(["user", "assistant"] * 3)]
    text = "\n".join(lines)
    p.write_text(text[: len(text) - 15])  # the copy stopped inside the sixth record


def invalid_utf8(p: Path) -> None:
    p.write_bytes("Notes on the café's menu: crème brûlée, entrées.\n".encode("latin-1"))


@pytest.mark.parametrize(
    ("name", "make", "words"),
    [
        ("program.bin", binary_file, "not UTF-8 text"),
        ("noise.txt", random_bytes_with_nul, "not UTF-8 text"),
        ("package.json", json_not_a_trace, "JSON but not a conversation trace ctxfold reads"),
        ("session.jsonl", truncated_jsonl, "line 6 is cut short"),
        ("notes.txt", invalid_utf8, "not UTF-8 text"),
    ],
)
def test_calibrate_refuses_a_file_it_cannot_fit_on(
    name: str, make: Callable[[Path], None], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / name
    make(bad)
    out = tmp_path / "cal.json"
    code, printed, err = run_main(capsys, "calibrate", "--tokenizer", TOKENIZER, "--corpus", str(bad),
                                  "-o", str(out), "--no-adversarial")
    line = one_error_line(err)
    assert code == EXIT_INPUT, (printed, err)
    assert str(bad) in line and words in line, line
    assert not out.exists() and "wrote" not in printed


def test_one_bad_file_among_good_ones_stops_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_conversations(tmp_path / "corpus", 3)
    bad = tmp_path / "corpus" / "session.jsonl"
    truncated_jsonl(bad)
    out = tmp_path / "cal.json"
    code, _, err = run_main(capsys, "calibrate", "--tokenizer", TOKENIZER, "--corpus", *map(str, good),
                            str(tmp_path / "corpus"), "-o", str(out), "--no-adversarial")
    assert code == EXIT_INPUT
    assert f"{bad}: line 6 is cut short" in one_error_line(err)
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("whole.json", json.dumps(conversation(0))[:-20], "line 1 is cut short"),  # one document, cut
        ("broken.jsonl", '{"role": "user", "content": "hi"}\n{"role": oops}\n{"role": "assistant", "content": "yo"}\n',
         "line 2"),
        ("prose.json", "Just some notes, not JSON at all.\n", "not valid JSON"),
    ],
)
def test_calibrate_refuses_other_malformed_traces(name: str, content: str, words: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / name
    bad.write_text(content)
    code, _, err = run_main(capsys, "calibrate", "--tokenizer", TOKENIZER, "--corpus", str(bad),
                            "-o", str(tmp_path / "cal.json"), "--no-adversarial")
    line = one_error_line(err)
    assert code == EXIT_INPUT
    assert str(bad) in line and words in line, line


def test_plain_utf8_text_is_fitted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("Notes on the café's menu: crème brûlée, entrées, and {braces} in prose.\n" * 20)
    code, printed, err = run_main(capsys, "calibrate", "--tokenizer", TOKENIZER, "--corpus", str(notes),
                                  "-o", str(tmp_path / "cal.json"), "--no-adversarial")
    assert code == EXIT_OK, err
    assert "wrote" in printed


def test_a_small_corpus_says_its_error_is_measured_on_the_fitting_texts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = write_conversations(tmp_path / "corpus", 3)
    out = tmp_path / "cal.json"
    code, printed, err = run_main(capsys, "calibrate", "--tokenizer", TOKENIZER, "--corpus", *map(str, paths),
                                  "-o", str(out))
    assert code == EXIT_OK, err
    data = json.loads(out.read_text())
    # The screen: measured on the 3 conversations it was fitted to, and that this flatters the estimate.
    assert "held-out conversations" not in printed
    assert "error on the 3 conversations / 6 messages it was fitted to" in printed
    assert "overstate" in printed
    # The file says the same.
    assert data["error"]["held_out"] == 0.0
    assert data["error"]["num_conversations"] == 3.0
    assert "measured on the fitting texts" in data["method"] and "% held out" not in data["method"]


def test_a_corpus_large_enough_says_its_error_is_measured_on_held_out_conversations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_conversations(tmp_path / "corpus", 30)
    out = tmp_path / "cal.json"
    code, printed, err = run_main(capsys, "calibrate", "--tokenizer", TOKENIZER, "--corpus", str(tmp_path / "corpus"),
                                  "-o", str(out), "--no-adversarial")
    assert code == EXIT_OK, err
    data = json.loads(out.read_text())
    n = int(data["error"]["num_conversations"])
    assert 0 < n < 30
    assert f"error on {n} held-out conversations" in printed and "overstate" not in printed
    assert data["error"]["held_out"] == 1.0
    assert "measured on held-out conversations" in data["method"]
