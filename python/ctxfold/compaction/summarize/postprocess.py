"""Answer post-processing shared by every model-backed summarizer.

:class:`StreamCutter` takes the answer piece by piece (SSE deltas, engine tokens) and decides, as the pieces
arrive, what is summary text: it skips a leading ``<think>...</think>`` block (reasoning is not summary),
stops before a control boundary (ds4 treats ``</think>`` and DSML as hard boundaries: internal compaction must
never execute tools or store markup), stops at an end-of-sequence string, and cuts at the token cap. A marker
can be split across pieces, so the cutter holds back any tail that could still become one and never streams
text it may have to take back.

:func:`garbage_reason` says why a finished answer is not a usable summary (empty, markup only, a loop).

:func:`with_trail` adds to a finished summary the files the agent changed that it leaves out (the artifact
trail, :mod:`ctxfold.compaction.trail`), so every summary carries them whoever wrote it.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

from ctxfold.chat.messages import Message
from ctxfold.compaction.summarize.base import CutReason, SummaryResult, TokenCounter, count_tokens, failed
from ctxfold.compaction.summarize.request import SUMMARY_CONTRACT
from ctxfold.compaction.trail import FileChange, artifact_trail, mentions, render_trail

TRAIL_MAX_TOKENS = 512  # summary.trail_max_tokens: the most a summary's trail section takes

# Markers where the model tries to leave the summary. ｜ is U+FF5C, ▁ is U+2581 (DeepSeek's specials).
CONTROL_MARKERS: tuple[str, ...] = (
    "</think>",  # end of thinking: ds4 prompts in non-thinking mode, so closing thinking means trouble
    "｜DSML｜",  # DeepSeek V4 tool-call markup (`<｜DSML｜tool_calls>`, closers `</｜DSML｜...`)
    "<tool_call>",  # Qwen / Hermes tool calls
    "<｜tool▁calls▁begin｜>",  # DeepSeek V3 tool calls
    "<|python_tag|>",  # Llama 3 tool calls
    "[TOOL_CALLS]",  # Mistral tool calls
)
# End-of-sequence strings some servers pass through as text when special tokens are not skipped.
EOS_MARKERS: tuple[str, ...] = (
    "<｜end▁of▁sentence｜>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
)
# The DSML opener and closer are markers of their own too, so the '<' or '</' before `｜DSML｜` is held back
# with it when the stream splits them (a '<' already streamed could not be taken back).
_MARKERS: tuple[tuple[str, CutReason], ...] = tuple(
    [(m, "control_boundary") for m in ("<｜DSML｜", "</｜DSML｜", *CONTROL_MARKERS)] + [(m, "eos") for m in EOS_MARKERS]
)
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"

# Leftover special-token-like markup removed from a finished summary (never part of durable state).
_SPECIAL_RE = re.compile(r"<[｜|][^<>\n]{0,48}[｜|]>|</?think>")


_MARKER_STARTS = "".join(sorted({m[0] for m, _ in _MARKERS}))  # "<", "[", "｜"
_MAX_MARKER_CHARS = max(len(m) for m, _ in _MARKERS)


def _held_suffix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker (it may still grow
    into one, so it must not be streamed yet). Every marker starts with one of a few characters, so only
    suffixes starting at one of those are tried: most pieces have none, and cost one scan of a short tail."""
    tail = text[-(_MAX_MARKER_CHARS - 1):]
    for i, ch in enumerate(tail):
        if ch in _MARKER_STARTS:
            suffix = tail[i:]
            if any(m.startswith(suffix) for m, _ in _MARKERS):
                return len(suffix)
    return 0


