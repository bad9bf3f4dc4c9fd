"""The compaction step of a request: its new messages go into the conversation's compactor, the
automatic passes and the window guard run, and the outgoing body is built from the compacted view.

Called under the conversation's lock, after the request was routed to its session
(:mod:`ctxfold.serve.sessions`). It runs to its end even when the client leaves (the caller shields
it): a compactor left half way through an append would not match its log.

The compactor's work is a step of its core (:mod:`ctxfold.compaction.effects`), driven here on the
proxy's event loop: a summary it asks for is awaited on the loop, through the proxy's own upstream client,
and stops early when the client leaves. The core's own work between summaries (counting, the session
log's writes) costs a thread hop only when something may fire or be flushed
(:meth:`CompactionStep.inline`): the common request appends on the event loop, before it is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.compaction.archive.marker import MARKER_PREFIX
from ctxfold.compaction.compactor import CompactionEvent, Compactor
from ctxfold.compaction.cost import CompactionCost, PriceTable
from ctxfold.compaction.effects import Step, run_async
from ctxfold.compaction.view import tokens_bound
from ctxfold.serve.config import ProxyConfig
from ctxfold.serve.dialect import OPENAI
from ctxfold.serve.metrics import ProxyMetrics
from ctxfold.serve.request import ParsedRequest
from ctxfold.serve.routing import ProxySession
from ctxfold.serve.summaries import UpstreamSummarizer
from ctxfold.serve.window import lower_after_refusal

# New messages up to this size (UTF-8 bytes, a frame each) are counted on the event loop: the exact
# counter takes about 20 us a kB (fastokens, one core), so at most a millisecond or so of the loop.
INLINE_NEW_BYTES = 64 * 1024

log = logging.getLogger("ctxfold.serve")

@dataclass(slots=True)
class Outgoing:
    """What a request sends upstream once compacted."""

    session: ProxySession
    body: dict[str, Any]  # the request object as sent (the first recall round's)
    payload: bytes  # its bytes
    recall: bool  # the proxy offers read_archive and search_archive and answers their calls
    own_recall: bool  # the client offers a recall tool of its own: the proxy never adds one
    first_new: int = 0  # the original index of the first message this request brought
    compactions: int = 0  # compaction passes this request applied
    # The engine's KV the last applied pass of this request plans to keep (its exact common prefix with the
    # request before, page-aligned), None when none was applied or it has no plan.
    kv_reused_tokens: int | None = None


def failure_kind(reason: str | None) -> str:
    """A summary failure's reason as a metric label: the reason without its details, so the label set
    stays small (the whole reason goes to the log). The first clause that is words, not a name such as
    the summarizer's ``openai:model``, up to a parenthesis."""
    for clause in (reason or "").split(": "):
        if " " in clause.strip():
            return clause.split("(", 1)[0].strip()[:60] or "unknown"
    return "unknown"


def cost_words(cost: CompactionCost, prices: PriceTable | None) -> str:
    """The cost of a compaction in a few words, for the text log line (the JSON line has every figure)."""
    words = (f"; cache read {cost.before.cached_tokens} -> {cost.after.cached_tokens}, written "
             f"{cost.before.written_tokens} -> {cost.after.written_tokens}, summary request "
             f"{cost.summary_prompt_tokens} ({cost.summary_cached_tokens} cached) + {cost.summary_output_tokens} out, "
             f"saving {cost.saving_tokens} over {cost.horizon_requests} requests")
    if prices is not None:
        money = cost.money(prices)
        words += f", net {money['net']:+.6f} {prices.currency}"
    return words


def _has_archive_marker(messages: list[Message]) -> bool:
    return any(m.role is Role.TOOL and m.text.startswith(MARKER_PREFIX) for m in messages)


