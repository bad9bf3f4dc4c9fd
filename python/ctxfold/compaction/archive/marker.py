"""The marker line that replaces an archived tool output, and its parser.

    [ctxfold archived id=<sha256> chars=<n> | read_archive(id) gives the full text] preview: <text>

One line: the preview is the first ``preview_chars`` of the output with every line break folded to a
space (every character ``str.splitlines`` breaks on, so the marker is one line by any reader's rule).
``chars`` is the output's length in characters, the unit ``read_archive`` offsets use.

The hard trigger's last resort writes the marker followed by one more line, a tool error telling the
model how to read the output in pieces (:func:`make_oversized_notice`).

Parsing is syntax only. Whether a parsed marker really is one is decided by the store: its id must
resolve there (see ``passes.py``); a tool output that merely looks like a marker is ordinary text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARKER_PREFIX = "[ctxfold archived id="
_HEADER_FMT = "[ctxfold archived id={id} chars={chars} | read_archive(id) gives the full text] preview: "
_MARKER_RE = re.compile(
    r"\[ctxfold archived id=(?P<id>[0-9a-f]{64}) chars=(?P<chars>0|[1-9][0-9]*)"
    r" \| read_archive\(id\) gives the full text\] preview: (?P<preview>[^\n]*)"
)
_NOTICE_RE = re.compile(
    r"Error: this (?P<kind>tool result|tool error output) is (?P<chars>[0-9]+) characters,"
    r" more than fits in the context \(limit: (?P<limit>[^()\n]*)\)\. It was archived whole,"
    r" nothing was dropped\. Read it in pieces: read_archive\(id=\"(?P<id>[0-9a-f]{64})\","
    r" offset=0, limit=(?P<piece>[0-9]+)\), then call again from the next_offset it returns\."
)
# Every character str.splitlines() breaks on.
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
_FOLD = str.maketrans({c: " " for c in _LINE_BREAKS})
_HEADER_CHARS_WITHOUT_COUNT = len(_HEADER_FMT.format(id="0" * 64, chars=""))


@dataclass(frozen=True, slots=True)
class Marker:
    """A parsed marker."""

    archive_id: str  # 64 hex: the sha256 of the archived output
    chars: int  # length of the archived output in characters
    preview: str  # the preview as shown (line breaks folded)
    oversized: bool = False  # written by the hard trigger's last resort (marker plus a tool error)
    tool_error: bool = False  # oversized only: the tool itself had reported an error


def fold_preview(text: str, preview_chars: int) -> str:
    """The first ``preview_chars`` characters with line breaks folded to spaces."""
    return text[:preview_chars].translate(_FOLD)


# Between the head and the tail of a head-and-tail preview.
PREVIEW_GAP = " [...] "


def make_marker(archive_id: str, text: str, preview_chars: int, tail_chars: int = 0) -> str:
    """The one-line marker for ``text`` archived under ``archive_id``. With ``tail_chars``, the preview
    is the first ``preview_chars`` and the last ``tail_chars`` characters around a gap (a message's end
    often says the most: a traceback's error, a pasted file's last lines), when the text is longer than
    both together."""
    header = _HEADER_FMT.format(id=archive_id, chars=len(text))
    if tail_chars > 0 and len(text) > preview_chars + tail_chars + len(PREVIEW_GAP):
        return header + fold_preview(text, preview_chars) + PREVIEW_GAP + text[-tail_chars:].translate(_FOLD)
    return header + fold_preview(text, preview_chars)


def preview_matches(text: str, preview: str) -> bool:
    """Whether ``preview`` is what :func:`make_marker` shows of ``text``: its head, or its head and tail
    around :data:`PREVIEW_GAP` (the head may hold that string too: each place it occurs is tried)."""
    if fold_preview(text, len(preview)) == preview:
        return True
    at = preview.find(PREVIEW_GAP)
    while at >= 0:
        head, tail = preview[:at], preview[at + len(PREVIEW_GAP):]
        if tail and fold_preview(text, len(head)) == head and text[-len(tail):].translate(_FOLD) == tail:
            return True
        at = preview.find(PREVIEW_GAP, at + 1)
    return False


def marker_chars(text_chars: int, preview_chars: int) -> int:
    """Length of the marker of a ``text_chars``-long output, known before hashing it."""
    return _HEADER_CHARS_WITHOUT_COUNT + len(str(text_chars)) + min(preview_chars, text_chars)


def make_oversized_notice(
    archive_id: str, text_chars: int, *, tool_error: bool, limit_desc: str, piece_chars: int
) -> str:
    """The tool error that follows the marker when an output is too large to keep inline."""
    kind = "tool error output" if tool_error else "tool result"
    text = (
        f"Error: this {kind} is {text_chars} characters, more than fits in the context (limit: {limit_desc})."
        " It was archived whole, nothing was dropped. Read it in pieces:"
        f' read_archive(id="{archive_id}", offset=0, limit={piece_chars}),'
        " then call again from the next_offset it returns."
    )
    if _NOTICE_RE.fullmatch(text) is None:  # a limit_desc with parentheses or a newline
        raise ValueError(f"limit description {limit_desc!r} must not contain parentheses or line breaks")
    return text


def is_marker(text: str) -> bool:
    """Whether ``text`` has the syntax of a marker (id not checked against any store)."""
    return text.startswith(MARKER_PREFIX) and parse_marker(text) is not None


def parse_marker(text: str) -> Marker | None:
    """The marker in ``text`` when the whole text is one (plain, or oversized with its notice)."""
    if not text.startswith(MARKER_PREFIX):
        return None
    line, sep, rest = text.partition("\n")
    m = _MARKER_RE.fullmatch(line)
    if m is None:
        return None
    archive_id, chars, preview = m.group("id"), int(m.group("chars")), m.group("preview")
    if len(preview) > chars:
        return None
    if not sep:
        return Marker(archive_id, chars, preview)
    n = _NOTICE_RE.fullmatch(rest)
    if n is None or n.group("id") != archive_id or int(n.group("chars")) != chars:
        return None
    return Marker(archive_id, chars, preview, oversized=True, tool_error=n.group("kind") == "tool error output")
