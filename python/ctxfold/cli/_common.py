"""Pieces the subcommands share: option types, trace loading, counters, the terminal, tables."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ctxfold.chat.messages import Conversation
from ctxfold.cli import EXIT_INPUT, EXIT_USAGE, CommandError
from ctxfold.cli._flags import flag_type
from ctxfold.errors import FormatError
from ctxfold.settings import Check
from ctxfold.tokens.counting import DEFAULT_TOKENIZER

if TYPE_CHECKING:
    from ctxfold.compaction.config import CompactConfig
    from ctxfold.tokens.counting import TokenCounter

DEFAULT_CONTEXT_TOKENS = 16384

# Raw, so the examples in each epilog keep their layout; descriptions are wrapped with wrap().
FORMATTER = argparse.RawDescriptionHelpFormatter


def wrap(text: str, width: int = 78) -> str:
    return textwrap.fill(text, width)


# -- option types: a bad value is a usage error (exit 2) that names the option ---------------------------


# The same checks as settings' fields (ctxfold.settings), and the same messages as their flags.
positive_int = flag_type(Check(int, 1))  # >= 1; 16k / 128K / 1M are shorthands (k = 1024)
non_negative_int = flag_type(Check(int, 0))


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port)."""
    from ctxfold.serve import PORT_RANGE

    low, high = PORT_RANGE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number ({low} to {high})") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is outside the port range {low} to {high}")
    return value


# -- common options --------------------------------------------------------------------------------------


def add_format_option(p: argparse.ArgumentParser) -> None:
    """How a trace is read: its format, what to do with bad records, and the system prompt and tool
    definitions to use where the trace does not record them."""
    from ctxfold.chat.formats import FORMATS

    p.add_argument("--format", choices=FORMATS, metavar="NAME",
                   help=f"read the input as this trace format instead of detecting it ({', '.join(FORMATS)})")
    p.add_argument("--lenient", action="store_true", help="skip malformed records of a trace (counted on "
                   "stderr) instead of stopping at the first one; replay also skips a whole file it cannot read, "
                   "with a warning, and exits 1 at the end")
    p.add_argument("--tools", metavar="FILE", help="the tool definitions the agent sent with each request, "
                   "for traces that do not record them: a JSON list (or an object with a 'tools' list) in "
                   "OpenAI or Anthropic shape; replaces any the trace records or ctxfold fills in")
    p.add_argument("--system", metavar="FILE", help="the system prompt the agent sent, as a text file (one "
                   "final newline is dropped), for traces that do not record it; replaces any the trace records")


def add_counting_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, metavar="SPEC",
                   help="token counter: a tokenizer by name (deepseek-v4, deepseek-v3 (its tokenizer.json from "
                   "$CTXFOLD_DEEPSEEK_V3_TOKENIZER or the Hugging Face cache), qwen3, mistral, tekken, o200k_base, "
                   "cl100k_base, llama3, llama4), a tokenizer.json or SentencePiece .model file, gguf:PATH (a GGUF model's own "
                   "tokenizer, through llama.cpp: pip install 'ctxfold[llama]'), estimate:NAME (the "
                   "calibrated estimator, an upper bound), auto:NAME (exact when the tokenizer and the fast "
                   f"exact counter are installed, else the estimate, with a warning), or chars4 (default: {DEFAULT_TOKENIZER})")
    p.add_argument("--template", metavar="SPEC",
                   help="chat template the requests are rendered with, for exact counts: deepseek-v3.2 "
                   "(DeepSeek V3.2's own), deepseek-v3.2-api (the hosted DeepSeek API, which counts one token "
                   "fewer after a user message that follows tool results), deepseek-v4, chatml (qwen3), "
                   "mistral-v7, gemma-3, llama-3.1, llama-3.2; or the model's own Jinja template: "
                   "hf:PATH (a tokenizer_config.json or its folder), gguf:PATH, file:PATH (needs "
                   "ctxfold[templates]); default: the template the counter stands for (deepseek-v3.2 for the default "
                   "counter and its estimate), else message text alone")


