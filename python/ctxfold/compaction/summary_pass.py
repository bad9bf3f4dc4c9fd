"""The summary pass: a rebuilt view of [the turn's request,] a summary of what came before, the verbatim
tail and what the model has not seen yet. A step of the core (:mod:`ctxfold.compaction.effects`): the
summary it needs from a model is yielded as a :class:`SummaryCall`, never called from here, and the
rewrite comes back as a plan (:class:`~ctxfold.compaction.outcome.PassOutcome`) the compactor applies.

The pass writes the history dump (the write-ahead record of the rewrite) into the journal before it plans
anything, and plans a rewrite only when the rebuilt view is smaller than the old one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ctxfold.chat.messages import Message, Role
from ctxfold.compaction import cost as costs
from ctxfold.compaction.archive import archive_whole
from ctxfold.compaction.archive.marker import is_marker, make_marker
from ctxfold.compaction.effects import Step, SummaryCall
from ctxfold.compaction.events import CompactionEvent
from ctxfold.compaction.journal import history_dump_text
from ctxfold.compaction.outcome import PassOutcome, Rewrite
from ctxfold.compaction.rebuild import (
    MARKER_MIN_TOKENS,
    SAMPLE_ARCHIVE_ID,
    Summary,
    frame_summary,
    keep_turns_alternating,
    open_call_group,
    resume_message,
)
from ctxfold.compaction.summarize import (
    SUMMARY_TEXT_KEY,
    ChunkedSummarizer,
    ExtractiveSummarizer,
    FallbackSummarizer,
    Summarizer,
    SummaryRequest,
    SummaryResult,
    build_summary_request,
    contract_text,
    with_trail,
)
from ctxfold.core.ledger import SegmentFlag
from ctxfold.core.tail import SegmentTail, select_tail_from_ledger, widen_tail, widened_preview_chars
from ctxfold.errors import ArchiveError

if TYPE_CHECKING:
    from ctxfold.compaction.compactor import Compactor


@dataclass(frozen=True, slots=True)
class _Plan:
    """Where a summary pass cuts the view, before it asks for a summary."""

    bottom: int  # view index from which everything stays verbatim (unseen, or folded by the guard)
    fresh_tokens: int  # tokens before BOTTOM that are not earlier summaries: what a summary replaces
    besides_tokens: int  # what the rebuilt view holds besides summary and tail


def summary_pass(c: Compactor, *, trigger: str, reason: str, mid_turn: bool,
                 queued: Sequence[Message] = (), guard_step: str | None = None,
                 shrink_tokens: int = 0) -> Step[PassOutcome]:
    """A summary rewrite, planned: [turn's request,] summary, verbatim tail, what the model has not seen
    yet (:func:`~ctxfold.compaction.outcome.settle` applies it). The window guard's steps (``guard_step``) write the extractive summary, sized to the room left;
    "shorter_tail" keeps no tail and "fold_newest" summarizes the turn's newest messages too."""
    ctx = c.context_tokens
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    c.observer.compaction_started(reason, "summary")
    before = c.occupancy_tokens(queued)
    plan = _plan(c, queued, mid_turn=mid_turn, guard_step=guard_step)
    # The guard may summarize earlier summaries again, shorter (whether that helps, the rebuilt
    # view's count decides below); the policy does not spend a dump on it.
    if plan.fresh_tokens <= 2 * c._summary_frame_tokens() and (guard_step is None or plan.bottom == 0):
        # Only earlier summaries (or nothing) lie before BOTTOM: a new summary cannot shrink the
        # view, so do not spend a dump and a model call on it, and stop trying for this turn.
        return failed(trigger, reason, before, "nothing to summarize: what comes before the newest "
                      "messages is too short or already a summary", timings, give_up=True,
                      guard_step=guard_step)

    # The history since the last dump, written before the rewrite (write-ahead) to the session
    # and to the archive, where the model can read it back with read_archive.
    try:
        dump, history_id = _write_history_dump(c)
    except (OSError, ArchiveError) as exc:
        # The dump is the write-ahead record of the rewrite: without it, no rewrite.
        return failed(trigger, reason, before, f"cannot write the history dump: {exc}", timings,
                      guard_step=guard_step)
    timings["dump"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    # Asked of a model: not the extractive summarizer, not the guard, not past the breaker.
    model_call = (guard_step is None and not isinstance(c.summarizer, ExtractiveSummarizer)
                  and c.state.turn.failures < c.config.max_consecutive_failures)
    summary = yield from summarize(c, plan.bottom, reason, mid_turn,
                                   guard_cap_tokens=_guard_cap_tokens(c, plan, guard_step, shrink_tokens))
    timings["summary"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    tail, budget = _choose_tail(c, plan, summary, guard_step)
    start, tail_tokens, stand_ins = widen_tail_with_markers(c, tail, budget)
    timings["tail"] = time.perf_counter() - t2

    new_view, new_origins = _rebuilt_view(c, summary, history_id, start, stand_ins, mid_turn=mid_turn)
    after = c.accounting.count_view(c.header, new_view) + c.reply_reserve_tokens()
    after += sum(c.accounting.message_tokens(m) for m in queued)
    if after >= before:
        return failed(trigger, reason, before, f"the rebuilt view would not be smaller ({after} >= {before} tokens)",
                      timings, summary=summary, dump=dump, give_up=True, guard_step=guard_step)
    if guard_step == "extractive_summary" and ctx is not None and after > ctx:
        # Not applied: the next step rewrites the same view with a shorter tail, instead of
        # summarizing this rewrite's summary again.
        return failed(trigger, reason, before,
                      f"with the configured tail the request would still be over the window ({after} > "
                      f"{ctx} tokens)", timings, summary=summary, dump=dump, guard_step=guard_step)
    timings["total"] = time.perf_counter() - t0
    event = CompactionEvent(
        kind="summary", trigger=trigger, reason=reason, applied=True, tokens_before=before,
        tokens_after=after, summary=summary.text, summarizer=summary.summarizer,
        summary_fallback=summary.fallback_from is not None, summary_failure=summary.fallback_from,
        summary_cut=summary.cut_reason if summary.cut_reason not in ("eos", "none") else None,
        tail_start=start, tail_rule=tail.rule.name.lower() if start == tail.start else "widened",
        tail_tokens=tail_tokens,
        history_dump=str(dump) if dump is not None else None, seconds=timings, guard_step=guard_step,
    )
    return PassOutcome(event, Rewrite(new_view, new_origins, history=(len(c.originals), history_id)),
                       queued=queued, cost=_pending_cost(c, plan, summary, reason, mid_turn=mid_turn,
                                                         model_call=model_call),
                       turn_start=not mid_turn)


def _plan(c: Compactor, queued: Sequence[Message], *, mid_turn: bool, guard_step: str | None) -> _Plan:
    # BOTTOM: what arrived since the last request (the new user turn, the latest tool results)
    # has not been seen by the model yet, so it is never summarized unseen (ds4 would): it stays
    # verbatim after the tail. BOTTOM never splits a call group: the calls stay with their results.
    view = c.view
    bottom = len(view) if guard_step == "fold_newest" else c.state.unseen_start()
    ledger = c.accounting.ledger
    while 0 < bottom < len(view) and (group := ledger.group_start_at(bottom)) < bottom:
        bottom = group
    if (opener := open_call_group(view, bottom)) >= 0:
        bottom = opener  # a call still waiting for its results stays with them
    tokens = c.accounting.tokens()
    flags = c.accounting.flags()
    fresh = int(tokens[:bottom][(flags[:bottom] & SegmentFlag.SUMMARY) == 0].sum())
    # What the rebuilt view holds besides summary and tail: the messages after BOTTOM, queued
    # inserts and, mid-turn, the turn's request and the resume instruction.
    besides = int(tokens[bottom:].sum()) + sum(c.accounting.message_tokens(m) for m in queued)
    if mid_turn:
        besides += c.accounting.message_tokens(resume_message(0))
        if 0 <= (r := c.state.request_index()) < bottom:
            # The turn's request and the messages queued after it stay ahead of the summary.
            besides += int(tokens[r]) + sum(int(tokens[i]) for i in range(r + 1, bottom) if view[i].queued)
    return _Plan(bottom, fresh, besides)


def _pending_cost(c: Compactor, plan: _Plan, summary: Summary, reason: str, *, mid_turn: bool,
                  model_call: bool) -> costs.PendingCost:
    """The cost figures that must be read before the rewrite (:mod:`ctxfold.compaction.cost`)."""
    prompt = cached = output = 0
    if model_call:
        contract = c.accounting.message_tokens(Message(Role.USER, contract_text(reason, mid_turn=mid_turn)))
        prompt, cached = costs.summary_prompt(c, plan.bottom, contract)
        output = c.counter.count(summary.text) if summary.fallback_from is None else 0
    ctx = c.context_tokens
    return costs.PendingCost(costs.request_before(c), prompt, cached, output, model_call,
                             growth_tokens=costs.growth_per_request_tokens(c),
                             line_tokens=c.policy.trigger_line_tokens(ctx) if ctx is not None else None)


def _write_history_dump(c: Compactor) -> tuple[Path | None, str]:
    """The originals since the last dump, to the session (its path) and to the archive (its id)."""
    dump = None
    new_originals = c.originals[c._dumped:]
    if c.journal is not None:
        name = c.journal.write_history_dump(new_originals, c.header, first_index=c._dumped, previous=c._history_id)
        dump = Path(c.dump_location(name))
    history_id = c.store.put(history_dump_text(new_originals, c.header, first_index=c._dumped,
                                               previous=c._history_id))
    return dump, history_id


def _guard_cap_tokens(c: Compactor, plan: _Plan, guard_step: str | None, shrink_tokens: int = 0) -> int | None:
    """The guard's summary takes what the window leaves beside everything else it must hold, less
    ``shrink_tokens`` (what a rebuild sized so came out over by), and no more than the extractive
    summary's own cap. None for a policy pass."""
    ctx = c.context_tokens
    if guard_step is None or ctx is None:
        return None
    cap = (ctx - c.accounting.fixed_tokens - plan.besides_tokens - c._summary_frame_tokens()
           - c.reply_reserve_tokens() - shrink_tokens)
    if guard_step != "fold_newest":
        cap //= 2  # the other half for the tail
    return max(16, cap)


def _choose_tail(c: Compactor, plan: _Plan, summary: Summary, guard_step: str | None) -> tuple[SegmentTail, int]:
    """The verbatim tail before BOTTOM, and the budget it was chosen with."""
    ctx = c.context_tokens
    budget, room = tail_budget(c, summary.text, plan.besides_tokens)
    # Keep at least half of what lies before BOTTOM for the summary to replace: a tail that takes
    # it all would make the rebuilt view larger than the old one (ds4 grows the transcript so).
    half = plan.fresh_tokens // 2
    budget, room = min(budget, half), min(room, half)
    if guard_step == "extractive_summary" and ctx is not None:
        budget = room = min(c.policy.tail_budget_tokens(ctx), half)  # the policy's own tail
    elif guard_step == "shorter_tail" and ctx is not None:
        # The longest tail the window has room for beside everything else: none, when it has none.
        left = (ctx - c.accounting.fixed_tokens - c.counter.count(summary.text)
                - c._summary_frame_tokens() - plan.besides_tokens - c.reply_reserve_tokens())
        budget = room = max(0, min(c.policy.tail_budget_tokens(ctx), half, left))
    elif guard_step == "fold_newest":
        budget = room = 0  # no tail: the summary is all that stays of the turn
    tail = select_tail_from_ledger(c.accounting.ledger, budget_tokens=budget, bottom=plan.bottom)
    while not tail.found and budget < room:
        # Not even the newest call group fits the configured tail: keep the smallest legal tail
        # the rebuilt view has room for, since mid-turn it holds the output the model just asked
        # for. Doubling keeps it small, so the next compaction is not due at once.
        budget = min(2 * max(budget, 1), room)
        tail = select_tail_from_ledger(c.accounting.ledger, budget_tokens=budget, bottom=plan.bottom)
    return tail, budget


def _rebuilt_view(c: Compactor, summary: Summary, history_id: str, start: int, stand_ins: dict[int, Message], *,
                  mid_turn: bool) -> tuple[list[Message], list[int]]:
    """[the turn's request and what was queued after it,] the summary, the tail from ``start`` (with
    its stand-ins) and what follows it, [the resume instruction]; with the originals each shows."""
    view, origins = c.view, c.view_origins
    summary_msg = Message(
        Role.USER, frame_summary(summary.text, history_id),
        id=f"ctxfold-summary-{c._rewrites}", summary=True, extra={SUMMARY_TEXT_KEY: summary.text},
    )
    new_view: list[Message] = []
    new_origins: list[int] = []
    request_index = c.state.request_index()
    if mid_turn and 0 <= request_index < start:
        # Mid-turn the turn's own request and the messages the user typed while it ran stay
        # verbatim ahead of the summary (Datus).
        keep = [request_index] + [i for i in range(request_index + 1, start) if view[i].queued]
        new_view.extend(view[i] for i in keep)
        new_origins.extend(origins[i] for i in keep)
    new_view.append(summary_msg)
    new_origins.append(-1)
    # An earlier resume instruction has done its job; a new one follows if this is mid-turn.
    kept = [i for i in range(start, len(view)) if not view[i].resume]
    new_view.extend(stand_ins.get(i, view[i]) for i in kept)
    new_origins.extend(origins[i] for i in kept)
    if mid_turn and open_call_group(new_view, len(new_view)) < 0:
        # The hidden instruction makes the model resume after the summary. Not while a call is in
        # flight (the hard trigger's case): its results come next and must follow their call.
        new_view.append(resume_message(c._rewrites))
        new_origins.append(-1)
    if c.accounting.alternates_roles:
        keep_turns_alternating(new_view, new_origins, c._rewrites)
    return new_view, new_origins


def summarize(c: Compactor, bottom: int, reason: str, mid_turn: bool, *,
              guard_cap_tokens: int | None = None) -> Step[Summary]:
    """The summary of view[:bottom]: the configured summarizer (chunked when even the request
    does not leave room for an answer), asked through the driver; else the extractive fallback, which
    cannot fail. The window guard (``guard_cap_tokens``) asks no model: the extractive summary, at most
    that long."""
    cfg = c.config
    ctx = c.context_tokens
    request = build_summary_request(c.view, bottom, reason=reason, cap_tokens=cfg.summary.max_tokens,
                                    mid_turn=mid_turn, system=c.header.system, tools=c.header.tools)
    failure: str | None = None
    if isinstance(c.summarizer, ExtractiveSummarizer) or guard_cap_tokens is not None:
        pass
    elif c.state.turn.failures >= cfg.max_consecutive_failures:
        failure = (f"{c.state.turn.failures} consecutive failures this turn: "
                   f"{c.summarizer.name} is not called again until the next turn")
    else:
        room = None if ctx is None else ctx - c.accounting.count_view(c.header, request.messages) - 1
        primary: Summarizer = c.summarizer
        if room is not None and ctx is not None and room < cfg.summary.min_room_tokens and cfg.summary.chunked:
            primary = ChunkedSummarizer(c.summarizer, window_tokens=ctx, counter=c.counter, fallback=c._extractive)
        else:
            request = replace(request, room_tokens=room, max_tokens=cfg.summary_max_tokens(room))
        try:
            result: SummaryResult = yield SummaryCall(FallbackSummarizer(primary, c._extractive), request,
                                                      cfg.summary.timeout_s, c.observer.summary_token)
        except Exception as exc:  # noqa: BLE001 - a summarizer outside the contract must not stop compaction
            failure = f"{c.summarizer.name} raised {type(exc).__name__}: {exc}"
        else:
            if not result.ok:  # cancelled by the summarizer itself (its caller left): no text to apply
                failure = f"{result.summarizer}: {result.failure}"
            else:
                failure = result.primary_failure
                if failure is not None and result.detail:
                    failure = f"{failure} ({result.detail})"
                if failure is None:  # a model wrote it: the files it leaves out are added
                    return _with_trail(c, result, request)
                return Summary(result.text, result.summarizer, result.cut_reason, failure)
    # The extractive summary takes no room in the window (no model writes it), so only the cap
    # binds; an eighth of the window at most, so the rebuilt view keeps room for the tail.
    cap = cfg.summary.max_tokens if ctx is None else max(64, min(cfg.summary.max_tokens, ctx // 8))
    if guard_cap_tokens is not None:
        cap = min(cap, guard_cap_tokens)
    extractive = c._extractive.summarize(replace(request, max_tokens=cap, cap_tokens=cap),
                                         on_token=c.observer.summary_token)
    return Summary(extractive.text, extractive.summarizer, extractive.cut_reason, failure)


def _with_trail(c: Compactor, result: SummaryResult, request: SummaryRequest) -> Summary:
    """A model's summary with the artifact trail it leaves out (:func:`with_trail`), within the same cap."""
    text, cut = with_trail(result.text, request.transcript, max_tokens=request.max_tokens, counter=c.counter,
                           trail_max_tokens=c.config.summary.trail_max_tokens)
    head = result.text.rstrip()
    if text != result.text and text.startswith(head):
        c.observer.summary_token(text[len(head):])  # streamed as the end of the summary it follows
    return Summary(text, result.summarizer, request.limit_reason if cut else result.cut_reason, None)


def tail_budget(c: Compactor, summary_text: str, besides_tokens: int) -> tuple[int, int]:
    """(the configured tail budget, the room the rebuilt view leaves for a tail under the
    low-water mark, given the tokens of everything it holds besides summary and tail)."""
    ctx = c.context_tokens
    if ctx is None:
        return c.config.tail.cap_tokens, c.config.tail.cap_tokens
    room = (c.policy.low_water_tokens(ctx) - c.accounting.fixed_tokens - c.counter.count(summary_text)
            - c._summary_frame_tokens() - besides_tokens - c.reply_reserve_tokens())
    room = max(0, room)
    return min(c.policy.tail_budget_tokens(ctx), room), room


def widen_tail_with_markers(c: Compactor, tail: SegmentTail, budget_tokens: int) -> tuple[int, int, dict[int, Message]]:
    """The tail widened by whole groups that fit the budget with their tool results archived
    (:func:`ctxfold.core.tail.widen_tail`): (start, tokens, view index -> the marker that stands in for
    it). The plain tail, unchanged, when no group before it needs archiving to fit or the archive
    cannot be written."""
    start = tail.start
    if start == 0 or tail.num_tokens >= budget_tokens:
        return start, tail.num_tokens, {}
    tokens = c.accounting.tokens()
    flags = c.accounting.flags()
    archived = tokens.copy()
    head = widened_preview_chars(budget_tokens, c.config.minor.archive_preview_chars)
    # Only the results the budget could reach matter: at least a marker's header each.
    seen = 0
    for i in range(start - 1, -1, -1):
        m = c.view[i]
        if m.role is not Role.TOOL or is_marker(m.text):
            continue
        marker = make_marker(SAMPLE_ARCHIVE_ID, m.text, head)
        if len(marker) < len(m.text):
            archived[i] = min(int(tokens[i]), c.accounting.message_tokens(replace(m, content=marker)))
        seen += 1
        if seen * MARKER_MIN_TOKENS > budget_tokens:
            break
    wide = widen_tail(tokens, flags, c.accounting.group_starts(), archived, tail=tail,
                      budget_tokens=budget_tokens)
    if not wide.archived:
        return start, tail.num_tokens, {}
    stand_ins: dict[int, Message] = {}
    for i in wide.archived:
        result = archive_whole(c.view[i], c.store, head_chars=head, tail_chars=0,
                               count_tokens=c.counter.count, index=i)
        if result.report.error is not None:
            return start, tail.num_tokens, {}  # the plain tail: nothing may enter as a marker unwritten
        stand_ins[i] = result.messages[0]
    return wide.start, wide.num_tokens, stand_ins


def failed(trigger: str, reason: str, before: int, why: str, timings: dict[str, float], *,
           summary: Summary | None = None, dump: Path | None = None, give_up: bool = False,
           guard_step: str | None = None) -> PassOutcome:
    """A summary pass that was not applied. ``give_up``: no retry can do better this turn."""
    event = CompactionEvent(
        kind="summary", trigger=trigger, reason=reason, applied=False, tokens_before=before,
        tokens_after=before, summary=summary.text if summary else None,
        summarizer=summary.summarizer if summary else None,
        history_dump=str(dump) if dump is not None else None, seconds=timings, failure=why,
        guard_step=guard_step,
    )
    return PassOutcome(event, give_up=give_up)