class CompactionStep:
    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.prices = config.money_prices  # the cost's money figures, None without --prices

    async def prepare(self, parsed: ParsedRequest, session: ProxySession | None,
                      create: Callable[[Conversation], Awaitable[ProxySession]],
                      left: asyncio.Event | None = None) -> Outgoing:
        """Store the request's new messages in ``session`` (None: a new conversation, made by
        ``create``), compact, and build what goes upstream.
        Raises BadRequest for a message or tool that is wrong (before anything is stored) and
        NoFitError when no compaction can fit it. ``left``: set when the client leaves (a summary in
        progress stops; the extractive summary stands in)."""
        known = session.num_known if session is not None else 0
        dialect = parsed.dialect or OPENAI
        new = dialect.new_messages(parsed, known)  # checked before anything is stored
        tools = parsed.body.get("tools") or []
        has_own_recall = dialect.has_own_recall(tools)
        if session is None or tools != session.tools_wire:
            # The tools this request offers, and the recall tool the proxy may add to them, are part of
            # what goes upstream: counted with every request that changes them (one comparison when not).
            specs = dialect.tool_specs(parsed.body) + (() if has_own_recall else dialect.recall_specs)
        if session is None:
            # Built with the history at once, but the tool results that end the request go in through
            # append_tool_result, so the hard trigger sees them arrive as it would in a running session.
            k = len(new)
            while k > 0 and new[k - 1].role is Role.TOOL:
                k -= 1
            session = await create(Conversation(messages=new[:k], system=parsed.system, tools=specs))
            session.note_wire(parsed.messages)
            session.tools_wire = tools
            new = new[k:]
        c = session.compactor
        first_new = known  # 0 for a new conversation: all of it is new
        c.expect_reply(dialect.max_reply_tokens(parsed.body))  # before the quiet check: the reserve is part of it
        if tools != session.tools_wire:
            c.update_tools(specs)
            session.tools_wire = tools
        quiet = self.inline(c, new)
        waits = c.min_gain_waits
        with _summaries_as(c, parsed.authorization):
            events = await run_async(self._ingest(session, new, parsed.messages, quiet=quiet), c._lock,
                                     in_thread=not quiet, cancel=left)
        self.count_events(events)
        if c.min_gain_waits > waits:
            self.metrics.min_gain_waits.inc(amount=c.min_gain_waits - waits)
        if not has_own_recall and not session.inject_recall:
            # Offer the tools once the conversation has archived outputs: from a pass of this request, in
            # the messages it brought, or (first request after a restart) anywhere in the view; or a
            # summary, whose history dump is archived and which tells the model to read and search it.
            scanned, session.recall_scanned = session.recall_scanned, True
            if tools or _has_archive_marker(new) or (not scanned and _has_archive_marker(c.view)) \
                    or any(e.archived or (e.applied and e.kind == "summary") for e in events):
                session.inject_recall = True
        out = self._outgoing(parsed, session, recall=session.inject_recall and not has_own_recall,
                             own_recall=has_own_recall)
        out.first_new = first_new
        applied = [e for e in events if e.applied]
        out.compactions = len(applied)
        planned = [e.kv for e in applied if e.kv is not None]
        out.kv_reused_tokens = planned[-1].tokens_reused if planned else None
        return out

    async def lower(self, parsed: ParsedRequest, out: Outgoing, prompt_tokens: int | None,
                    limit_tokens: int | None, left: asyncio.Event | None = None) -> Outgoing | None:
        """The upstream refused ``out`` as too long: compact to a lower window (:mod:`ctxfold.serve.window`)
        and build the request again; None when there is no window to aim at."""
        session = out.session
        with _summaries_as(session.compactor, parsed.authorization):
            events = await run_async(self._lower(session, out.first_new, prompt_tokens, limit_tokens),
                                     session.compactor._lock, cancel=left)
        if events is None:
            return None
        self.count_events(events)
        if any(e.archived for e in events) and not out.own_recall:
            session.inject_recall = True
        lowered = self._outgoing(parsed, session, recall=session.inject_recall and not out.own_recall,
                                 own_recall=out.own_recall)
        lowered.first_new = out.first_new
        return lowered

    def _lower(self, session: ProxySession, first_new: int, prompt_tokens: int | None, limit_tokens: int | None
               ) -> Step[list[CompactionEvent] | None]:
        c = session.compactor
        sent_tokens = c.occupancy_tokens() - c.reply_reserve_tokens()  # the view as it went out
        if not lower_after_refusal(session, self.config.compact, prompt_tokens, limit_tokens, sent_tokens):
            return None
        first = len(c.events)
        c.mark_unseen(first_new)  # the model never read the request: the passes judge it as new again
        yield from c.before_request_step()  # the window guard makes it fit the lower window (it may summarize)
        return list(c.events[first:])

    def _outgoing(self, parsed: ParsedRequest, session: ProxySession, *, recall: bool, own_recall: bool) -> Outgoing:
        c = session.compactor
        view, origins, originals = session.request_view()
        # The view is the originals themselves (the usual case): a list comparison, in C, by identity
        # (a message equal to its original would go out as the client sent it, which is the same).
        untouched = view == originals
        if untouched and not recall:
            return Outgoing(session, parsed.body, parsed.raw, recall, own_recall)  # the client's own bytes go upstream
        dialect = parsed.dialect or OPENAI
        body = dict(parsed.body)
        if not untouched:
            body.update(dialect.outgoing_messages(parsed, c.header.system, view, origins, originals))
        if recall:
            body["tools"] = list(parsed.body.get("tools") or []) + dialect.recall_tools()
        return Outgoing(session, body, dialect.dumps(body, parsed.fast_json), recall, own_recall)

    @staticmethod
    def inline(c: Compactor, new: list[Message]) -> bool:
        """Whether appending ``new`` is cheap enough to run on the event loop: nothing fires and nothing
        is archived. A thread hop costs two context switches, which on a busy machine is most of the
        latency the proxy adds; a summary (a model call) must not block the loop. (The compactor never
        writes: its log is buffered, and the commit fsyncs off the loop.)

        New messages over :data:`INLINE_NEW_BYTES` are counted in the worker thread too: an exact
        count of a large tool output takes milliseconds, which the other conversations on the loop
        would wait out.

        Nothing fires when even an upper bound of the tokens after the append (every byte a token)
        stays under the lowest trigger line of the configuration (:meth:`Compactor.quiet`) and no
        tool output worth archiving slid behind the kept turns (:meth:`Compactor.archive_due`, at
        most once per user turn): nothing is counted to find that out.
        """
        return c.quiet(new) and not c.archive_due(new) and sum(map(tokens_bound, new)) <= INLINE_NEW_BYTES

    @staticmethod
    def _ingest(session: ProxySession, new: list[Message], sent: list[dict[str, Any]], *,
                quiet: bool = False) -> Step[list[CompactionEvent]]:
        """Append the request's new messages and run the automatic passes (the driver runs the work
        inline or in a worker thread: see :meth:`inline`). ``sent``: the request's messages, as it sent them. ``quiet``: the caller
        found that nothing can fire (:meth:`Compactor.quiet`), the hard trigger of tool results
        included: they go in with the rest, in one append (one write to the log)."""
        try:
            return (yield from session.compactor.request_step(new, quiet=quiet))
        finally:
            # Whatever was stored before a failure is known, so a retry does not store it twice.
            session.note_wire(sent)

    def count_events(self, events: list[CompactionEvent]) -> None:
        m = self.metrics
        for e in events:
            fields = {"kind": e.kind, "trigger": e.trigger, "applied": e.applied, "tokens_before": e.tokens_before,
                      "tokens_after": e.tokens_after}
            if e.applied:
                m.compactions.inc(e.kind, e.trigger)
                m.tokens_saved.inc(amount=max(0, e.tokens_before - e.tokens_after))
                said = ""
                if e.cost is not None:
                    m.note_cost(e.cost, self.prices)
                    fields["cost"] = e.cost.to_json(self.prices)
                    said = cost_words(e.cost, self.prices)
                log.info("compaction: %s (%s): %d -> %d tokens%s", e.kind, e.reason, e.tokens_before, e.tokens_after,
                         said, extra=fields)
            else:
                m.compaction_failures.inc(e.kind, e.trigger)
                log.info("compaction not applied: %s (%s): %s", e.kind, e.reason, e.failure or "no change",
                         extra=fields)
            if e.kind == "summary" and "summary" in e.seconds:
                m.summary_seconds.observe(e.seconds["summary"])
            if e.summary_fallback:
                m.summary_fallbacks.inc(failure_kind(e.summary_failure))
                log.warning("summary by the extractive fallback: %s", e.summary_failure)


@contextmanager
def _summaries_as(c: Compactor, authorization: str | None) -> Iterator[None]:
    """The summaries a request's compaction triggers go upstream with its credentials (the conversation's
    own summarizer; its requests run one at a time), which the summarizer keeps no longer."""
    summarizer = c.summarizer if isinstance(c.summarizer, UpstreamSummarizer) else None
    if summarizer is not None:
        summarizer.client_authorization = authorization
    try:
        yield
    finally:
        if summarizer is not None:
            summarizer.client_authorization = None