def add_policy_options(p: argparse.ArgumentParser) -> None:
    from ctxfold.compaction.config import POLICIES

    p.add_argument("--ctx", type=positive_int, metavar="TOKENS", help="the model's context window in tokens "
                   f"(16k = 16384; default: the config file's context_tokens, else {DEFAULT_CONTEXT_TOKENS})")
    p.add_argument("--config", metavar="FILE", help="compaction settings: an agent.yml (agent.compact), or a "
                   "YAML/TOML file of compact keys; --policy and --ctx override it")
    p.add_argument("--policy", choices=POLICIES, help="which compaction passes run: ds4 (soft and hard "
                   "triggers, after the ds4 inference engine: summarize near the window's end), datus (archive "
                   "and summary passes, after the Datus agent framework: old tool outputs go to an archive "
                   "first, a summary when that is not enough) or both (default: both, or the config file's)")
    p.add_argument("--summarizer", metavar="extractive|URL", help="who writes summaries: extractive (built "
                   "from the conversation itself, no model; the default) or the base URL of an "
                   "OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (needs --model)")
    p.add_argument("--model", help="model name for --summarizer URL (default: $CTXFOLD_SUMMARY_MODEL)")
    p.add_argument("--strict-summarizer", action="store_true", help="exit 1 when any summary fell back to "
                   "the extractive one because the --summarizer endpoint failed (default: a warning)")
    p.add_argument("--page-size", type=positive_int, default=16, metavar="TOKENS",
                   help="KV cache page size the reuse figures round down to (default: 16)")
    p.add_argument("--kv-plan", choices=("segments", "tokens"), default="segments",
                   help="how the KV plan is computed: from per-message counts (segments, free) or over "
                   "the token ids of both requests, with the spans a shifting engine can move (tokens: "
                   "needs a tokenizer.json --tokenizer and a --template; two encodes per compaction)")
    p.add_argument("--reply-reserve", type=non_negative_int, metavar="TOKENS", help="tokens kept free for "
                   "each answer (default: the config's, else the longest recorded answer, at least 256 "
                   "and at most a quarter of the window)")


def check_summarizer_args(args: argparse.Namespace) -> None:
    s = args.summarizer
    if s is not None and s != "extractive":
        if not s.startswith(("http://", "https://")):
            raise CommandError(f"--summarizer {s!r}: expected 'extractive' or an http(s) URL of an "
                               "OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1", EXIT_USAGE)
        if not (args.model or os.environ.get("CTXFOLD_SUMMARY_MODEL")):
            raise CommandError(f"--summarizer {s}: which model? add --model NAME", EXIT_USAGE)
    elif args.model:
        raise CommandError("--model is for --summarizer URL; the extractive summarizer needs no model", EXIT_USAGE)


def make_summarizer(config: CompactConfig, counter: Any) -> Any:
    """The summarizer ``config.summarizer`` asks for, built by ctxfold.compaction.summarize; None for the extractive
    one, which is the compactor's own default (so a replay here and replay_conversation agree)."""
    if config.summarizer.kind == "extractive":
        return None
    from ctxfold.compaction.summarize import make_summarizer as make

    return make(config, counter=counter)


def reply_reserve_config(config: CompactConfig, explicit: int | None) -> tuple[CompactConfig, bool]:
    """The config with --reply-reserve applied, and whether each conversation gets its own reserve
    (neither the option nor the config sets one)."""
    if explicit is not None:
        return replace(config, reply_reserve_tokens=explicit), False
    return config, config.reply_reserve_tokens is None and config.max_output_tokens is None


# A window below this cannot hold a system prompt, a request and an answer: every request would
# overflow and the run would only print that, once per request.
MIN_CONTEXT_TOKENS = 512
# The largest windows models have are around 10M tokens: a larger figure is a typo (a zero too many).
MAX_CONTEXT_TOKENS = 1 << 24
# What the reply reserve must leave of the window for the prompt itself.
MIN_PROMPT_TOKENS = 256


