"""Where the verbatim tail starts: over segments (messages) and over raw token ids.

Both scans run in the C++ core, backward from BOTTOM, and stop as soon as the budget is spent.
Neither ever returns a start that orphans a tool result, splits a tool call from its results or
enters a thinking block, and neither wastes the budget to start on a preferred kind of boundary:
a preferred start is taken only while it keeps at least ``min_fill`` of the tokens the best legal
start would keep (``min_fill=0`` is the strict order: a user turn whenever one fits).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxfold import _core
from ctxfold.core._arrays import as_view
from ctxfold.core.ledger import SegmentFlag

#: A preferred boundary must keep at least this share of what the best legal cut keeps.
DEFAULT_MIN_FILL = 0.9


class TailRule(enum.IntEnum):
    """Which rule chose a segment-level cut (values shared with the C++ core)."""

    NONE = 0  # nothing fits: no tail
    USER_TURN = 1  # the start of a real user turn
    ASSISTANT_TURN = 2  # the start of an assistant turn (text, tool calls or thinking)
    GROUP_START = 3  # any other segment that starts an atomic group


# The core's rule number -> TailRule by indexing: calling TailRule(n) goes through the enum
# machinery and costs about as much as the scan of a small table.
_TAIL_RULES: tuple[TailRule, ...] = tuple(TailRule)  # values are 0..3, in order (tests check)


@dataclass(frozen=True, slots=True)
class SegmentTail:
    """The tail [start, bottom) of a segment table."""

    start: int  # first segment of the tail; == bottom when nothing fits
    num_tokens: int  # tokens in segments [start, bottom)
    rule: TailRule  # which rule chose the start

    @property
    def found(self) -> bool:
        return self.rule is not TailRule.NONE


@dataclass(frozen=True, slots=True)
class SegmentCut:
    """The newest cut that frees enough: segments [floor, cut) go, [cut, bottom) stay."""

    found: bool  # False: dropping everything above the system prefix frees too little
    cut: int  # first kept segment; == bottom when everything above the system prefix goes
    freed_tokens: int  # tokens in [floor, cut), floor being the end of the system prefix
    rule: TailRule  # kind of segment at `cut`; NONE when cut == bottom or not found


def _bottom(bottom: int | None, n: int) -> int:
    return n if bottom is None else bottom


def select_tail(
    tokens: Any,
    flags: Any,
    group_starts: Any,
    *,
    budget_tokens: int,
    bottom: int | None = None,
    min_fill: float = DEFAULT_MIN_FILL,
) -> SegmentTail:
    """The verbatim tail of segments [.., bottom) within ``budget_tokens``.

    tokens: int64[n] per-segment token counts; flags: uint32[n] ``SegmentFlag`` bits;
    group_starts: int32[n], the first segment of each segment's atomic group. numpy arrays or CPU
    tensors are read in place. bottom defaults to n. O(segments inside the budget).
    Raises ValueError on bad arrays or arguments, IndexError when bottom is out of [0, n].
    """
    t = as_view(tokens, np.int64, "tokens")
    r = _core.select_segment_tail(
        t,
        as_view(flags, np.uint32, "flags"),
        as_view(group_starts, np.int32, "group_starts"),
        _bottom(bottom, len(t)),
        budget_tokens,
        min_fill,
    )
    return SegmentTail(r.start, r.num_tokens, _TAIL_RULES[r.rule])


def select_tail_from_ledger(
    ledger: _core.Ledger, *, budget_tokens: int, bottom: int | None = None, min_fill: float = DEFAULT_MIN_FILL
) -> SegmentTail:
    """As :func:`select_tail`, over a Ledger's own arrays (nothing copied)."""
    r = _core.select_segment_tail_ledger(ledger, _bottom(bottom, len(ledger)), budget_tokens, min_fill)
    return SegmentTail(r.start, r.num_tokens, _TAIL_RULES[r.rule])


