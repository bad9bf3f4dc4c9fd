"""``ctxfold calibrate``: fit the token estimator to a tokenizer on a corpus and write a calibration."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ctxfold.chat.messages import Conversation
from ctxfold.cli._common import FORMATTER
from ctxfold.errors import ConfigError, FormatError
from ctxfold.tokens.calibration import ALLOWANCE_FRACTION, DEFAULT_TEMPLATES, calibrate
from ctxfold.tokens.calibration_corpus import (
    CORPUS_SUFFIXES,
    MIN_GROUPS_TO_HOLD_OUT,
    TextGroup,
    conversation_texts,
    corpus_files,
    why_nothing_held_out,
)
from ctxfold.tokens.counting import load_counter

EPILOG = f"""examples:
  ctxfold calibrate --tokenizer deepseek-v4 --corpus traces/ -o deepseek-v4.json
  ctxfold calibrate --tokenizer path/to/tokenizer.json --corpus a.jsonl b.traj -o mine.json
  ctxfold count run.json --tokenizer mine.json          use the calibration as a counter

The estimator is fitted as an upper bound: at the 99.9th percentile its under-count stays within
1% of any window from 4k to 200k tokens that holds the request, on the corpus and on generated
adversarial text (random Unicode, emoji, CJK, base64, hex, digit runs, minified JSON, whitespace
runs, random letters, a unit of letters repeated, short words: hex dumps and random ones). Conversations are split by a hash of their id: 20% (--held-out) never enter the fit; the
error and the under- and over-count printed and stored in the file are measured on them and on
adversarial text of another seed, beside chars/4 on the same texts. With fewer than {MIN_GROUPS_TO_HOLD_OUT}
conversations (or none held out) the error is measured on the texts it was fitted to, which
overstates the accuracy: the output says so, and the file's error has "held_out": 0.

The corpus is trace files (OpenAI or Anthropic messages, Claude Code sessions, tau-bench, SWE-agent,
OpenHands or mini-SWE-agent trajectories) and UTF-8 text files. A file that is neither (a binary
file, other JSON, a trace cut short or with a broken line) stops the run before any fit.

exit codes: 0 success, 2 usage error, 3 input error (missing or malformed file),
4 tokenizer unavailable, 5 internal error."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "calibrate",
        help="fit the byte-class token estimator to a tokenizer and write a calibration file",
        description="Fit the estimator's coefficients by least squares against an exact tokenizer on "
        "the texts of a corpus (trace files or directories of them), measure its error on held-out "
        "conversations beside chars/4, and write a calibration JSON usable as --tokenizer FILE or "
        "load_counter(FILE).",
        epilog=EPILOG,
        formatter_class=FORMATTER,
    )
    p.add_argument("--tokenizer", required=True, metavar="NAME_OR_PATH",
                   help="exact tokenizer: deepseek-v4, deepseek-v3, qwen3, mistral-v7, tekken, o200k_base, ..., or a "
                   "tokenizer.json / SentencePiece .model path")
    p.add_argument("--corpus", required=True, nargs="+", metavar="PATH",
                   help="trace files (.json, .jsonl, .traj), UTF-8 text files, or directories searched for trace files")
    p.add_argument("-o", "--output", required=True, type=Path, help="calibration file to write")
    p.add_argument("--held-out", type=float, default=0.2, metavar="FRACTION",
                   help="fraction of conversations kept out of the fit to measure the error (default 0.2)")
    p.add_argument("--ridge", type=float, default=1e-3, help="ridge penalty on scaled features (default 1e-3)")
    p.add_argument("--template", metavar="NAME",
                   help="chat template whose framing counts with this calibration add when no template is "
                   "given (default: the tokenizer's own: " + ", ".join(f"{k} -> {v}" for k, v in
                                                                         DEFAULT_TEMPLATES.items()) + "; none otherwise)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the adversarial text added to the fit (default 0; seed+1 is measured)")
    p.add_argument("--no-adversarial", action="store_true",
                   help="fit and measure on the corpus alone, without generated adversarial text")
    return p


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.held_out < 1.0:
        raise ConfigError(f"--held-out must be in [0, 1), got {args.held_out}")
    if args.ridge < 0:
        raise ConfigError(f"--ridge must be >= 0, got {args.ridge}")
    template = args.template if args.template is not None else DEFAULT_TEMPLATES.get(args.tokenizer.lower(), "")
    if template:
        from ctxfold.tokens.templates import get_template

        get_template(template)  # an unknown name is a usage error before any work
    counter = load_counter(args.tokenizer)
    if not counter.exact:
        raise ConfigError(f"--tokenizer must be an exact tokenizer, not the estimate {counter.name!r}")

    def skipped(path: Path, why: str) -> None:
        print(f"ctxfold: warning: {path}: {why}; file skipped", file=sys.stderr)

    groups = read_corpus_strictly(args.corpus, on_skip=skipped)
    if not groups:
        raise ConfigError(f"no text found in the corpus {' '.join(args.corpus)}")
    corpus = f"{' '.join(args.corpus)}: {len(groups)} conversations, {sum(len(g.texts) for g in groups)} texts"
    cal = calibrate(counter, groups, tokenizer=args.tokenizer, template=template, corpus=corpus,
                    held_out_fraction=args.held_out, ridge=args.ridge,
                    adversarial_seed=None if args.no_adversarial else args.seed)
    cal.save(args.output)
    print(f"wrote {args.output}: estimator for {cal.tokenizer}, fitted on {cal.num_texts} texts; "
          f"framing added by default: {template or 'none'}")
    print(render_bounds(cal.error, cal.bounds, why_nothing_held_out(groups, args.held_out)), end="")
    sys.stdout.flush()
    return 0


