"""``ctxfold calibrate``: fit the token estimator to a tokenizer on a corpus and write a calibration."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ctxfold.calibration import ALLOWANCE_FRACTION, DEFAULT_TEMPLATES, calibrate, read_corpus
from ctxfold.cli._common import FORMATTER
from ctxfold.counting import load_counter
from ctxfold.errors import ConfigError

EPILOG = """examples:
  ctxfold calibrate --tokenizer deepseek-v4 --corpus traces/ -o deepseek-v4.json
  ctxfold calibrate --tokenizer path/to/tokenizer.json --corpus a.jsonl b.traj -o mine.json
  ctxfold count run.json --tokenizer mine.json          use the calibration as a counter

The estimator is fitted as an upper bound: at the 99.9th percentile its under-count stays within
1% of any window from 4k to 200k tokens that holds the request, on the corpus and on generated
adversarial text (random Unicode, emoji, CJK, base64, hex, digit runs, minified JSON, whitespace
runs). Conversations are split by a hash of their id: 20% (--held-out) never enter the fit; the
error and the under- and over-count printed and stored in the file are measured on them and on
adversarial text of another seed, beside chars/4 on the same texts.

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
        from ctxfold.templates import get_template

        get_template(template)  # an unknown name is a usage error before any work
    counter = load_counter(args.tokenizer)
    if not counter.exact:
        raise ConfigError(f"--tokenizer must be an exact tokenizer, not the estimate {counter.name!r}")
    def skipped(path: Path, why: str) -> None:
        print(f"ctxfold: warning: {path}: {why}; file skipped", file=sys.stderr)

    groups = read_corpus(args.corpus, on_skip=skipped)
    if not groups:
        raise ConfigError(f"no text found in the corpus {' '.join(args.corpus)}")
    corpus = f"{' '.join(args.corpus)}: {len(groups)} conversations, {sum(len(g.texts) for g in groups)} texts"
    cal = calibrate(counter, groups, tokenizer=args.tokenizer, template=template, corpus=corpus,
                    held_out_fraction=args.held_out, ridge=args.ridge,
                    adversarial_seed=None if args.no_adversarial else args.seed)
    cal.save(args.output)
    print(f"wrote {args.output}: estimator for {cal.tokenizer}, fitted on {cal.num_texts} texts; "
          f"framing added by default: {template or 'none'}")
    print(render_bounds(cal.error, cal.bounds), end="")
    sys.stdout.flush()
    return 0


def render_bounds(error: dict[str, float], bounds: dict[str, dict[str, dict[str, float]]]) -> str:
    """The figures of a calibration as text: the error on conversations, then per class of text the
    under-count (exact - estimate) / exact and in tokens, the over-count and the request bound."""
    out: list[str] = []
    if error:
        out.append(f"  error on {int(error['num_conversations'])} held-out conversations / "
                   f"{int(error['num_messages'])} messages (absolute relative; median, p95):\n")
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