def select_cut(
    tokens: Any,
    flags: Any,
    group_starts: Any,
    *,
    min_free_tokens: int,
    bottom: int | None = None,
    min_fill: float = 1.0,
) -> SegmentCut:
    """The newest legal cut freeing at least ``min_free_tokens`` above the system prefix: the
    smallest prefix to drop or summarize.

    Same arrays and legality as :func:`select_tail`. With ``min_fill < 1`` the cut may move forward
    to a preferred boundary (a user turn) while the tail left keeps ``min_fill`` of what the newest
    legal cut would keep; it then frees more. O(bottom).
    """
    t = as_view(tokens, np.int64, "tokens")
    r = _core.select_segment_cut(
        t,
        as_view(flags, np.uint32, "flags"),
        as_view(group_starts, np.int32, "group_starts"),
        _bottom(bottom, len(t)),
        min_free_tokens,
        min_fill,
    )
    return SegmentCut(r.found, r.cut, r.freed_tokens, _TAIL_RULES[r.rule])


# ---- token level -------------------------------------------------------------------------------

#: ``TokenTail.rule`` when no boundary lay within the budget and a raw index was returned.
RAW_CUT: int = _core.RAW_CUT
#: ``TokenTail.rule`` when not even a raw cut fits (zero budget, or a no-entry span covers it all).
NO_TAIL: int = _core.NO_TAIL


@dataclass(frozen=True, slots=True)
class Boundary:
    """One kind of chat boundary in token space."""

    token_id: int  # the marker's token id, e.g. DeepSeek V4 <｜User｜> = 128803
    cut_after: bool = False  # True: the tail starts after the marker (EOS ends a message)


@dataclass(frozen=True, slots=True)
class TokenTail:
    """The tail ids[start:bottom] of a token buffer."""

    start: int  # first token of the tail; == bottom when rule == NO_TAIL
    num_tokens: int  # bottom - start
    rule: int  # >= 0: index of the boundary kind that chose the cut; RAW_CUT; NO_TAIL

    @property
    def at_boundary(self) -> bool:
        return self.rule >= 0


_NO_SPANS = np.zeros(0, np.int64)
_NO_SPANS.flags.writeable = False  # shared by every call without no-entry spans


@functools.lru_cache(maxsize=64)
def _boundary_arrays(
    boundaries: tuple[Boundary | int, ...],
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint8]]:
    """The core's form of boundary kinds: int32 marker ids and uint8 cut-after flags, read-only.
    Cached: an engine asks with its template's same few kinds on every scan, and building the
    arrays costs more than the Python side of the scan itself."""
    kinds = [b if isinstance(b, Boundary) else Boundary(int(b)) for b in boundaries]
    if not kinds:
        raise ValueError("boundaries: give at least one boundary token id")
    if not all(-(2**31) <= k.token_id < 2**31 for k in kinds):
        raise ValueError("boundaries: token ids must fit int32")
    boundary_ids = np.array([k.token_id for k in kinds], np.int32)
    cut_after = np.array([k.cut_after for k in kinds], np.uint8)
    boundary_ids.flags.writeable = cut_after.flags.writeable = False
    return boundary_ids, cut_after


def select_token_tail(
    ids: Any,
    *,
    budget_tokens: int,
    boundaries: Sequence[Boundary | int],
    bottom: int | None = None,
    floor: int = 0,
    no_entry: Any = None,
    min_fill: float = DEFAULT_MIN_FILL,
) -> TokenTail:
    """The verbatim tail of ids[floor:bottom] within ``budget_tokens``, cut at a chat boundary.

    ids: int32[n] token ids (numpy or CPU tensor, read in place). boundaries: kinds in order of
    preference (an int is a marker the tail starts with). floor: end of the system prefix.
    no_entry: spans no cut may fall strictly inside (tool calls, thinking), as int64[m, 2] or a
    flat int64[2m] of sorted, disjoint [begin, end) pairs. A raw index is returned only when no
    boundary lies within the budget, and never inside a no-entry span.
    O(tokens inside the budget). Raises ValueError on bad input, IndexError on out-of-range positions.
    """
    v = as_view(ids, np.int32, "ids")
    boundary_ids, cut_after = _boundary_arrays(tuple(boundaries))
    spans: npt.NDArray[Any]
    if no_entry is None:
        spans = _NO_SPANS
    else:
        spans = as_view(no_entry, np.int64, "no_entry")
        if spans.ndim == 2 and spans.shape[1] == 2 and spans.flags.c_contiguous:
            spans = spans.reshape(-1)  # a view: the flat layout the core reads
    r = _core.select_token_tail(
        v, _bottom(bottom, len(v)), floor, budget_tokens, boundary_ids, cut_after, spans, min_fill
    )
    return TokenTail(r.start, r.num_tokens, r.rule)


