"""What a pass returns instead of changing the compactor, and the one place the compactor takes it.

A pass (the archive pass, the summary pass, the window guard's steps) reads the compactor and writes only
into the conversation's journal and archive (the history dump, archived outputs: the driver persists
them). What it decides comes back as a :class:`PassOutcome`: the record of the attempt and, when it
rewrites the view, the :class:`Rewrite` it plans. :func:`settle` applies it: the view and the bookkeeping
that moves with it, the KV and cost figures only the rewritten view can give, the turn's breaker, the log
and the event list. So what a pass decides can be read and tested apart from what it changes, and a
change of state has one path in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ctxfold.chat.messages import Message
from ctxfold.compaction.cost import PendingCost
from ctxfold.compaction.events import CompactionEvent
from ctxfold.compaction.kv import kv_figures

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ctxfold.compaction.compactor import Compactor


@dataclass(frozen=True, slots=True)
class Rewrite:
    """The view a pass rebuilt. ``origins[i]``: the original ``view[i]`` shows, -1 for a message ctxfold
    wrote. ``history``: a summary rewrite's (originals now in a history dump, the newest dump's archive
    id); None for an archive rewrite, which keeps every message where it was."""

    view: list[Message]
    origins: list[int]
    history: tuple[int, str] | None = None


@dataclass(frozen=True, slots=True)
class PassOutcome:
    """One pass's decision. ``event``: the record of the attempt (None: nothing was tried worth a
    record); its ``tokens_after``, ``kv`` and ``cost`` are filled in when ``rewrite`` is applied.
    ``queued``: messages that follow the view in the request (counted in ``tokens_after``).
    ``cost``: the figures of an applied summary read before the rewrite. ``turn_start``: the pass ran
    at a turn start (the breaker's trigger line is that one). ``give_up``: no retry of a failed summary
    can do better this turn. ``archive_watermark``: the turn-start archive pass judged every output
    before this view index."""

    event: CompactionEvent | None
    rewrite: Rewrite | None = None
    queued: Sequence[Message] = ()
    cost: PendingCost | None = None
    turn_start: bool = False
    give_up: bool = False
    archive_watermark: int | None = None


def settle(c: Compactor, outcome: PassOutcome) -> CompactionEvent | None:
    """Apply ``outcome`` to ``c`` and return its completed event (None when it has none)."""
    if outcome.archive_watermark is not None:
        c._archive_watermark = outcome.archive_watermark
    event, rewrite = outcome.event, outcome.rewrite
    if event is None:
        return None
    if rewrite is not None:
        event = _apply(c, rewrite, event, outcome)
    _move_breaker(c, event, outcome)
    if rewrite is not None:
        c._log_view(event)
    elif event.kind == "summary" and c.journal is not None:
        # A summary not applied leaves the view as it was: the log keeps the breaker's new state and why.
        c.journal.log_state({**c._state(), "failure": event.failure})
    c._record(event)
    return event


def settle_summary(c: Compactor, outcome: PassOutcome) -> CompactionEvent:
    """:func:`settle` for a summary pass, which records every attempt."""
    event = settle(c, outcome)
    if event is None:
        raise RuntimeError("a summary pass returned no record of its attempt")
    return event


def _apply(c: Compactor, rewrite: Rewrite, event: CompactionEvent, outcome: PassOutcome) -> CompactionEvent:
    """The rewritten view in place, and the event's figures that only it can give."""
    old_view, unseen = c.view, c.state.unseen_start()
    c.state.replace(rewrite.view, rewrite.origins)
    c._accounting.reset(c.header, rewrite.view)
    c._pending_bound_tokens = 0
    if rewrite.history is None:  # an archive rewrite: positions kept; the first unseen may be a marker now
        c.state.keep_unseen_position(unseen)
        return replace(event, tokens_after=c.occupancy_tokens(outcome.queued))
    c._archive_watermark = 0  # positions moved: the turn-start pass looks at everything again
    c._rewrites += 1
    c._dumped, c._history_id = rewrite.history
    after = c.occupancy_tokens(outcome.queued)
    kv = kv_figures(c, old_view, rewrite.view)
    cost = None
    if outcome.cost is not None:
        cost = outcome.cost.complete(c.config.cost, reused_tokens=kv.tokens_reused,
                                     prefill_tokens=kv.tokens_to_prefill, after_tokens=after)
    return replace(event, tokens_after=after, kv=kv, cost=cost)


def _move_breaker(c: Compactor, event: CompactionEvent, outcome: PassOutcome) -> None:
    """A policy summary moves the turn's breaker: a fallback or a failure counts, a model's summary
    resets the count; the automatic passes stop for the turn after too many failures, when no retry can
    do better, or when even the rewritten view is over the trigger line. The guard's steps are outside
    the policy and a manual pass is the user's: neither stops the automatic passes."""
    if event.kind != "summary" or event.trigger == "guard":
        return
    turn = c.state.turn
    ctx = c.context_tokens
    if event.applied:
        turn.failures = turn.failures + 1 if event.summary_fallback else 0
        if (event.trigger != "manual" and ctx is not None
                and c.policy.summary_trigger(event.tokens_after, ctx, turn_start=outcome.turn_start) is not None):
            turn.gave_up = True
    elif event.trigger != "manual":
        turn.failures += 1
        if outcome.give_up or turn.failures >= c.config.max_consecutive_failures:
            turn.gave_up = True
