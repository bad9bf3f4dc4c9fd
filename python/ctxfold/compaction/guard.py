"""The window guard: whatever the policy and its breaker did, a request never leaves over the window
while any fit exists. Its steps (:data:`~ctxfold.compaction.events.GUARD_STEPS`) run in order, each only
while the request is still over, and none of them asks a model: the guard's summaries are extractive.
Where no fit exists, :class:`~ctxfold.errors.NoFitError` says what the smallest request would hold.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ctxfold.chat.messages import Message, Role
from ctxfold.compaction import events
from ctxfold.compaction.archive import archive_whole
from ctxfold.compaction.archive.marker import make_marker
from ctxfold.compaction.archive_pass import archive_pass
from ctxfold.compaction.effects import no_calls
from ctxfold.compaction.events import ArchivedOutput, CompactionEvent
from ctxfold.compaction.outcome import PassOutcome, Rewrite, settle, settle_summary
from ctxfold.compaction.rebuild import resume_message
from ctxfold.compaction.summary_pass import summary_pass
from ctxfold.errors import NoFitError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ctxfold.compaction.compactor import Compactor

# The last step folded again at most this often, each time with its summary's room lowered by what it came
# out over by and this margin (the estimates that sized it are off by a few tokens, not by hundreds).
MAX_REFOLDS = 2
REFOLD_MARGIN_TOKENS = 8


def guard(c: Compactor, turn_start: bool, queued: list[Message]) -> tuple[list[Message], CompactionEvent | None]:
    """Make the request fit the window, whatever the policy and the breaker did: the steps of
    :data:`~ctxfold.compaction.events.GUARD_STEPS` in order, each only while the request is still
    over, every one without a model call (:func:`no_calls` holds it to that). Returns what to show for ``queued`` (stand-ins where the oversized step archived
    one) and the last applied event. Raises NoFitError when even the smallest request that keeps
    what must be sent (:func:`fit_floor`) is over the window."""
    ctx = c.context_tokens
    if ctx is None or c.occupancy_bound_tokens(queued) <= ctx:
        return queued, None  # even the byte bound fits: nothing to count (the common case)
    if c.occupancy_tokens(queued) <= ctx:
        return queued, None
    floor = fit_floor(c, turn_start, queued)
    if sum(floor.values()) > ctx:
        raise NoFitError(ctx, floor)
    reason = "request over the context window"
    last: CompactionEvent | None = None
    shown = list(queued)
    for step in events.GUARD_STEPS:  # read at the call: tests leave a step out
        event: CompactionEvent | None
        if step == "archive_all":
            event = settle(c, archive_pass(c, stage="all", trigger="guard", reason=reason, guard_step=step))
        elif step == "oversized_message":
            outcome, shown = archive_oversized_messages(c, ctx, shown, reason)
            event = settle(c, outcome)
        elif step == "fold_newest" and turn_start:
            continue  # at a turn start what lies after the summary is the new request alone
        else:
            event = settle_summary(c, no_calls(summary_pass(c, trigger="guard", reason=reason,
                                                            mid_turn=not turn_start, queued=shown, guard_step=step)))
        if event is not None and event.applied:
            last = event
        if c.occupancy_tokens(shown) <= ctx:
            return shown, last
    # The last summary is sized on estimates (its frame, the messages around it as the template renders
    # them) and can come out a little over: fold again, its room lowered by what it came out over by.
    refold = [s for s in events.GUARD_STEPS if s == "shorter_tail" or (s == "fold_newest" and not turn_start)]
    for step in refold[-1:] * MAX_REFOLDS:  # the last summary step that ran
        over = c.occupancy_tokens(shown) - ctx
        refolded = settle_summary(c, no_calls(summary_pass(c, trigger="guard", reason=reason,
                                                           mid_turn=not turn_start, queued=shown, guard_step=step,
                                                           shrink_tokens=over + REFOLD_MARGIN_TOKENS)))
        if refolded.applied:
            last = refolded
        if c.occupancy_tokens(shown) <= ctx:
            return shown, last
        if not refolded.applied:
            break
    # The steps rewrote the view: the smallest request it allows now may be over the window after all (the
    # queued messages a mid-turn rewrite keeps ahead of the summary, at their smallest, with the new ones).
    floor = fit_floor(c, turn_start, shown)
    if sum(floor.values()) > ctx:
        raise NoFitError(ctx, floor)
    # Every step ran and the request is over still, though the floor fits: a case the steps do not
    # cover. Refuse it here rather than send it over the window.
    raise NoFitError(ctx, {"request after every compaction step": c.occupancy_tokens(shown)
                           - c.reply_reserve_tokens(), "reply reserve": c.reply_reserve_tokens()},
                     note="ctxfold could not shrink it further; please report this conversation")


def fit_floor(c: Compactor, turn_start: bool, queued: Sequence[Message]) -> dict[str, int]:
    """The smallest request the guard can build, in tokens by part: the system prompt and tools, the
    newest user request and the queued messages (each at the size of its head-and-tail marker when
    that is smaller), the summary's frame and, mid-turn, the resume instruction; and the reply reserve.
    A fit exists when their sum is within the window."""
    acc = c.accounting
    parts = {"system prompt and tools": acc.fixed_tokens}
    request = c.state.turn.request
    kept = [m for m in c.view[c.state.unseen_start():] if m.is_user_turn] if turn_start else []
    if not kept and request is not None and (r := c.state.request_index()) >= 0:
        # Mid-turn every rewrite keeps the turn's request and what was queued after it.
        kept = [request, *(m for m in c.view[r + 1:] if m.queued)]
    if kept:
        parts["newest user request"] = sum(smallest_tokens(c, m) for m in kept)
    if queued:
        parts["queued messages"] = sum(smallest_tokens(c, m) for m in queued)
    parts["summary frame"] = (c._summary_frame_tokens()
                              + (acc.message_tokens(resume_message(0)) if not turn_start else 0))
    parts["reply reserve"] = c.reply_reserve_tokens()
    return parts


def smallest_tokens(c: Compactor, m: Message) -> int:
    """Tokens of ``m`` as the guard can show it at its smallest: whole, or as its marker."""
    acc = c.accounting
    whole = acc.message_tokens(m)
    head, tail = oversized_preview_chars(c)
    stand_in = replace(m, content=make_marker("0" * 64, m.text, head, tail))
    # Counted where it would stand: a message of the view in its place (counted as if appended after
    # itself, a user message would follow a user message, which a template that wants turns to
    # alternate refuses); a queued one after the view, where it goes.
    for i in range(len(c.view) - 1, -1, -1):
        if c.view[i] is m:
            replaced = [*c.view[:i], stand_in, *c.view[i + 1:]]
            return min(whole, acc.count_view(c.header, replaced) - (acc.total_tokens - whole))
    return min(whole, acc.message_tokens(stand_in))


def oversized_preview_chars(c: Compactor) -> tuple[int, int]:
    """(head, tail) characters of an oversized message's preview: the configured preview, shared
    60/40, and at most about a sixteenth of a known window (a character is at least a quarter of a
    token's bytes, so ctx // 4 characters stay well within it)."""
    preview = c.config.minor.archive_preview_chars
    if c.context_tokens is not None:
        preview = min(preview, c.context_tokens // 4)
    return preview * 3 // 5, preview * 2 // 5


def archive_oversized_messages(c: Compactor, ctx: int, queued: list[Message],
                                reason: str) -> tuple[PassOutcome, list[Message]]:
    """The guard's "oversized_message" step: the largest tool results and user messages of the view
    and of ``queued`` (the newest request too: a huge pasted file, another agent's summary), largest
    first, each archived whole behind a head-and-tail marker, until the request fits. Planned (the guard
    settles it), with what to show for ``queued``."""
    t0 = time.perf_counter()
    before = c.occupancy_tokens(queued)
    head, tail = oversized_preview_chars(c)
    tokens = c.accounting.tokens()
    n = len(c.view)
    candidates = [(int(tokens[i]), i) for i, m in enumerate(c.view)
                  if m.role in (Role.TOOL, Role.USER) and not (m.summary or m.resume)]
    candidates += [(c.accounting.message_tokens(m), n + j) for j, m in enumerate(queued)]
    view, shown = list(c.view), list(queued)
    archived: list[ArchivedOutput] = []
    error: str | None = None
    used = before
    for size, i in sorted(candidates, reverse=True):
        if used <= ctx:
            break
        m = view[i] if i < n else shown[i - n]
        result = archive_whole(m, c.store, head_chars=head, tail_chars=tail, count_tokens=c.counter.count,
                               index=i)
        error = error or result.report.error
        new = result.messages[0]
        if new is m:
            continue
        archived += [ArchivedOutput(a.message_id, a.archive_id, a.chars_before, a.chars_after)
                     for a in result.report.archived]
        if i < n:
            # Counted in its place (see smallest_tokens): the request with it, the queued ones and the reserve.
            view[i] = new
            used = (c.accounting.count_view(c.header, view) + sum(c.accounting.message_tokens(q) for q in shown)
                    + c.reply_reserve_tokens())
        else:
            shown[i - n] = new
            used -= size - c.accounting.message_tokens(new)
    if not archived:
        return PassOutcome(None), queued
    event = CompactionEvent(
        kind="archive", trigger="guard", reason=reason, applied=True, tokens_before=before,
        tokens_after=before, archived=tuple(archived), failure=error,
        seconds={"archive": time.perf_counter() - t0}, guard_step="oversized_message",
    )
    return PassOutcome(event, Rewrite(view, list(c.view_origins)), queued=shown), shown
