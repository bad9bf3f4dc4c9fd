"""The archive pass (Datus' minor pass, no model call): bulky tool outputs go to the archive and a
marker the model can read them back through stands in for each. At a turn start it judges the outputs the
window of kept user turns slid past; mid-turn, all but the newest; for the window guard, all of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import chain
from typing import TYPE_CHECKING

from ctxfold.chat.messages import Message, Role
from ctxfold.compaction.archive import ArchivePass, archive_mid_turn, archive_turn_start
from ctxfold.compaction.events import ArchivedOutput, CompactionEvent
from ctxfold.compaction.outcome import PassOutcome, Rewrite

if TYPE_CHECKING:
    from ctxfold.compaction.compactor import Compactor


def archive_pass(c: Compactor, *, stage: str, trigger: str, reason: str,
                 guard_step: str | None = None) -> PassOutcome:
    """The turn-start pass (``stage="turn_start"``), the mid-turn stage (``"mid_turn"``: all but the
    newest outputs) or the guard's (``"all"``: the newest outputs too), planned
    (:func:`~ctxfold.compaction.outcome.settle` applies it). No event when there was nothing to do."""
    t0 = time.perf_counter()
    params = c._archive_params
    judged: int | None = None
    if stage == "turn_start":
        # Outputs before the previous cutoff were judged at an earlier turn start (archived, or
        # too small): scan only what the window slid past since, so a turn start with nothing
        # to do costs a look at the index of user turns, not a walk through the conversation.
        cutoff = turn_start_cutoff(c)
        lo = c._archive_watermark
        if cutoff <= lo:
            return PassOutcome(None)
        if not worth_archiving(c, c.view[lo:cutoff]):  # judged: nothing there to archive
            return PassOutcome(None, archive_watermark=cutoff)
        part = archive_turn_start(c.view[lo:], c.store, params, count_tokens=c.counter.count)
        if part.report.error is None:
            judged = cutoff
        result = ArchivePass(c.view[:lo] + part.messages if part.report.archived else c.view, part.report)
    else:
        if stage == "all":
            params = replace(params, keep_recent_tool_results=0)
        result = archive_mid_turn(c.view, c.store, params, count_tokens=c.counter.count)
    report = result.report
    if not report.archived and report.error is None:
        return PassOutcome(None, archive_watermark=judged)  # nothing to do: no event, no log line
    before = c.occupancy_tokens()
    event = CompactionEvent(
        kind="archive", trigger=trigger, reason=reason, applied=bool(report.archived),
        tokens_before=before, tokens_after=before,
        archived=tuple(ArchivedOutput(a.message_id, a.archive_id, a.chars_before, a.chars_after)
                       for a in report.archived),
        failure=report.error, seconds={"archive": time.perf_counter() - t0}, guard_step=guard_step,
    )
    rewrite = Rewrite(result.messages, list(c.view_origins)) if report.archived else None
    return PassOutcome(event, rewrite, archive_watermark=judged)


def archive_due(c: Compactor, extra: Sequence[Message] = ()) -> bool:
    """Whether the turn-start archive pass may archive something once ``extra`` is appended: the
    window of kept turns slid past a tool output of at least the threshold that the pass has not
    judged yet. Cheap: a backward scan over the kept turns and a length check over what the window
    slid past. True does not mean something will be archived; False means nothing will be."""
    if not c.policy.archive_enabled(mid_turn=False):
        return False
    with c._lock:
        view, n = c.view, len(c.view)
        cutoff = turn_start_cutoff(c, extra)
        lo, hi = c._archive_watermark, max(cutoff, 0)
        return worth_archiving(c, chain(view[lo:min(hi, n)], extra[max(lo - n, 0):max(hi - n, 0)]))


def turn_start_cutoff(c: Compactor, extra: Sequence[Message] = ()) -> int:
    """:func:`ctxfold.compaction.archive.turn_start_cutoff` of the view followed by ``extra``, from the index of the view's
    user turns: O(len(extra)), where a scan would walk back through the whole view of an agent's
    conversation (one user turn, hundreds of tool calls) on every request."""
    k = c._archive_params.keep_recent_user_turns
    n = len(c.view)
    turns = c.state.user_turns  # not copied: a conversation of user turns has hundreds
    new = [n + j for j, m in enumerate(extra) if m.is_user_turn]
    total = len(turns) + len(new)
    if total <= k:
        return -1
    if k == 0:
        return n + len(extra)
    i = total - k  # the k-th newest user turn, of the view's followed by extra's
    return turns[i] if i < len(turns) else new[i - len(turns)]


def worth_archiving(c: Compactor, messages: Iterable[Message]) -> bool:
    """Whether any of ``messages`` is a tool output of at least the archive threshold: the first
    test of the turn-start pass (archive_turn_start), which archives nothing when it fails."""
    threshold = c._archive_params.archive_threshold_chars
    return any(m.role is Role.TOOL and len(m.text) >= threshold for m in messages)
