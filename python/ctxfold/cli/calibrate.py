"""``ctxfold calibrate``: fit the token estimator to a tokenizer on a corpus and write a calibration."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ctxfold.calibration import calibrate, read_corpus
from ctxfold.cli._common import FORMATTER
from ctxfold.counting import load_counter
from ctxfold.errors import ConfigError

EPILOG = """examples:
  ctxfold calibrate --tokenizer deepseek-v4 --corpus traces/ -o deepseek-v4.json
  ctxfold calibrate --tokenizer path/to/tokenizer.json --corpus a.jsonl b.traj -o mine.json
  ctxfold count run.json --tokenizer mine.json          use the calibration as a counter

Conversations are split by a hash of their id: 20% (--held-out) never enter the fit and the
error printed and stored in the file is measured on them, beside chars/4 on the same texts.

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
                   help="exact tokenizer: deepseek-v4, qwen3, mistral-v7, o200k_base, ..., or a "
                   "tokenizer.json / SentencePiece .model path")
    p.add_argument("--corpus", required=True, nargs="+", metavar="PATH",
                   help="trace files (.json, .jsonl, .traj) or directories searched for them")
    p.add_argument("-o", "--output", required=True, type=Path, help="calibration file to write")
    p.add_argument("--held-out", type=float, default=0.2, metavar="FRACTION",
                   help="fraction of conversations kept out of the fit to measure the error (default 0.2)")
    p.add_argument("--ridge", type=float, default=1e-3, help="ridge penalty on scaled features (default 1e-3)")
    return p


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.held_out < 1.0:
        raise ConfigError(f"--held-out must be in [0, 1), got {args.held_out}")
    if args.ridge < 0:
        raise ConfigError(f"--ridge must be >= 0, got {args.ridge}")
    counter = load_counter(args.tokenizer)
    if not counter.exact:
        raise ConfigError(f"--tokenizer must be an exact tokenizer, not the estimate {counter.name!r}")
    def skipped(path: Path, why: str) -> None:
        print(f"ctxfold: warning: {path}: {why}; file skipped", file=sys.stderr)

    groups = read_corpus(args.corpus, on_skip=skipped)
    if not groups:
        raise ConfigError(f"no text found in the corpus {' '.join(args.corpus)}")
    corpus = f"{' '.join(args.corpus)}: {len(groups)} conversations, {sum(len(g.texts) for g in groups)} texts"
    cal = calibrate(counter, groups, tokenizer=args.tokenizer, corpus=corpus,
                    held_out_fraction=args.held_out, ridge=args.ridge)
    cal.save(args.output)
    e = cal.error
    print(f"wrote {args.output}: estimator for {cal.tokenizer}, fitted on {cal.num_texts} texts")
    print(f"  error on {int(e['num_conversations'])} conversations / {int(e['num_messages'])} messages "
          "(absolute relative; median, p95):")
    print(f"    estimate  per conversation {e['conversation_median']:.2%}, {e['conversation_p95']:.2%}"
          f"   per message {e['message_median']:.2%}, {e['message_p95']:.2%}")
    print(f"    chars/4   per conversation {e['chars4_conversation_median']:.2%}, {e['chars4_conversation_p95']:.2%}"
          f"   per message {e['chars4_message_median']:.2%}, {e['chars4_message_p95']:.2%}")
    sys.stdout.flush()
    return 0