class StreamCutter:
    """Incremental cutter for one answer. Not thread-safe (one per generation).

    ``feed(piece)`` returns the text newly accepted as summary (stream it to the user); once ``stopped`` is
    true, later pieces are ignored. ``finish()`` flushes the held-back tail at the end of the stream.
    """

    def __init__(self, max_tokens: int, *, counter: TokenCounter | None = None,
                 limit_reason: CutReason = "token_cap") -> None:
        self._max_tokens = max_tokens
        self._counter = counter
        self.limit_reason: CutReason = limit_reason
        self._state = "start"  # start -> (think -> lead ->) body
        self._pending = ""  # text not yet decided (a possible marker prefix, or the start)
        self._parts: list[str] = []  # accepted summary text
        self._num_chars = 0
        self._est_tokens = 0  # running estimate with a counter (sum over pieces; >= the exact count)
        self.stopped = False
        self.cut_reason: CutReason = "none"
        self.reasoning_chars = 0  # characters of a leading thinking block that were skipped

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def feed(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        self._pending += piece
        if self._state == "start":
            stripped = self._pending.lstrip()
            if not stripped or (len(stripped) < len(_THINK_OPEN) and _THINK_OPEN.startswith(stripped)):
                return ""  # could still be the start of a thinking block
            if stripped.startswith(_THINK_OPEN):
                self._state = "think"
                self._pending = stripped[len(_THINK_OPEN):]
            else:
                self._state = "body"
        if self._state == "think":
            end = self._pending.find(_THINK_CLOSE)
            if end < 0:
                keep = len(_THINK_CLOSE) - 1
                self.reasoning_chars += max(0, len(self._pending) - keep)
                self._pending = self._pending[-keep:]
                return ""
            self.reasoning_chars += end
            self._pending = self._pending[end + len(_THINK_CLOSE):]
            self._state = "lead"
        if self._state == "lead":  # whitespace between the thinking block and the answer is not summary
            self._pending = self._pending.lstrip()
            if not self._pending:
                return ""
            self._state = "body"
        return self._scan()

    def _scan(self) -> str:
        if not any(ch in self._pending for ch in _MARKER_STARTS):  # the common piece: plain text
            accepted, self._pending = self._pending, ""
            return self._accept(accepted)
        first = -1
        reason: CutReason = "none"
        for m, r in _MARKERS:
            i = self._pending.find(m)
            if i >= 0 and (first < 0 or i < first):
                first, reason = i, r
        if first >= 0:
            accepted = self._pending[:first]
            self._pending = ""
            out = self._accept(accepted)
            if not self.stopped:
                self.stopped, self.cut_reason = True, reason
            return out
        hold = _held_suffix_len(self._pending)
        accepted, self._pending = self._pending[: len(self._pending) - hold], self._pending[len(self._pending) - hold:]
        return self._accept(accepted)

    def _accept(self, piece: str) -> str:
        if not piece:
            return ""
        self._parts.append(piece)
        self._num_chars += len(piece)
        if self._counter is None:
            over = (self._num_chars + 3) // 4 > self._max_tokens
        else:
            self._est_tokens += self._counter.count(piece)
            over = False
            if self._est_tokens > self._max_tokens:
                # Piecewise counts overestimate (token merges across pieces): recount before cutting.
                self._est_tokens = self._counter.count(self.text)
                over = self._est_tokens > self._max_tokens
        if not over:
            return piece
        before = self._num_chars - len(piece)
        full = self.text
        cut = trim_to_tokens(full, self._max_tokens, self._counter)
        self._parts = [cut]
        self._num_chars = len(cut)
        self.stopped, self.cut_reason = True, self.limit_reason
        return cut[before:] if len(cut) > before else ""

    def finish(self, reason: CutReason = "eos") -> str:
        """End of the stream: flush the held-back tail (it did not become a marker)."""
        if self.stopped:
            return ""
        out = ""
        if self._state == "body" or (self._state == "start" and self._pending.strip()):
            out = self._accept(self._pending)
        self._pending = ""
        if not self.stopped:
            self.stopped, self.cut_reason = True, reason
        return out


def trim_to_tokens(text: str, max_tokens: int, counter: TokenCounter | None) -> str:
    """The longest prefix of ``text`` with at most ``max_tokens`` tokens (chars/4 when no counter):
    a binary search over character lengths, O(log n) counts."""
    if count_tokens(counter, text) <= max_tokens:
        return text
    if counter is None:
        return text[: max(0, max_tokens) * 4]
    lo, hi = 0, len(text)  # count(text[:lo]) <= max, count(text[:hi]) > max
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if counter.count(text[:mid]) <= max_tokens:
            lo = mid
        else:
            hi = mid
    return text[:lo]


def clean_summary(text: str) -> str:
    """Remove special-token-like markup and thinking tags; strip surrounding whitespace."""
    return _SPECIAL_RE.sub("", text).strip()


_WORD_RE = re.compile(r"\w", re.UNICODE)
# The lines of the summary request a model echoes instead of following (seen from a small model): two
# of them verbatim in an answer make it an echo, not a summary.
_CONTRACT_LINES = tuple(line.strip("- ;.") for line in SUMMARY_CONTRACT.splitlines() if len(line.strip()) >= 30)


def garbage_reason(text: str) -> str | None:
    """Why ``text`` is not a usable summary, or None when it is.

    - empty or whitespace only;
    - markup only: fewer than 8 word characters once tags are removed;
    - a loop: the text compresses to under 12 % of its size (English prose and code compress to 30-50 %;
      a model repeating itself compresses to a few percent), or most of its lines are copies.
    """
    if not text.strip():
        return "empty summary"
    if "[ctxfold compacted " in text or "[End of summary." in text:
        # Carried on, the frame would nest in every later summary.
        return "summary contains a compaction frame"
    contract = sum(1 for line in _CONTRACT_LINES if line in text)
    if contract >= 2:
        return f"summary echoes the summary request ({contract} of its lines)"
    bare = re.sub(r"<[^<>]{0,80}>", "", text)
    if len(_WORD_RE.findall(bare)) < 8:
        return "summary has no text (markup or punctuation only)"
    raw = text.encode("utf-8")
    if len(raw) >= 256:
        ratio = len(zlib.compress(raw, 6)) / len(raw)
        if ratio < 0.12:
            return f"summary is a repetition loop (compresses to {ratio:.0%} of its size)"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) >= 10 and len(set(lines)) / len(lines) < 0.3:
        return f"summary is a repetition loop ({len(set(lines))} distinct lines of {len(lines)})"
    # A short loop (too short to compress much): one substantial line said three times or more that makes up
    # most of the text. Seen from a real small model that parroted the transcript's last message.
    counts: dict[str, int] = {}
    for ln in lines:
        if len(ln) >= 15:
            counts[ln] = counts.get(ln, 0) + 1
    repeated_chars = sum(len(ln) * n for ln, n in counts.items() if n >= 3)
    if repeated_chars * 2 >= len(text.strip()) and repeated_chars:
        return "summary is a repetition loop (the same line three times or more)"
    return None