def check_settings(args: argparse.Namespace, config: CompactConfig, *, counter: TokenCounter | None = None) -> None:
    """Refuse impossible or contradictory settings before any work, as one usage error naming the
    option (or the config file's key) and the allowed range. ``counter``, once loaded, is checked
    against --kv-plan tokens."""

    def source(flag: str, dest: str, key: str) -> str:
        """The option as the user gave it, else the config file's key with its value."""
        value = getattr(args, dest, None)
        return f"{flag} {value}" if value is not None else f"{key} {getattr(config, key)} in {args.config}"

    ctx = config.context_tokens
    ctx_flag, ctx_dest = ("--ctx", "ctx") if hasattr(args, "ctx") else ("--context-tokens", "context_tokens")
    if ctx is not None and ctx < MIN_CONTEXT_TOKENS:
        raise CommandError(f"{source(ctx_flag, ctx_dest, 'context_tokens')}: the context window must be at least "
                           f"{MIN_CONTEXT_TOKENS} tokens; a smaller one cannot hold a prompt and an answer",
                           EXIT_USAGE)
    if ctx is not None and ctx > MAX_CONTEXT_TOKENS:
        raise CommandError(f"{source(ctx_flag, ctx_dest, 'context_tokens')}: the context window must be at most "
                           f"{MAX_CONTEXT_TOKENS:,} tokens (16M); no model has a larger one", EXIT_USAGE)
    if ctx is not None and config.reply_reserve() > ctx - MIN_PROMPT_TOKENS:
        if config.reply_reserve_tokens is not None:
            reserve_flag, reserve_dest = ("--reply-reserve", "reply_reserve") if hasattr(args, "reply_reserve") \
                else ("--reply-reserve-tokens", "reply_reserve_tokens")
            what = source(reserve_flag, reserve_dest, "reply_reserve_tokens")
        else:  # the reserve follows the reply cap
            what = source("--max-output-tokens", "max_output_tokens", "max_output_tokens")
        raise CommandError(f"{what}: the reply reserve ({config.reply_reserve()} tokens) must leave at least "
                           f"{MIN_PROMPT_TOKENS} tokens of the {ctx}-token window for the prompt, so 0 to "
                           f"{ctx - MIN_PROMPT_TOKENS}; lower it or widen the window with {ctx_flag}", EXIT_USAGE)
    page_size = getattr(args, "page_size", None)
    if ctx is not None and page_size is not None and page_size > ctx:
        raise CommandError(f"--page-size {page_size}: a KV cache page cannot be larger than the {ctx}-token "
                           f"window, so 1 to {ctx}", EXIT_USAGE)
    if getattr(args, "strict_summarizer", False) and config.summarizer.kind == "extractive":
        raise CommandError("--strict-summarizer: the extractive summarizer cannot fail; the option is for a "
                           "model's endpoint (--summarizer URL --model NAME)", EXIT_USAGE)
    if getattr(args, "kv_plan", None) == "tokens":
        has_ids = counter is None or getattr(counter, "tokenizer", None) is not None
        if getattr(args, "template", None) is None or not has_ids:
            raise CommandError("--kv-plan tokens: plans over token ids, so it needs a tokenizer.json tokenizer "
                               "and its chat template: add --tokenizer deepseek-v4 --template deepseek-v4 (or "
                               "--tokenizer qwen3 --template chatml), or use --kv-plan segments", EXIT_USAGE)


def with_auto_reserve(config: CompactConfig, conversation: Conversation, counter: TokenCounter) -> CompactConfig:
    """The replay reserve of ``ctxfold.replay.default_reply_reserve``: the longest recorded answer."""
    from ctxfold.replay import default_reply_reserve

    return replace(config, reply_reserve_tokens=default_reply_reserve(conversation, counter.count,
                                                                      config.context_tokens))


def load_counter(spec: str) -> TokenCounter:
    from ctxfold.tokens.counting import load_counter as load

    return load(spec)


def load_template(spec: str | None) -> Any:
    """The chat template ``spec`` names: a preset, hf:PATH, gguf:PATH or file:PATH (None: plain text, no
    template tokens). One parser for every command and the proxy: :func:`ctxfold.tokens.templates.get_template`."""
    if spec is None:
        return None
    from ctxfold.tokens.templates import get_template

    return get_template(spec)


