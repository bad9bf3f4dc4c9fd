"""The compactor: one object per conversation, called before every model request.

It decides (the soft and hard triggers of ds4, the minor, major and mid-turn passes of Datus), runs
the passes (archive, summary, rebuild), and returns the new view with an event record. It never
deadlocks: a failed or impossible summary falls back to the extractive one, a rewrite that does not
shrink the conversation is not applied, and a breaker stops automatic passes for the rest of a turn
after repeated failures or when even the compacted view is over the threshold.

Lifecycle, as an agent loop drives it::

    c = Compactor(conversation, config=cfg, counter=counter, session_dir=...)
    c.append(user_message)                 # a new user turn
    event = c.before_request()             # maybe compacts; c.view is what to send
    c.append(assistant_message)            # the model's answer
    c.append_tool_result(result)           # the hard trigger lives here
    event = c.before_request()             # a tool continuation: mid-turn checks
    c.compact_now()                        # manual: always a summary pass

The passes live in :mod:`ctxfold.compaction` (policy, archive pass, summary pass, window guard), ask
for summaries instead of calling a model (:mod:`ctxfold.compaction.effects`), write into the
conversation's journal instead of a file (:mod:`ctxfold.compaction.journal`) and return their rewrite as
a plan that :func:`~ctxfold.compaction.outcome.settle` applies to this object. This class holds the
state and is the synchronous driver: it commits the journal to the session directory at the end of
every call (a disk that refuses it does not stop the conversation: see :attr:`Compactor.unwritten`);
:class:`AsyncCompactor` drives the same steps on an event loop.

Thread safety: every public method holds the compactor's lock, so one conversation can be shared
between threads. Use one driver at a time for a conversation: the synchronous methods or one
:class:`AsyncCompactor`.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from ctxfold.chat.messages import Conversation, Message, Role, ToolSpec
from ctxfold.compaction import archive_pass as archive
from ctxfold.compaction import cost
from ctxfold.compaction.archive import ArchiveParams, ArchiveStore, archive_oversized
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.effects import Step, drive_sync
from ctxfold.compaction.events import (
    GUARD_STEPS,
    AppendResult,
    ArchivedOutput,
    CompactionEvent,
    KvPlanFigures,
    NullObserver,
    Observer,
)
from ctxfold.compaction.guard import guard
from ctxfold.compaction.journal import Journal
from ctxfold.compaction.kv import MIN_SHIFT_TOKENS
from ctxfold.compaction.log_writer import MAX_UNWRITTEN_BYTES, LogWriter
from ctxfold.compaction.outcome import settle, settle_summary
from ctxfold.compaction.policy import Policy
from ctxfold.compaction.rebuild import (
    SAMPLE_ARCHIVE_ID,
    SUMMARY_ACKNOWLEDGEMENT,
    frame_summary,
    keep_turns_alternating,
    resume_message,
)
from ctxfold.compaction.session import Session, ViewEntry
from ctxfold.compaction.store.buffer import BufferedLog
from ctxfold.compaction.summarize import ExtractiveSummarizer, Summarizer
from ctxfold.compaction.summary_pass import summary_pass
from ctxfold.compaction.view import (
    FRAME_TOKENS,
    RERENDER_FRAME_TOKENS,
    TurnState,
    ViewState,
    tokens_bound,
    utf8_len,
)
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import DEFAULT_TOKENIZER, TokenCounter, load_counter
from ctxfold.tokens.templates import ChatTemplate
from ctxfold.tokens.templates.jinja import JinjaChatTemplate

# The records and pieces users import from here, where they were first defined.
__all__ = ["GUARD_STEPS", "MIN_SHIFT_TOKENS", "SAMPLE_ARCHIVE_ID", "SUMMARY_ACKNOWLEDGEMENT", "AppendResult",
           "ArchivedOutput", "AsyncCompactor", "CompactionEvent", "Compactor", "KvPlanFigures", "NullObserver",
           "Observer", "frame_summary", "keep_turns_alternating", "resume_message"]

T = TypeVar("T")


class Compactor:
    """Compaction policy and state for one conversation. See the module docstring."""

    def __init__(
        self,
        conversation: Conversation,
        *,
        config: CompactConfig | None = None,
        counter: TokenCounter | None = None,
        template: ChatTemplate | JinjaChatTemplate | None = None,
        summarizer: Summarizer | None = None,
        session_dir: str | Path | None = None,
        session_log: BufferedLog | None = None,
        store: ArchiveStore | None = None,
        durable: bool = True,
        fsync_appends: bool = True,
        max_unwritten_bytes: int = MAX_UNWRITTEN_BYTES,
        page_size_tokens: int = 16,
        kv_plan: str = "segments",
        observer: Observer | None = None,
    ) -> None:
        self.config = config if config is not None else CompactConfig()
        self._policy = Policy(self.config)
        self._quiet_line: tuple[CompactConfig | None, int | None] = (None, None)  # see _quiet_line_tokens
        self.counter = counter if counter is not None else load_counter(DEFAULT_TOKENIZER)
        self._accounting = RequestAccounting(self.counter, template)
        # The byte bound of the messages appended since the last count; not 0 exactly when there are
        # some (every message has a frame), so it also says that the accounting is stale.
        self._pending_bound_tokens = 0
        # The default and the fallback.
        self._extractive = ExtractiveSummarizer(counter=self.counter,
                                                trail_max_tokens=self.config.summary.trail_max_tokens)
        self.summarizer: Summarizer = summarizer if summarizer is not None else self._extractive
        self.observer: Observer = observer if observer is not None else NullObserver()
        self.page_size_tokens = page_size_tokens
        if kv_plan not in ("segments", "tokens"):
            raise ValueError(f"kv_plan must be 'segments' or 'tokens', got {kv_plan!r}")
        if kv_plan == "tokens" and (getattr(self.counter, "tokenizer", None) is None or template is None):
            raise ValueError("kv_plan='tokens' needs a tokenizer.json counter (it encodes the rendered requests) "
                             "and a chat template")
        # "tokens": render both requests, encode them, and plan over the ids (exact, with the spans a
        # shifting engine can move; costs two encodes of the request per compaction). "segments":
        # the same figures from per-message counts, free, without shift spans.
        self.kv_plan = kv_plan
        self._lock = threading.RLock()
        self.header = replace(conversation, messages=[])
        self.events: list[CompactionEvent] = []
        self.state = ViewState()
        self._rewrites = 0  # summary rewrites so far in this session: numbers the messages they write
        self._dumped = 0  # originals already in a history dump
        self._history_id: str | None = None  # archive id of the newest history dump
        self._archive_watermark = 0  # view index before which the turn-start pass has judged every output
        self._archive_params = ArchiveParams.from_config(self.config.minor)
        self._frame_tokens: int | None = None  # see _summary_frame_tokens
        self._tools_bound: tuple[Any, int] | None = None  # (the tools it is for, the bound): _moving_tools_bound_tokens
        self._answer_tokens: list[int] = []  # tokens of each answer so far, sorted (the reserve's percentile)
        self._max_reply_tokens: int | None = None  # the current request's own max_tokens, where it gave one
        self.min_gain_waits = 0  # automatic summaries the minimum-gain rule put off (compaction.cost)

        # What the core writes goes into the conversation's journal, never to disk: the writer opens it
        # and persists it, where this class is the driver that must (ctxfold.compaction.log_writer).
        # The archive given (shared, object storage) or the session's own: written through the journal.
        self._log = LogWriter(session_dir, session_log, archive=store, durable=durable, fsync_appends=fsync_appends,
                              max_unwritten_bytes=max_unwritten_bytes)
        self.journal: Journal | None = self._log.journal if self._log.keeps_log else None  # what the core logs to
        self.store = self._log.archive()

        resumed = self._log.resumed
        if resumed is not None:
            self.header = replace(resumed.conversation, messages=[])
            self.state = ViewState.resumed(resumed.originals, resumed.conversation.messages, resumed.view_origins)
            self._load_state(resumed.state)
            self._answer_tokens = sorted(self._answer_size_tokens(m) for m in self.originals
                                         if m.role is Role.ASSISTANT)
            self._accounting.reset(self.header, self.view)
        else:
            self._log.start(self.header)
            self._accounting.reset(self.header, [])
            self._ingest(conversation.messages)
            self._log.commit()

    # -- the conversation ---------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        """The trigger arithmetic of the current configuration (the proxy's calibration replaces it)."""
        if self._policy.config is not self.config:
            self._policy = Policy(self.config)
        return self._policy

    @property
    def view(self) -> list[Message]:
        """What the next request shows the model (system prompt and tools aside)."""
        return self.state.view

    @property
    def originals(self) -> list[Message]:
        """Every message of the conversation as it came, in order."""
        return self.state.originals

    @property
    def view_origins(self) -> list[int]:
        """For each view entry, the index of the original it shows; -1 for a message ctxfold wrote."""
        return self.state.origins

    # -- figures ------------------------------------------------------------------------------------
    @property
    def accounting(self) -> RequestAccounting:
        """The token accounting of the view. Appends only mark it stale and the first read brings it
        up to date: an answer and the next request's messages are then rendered and counted in one
        pass (appending re-renders the message before, so two appends cost more than one of two)."""
        if self._pending_bound_tokens:
            with self._lock:
                if self._pending_bound_tokens:
                    self._accounting.sync(self.view)
                    self._pending_bound_tokens = 0
        return self._accounting

    @property
    def context_tokens(self) -> int | None:
        return self.config.context_tokens

    def occupancy_tokens(self, queued: Sequence[Message] = ()) -> int:
        """System + tools + view + queued messages + reply reserve, in tokens. O(len(queued))."""
        extra = sum(self.accounting.message_tokens(m) for m in queued)
        return self.accounting.total_tokens + extra + self.reply_reserve_tokens()

    def update_tools(self, tools: Sequence[ToolSpec]) -> None:
        """The tool definitions the next requests offer, where they differ from what the conversation
        started with (a client that adds tools as it goes): counted from now on, in every occupancy,
        trigger and guard decision. Recounts the request when they change; nothing when they do not."""
        tools = tuple(tools)
        with self._lock:
            if tools == self.header.tools:
                return
            self.header = replace(self.header, tools=tools)
            self._tools_bound = None
            self._accounting.reset(self.header, self.view)
            self._pending_bound_tokens = 0  # the reset counted the whole view

    def update_system(self, system: str | None) -> None:
        """The system prompt the next requests send, where it differs from what the conversation started
        with (a prompt built per request): counted from now on, as :meth:`update_tools` counts tools. Not
        logged: a resumed session counts the prompt it started with until the next request sets it."""
        with self._lock:
            if system == self.header.system:
                return
            self.header = replace(self.header, system=system)
            self._accounting.reset(self.header, self.view)
            self._pending_bound_tokens = 0

    def run(self, step: Step[T]) -> T:
        """Drive a step of this compactor's core that the caller put together from the ``*_step``
        methods (several appends and a request, as one operation) in this thread, under the lock."""
        return self._drive(step)

    def expect_reply(self, max_tokens: int | None) -> None:
        """The next requests' own limit on the answer (their ``max_tokens``), None where they give none:
        the reply reserve is at least that (:meth:`reply_reserve_tokens`). The proxy sets it per request,
        before it asks :meth:`quiet`."""
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 0):
            raise ValueError(f"max_tokens must be a whole number >= 0, got {max_tokens!r}")
        self._max_reply_tokens = max_tokens

    def reply_reserve_tokens(self) -> int:
        """Tokens kept free for the model's answer: the largest of the configured reserve, the current
        request's own ``max_tokens`` (given to :meth:`before_request`) and the 95th percentile of this
        conversation's answers so far. The percentile is capped at half a known window: one outlier
        answer must not leave no room for the conversation."""
        return self.policy.reply_reserve_tokens(self.context_tokens, self._answer_tokens, self._max_reply_tokens)

    def occupancy_bound_tokens(self, extra: Sequence[Message] = ()) -> int:
        """An upper bound of :meth:`occupancy_tokens` once ``extra`` is appended, without counting
        anything new: the last counted total, plus for every message appended since and every one of
        ``extra`` its UTF-8 bytes (no tokenizer makes a token of less than a byte) and a template frame.
        O(len(extra)). Never below the count, so a bound under a trigger line proves the trigger cannot
        fire (:meth:`quiet`); whether one that may fire does is decided by counting."""
        with self._lock:
            total = self._accounting.total_tokens + self._pending_bound_tokens
        return (total + sum(map(tokens_bound, extra)) + RERENDER_FRAME_TOKENS + self._moving_tools_bound_tokens()
                + self.reply_reserve_tokens())

    def _moving_tools_bound_tokens(self) -> int:
        """A bound of the tools block where the template renders it with the newest user message
        (Mistral v7): a new user message can bring it into a view that held none. Its bytes, and a
        token per control token; 0 for templates that keep tools in the fixed prefix."""
        renderer = self._accounting.renderer
        if not renderer.template.tools_with_last_user or not self.header.tools:
            return 0
        if self._tools_bound is None or self._tools_bound[0] is not self.header.tools:
            parts = renderer.tools_block(self.header.tools)
            n = sum(utf8_len(p) if isinstance(p, str) else 1 for p in parts)
            self._tools_bound = (self.header.tools, n)
        return self._tools_bound[1]

    def quiet(self, extra: Sequence[Message] = ()) -> bool:
        """Whether no token trigger (a summary, the mid-turn archive) can fire once ``extra`` is appended,
        by the byte bound alone (:meth:`occupancy_bound_tokens`): counts nothing. False with room to
        spare is fine; True is a guarantee. Without a known window, always True."""
        line = self._quiet_line_tokens()
        return line is None or self.occupancy_bound_tokens(extra) < line

    def _quiet_line_tokens(self) -> int | None:
        """The lowest line a token trigger fires at, None without a known window. Asked twice per
        request by the proxy: kept until the configuration is replaced (a calibration does that)."""
        cfg = self.config
        if self._quiet_line[0] is not cfg:
            ctx = cfg.context_tokens
            self._quiet_line = (cfg, None if ctx is None else self.policy.quiet_line_tokens(ctx))
        return self._quiet_line[1]

    def archive_due(self, extra: Sequence[Message] = ()) -> bool:
        """Whether the turn-start archive pass may archive something once ``extra`` is appended: the
        window of kept turns slid past a tool output of at least the threshold that the pass has not
        judged yet (:func:`ctxfold.compaction.archive_pass.archive_due`). True does not mean something
        will be archived; False means nothing will be."""
        return archive.archive_due(self, extra)

    def counted_occupancy_tokens(self) -> int | None:
        """:meth:`occupancy_tokens` when the view is counted already, else None: for figures worth
        having only when they cost nothing (the proxy's calibration against the upstream's usage)."""
        with self._lock:
            return None if self._pending_bound_tokens else self.occupancy_tokens()

    def mark_unseen(self, first_original: int) -> None:
        """The model did not see the last request (the upstream refused it unread): the view from the
        message of original ``first_original`` on counts as new again, so the next :meth:`before_request`
        judges it as it judged that request (a turn start stays one: no resume instruction)."""
        with self._lock:
            self.state.mark_unseen(first_original)

    def seen_originals(self) -> int:
        """How many leading originals the model has seen (they went out in a request)."""
        with self._lock:
            return self.state.seen_originals()

    def mark_seen(self, num_originals: int) -> None:
        """The model saw the first ``num_originals`` originals, none after (a fork's parent sent them)."""
        with self._lock:
            self.state.mark_seen(num_originals)

    def conversation(self) -> Conversation:
        """The current view as a conversation (what the next request sends)."""
        return replace(self.header, messages=list(self.view))

    # -- appending ----------------------------------------------------------------------------------
    def append(self, *messages: Message) -> None:
        """Append messages as they happen (user turns, assistant answers). Tool results should go
        through :meth:`append_tool_result`, which applies the hard trigger."""
        with self._lock, self._log.call():
            self._ingest(messages)

    def append_tool_result(self, result: Message) -> AppendResult:
        """Append one tool result; if it would not fit with the reply reserve, compact and retry once,
        and as the last resort archive it and append a marker with a tool error instead."""
        return self._drive(self.append_tool_result_step(result))

    def append_tool_result_step(self, result: Message) -> Step[AppendResult]:
        """:meth:`append_tool_result` as a step for a driver (:mod:`ctxfold.compaction.effects`)."""
        ctx = self.context_tokens
        if ctx is None or not self.config.hard.enabled or self._fits(result):
            self._ingest([result])
            return AppendResult(result, fitted=True)
        events: list[CompactionEvent] = []
        reason = "tool result would exceed context"
        if self.policy.archive_enabled(mid_turn=True):
            ev = settle(self, archive.archive_pass(self, stage="mid_turn", trigger="hard", reason=reason))
            if ev is not None:
                events.append(ev)
        if not self._fits(result):
            events.append(settle_summary(self, (yield from summary_pass(self, trigger="hard", reason=reason,
                                                                        mid_turn=not self.state.at_turn_start()))))
        if self._fits(result):
            self._ingest([result])
            return AppendResult(result, fitted=True, events=tuple(events))
        # The last resort: the result goes to the archive and the model gets a marker with a
        # tool error saying how to read it in pieces. With no room at all, the marker still goes
        # in (a line, against a result that cannot fit): nothing is dropped.
        before = self.occupancy_tokens()
        room = max(ctx - before, 1)
        oversized = archive_oversized(result, self.store, max_tokens=room, count_tokens=self.counter.count,
                                      preview_chars=self.config.minor.archive_preview_chars)
        appended = oversized.message
        self._ingest([result], shown=[appended])
        events.append(CompactionEvent(
            kind="last_resort", trigger="hard", reason="tool result does not fit even after compaction",
            applied=oversized.fits, tokens_before=before, tokens_after=self.occupancy_tokens(),
            archived=tuple(ArchivedOutput(a.message_id, a.archive_id, a.chars_before, a.chars_after)
                           for a in oversized.report.archived),
            failure=oversized.report.error,
        ))
        if appended is not result:
            self._log_view(events[-1])  # the view shows a stand-in: a resumed session must too
        self._record(events[-1])
        return AppendResult(appended, fitted=False, events=tuple(events))

    # -- the decision -------------------------------------------------------------------------------
    def before_request(self, queued: Sequence[Message] = (), *,
                       max_reply_tokens: int | None = None) -> CompactionEvent | None:
        """Run the automatic passes due before a model request, then the window guard; return the last
        event, if any.

        ``queued`` are user messages typed while the turn runs: counted before deciding, appended to
        the view after any rewrite (so they follow a resume instruction), flagged as queued inserts.
        ``max_reply_tokens``: the request's own limit on the answer (its ``max_tokens``), as
        :meth:`expect_reply` sets it; not given, the last one set stays.

        The guard is never off: the breaker may stop the automatic passes for the rest of a turn, but
        a request never leaves over the window while any fit exists (:mod:`ctxfold.compaction.guard`).
        Where none exists, :class:`~ctxfold.errors.NoFitError` is raised here, before the request is sent.
        """
        return self._drive(self.before_request_step(queued, max_reply_tokens=max_reply_tokens))

    def before_request_step(self, queued: Sequence[Message] = (), *,
                            max_reply_tokens: int | None = None) -> Step[CompactionEvent | None]:
        """:meth:`before_request` as a step for a driver (:mod:`ctxfold.compaction.effects`)."""
        if max_reply_tokens is not None:
            self.expect_reply(max_reply_tokens)
        turn_start = self.state.at_turn_start()
        if turn_start:
            self.state.new_turn()
        last: CompactionEvent | None = None
        if not self.state.turn.gave_up:
            last = yield from self._run_automatic(turn_start, queued)
        queued = [replace(m, queued=True) if not m.queued else m for m in queued]
        shown, guarded = guard(self, turn_start, queued)
        last = guarded or last
        if queued:
            self._ingest(queued, shown=shown)
            if any(a is not b for a, b in zip(queued, shown, strict=True)):
                self._log_view(self.events[-1])  # the view shows stand-ins: a resumed session must too
        self.state.first_unseen = None  # the request goes out: the model sees it all
        return last

    def compact_now(self, reason: str = "manual compaction") -> CompactionEvent:
        """Manual compaction: always a summary pass, even when automatic passes are off."""
        return self._drive(self.compact_now_step(reason))

    def compact_now_step(self, reason: str = "manual compaction") -> Step[CompactionEvent]:
        """:meth:`compact_now` as a step for a driver (:mod:`ctxfold.compaction.effects`)."""
        return settle_summary(self, (yield from summary_pass(self, trigger="manual", reason=reason, mid_turn=False)))

    def request_step(self, new: Sequence[Message], *, quiet: bool = False) -> Step[list[CompactionEvent]]:
        """A model request that brings ``new`` messages, as a step: tool results through the hard trigger
        (:meth:`append_tool_result_step`), the rest appended as they come, then :meth:`before_request_step`;
        returns the events. ``quiet``: the caller found that nothing can fire (:meth:`quiet`), so all of
        ``new`` goes in with one append (one write to the log)."""
        first = len(self.events)
        plain: list[Message] = []
        for m in new:
            if m.role is Role.TOOL and not quiet:
                if plain:
                    self.append(*plain)
                    plain = []
                yield from self.append_tool_result_step(m)
            else:
                plain.append(m)
        if plain:
            self.append(*plain)
        yield from self.before_request_step()
        return list(self.events[first:])

    def _run_automatic(self, turn_start: bool, queued: Sequence[Message]) -> Step[CompactionEvent | None]:
        cfg = self.config
        last: CompactionEvent | None = None
        if turn_start and self.policy.archive_enabled(mid_turn=False):
            last = settle(self, archive.archive_pass(self, stage="turn_start", trigger="turn_start",
                                                     reason=f"more than {cfg.minor.keep_recent_user_turns} "
                                                     "user turns")) or last
        ctx = self.context_tokens
        if ctx is None:
            return last  # unknown window: token triggers are skipped
        if self.quiet(queued):
            return last  # not even the byte bound reaches a line: nothing to count (the common case)
        used = self.occupancy_tokens(queued)
        archive_line = self.policy.mid_turn_archive_line_tokens(ctx)
        if not turn_start and archive_line is not None and used >= archive_line:
            last = settle(self, archive.archive_pass(self, stage="mid_turn", trigger="mid_turn",
                                                     reason=f"mid-turn occupancy over "
                                                     f"{cfg.minor.mid_turn_token_threshold:.0%} of the window")) or last
            used = self.occupancy_tokens(queued)
        trigger = self.policy.summary_trigger(used, ctx, turn_start=turn_start)
        if trigger is not None and not cost.waits(self, used, ctx, queued):  # the minimum-gain rule
            kind, reason = trigger
            last = settle_summary(self, (yield from summary_pass(self, trigger=kind, reason=reason,
                                                                 mid_turn=not turn_start, queued=queued)))
        return last

    def _summary_frame_tokens(self) -> int:
        """Tokens the frame around a summary adds (the pointer to the history dump included), with this
        conversation's counter, plus a message's template frame: counted once."""
        if self._frame_tokens is None:
            self._frame_tokens = self.counter.count(frame_summary("", SAMPLE_ARCHIVE_ID)) + FRAME_TOKENS
        return self._frame_tokens

    def _fits(self, result: Message) -> bool:
        ctx = self.context_tokens
        if ctx is None or self.occupancy_bound_tokens([result]) <= ctx:
            return True  # even the bound fits: no need to count (the common case, far from the window)
        return self.occupancy_tokens() + self.accounting.message_tokens(result) <= ctx

    def _ingest(self, messages: Iterable[Message], shown: Sequence[Message] | None = None, *, log: bool = True) -> None:
        """Log originals and show them (or their stand-ins) in the view. ``log=False``: the caller has
        logged them already."""
        messages = list(messages)
        shown = messages if shown is None else list(shown)
        if log and self.journal is not None:
            self.journal.append_messages(messages)
        for m in messages:
            if m.role is Role.ASSISTANT:
                bisect.insort(self._answer_tokens, self._answer_size_tokens(m))
        self.state.add(messages, shown)
        self._pending_bound_tokens += sum(map(tokens_bound, shown))

    def _answer_size_tokens(self, m: Message) -> int:
        """What an answer took to write: its text, reasoning and calls (templates drop an old answer's
        reasoning from later requests, but the model wrote it within the reply's budget)."""
        count = self.counter.count
        n = count(m.text) + (count(m.reasoning) if m.reasoning else 0)
        return n + sum(count(c.name) + count(c.arguments) for c in m.tool_calls)

    def _state(self) -> dict[str, Any]:
        turn = self.state.turn
        return {"turn": turn.number, "failures": turn.failures, "gave_up": turn.gave_up,
                "request_index": self.state.request_index(), "occupancy_tokens": self.occupancy_tokens(),
                "compactions": len(self.events), "rewrites": self._rewrites, "dumped": self._dumped,
                "history_id": self._history_id}

    def _load_state(self, state: dict[str, Any]) -> None:
        # The turn's request is the last real user turn in the view: turns that arrived after the
        # last logged state are in the view, not in the state.
        request = next((m for m in reversed(self.view) if m.is_user_turn), None)
        self.state.turn = TurnState(number=int(state.get("turn", 0)), failures=int(state.get("failures", 0)),
                                    gave_up=bool(state.get("gave_up", False)), request=request)
        self._rewrites = int(state.get("rewrites", 0))
        self._dumped = int(state.get("dumped", 0))
        history_id = state.get("history_id")
        self._history_id = history_id if isinstance(history_id, str) else None

    def _log_view(self, event: CompactionEvent) -> None:
        if self.journal is None:
            return
        entries = [ViewEntry(o, None if o >= 0 and m is self.originals[o] else m)
                   for m, o in zip(self.view, self.view_origins, strict=True)]
        dump = self._log.dump_name(event.history_dump)
        figures: dict[str, Any] = {"tokens_before": event.tokens_before, "tokens_after": event.tokens_after}
        # Why the configured summarizer did not write this summary, and which guard step ran: in the
        # log, where an operator reading a session finds them.
        if event.summary_failure is not None:
            figures["summary_failure"] = event.summary_failure
        if event.guard_step is not None:
            figures["guard_step"] = event.guard_step
        self.journal.log_view(entries, kind=event.kind, reason=event.reason, dump=dump, state=self._state(),
                              figures=figures)

    def _record(self, event: CompactionEvent) -> None:
        self.events.append(event)
        self.observer.compaction_finished(event)

    def dump_location(self, name: Path) -> str:
        """Where a history dump the journal named can be read (:meth:`LogWriter.dump_location`)."""
        return self._log.dump_location(name)

    # -- the synchronous driver's writes --------------------------------------------------------------
    def _drive(self, step: Step[T]) -> T:
        """Run ``step`` in this thread under the lock (:func:`~ctxfold.compaction.effects.drive_sync`), then
        commit what it logged, also when it raised (:meth:`LogWriter.call`)."""
        with self._lock, self._log.call():
            return drive_sync(step)

    @property
    def session(self) -> Session | None:
        """The session directory this compactor commits to (its ``root``, ``restore()``), None without one."""
        return self._log.directory

    @property
    def unwritten(self) -> OSError | None:
        """Why the session directory lacks what this conversation logged last (records wait in the
        journal for the next commit), or None when it holds everything."""
        return self._log.unwritten

    def flush(self) -> None:
        """Write what waits to the session directory now; OSError when it still cannot be written."""
        with self._lock:
            self._log.flush()

    def close(self) -> None:
        """Write what waits (OSError when it cannot be: nothing of it is lost while this object lives)
        and close the session's log."""
        with self._lock:
            self._log.close()


# The asyncio driver, in a module of its own; its import path has always been this one.
from ctxfold.compaction.async_driver import AsyncCompactor