# What a corpus file may be, for the messages that refuse one.
TRACE_KINDS = ("OpenAI or Anthropic messages, a Claude Code session, or a tau-bench, SWE-agent, OpenHands "
               "or mini-SWE-agent trajectory")
LEAVE_OUT = "the corpus takes trace files (JSON or JSONL) and UTF-8 text: leave this file out"


def read_corpus_strictly(paths: Iterable[str | Path], *, on_skip: Callable[[Path, str], None]) -> list[TextGroup]:
    """Text groups of the corpus: one per conversation of a trace file, one per text file.

    Unlike ``calibration.read_corpus``, which fits whatever strings it finds, this raises FormatError
    naming a file that is neither a trace ctxfold reads nor UTF-8 text: fitted as text, a binary file
    or a cut trace would skew the coefficients and the figures without a word. An empty file, or a
    trace whose conversations hold no text, is only reported to ``on_skip``.
    """
    groups: list[TextGroup] = []
    for f in corpus_files(paths):
        groups += _file_groups(f, on_skip)
    return groups


def _file_groups(f: Path, on_skip: Callable[[Path, str], None]) -> list[TextGroup]:
    try:
        data = f.read_bytes()
    except OSError as exc:
        raise FormatError(f"cannot read it ({exc.strerror or exc}); check its permissions or leave it out",
                          source=str(f)) from None
    text = _utf8_text(f, data)
    if not text.strip():
        on_skip(f, "empty file")
        return []
    if not _is_json(f, text):
        return [TextGroup(f.name, (text,))]
    groups: list[TextGroup] = []
    for i, conv in enumerate(_read_trace(f, text)):
        texts = conversation_texts(conv)
        if texts:
            groups.append(TextGroup(f"{f.name}:{conv.id or i}", texts))
    if not groups:
        on_skip(f, "its conversations hold no text")
    return groups


def _utf8_text(f: Path, data: bytes) -> str:
    # NUL is valid UTF-8, but no text a tokenizer is fitted on holds it: it marks a binary file.
    nul = data.find(b"\x00")
    if nul >= 0:
        raise FormatError(f"not UTF-8 text: it holds NUL bytes (the first at byte {nul}), as binary files and "
                          f"UTF-16 text do; {LEAVE_OUT}", source=str(f))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise FormatError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} on line {line} (byte {exc.start}) is "
                          "not UTF-8; convert the file to UTF-8, or leave it out", source=str(f)) from None


def _json_error(text: str) -> json.JSONDecodeError | None:
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return exc
    except RecursionError:
        return None  # nested too deep to parse here; the trace reader says so
    return None


def _ends_early(text: str, exc: json.JSONDecodeError) -> bool:
    """Whether the JSON went wrong only because the text stopped: a file cut short, not a typo."""
    return exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")


def _is_json(f: Path, text: str) -> bool:
    """Whether the file is JSON or JSON lines, and so must be a trace: its name says so, or it parses
    as JSON. Raises when it claims to be JSON and is not, or is JSON cut short."""
    stripped = text.strip()
    named = f.suffix in CORPUS_SUFFIXES
    if stripped[0] not in "{[":
        if named and _json_error(text) is None:  # a lone number or string: JSON, but no trace
            raise FormatError(f"JSON but not a conversation trace ctxfold reads; expected {TRACE_KINDS}",
                              source=str(f))
        if named:
            raise FormatError(f"not valid JSON: it starts with {stripped[:20]!r}; a {f.suffix} file must hold "
                              "a conversation trace (rename it .txt to fit it as plain text)", source=str(f))
        return False
    doc_error = _json_error(text)
    if doc_error is None:
        return True
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if len(lines) > 1 and _json_error(lines[0][1]) is None:  # JSON lines
        last_no, last = lines[-1]
        last_error = _json_error(last)
        # A copy or a log cut mid-write ends inside its last record, with no newline after it.
        if last_error is not None and not text.endswith("\n") and _ends_early(last, last_error):
            raise FormatError(f"line {last_no} is cut short: the file ends inside a JSON record; copy the "
                              "whole file again, or delete that line", source=str(f))
        return True  # a broken line elsewhere: the trace reader names it
    if _ends_early(text, doc_error):
        raise FormatError(f"line {doc_error.lineno} is cut short: the file ends before its JSON document "
                          "is complete; copy the whole file again", source=str(f))
    if named:
        raise FormatError(f"not valid JSON: {doc_error.msg} at line {doc_error.lineno}, column "
                          f"{doc_error.colno}; fix it, or rename the file .txt to fit it as plain text",
                          source=str(f))
    return False  # prose that happens to start with a brace