def build_config(args: argparse.Namespace, *, default_context_tokens: int | None) -> CompactConfig:
    """The compaction settings: --config FILE, else the --policy preset, with --ctx over both."""
    from ctxfold.compaction.config import CompactConfig, load_config

    overrides: dict[str, Any] = {}
    if getattr(args, "policy", None) is not None:
        overrides["policy"] = args.policy
    if getattr(args, "ctx", None) is not None:
        overrides["context_tokens"] = args.ctx
    if getattr(args, "config", None) is not None:
        config = load_config(args.config, **overrides)
    else:
        config = CompactConfig.from_mapping(overrides)
    if config.context_tokens is None and default_context_tokens is not None:
        config = replace(config, context_tokens=default_context_tokens)
    spec = getattr(args, "summarizer", None)
    if spec == "extractive":
        config = replace(config, summarizer=replace(config.summarizer, kind="extractive"))
    elif spec is not None:  # an endpoint URL (check_summarizer_args ran)
        config = replace(config, summarizer=replace(config.summarizer, kind="openai", base_url=spec,
                                                    model=args.model or config.summarizer.model))
    return config


# -- input -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Loaded:
    path: str  # the file as named on the command line
    format: str  # the importer that read it
    conversations: list[Conversation]


def load_traces(paths: Sequence[str], format: str | None = None, *, lenient: bool = False,
                warn: Callable[[str], None] | None = None, system_file: str | None = None,
                tools_file: str | None = None) -> list[Loaded]:
    """Every conversation of every file, in order. A missing or malformed file is an input error
    naming the file (and the line, for a malformed record); with ``lenient`` bad records are skipped
    and ``warn`` hears how many, and the first. ``system_file`` and ``tools_file`` (--system,
    --tools) go on every conversation, over what the trace records; ``warn`` hears where they
    replace something the trace records."""
    from ctxfold.chat.formats import read_path
    from ctxfold.chat.formats.header import HeaderFiles, apply_header

    # The files first: a bad one fails before a long trace is parsed.
    header = HeaderFiles.read(system_file, tools_file)
    out = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise CommandError(f"{path}: no such file; expected a trace file (JSON or JSONL)", EXIT_INPUT)
        if p.is_dir():
            raise CommandError(f"{path}: is a directory; name the trace files in it (e.g. {path}/*.json)",
                               EXIT_INPUT)
        report = read_path(p, format, lenient=lenient)
        if report.skipped and warn is not None:
            warn(f"{path}: skipped {len(report.skipped)} malformed record{'s' if len(report.skipped) != 1 else ''}"
                 f" (first: {report.skipped[0]})")
        if not report.conversations:
            raise FormatError("no conversation in this file", source=path)
        if header:
            replaced: dict[str, int] = {}
            for c in report.conversations:
                for what in apply_header(c, header):
                    replaced[what] = replaced.get(what, 0) + 1
            if replaced and warn is not None:
                n = len(report.conversations)
                warn(f"{path}: " + "; ".join(
                    f"{'--system' if what == 'system prompt' else '--tools'} replaces the {what} the trace records"
                    + ("" if n == 1 else f" (in {k} of its {n} conversations)") for what, k in replaced.items()))
        out.append(Loaded(path, report.format, report.conversations))
    return out


def warn(text: str) -> None:
    """A warning: one line on stderr, shown even with --quiet."""
    print(f"ctxfold: warning: {text}", file=sys.stderr)


def unique_labels(conversations: Sequence[Conversation]) -> list[str]:
    """A short, distinct, filesystem-safe label per conversation (its id, made unique)."""
    labels: list[str] = []
    seen: dict[str, int] = {}
    for c in conversations:
        base = re.sub(r"[^A-Za-z0-9._:-]+", "_", c.id or "conversation").strip("._") or "conversation"
        n = seen.get(base, 0)
        seen[base] = n + 1
        labels.append(base if n == 0 else f"{base}.{n}")
    return labels


def write_output(path: str, text: str) -> None:
    """Write ``text`` to ``path`` ('-' is stdout) whole or not at all (a temporary file beside it, then
    renamed). Its folder must exist: a mistyped path is an error, not a new folder somewhere."""
    if path == "-":
        sys.stdout.write(text)
        return
    p = Path(path)
    if p.is_dir():
        raise CommandError(f"{path}: is a directory; give a file name for the output", EXIT_INPUT)
    if not p.parent.is_dir():
        raise CommandError(f"{path}: the folder {p.parent} does not exist; create it first", EXIT_INPUT)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_UMASK)  # what open() would have made: mkstemp's file is 0600
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; at import, before any thread could create a file
    os.umask(mask)
    return mask


_UMASK = _read_umask()


# -- terminal --------------------------------------------------------------------------------------------