def align_down_to_page(pos: int, page_size_tokens: int) -> int:
    """``pos`` rounded down to a multiple of the engine's KV page size (vLLM blocks: 16 tokens)."""
    return _core.align_down_to_page(pos, page_size_tokens)


# ---- a fuller tail: groups that enter with their results archived ------------------------------------


@dataclass(frozen=True, slots=True)
class WidenedTail:
    """A segment tail widened by whole groups whose tool results enter as archive markers."""

    start: int  # first segment of the widened tail (<= the plain tail's start)
    num_tokens: int  # tokens of [start, bottom) with the chosen results counted at their archived size
    archived: tuple[int, ...]  # segments (tool results) that enter as markers, ascending


def widened_preview_chars(budget_tokens: int, preview_chars: int) -> int:
    """The preview of a result that enters a tail of ``budget_tokens`` as a marker: the configured
    ``preview_chars``, but at most a sixteenth of the budget's characters (about four a token) and at
    least 200, so a small budget holds several groups rather than one preview."""
    return max(200, min(preview_chars, budget_tokens // 4))


def widen_tail(
    tokens: Any,
    flags: Any,
    group_starts: Any,
    archived_tokens: Any,
    *,
    tail: SegmentTail,
    budget_tokens: int,
) -> WidenedTail:
    """Widen ``tail`` backwards by whole atomic groups while they fit the rest of the budget, their
    tool results counted at their archived size (``archived_tokens``: int64[n], the tokens of each
    segment as a marker; equal to ``tokens`` where archiving would not shrink it). A group whose call
    stays keeps its results (as markers), so nothing is orphaned, and the tail uses its budget where the
    plain cut stops at a group with one huge result (or, with a result bigger than the budget, keeps
    nothing).

    Groups that fit whole were left out by the plain cut on purpose (it aligns to a user turn): they
    are taken only on the way to a group that enters with its results archived, never on their own
    (after one has, any group that fits is taken).
    Widening stops at the first group that does not fit even with its results archived, at a system
    segment and at a group that opens on a result. O(segments added)."""
    t = as_view(tokens, np.int64, "tokens")
    f = as_view(flags, np.uint32, "flags")
    g = as_view(group_starts, np.int32, "group_starts")
    a = as_view(archived_tokens, np.int64, "archived_tokens")
    if not (len(t) == len(f) == len(g) == len(a)):
        raise ValueError(f"tokens, flags, group_starts and archived_tokens differ in length: "
                         f"{len(t)}, {len(f)}, {len(g)}, {len(a)}")
    start, used = tail.start, tail.num_tokens  # committed: ends at a group that entered archived
    probe, probe_used = start, used  # groups taken whole since, pending such a group
    archived: list[int] = []
    tool_result, system = int(SegmentFlag.TOOL_RESULT), int(SegmentFlag.SYSTEM)
    while probe > 0:
        first = int(g[probe - 1])
        if first < 0 or first >= probe or int(f[first]) & (tool_result | system):
            break  # not a legal start: a system prefix, or a group that opens on a result
        whole = int(t[first:probe].sum())
        if probe_used + whole <= budget_tokens:
            probe, probe_used = first, probe_used + whole
            if archived:  # past the plain cut already: nothing to protect
                start, used = probe, probe_used
            continue
        results = [i for i in range(first, probe) if int(f[i]) & tool_result and int(a[i]) < int(t[i])]
        size = whole - sum(int(t[i]) - int(a[i]) for i in results)
        if not results or probe_used + size > budget_tokens:
            break
        probe, probe_used = first, probe_used + size
        start, used = probe, probe_used
        archived = results + archived
    return WidenedTail(start, used, tuple(archived))