def result_from_cutter(cutter: StreamCutter, name: str, seconds: float, counter: TokenCounter | None,
                       *, detail: str | None = None) -> SummaryResult:
    """The result of a finished generation: the cleaned text, or a failure when it is empty or garbage."""
    text = clean_summary(cutter.text)
    bad = garbage_reason(text)
    if bad is not None:
        extra = f"{cutter.reasoning_chars} chars of reasoning skipped" if cutter.reasoning_chars else None
        return failed(name, bad, seconds, detail="; ".join(x for x in (detail, extra) if x) or None)
    return SummaryResult(text=text, ok=True, failure=None, cut_reason=cutter.cut_reason,
                         num_tokens=count_tokens(counter, text), seconds=seconds, summarizer=name, detail=detail)


def trail_section(trail: Sequence[FileChange], max_tokens: int, counter: TokenCounter | None) -> str:
    """The trail section in at most ``max_tokens`` tokens: the newest changes that fit ("" if none does)."""
    max_chars = max(0, max_tokens) * 4  # chars/4 is the first guess; a real counter corrects it below
    for _ in range(4):
        section = render_trail(trail, max_chars=max_chars)
        n = count_tokens(counter, section)
        if n <= max_tokens:
            return section
        max_chars = int(max_chars * max_tokens / n * 0.95)
    return ""


def append_section(text: str, section: str, max_tokens: int, counter: TokenCounter | None) -> tuple[str, bool]:
    """``text`` and ``section`` in at most ``max_tokens`` tokens: the section whole, the text cut to make
    room where it must. Returns (the joined text, whether ``text`` was cut)."""
    if not section:
        return text, False
    room = max_tokens - count_tokens(counter, section) - 1
    cut = False
    for _ in range(4):
        body = trim_to_tokens(text, max(0, room), counter)
        cut = cut or len(body) < len(text)
        joined = (body.rstrip() + "\n\n" + section) if body.strip() else section
        over = count_tokens(counter, joined) - max_tokens
        if over <= 0:
            return joined, cut
        room -= over  # tokens can merge or split at the seam: shorten by what it came out over
    return trim_to_tokens(joined, max_tokens, counter), True


def with_trail(text: str, transcript: Sequence[Message], *, max_tokens: int, counter: TokenCounter | None,
               trail_max_tokens: int = TRAIL_MAX_TOKENS) -> tuple[str, bool]:
    """A summary of ``transcript`` with the files the agent changed that it does not name, newest first, in
    a section of at most min(``trail_max_tokens``, ``max_tokens`` / 4) tokens; the whole stays within
    ``max_tokens`` (the summary's own text is cut at its end when it must make room). A summary that names
    every changed file comes back unchanged. Returns (the text, whether the summary's own text was cut)."""
    missing = [c for c in artifact_trail(transcript) if not mentions(text, c.path)]
    if not missing:
        return text, False
    section = trail_section(missing, min(trail_max_tokens, max_tokens // 4), counter)
    return append_section(text, section, max_tokens, counter)