BANNER = "\x1b[1;95m"  # ds4's COMPACTING banner: bold bright magenta
GREY = "\x1b[38;5;245m"  # ds4 streams the summary in this grey
DIM = "\x1b[2m"
BOLD = "\x1b[1m"
RED = "\x1b[31m"
YELLOW = "\x1b[33m"
GREEN = "\x1b[32m"
RESET = "\x1b[0m"


class Terminal:
    """One output stream (stderr) for progress and markers. Escape codes only on a terminal without
    NO_COLOR; the redrawn progress line only on a terminal at all, so logs stay plain text."""

    def __init__(self, stream: IO[str] | None = None, *, quiet: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        isatty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.live = isatty and os.environ.get("TERM") != "dumb"
        self.color = self.live and not os.environ.get("NO_COLOR")  # no-color.org: set and non-empty
        self._status = ""  # the live line currently drawn (progress bar), "" when none
        self._open_text = False  # a streamed text is mid-line

    def style(self, text: str, code: str) -> str:
        return f"{code}{text}{RESET}" if self.color else text

    def line(self, text: str) -> None:
        """Print one line above the live status line."""
        if self.quiet:
            return
        self._clear()
        if self._open_text:
            self.stream.write("\n")
            self._open_text = False
        self.stream.write(text + "\n")
        self._redraw()

    def stream_text(self, text: str, code: str = GREY) -> None:
        """Stream text (a summary being written) with the status line out of the way."""
        if self.quiet or not text:
            return
        if not self._open_text:
            self._clear()
        body, newline = (text[:-1], "\n") if text.endswith("\n") else (text, "")
        self.stream.write((self.style(body, code) if body else "") + newline)
        self._open_text = not newline
        self.stream.flush()

    def end_text(self) -> None:
        """End streamed text; the status line comes back under it."""
        if self._open_text:
            self.stream.write("\n")
            self._open_text = False
            self._redraw()

    def status(self, text: str) -> None:
        """Replace the live status line (terminals only)."""
        if self.quiet or not self.live:
            return
        self._status = text
        if not self._open_text:
            self._clear()
            self._redraw()

    def clear_status(self) -> None:
        self._clear()
        self._status = ""

    def _clear(self) -> None:
        if self.live and self._status and not self._open_text:
            # Erase the status line: one escape code, or (NO_COLOR: no escape codes at all) blanks.
            self.stream.write("\r\x1b[2K" if self.color else "\r" + " " * (_columns() - 1) + "\r")

    def _redraw(self) -> None:
        if self.live and self._status and not self._open_text:
            self.stream.write(self._status[: _columns() - 1])
        self.stream.flush()


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 100


def bar(done: int, total: int, cells: int = 24, full: str = "█", empty: str = "·") -> str:
    n = 0 if total <= 0 else min(cells, done * cells // total)
    return full * n + empty * (cells - n)


class Throttle:
    """True at most every ``interval_s`` seconds (so redraws do not cost more than the work)."""

    def __init__(self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last = -1e9

    def __call__(self, force: bool = False) -> bool:
        now = self.clock()
        if force or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False


def tokens(n: float | None) -> str:
    """A token count as people read them: 950, 12.3k, 1.20M (ds4's footer style)."""
    if n is None:
        return "-"
    a = abs(n)
    if a < 1000:
        return f"{int(n)}"
    if a < 1_000_000:
        return f"{n / 1000:.1f}k"
    return f"{n / 1_000_000:.2f}M"


# -- tables ----------------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, align: str | None = None,
          total: Sequence[object] | None = None) -> str:
    """A plain-text table: first column left-aligned, the rest right-aligned (``align`` overrides,
    one of 'l'/'r' per column); an optional total row under a rule."""
    cells = [[str(c) for c in r] for r in rows]
    tot = [str(c) for c in total] if total is not None else None
    allrows = [list(headers), *cells, *([tot] if tot else [])]
    widths = [max(len(r[i]) for r in allrows) for i in range(len(headers))]
    al = align or ("l" + "r" * (len(headers) - 1))

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, al, strict=True)).rstrip()

    out = [fmt(headers), "  ".join("-" * w for w in widths)]
    out += [fmt(r) for r in cells]
    if tot is not None:
        out += ["  ".join("-" * w for w in widths), fmt(tot)]
    return "\n".join(out) + "\n"