def _read_trace(f: Path, text: str) -> list[Conversation]:
    """The conversations of a JSON file; raises unless ctxfold reads every record in it."""
    from ctxfold.chat import formats  # the importers; loaded only when the corpus holds JSON

    source = str(f)
    try:
        # Lenient, so a broken record is named with how many more there are. The ids are formats.load's,
        # so the held-out split is the same as it always was.
        report = formats.read(text, source=source, lenient=True, conv_id=f.name.split(".")[0])
    except FormatError as exc:
        try:
            formats.detect_format(text, source=source)
        except FormatError:
            raise FormatError(f"JSON but not a conversation trace ctxfold reads; expected {TRACE_KINDS}",
                              source=source) from None
        where = f" ({exc.location})" if exc.location else ""
        raise FormatError(f"JSON but not a conversation trace ctxfold reads: {exc.reason}{where}",
                          source=source) from None
    if report.skipped:
        more = len(report.skipped) - 1
        also = f" (and {more} more record{'s' if more > 1 else ''} ctxfold cannot read)" if more else ""
        raise FormatError(f"{report.skipped[0]}{also}; fix or delete the record, then run again")
    return report.conversations


def render_bounds(error: dict[str, float], bounds: dict[str, dict[str, dict[str, float]]],
                  why_not_held_out: str = "") -> str:
    """The figures of a calibration as text: the error on conversations, then per class of text the
    under-count (exact - estimate) / exact and in tokens, the over-count and the request bound.

    The error is said to be on held-out conversations only when ``error["held_out"]`` says so (files
    written before that key existed held them out); otherwise on the texts it was fitted to, and why."""
    out: list[str] = []
    if error:
        convs, msgs = int(error["num_conversations"]), int(error["num_messages"])
        if error.get("held_out", 1.0) == 1.0:
            out.append(f"  error on {convs} held-out conversations / {msgs} messages "
                       "(absolute relative; median, p95):\n")
        else:
            why = f" ({why_not_held_out})" if why_not_held_out else ""
            out.append(f"  error on the {convs} conversations / {msgs} messages it was fitted to "
                       "(absolute relative; median, p95):\n")
            out.append(f"    none held out{why}: measured on the texts it was fitted to, these figures "
                       "overstate the accuracy on new text\n")
        out.append(f"    estimate  per conversation {error['conversation_median']:.2%}, "
                   f"{error['conversation_p95']:.2%}   per message {error['message_median']:.2%}, "
                   f"{error['message_p95']:.2%}\n")
        out.append(f"    chars/4   per conversation {error['chars4_conversation_median']:.2%}, "
                   f"{error['chars4_conversation_p95']:.2%}   per message {error['chars4_message_median']:.2%}, "
                   f"{error['chars4_message_p95']:.2%}\n")
    out.append(f"  under-count per text, (exact - estimate) / exact and in tokens (p50 / p99 / p99.9), "
               f"over-count per request (median / p99), and the worst request's under-count as a share "
               f"of the allowance ({ALLOWANCE_FRACTION:.0%} of the smallest window from 4k that holds it; "
               "<= 100% meets it):\n")
    out.append(f"    {'text':<16}{'counter':<10}{'error p50':>10}{'under p50 / p99 / p99.9':>28}"
               f"{'tokens p50 / p99 / p99.9':>28}{'over p50 / p99':>18}{'worst':>10}\n")
    for counter, kinds in bounds.items():
        for kind, f in kinds.items():
            out.append(
                f"    {kind:<16}{counter:<10}{f['error_median']:>10.1%}"
                f"{f['under_p50']:>10.1%} /{f['under_p99']:>7.1%} /{f['under_p99.9']:>7.1%}"
                f"{f['under_tokens_p50']:>10.0f} /{f['under_tokens_p99']:>7.0f} /{f['under_tokens_p99.9']:>7.0f}"
                f"{f['request_over_median']:>9.1%} /{f['request_over_p99']:>6.1%}"
                f"{f['request_under_of_allowance_max']:>10.0%}\n")
    return "".join(out)
