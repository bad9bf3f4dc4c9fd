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

Thread safety: every public method holds the compactor's lock, so one conversation can be shared
between threads; :class:`AsyncCompactor` is the asyncio variant for servers.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from ctxfold.accounting import RequestAccounting
from ctxfold.archive import (
    ArchiveParams,
    ArchivePass,
    ArchiveStore,
    MemoryBackend,
    archive_mid_turn,
    archive_oversized,
    archive_turn_start,
    archive_whole,
)
from ctxfold.archive.marker import is_marker, make_marker
from ctxfold.config import CompactConfig
from ctxfold.counting import TokenCounter, load_counter
from ctxfold.errors import ArchiveError, NoFitError
from ctxfold.jinja_template import JinjaChatTemplate
from ctxfold.kvplan import plan_kv_resync
from ctxfold.ledger import SegmentFlag
from ctxfold.messages import Conversation, Message, Role, ToolSpec
from ctxfold.session import Session, ViewEntry, history_dump_text
from ctxfold.summarize import (
    FRAME_CLOSE,
    FRAME_OPEN,
    SUMMARY_TEXT_KEY,
    ChunkedSummarizer,
    ExtractiveSummarizer,
    FallbackSummarizer,
    Summarizer,
    build_summary_request,
)
from ctxfold.tail import SegmentTail, select_tail_from_ledger, widen_tail, widened_preview_chars
from ctxfold.templates import ChatTemplate

if TYPE_CHECKING:
    from ctxfold.store.buffer import BufferedLog

class Observer(Protocol):
    """Hooks for user interfaces. Every method is optional to implement (see NullObserver)."""

    def compaction_started(self, reason: str, kind: str) -> None: ...
    def summary_token(self, text: str) -> None: ...
    def compaction_finished(self, event: CompactionEvent) -> None: ...
    def prefill_progress(self, done_tokens: int, total_tokens: int) -> None: ...


class NullObserver:
    def compaction_started(self, reason: str, kind: str) -> None:
        pass

    def summary_token(self, text: str) -> None:
        pass

    def compaction_finished(self, event: CompactionEvent) -> None:
        pass

    def prefill_progress(self, done_tokens: int, total_tokens: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class KvPlanFigures:
    """What an engine's KV cache keeps across one rewrite."""

    tokens_reused: int  # cached tokens kept as they are (exact common prefix, page-aligned)
    tokens_to_prefill: int  # tokens of the new request that must be computed again
    tokens_shift_reusable: int = 0  # of those, tokens an engine that can shift positions could move (approximate)
    exact: bool = False  # computed over token ids (True) or over per-message counts (False)


@dataclass(frozen=True, slots=True)
class ArchivedOutput:
    message_id: str  # id of the tool-result message that was archived
    archive_id: str  # content address in the archive store
    chars_before: int  # characters of the original output
    chars_after: int  # characters of the marker that replaced it


@dataclass(frozen=True, slots=True)
class CompactionEvent:
    """The record of one compaction attempt (applied or not)."""

    kind: str  # "archive" (minor), "summary" (major), "last_resort" (a result too big even after compaction)
    trigger: str  # "turn_start", "soft", "major", "mid_turn", "hard", "manual"
    reason: str  # human-readable reason, e.g. "soft limit before user turn"
    applied: bool  # False when the pass failed or would not have shrunk the conversation
    tokens_before: int  # occupancy before, reply reserve included
    tokens_after: int  # occupancy after (equal to before when not applied)
    archived: tuple[ArchivedOutput, ...] = ()
    summary: str | None = None
    summarizer: str | None = None  # which summarizer wrote the summary that was used
    summary_fallback: bool = False  # the configured summarizer failed and the extractive one stood in
    summary_failure: str | None = None  # why the configured summarizer failed
    summary_cut: str | None = None  # "token_cap", "control_boundary", ... when the summary was cut
    tail_start: int | None = None  # index in the old view where the verbatim tail starts
    tail_rule: str | None = None  # which rule chose the tail start
    tail_tokens: int = 0
    history_dump: str | None = None  # path of the full-history dump written before the rewrite
    kv: KvPlanFigures | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # per phase wall time
    failure: str | None = None  # why nothing was applied
    # The window guard's step that ran (GUARD_STEPS), None for a policy pass. The guard runs when a
    # request would leave over the window; its last applied step is the one that made it fit.
    guard_step: str | None = None


# The window guard's cascade, in order: each runs only while the request is still over the window.
GUARD_STEPS: tuple[str, ...] = (
    "archive_all",  # every tool output the archive can shrink, the newest too (markers the model reads back)
    "extractive_summary",  # a summary written without a model, with a tail under the trigger line
    "shorter_tail",  # the same with no tail: only what the model has not seen yet stays verbatim
    "oversized_message",  # single huge messages (a result, a pasted file, an agent's summary) archived
    "fold_newest",  # mid-turn: the turn's newest calls and results folded into the summary too
)


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Outcome of :meth:`Compactor.append_tool_result`."""

    appended: Message  # what was appended: the result, or a marker plus tool error
    fitted: bool  # the original result fits (possibly after compaction)
    events: tuple[CompactionEvent, ...] = ()


@dataclass(slots=True)
class _TurnState:
    number: int = 0  # real user turns seen
    failures: int = 0  # consecutive failed compactions in this turn
    gave_up: bool = False  # automatic passes stopped for the rest of this turn
    request: Message | None = None  # the user message that started this turn (found in the view by identity)


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
        page_size_tokens: int = 16,
        kv_plan: str = "segments",
        observer: Observer | None = None,
    ) -> None:
        self.config = config if config is not None else CompactConfig()
        self._quiet_line: tuple[CompactConfig | None, int | None] = (None, None)  # see _quiet_line_tokens
        self.counter = counter if counter is not None else load_counter("estimate:deepseek-v4")
        self._accounting = RequestAccounting(self.counter, template)
        # The byte bound of the messages appended since the last count; not 0 exactly when there are
        # some (every message has a frame), so it also says that the accounting is stale.
        self._pending_bound_tokens = 0
        self._extractive = ExtractiveSummarizer(counter=self.counter)  # the default and the fallback
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
        self._turn = _TurnState()
        # The first message the model has not seen yet (appended since the last request), found in
        # the view by identity, so rewrites that move it keep it; None when the model saw it all.
        self._first_unseen: Message | None = None
        self._rewrites = 0  # summary rewrites so far in this session: numbers the messages they write
        self._dumped = 0  # originals already in a history dump
        self._history_id: str | None = None  # archive id of the newest history dump
        self._archive_watermark = 0  # view index before which the turn-start pass has judged every output
        self._archive_params = ArchiveParams.from_config(self.config.minor)
        self._frame_tokens: int | None = None  # see _summary_frame_tokens
        self._tools_bound: tuple[Any, int] | None = None  # (the tools it is for, the bound): _moving_tools_bound_tokens
        self._answer_tokens: list[int] = []  # tokens of each answer so far, sorted (the reserve's percentile)
        self._max_reply_tokens: int | None = None  # the current request's own max_tokens, where it gave one

        # The event log: a session directory, or a buffer a session store commits (ctxfold.store.buffer).
        self.session: Session | BufferedLog | None = session_log
        if session_dir is not None:
            if session_log is not None:
                raise ValueError("give session_dir or session_log, not both")
            self.session = Session(session_dir, durable=durable, fsync_appends=fsync_appends)
        # The archive: given (shared by several sessions, or on object storage), else the session's
        # own directory (or the store's, through the buffer), else memory.
        if store is None:
            store = ArchiveStore(self.session.archive_dir if isinstance(self.session, Session)
                                 else self.session.archive_backend() if self.session is not None
                                 else MemoryBackend())
        self.store = store

        if self.session is not None and self.session.exists():
            resumed = self.session.load()
            self.header = replace(resumed.conversation, messages=[])
            self.originals = resumed.originals
            self.view = resumed.conversation.messages
            self.view_origins = resumed.view_origins
            self._user_turns = _user_turn_indexes(self.view)
            self._load_state(resumed.state)
            self._answer_tokens = sorted(self._answer_size_tokens(m) for m in self.originals
                                         if m.role is Role.ASSISTANT)
            for m in self.view:  # a resumed session: the same rule over the whole view
                self._track_unseen(m)
            self._accounting.reset(self.header, self.view)
        else:
            self.originals = []
            self.view = []
            self.view_origins = []
            self._user_turns = []
            if self.session is not None:
                self.session.create(self.header)
            self._accounting.reset(self.header, [])
            self._ingest(conversation.messages)

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
        reserve = self.config.reply_reserve()
        if self._max_reply_tokens is not None:
            reserve = max(reserve, self._max_reply_tokens)
        answers = self._answer_tokens
        if answers:
            high = answers[min(len(answers) - 1, (95 * len(answers)) // 100)]  # nearest rank
            ctx = self.context_tokens
            reserve = max(reserve, high if ctx is None else min(high, ctx // 2))
        return reserve

    def occupancy_bound_tokens(self, extra: Sequence[Message] = ()) -> int:
        """An upper bound of :meth:`occupancy_tokens` once ``extra`` is appended, without counting
        anything new: the last counted total, plus for every message appended since and every one of
        ``extra`` its UTF-8 bytes (no tokenizer makes a token of less than a byte) and a template frame.
        O(len(extra)). Never below the count, so a bound under a trigger line proves the trigger cannot
        fire (:meth:`quiet`); whether one that may fire does is decided by counting."""
        with self._lock:
            total = self._accounting.total_tokens + self._pending_bound_tokens
        return (total + sum(map(_tokens_bound, extra)) + _RERENDER_FRAME_TOKENS + self._moving_tools_bound_tokens()
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
            n = sum(_utf8_len(p) if isinstance(p, str) else 1 for p in parts)
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
            line: int | None = None
            if ctx is not None:
                line = self._trigger_line_tokens(ctx)
                if self._archive_enabled(mid_turn=True):
                    line = min(line, int(ctx * cfg.minor.mid_turn_token_threshold))
            self._quiet_line = (cfg, line)
        return self._quiet_line[1]

    def archive_due(self, extra: Sequence[Message] = ()) -> bool:
        """Whether the turn-start archive pass may archive something once ``extra`` is appended: the
        window of kept turns slid past a tool output of at least the threshold that the pass has not
        judged yet. Cheap: a backward scan over the kept turns and a length check over what the window
        slid past. True does not mean something will be archived; False means nothing will be."""
        if not self._archive_enabled(mid_turn=False):
            return False
        with self._lock:
            view, n = self.view, len(self.view)
            cutoff = self._turn_start_cutoff(extra)
            lo, hi = self._archive_watermark, max(cutoff, 0)
            return self._worth_archiving(chain(view[lo:min(hi, n)], extra[max(lo - n, 0):max(hi - n, 0)]))

    def _turn_start_cutoff(self, extra: Sequence[Message] = ()) -> int:
        """:func:`turn_start_cutoff` of the view followed by ``extra``, from the index of the view's
        user turns: O(len(extra)), where a scan would walk back through the whole view of an agent's
        conversation (one user turn, hundreds of tool calls) on every request."""
        k = self._archive_params.keep_recent_user_turns
        n = len(self.view)
        turns = self._user_turns  # not copied: a conversation of user turns has hundreds
        new = [n + j for j, m in enumerate(extra) if m.is_user_turn]
        total = len(turns) + len(new)
        if total <= k:
            return -1
        if k == 0:
            return n + len(extra)
        i = total - k  # the k-th newest user turn, of the view's followed by extra's
        return turns[i] if i < len(turns) else new[i - len(turns)]

    def _worth_archiving(self, messages: Iterable[Message]) -> bool:
        """Whether any of ``messages`` is a tool output of at least the archive threshold: the first
        test of the turn-start pass (archive_turn_start), which archives nothing when it fails."""
        threshold = self._archive_params.archive_threshold_chars
        return any(m.role is Role.TOOL and len(m.text) >= threshold for m in messages)

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
            origins = self.view_origins
            for i, origin in enumerate(origins):
                if origin >= first_original:
                    self._first_unseen = self.view[i]
                    return

    def conversation(self) -> Conversation:
        """The current view as a conversation (what the next request sends)."""
        return replace(self.header, messages=list(self.view))

    # -- appending ----------------------------------------------------------------------------------
    def append(self, *messages: Message) -> None:
        """Append messages as they happen (user turns, assistant answers). Tool results should go
        through :meth:`append_tool_result`, which applies the hard trigger."""
        with self._lock:
            self._ingest(messages)

    def append_tool_result(self, result: Message) -> AppendResult:
        """Append one tool result; if it would not fit with the reply reserve, compact and retry once,
        and as the last resort archive it and append a marker with a tool error instead."""
        with self._lock:
            ctx = self.context_tokens
            if ctx is None or not self.config.hard.enabled or self._fits(result):
                self._ingest([result])
                return AppendResult(result, fitted=True)
            events: list[CompactionEvent] = []
            reason = "tool result would exceed context"
            if self._archive_enabled(mid_turn=True):
                ev = self._archive_pass(stage="mid_turn", trigger="hard", reason=reason)
                if ev is not None:
                    events.append(ev)
            if not self._fits(result):
                events.append(self._summary_pass(trigger="hard", reason=reason, mid_turn=not self._at_turn_start()))
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
        a request never leaves over the window while any fit exists (:meth:`_guard`). Where none
        exists, :class:`~ctxfold.errors.NoFitError` is raised here, before the request is sent.
        """
        with self._lock:
            if max_reply_tokens is not None:
                self.expect_reply(max_reply_tokens)
            turn_start = self._at_turn_start()
            if turn_start:
                self._new_turn()
            last: CompactionEvent | None = None
            if not self._turn.gave_up:
                last = self._run_automatic(turn_start, queued)
            queued = [replace(m, queued=True) if not m.queued else m for m in queued]
            shown, guarded = self._guard(turn_start, queued)
            last = guarded or last
            if queued:
                self._ingest(queued, shown=shown)
                if any(a is not b for a, b in zip(queued, shown, strict=True)):
                    self._log_view(self.events[-1])  # the view shows stand-ins: a resumed session must too
            self._first_unseen = None  # the request goes out: the model sees it all
            return last

    # -- the window guard ---------------------------------------------------------------------------
    def _guard(self, turn_start: bool, queued: list[Message]) -> tuple[list[Message], CompactionEvent | None]:
        """Make the request fit the window, whatever the policy and the breaker did: the steps of
        :data:`GUARD_STEPS` in order, each only while the request is still over, every one without a
        model call. Returns what to show for ``queued`` (stand-ins where the oversized step archived
        one) and the last applied event. Raises NoFitError when even the smallest request that keeps
        what must be sent (:meth:`_fit_floor`) is over the window."""
        ctx = self.context_tokens
        if ctx is None or self.occupancy_bound_tokens(queued) <= ctx:
            return queued, None  # even the byte bound fits: nothing to count (the common case)
        if self.occupancy_tokens(queued) <= ctx:
            return queued, None
        floor = self._fit_floor(turn_start, queued)
        if sum(floor.values()) > ctx:
            raise NoFitError(ctx, floor)
        reason = "request over the context window"
        last: CompactionEvent | None = None
        shown = list(queued)
        for step in GUARD_STEPS:
            event: CompactionEvent | None
            if step == "archive_all":
                event = self._archive_pass(stage="all", trigger="guard", reason=reason, guard_step=step)
            elif step == "oversized_message":
                event, shown = self._archive_oversized_messages(ctx, shown, reason)
            elif step == "fold_newest" and turn_start:
                continue  # at a turn start what lies after the summary is the new request alone
            else:
                event = self._summary_pass(trigger="guard", reason=reason, mid_turn=not turn_start, queued=shown,
                                           guard_step=step)
            if event is not None and event.applied:
                last = event
            if self.occupancy_tokens(shown) <= ctx:
                return shown, last
        # Every step ran and the request is over still, though the floor fits: a case the steps do not
        # cover. Refuse it here rather than send it over the window.
        raise NoFitError(ctx, {"request after every compaction step": self.occupancy_tokens(shown)
                               - self.reply_reserve_tokens(), "reply reserve": self.reply_reserve_tokens()},
                         note="ctxfold could not shrink it further; please report this conversation")

    def _fit_floor(self, turn_start: bool, queued: Sequence[Message]) -> dict[str, int]:
        """The smallest request the guard can build, in tokens by part: the system prompt and tools, the
        newest user request and the queued messages (each at the size of its head-and-tail marker when
        that is smaller), the summary's frame and, mid-turn, the resume instruction; and the reply reserve.
        A fit exists when their sum is within the window."""
        acc = self.accounting
        parts = {"system prompt and tools": acc.fixed_tokens}
        request = self._turn.request
        kept = [m for m in self.view[self._unseen_start():] if m.is_user_turn] if turn_start else []
        if not kept and request is not None and (r := self._request_index()) >= 0:
            # Mid-turn every rewrite keeps the turn's request and what was queued after it.
            kept = [request, *(m for m in self.view[r + 1:] if m.queued)]
        if kept:
            parts["newest user request"] = sum(self._smallest_tokens(m) for m in kept)
        if queued:
            parts["queued messages"] = sum(self._smallest_tokens(m) for m in queued)
        parts["summary frame"] = (self._summary_frame_tokens()
                                  + (acc.message_tokens(resume_message(0)) if not turn_start else 0))
        parts["reply reserve"] = self.reply_reserve_tokens()
        return parts

    def _smallest_tokens(self, m: Message) -> int:
        """Tokens of ``m`` as the guard can show it at its smallest: whole, or as its marker."""
        whole = self.accounting.message_tokens(m)
        head, tail = self._oversized_preview_chars()
        marker = make_marker("0" * 64, m.text, head, tail)
        return min(whole, self.accounting.message_tokens(replace(m, content=marker)))

    def _oversized_preview_chars(self) -> tuple[int, int]:
        """(head, tail) characters of an oversized message's preview: the configured preview, shared
        60/40, and at most about a sixteenth of a known window (a character is at least a quarter of a
        token's bytes, so ctx // 4 characters stay well within it)."""
        preview = self.config.minor.archive_preview_chars
        if self.context_tokens is not None:
            preview = min(preview, self.context_tokens // 4)
        return preview * 3 // 5, preview * 2 // 5

    def _archive_oversized_messages(self, ctx: int, queued: list[Message],
                                    reason: str) -> tuple[CompactionEvent | None, list[Message]]:
        """The guard's "oversized_message" step: the largest tool results and user messages of the view
        and of ``queued`` (the newest request too: a huge pasted file, another agent's summary), largest
        first, each archived whole behind a head-and-tail marker, until the request fits."""
        t0 = time.perf_counter()
        before = self.occupancy_tokens(queued)
        head, tail = self._oversized_preview_chars()
        tokens = self.accounting.tokens()
        n = len(self.view)
        candidates = [(int(tokens[i]), i) for i, m in enumerate(self.view)
                      if m.role in (Role.TOOL, Role.USER) and not (m.summary or m.resume)]
        candidates += [(self.accounting.message_tokens(m), n + j) for j, m in enumerate(queued)]
        view, shown = list(self.view), list(queued)
        archived: list[ArchivedOutput] = []
        error: str | None = None
        used = before
        for size, i in sorted(candidates, reverse=True):
            if used <= ctx:
                break
            m = view[i] if i < n else shown[i - n]
            result = archive_whole(m, self.store, head_chars=head, tail_chars=tail, count_tokens=self.counter.count,
                                   index=i)
            error = error or result.report.error
            new = result.messages[0]
            if new is m:
                continue
            if i < n:
                view[i] = new
            else:
                shown[i - n] = new
            archived += [ArchivedOutput(a.message_id, a.archive_id, a.chars_before, a.chars_after)
                         for a in result.report.archived]
            used -= size - self.accounting.message_tokens(new)
        if not archived:
            return None, queued
        unseen = self._unseen_start()
        self._rewrite(view, list(self.view_origins))
        if unseen < len(self.view):  # positions kept; the first unseen one may be a marker now
            self._first_unseen = self.view[unseen]
        event = CompactionEvent(
            kind="archive", trigger="guard", reason=reason, applied=True, tokens_before=before,
            tokens_after=self.occupancy_tokens(shown), archived=tuple(archived), failure=error,
            seconds={"archive": time.perf_counter() - t0}, guard_step="oversized_message",
        )
        self._log_view(event)
        self._record(event)
        return event, shown

    def compact_now(self, reason: str = "manual compaction") -> CompactionEvent:
        """Manual compaction: always a summary pass, even when automatic passes are off."""
        with self._lock:
            return self._summary_pass(trigger="manual", reason=reason, mid_turn=False, manual=True)

    def _run_automatic(self, turn_start: bool, queued: Sequence[Message]) -> CompactionEvent | None:
        cfg = self.config
        last: CompactionEvent | None = None
        if turn_start and self._archive_enabled(mid_turn=False):
            last = self._archive_pass(stage="turn_start", trigger="turn_start",
                                      reason=f"more than {cfg.minor.keep_recent_user_turns} user turns") or last
        ctx = self.context_tokens
        if ctx is None:
            return last  # unknown window: token triggers are skipped
        if self.quiet(queued):
            return last  # not even the byte bound reaches a line: nothing to count (the common case)
        used = self.occupancy_tokens(queued)
        if (not turn_start and self._archive_enabled(mid_turn=True)
                and used >= cfg.minor.mid_turn_token_threshold * ctx):
            last = self._archive_pass(stage="mid_turn", trigger="mid_turn", reason=f"mid-turn occupancy over "
                                      f"{cfg.minor.mid_turn_token_threshold:.0%} of the window") or last
            used = self.occupancy_tokens(queued)
        trigger = self._summary_trigger(used, ctx, turn_start)
        if trigger is not None:
            kind, reason = trigger
            last = self._summary_pass(trigger=kind, reason=reason, mid_turn=not turn_start, queued=queued)
        return last

    def _summary_trigger(self, used: int, ctx: int, turn_start: bool) -> tuple[str, str] | None:
        cfg = self.config
        where = "before user turn" if turn_start else "before tool continuation"
        if cfg.soft.enabled and (used >= ctx * cfg.soft.percent / 100
                                 or ctx - used <= cfg.soft.free_threshold_tokens(ctx)):
            return "soft", f"soft limit {where}"
        if cfg.major.enabled and (turn_start or cfg.major.mid_turn_enabled) and used >= cfg.major.token_threshold * ctx:
            return ("major" if turn_start else "mid_turn"), (f"summary threshold ({cfg.major.token_threshold:.0%} "
                                                             f"of the window) reached {where}")
        return None

    def _archive_enabled(self, *, mid_turn: bool) -> bool:
        minor = self.config.minor
        return minor.enabled and (minor.mid_turn_enabled or not mid_turn)

    # -- passes -------------------------------------------------------------------------------------
    def _archive_pass(self, *, stage: str, trigger: str, reason: str,
                      guard_step: str | None = None) -> CompactionEvent | None:
        """The turn-start pass (``stage="turn_start"``), the mid-turn stage (``"mid_turn"``: all but the
        newest outputs) or the guard's (``"all"``: the newest outputs too)."""
        t0 = time.perf_counter()
        params = self._archive_params
        if stage == "turn_start":
            # Outputs before the previous cutoff were judged at an earlier turn start (archived, or
            # too small): scan only what the window slid past since, so a turn start with nothing
            # to do costs a look at the index of user turns, not a walk through the conversation.
            cutoff = self._turn_start_cutoff()
            lo = self._archive_watermark
            if cutoff <= lo:
                return None
            if not self._worth_archiving(self.view[lo:cutoff]):  # judged: nothing there to archive
                self._archive_watermark = cutoff
                return None
            part = archive_turn_start(self.view[lo:], self.store, params, count_tokens=self.counter.count)
            if part.report.error is None:
                self._archive_watermark = cutoff
            result = ArchivePass(self.view[:lo] + part.messages if part.report.archived else self.view, part.report)
        else:
            if stage == "all":
                params = replace(params, keep_recent_tool_results=0)
            result = archive_mid_turn(self.view, self.store, params, count_tokens=self.counter.count)
        report = result.report
        if not report.archived and report.error is None:
            return None  # nothing to do: no event, no log line
        before = self.occupancy_tokens()
        if report.archived:
            unseen = self._unseen_start()
            self._rewrite(result.messages, list(self.view_origins))
            if unseen < len(self.view):  # the pass keeps positions; the unseen one may be a marker now
                self._first_unseen = self.view[unseen]
        event = CompactionEvent(
            kind="archive", trigger=trigger, reason=reason, applied=bool(report.archived),
            tokens_before=before, tokens_after=self.occupancy_tokens(),
            archived=tuple(ArchivedOutput(a.message_id, a.archive_id, a.chars_before, a.chars_after)
                           for a in report.archived),
            failure=report.error, seconds={"archive": time.perf_counter() - t0}, guard_step=guard_step,
        )
        if report.archived:
            self._log_view(event)
        self._record(event)
        return event

    def _summary_pass(self, *, trigger: str, reason: str, mid_turn: bool, manual: bool = False,
                      queued: Sequence[Message] = (), guard_step: str | None = None) -> CompactionEvent:
        """A summary rewrite: [turn's request,] summary, verbatim tail, what the model has not seen yet.
        The window guard's steps (``guard_step``) write the extractive summary, sized to the room left;
        "shorter_tail" keeps no tail and "fold_newest" summarizes the turn's newest messages too."""
        ctx = self.context_tokens
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        self.observer.compaction_started(reason, "summary")
        before = self.occupancy_tokens(queued)
        # BOTTOM: what arrived since the last request (the new user turn, the latest tool results)
        # has not been seen by the model yet, so it is never summarized unseen (ds4 would): it stays
        # verbatim after the tail. BOTTOM never splits a call group: the calls stay with their results.
        bottom = len(self.view) if guard_step == "fold_newest" else self._unseen_start()
        ledger = self.accounting.ledger
        while 0 < bottom < len(self.view) and (group := ledger.group_start_at(bottom)) < bottom:
            bottom = group
        if (opener := _open_call_group(self.view, bottom)) >= 0:
            bottom = opener  # a call still waiting for its results stays with them
        tokens = self.accounting.tokens()
        flags = self.accounting.flags()
        fresh = int(tokens[:bottom][(flags[:bottom] & SegmentFlag.SUMMARY) == 0].sum())
        # The guard may summarize earlier summaries again, shorter (whether that helps, the rebuilt
        # view's count decides below); the policy does not spend a dump on it.
        if fresh <= 2 * self._summary_frame_tokens() and (guard_step is None or bottom == 0):
            # Only earlier summaries (or nothing) lie before BOTTOM: a new summary cannot shrink the
            # view, so do not spend a dump and a model call on it, and stop trying for this turn.
            return self._failed(trigger, reason, before, "nothing to summarize: what comes before the newest "
                                "messages is too short or already a summary", timings, give_up=True,
                                guard_step=guard_step)

        # The history since the last dump, written before the rewrite (write-ahead) to the session
        # and to the archive, where the model can read it back with read_archive.
        dump = None
        new_originals = self.originals[self._dumped:]
        try:
            if self.session is not None:
                dump = self.session.write_history_dump(new_originals, self.header, first_index=self._dumped,
                                                       previous=self._history_id)
            history_id = self.store.put(history_dump_text(new_originals, self.header, first_index=self._dumped,
                                                          previous=self._history_id))
        except (OSError, ArchiveError) as exc:
            # The dump is the write-ahead record of the rewrite: without it, no rewrite.
            return self._failed(trigger, reason, before, f"cannot write the history dump: {exc}", timings,
                                guard_step=guard_step)
        timings["dump"] = time.perf_counter() - t0

        # What the rebuilt view holds besides summary and tail: the messages after BOTTOM, queued
        # inserts and, mid-turn, the turn's request and the resume instruction.
        besides = int(tokens[bottom:].sum()) + sum(self.accounting.message_tokens(m) for m in queued)
        if mid_turn:
            besides += self.accounting.message_tokens(resume_message(0))
            if 0 <= (r := self._request_index()) < bottom:
                # The turn's request and the messages queued after it stay ahead of the summary.
                besides += int(tokens[r]) + sum(int(tokens[i]) for i in range(r + 1, bottom) if self.view[i].queued)

        t1 = time.perf_counter()
        guard_cap = None
        if guard_step is not None and ctx is not None:
            # The guard's summary takes what the window leaves beside everything else it must hold,
            # and no more than the extractive summary's own cap.
            guard_cap = (ctx - self.accounting.fixed_tokens - besides - self._summary_frame_tokens()
                         - self.reply_reserve_tokens())
            if guard_step != "fold_newest":
                guard_cap //= 2  # the other half for the tail
            guard_cap = max(16, guard_cap)
        summary = self._summarize(bottom, reason, mid_turn, guard_cap_tokens=guard_cap)
        timings["summary"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        budget, room = self._tail_budget(summary.text, besides)
        # Keep at least half of what lies before BOTTOM for the summary to replace: a tail that takes
        # it all would make the rebuilt view larger than the old one (ds4 grows the transcript so).
        half = fresh // 2
        budget, room = min(budget, half), min(room, half)
        if guard_step == "extractive_summary" and ctx is not None:
            budget = room = min(self.config.tail.budget_tokens(ctx), half)  # the policy's own tail
        elif guard_step == "shorter_tail" and ctx is not None:
            # The longest tail the window has room for beside everything else: none, when it has none.
            left = (ctx - self.accounting.fixed_tokens - self.counter.count(summary.text)
                    - self._summary_frame_tokens() - besides - self.reply_reserve_tokens())
            budget = room = max(0, min(self.config.tail.budget_tokens(ctx), half, left))
        elif guard_step == "fold_newest":
            budget = room = 0  # no tail: the summary is all that stays of the turn
        tail = select_tail_from_ledger(self.accounting.ledger, budget_tokens=budget, bottom=bottom)
        while not tail.found and budget < room:
            # Not even the newest call group fits the configured tail: keep the smallest legal tail
            # the rebuilt view has room for, since mid-turn it holds the output the model just asked
            # for. Doubling keeps it small, so the next compaction is not due at once.
            budget = min(2 * max(budget, 1), room)
            tail = select_tail_from_ledger(self.accounting.ledger, budget_tokens=budget, bottom=bottom)
        start, tail_tokens, stand_ins = self._widen_tail(tail, budget)
        timings["tail"] = time.perf_counter() - t2

        summary_msg = Message(
            Role.USER, frame_summary(summary.text, history_id),
            id=f"ctxfold-summary-{self._rewrites}", summary=True, extra={SUMMARY_TEXT_KEY: summary.text},
        )
        new_view: list[Message] = []
        new_origins: list[int] = []
        request_index = self._request_index()
        if mid_turn and 0 <= request_index < start:
            # Mid-turn the turn's own request and the messages the user typed while it ran stay
            # verbatim ahead of the summary (Datus).
            keep = [request_index] + [i for i in range(request_index + 1, start) if self.view[i].queued]
            new_view.extend(self.view[i] for i in keep)
            new_origins.extend(self.view_origins[i] for i in keep)
        new_view.append(summary_msg)
        new_origins.append(-1)
        # An earlier resume instruction has done its job; a new one follows if this is mid-turn.
        kept = [i for i in range(start, len(self.view)) if not self.view[i].resume]
        new_view.extend(stand_ins.get(i, self.view[i]) for i in kept)
        new_origins.extend(self.view_origins[i] for i in kept)
        if mid_turn and _open_call_group(new_view, len(new_view)) < 0:
            # The hidden instruction makes the model resume after the summary. Not while a call is in
            # flight (the hard trigger's case): its results come next and must follow their call.
            new_view.append(resume_message(self._rewrites))
            new_origins.append(-1)

        if self.accounting.alternates_roles:
            keep_turns_alternating(new_view, new_origins, self._rewrites)
        after = self.accounting.count_view(self.header, new_view) + self.reply_reserve_tokens()
        after += sum(self.accounting.message_tokens(m) for m in queued)
        if after >= before:
            return self._failed(trigger, reason, before,
                                f"the rebuilt view would not be smaller ({after} >= {before} tokens)",
                                timings, summary=summary, dump=dump, give_up=True, guard_step=guard_step)
        if guard_step == "extractive_summary" and ctx is not None and after > ctx:
            # Not applied: the next step rewrites the same view with a shorter tail, instead of
            # summarizing this rewrite's summary again.
            return self._failed(trigger, reason, before,
                                f"with the configured tail the request would still be over the window ({after} > "
                                f"{ctx} tokens)", timings, summary=summary, dump=dump, guard_step=guard_step)
        old_view = self.view
        self._archive_watermark = 0  # positions moved: the turn-start pass looks at everything again
        self._rewrites += 1
        self._dumped, self._history_id = len(self.originals), history_id
        self._rewrite(new_view, new_origins)
        kv = self._kv_figures(old_view, new_view)
        timings["total"] = time.perf_counter() - t0
        event = CompactionEvent(
            kind="summary", trigger=trigger, reason=reason, applied=True, tokens_before=before,
            tokens_after=self.occupancy_tokens(queued), summary=summary.text, summarizer=summary.summarizer,
            summary_fallback=summary.fallback_from is not None, summary_failure=summary.fallback_from,
            summary_cut=summary.cut_reason if summary.cut_reason not in ("eos", "none") else None,
            tail_start=start, tail_rule=tail.rule.name.lower() if start == tail.start else "widened",
            tail_tokens=tail_tokens,
            history_dump=str(dump) if dump is not None else None, kv=kv, seconds=timings, guard_step=guard_step,
        )
        if guard_step is None:  # the guard's passes are outside the policy: they leave its breaker alone
            if summary.fallback_from is not None:
                self._turn.failures += 1
            else:
                self._turn.failures = 0
            if (ctx is not None and not manual
                    and self._summary_trigger(event.tokens_after, ctx, not mid_turn) is not None):
                self._turn.gave_up = True  # even the compacted view is over the threshold: stop for this turn
        self._log_view(event)
        self._record(event)
        return event

    # -- pieces of the passes -----------------------------------------------------------------------
    def _summarize(self, bottom: int, reason: str, mid_turn: bool, *, guard_cap_tokens: int | None = None) -> _Summary:
        """The summary of view[:bottom]: the configured summarizer (chunked when even the request
        does not leave room for an answer), else the extractive fallback, which cannot fail. The window
        guard (``guard_cap_tokens``) asks no model: the extractive summary, at most that long."""
        cfg = self.config
        ctx = self.context_tokens
        request = build_summary_request(self.view, bottom, reason=reason, cap_tokens=cfg.summary.max_tokens,
                                        mid_turn=mid_turn, system=self.header.system, tools=self.header.tools)
        failure: str | None = None
        if isinstance(self.summarizer, ExtractiveSummarizer) or guard_cap_tokens is not None:
            pass
        elif self._turn.failures >= cfg.max_consecutive_failures:
            failure = (f"{self._turn.failures} consecutive failures this turn: "
                       f"{self.summarizer.name} is not called again until the next turn")
        else:
            room = None if ctx is None else ctx - self.accounting.count_view(self.header, request.messages) - 1
            primary: Summarizer = self.summarizer
            if room is not None and ctx is not None and room < cfg.summary.min_room_tokens and cfg.summary.chunked:
                primary = ChunkedSummarizer(self.summarizer, window_tokens=ctx, counter=self.counter,
                                            fallback=self._extractive)
            else:
                request = replace(request, room_tokens=room, max_tokens=cfg.summary_max_tokens(room))
            try:
                result = FallbackSummarizer(primary, self._extractive).summarize(
                    request, on_token=self.observer.summary_token, timeout_s=cfg.summary.timeout_s)
            except Exception as exc:  # noqa: BLE001 - a summarizer outside the contract must not stop compaction
                failure = f"{self.summarizer.name} raised {type(exc).__name__}: {exc}"
            else:
                if not result.ok:  # cancelled by the summarizer itself (its caller left): no text to apply
                    failure = f"{result.summarizer}: {result.failure}"
                else:
                    failure = result.primary_failure
                    if failure is not None and result.detail:
                        failure = f"{failure} ({result.detail})"
                    return _Summary(result.text, result.summarizer, result.cut_reason, failure)
        # The extractive summary takes no room in the window (no model writes it), so only the cap
        # binds; an eighth of the window at most, so the rebuilt view keeps room for the tail.
        cap = cfg.summary.max_tokens if ctx is None else max(64, min(cfg.summary.max_tokens, ctx // 8))
        if guard_cap_tokens is not None:
            cap = min(cap, guard_cap_tokens)
        result = self._extractive.summarize(replace(request, max_tokens=cap, cap_tokens=cap),
                                            on_token=self.observer.summary_token)
        return _Summary(result.text, result.summarizer, result.cut_reason, failure)

    def _trigger_line_tokens(self, ctx: int) -> int:
        """The occupancy at which an automatic summary fires; a rebuilt view must stay below it."""
        cfg = self.config
        lines = [ctx]
        if cfg.soft.enabled:
            lines += [int(ctx * cfg.soft.percent / 100), ctx - cfg.soft.free_threshold_tokens(ctx)]
        if cfg.major.enabled:
            lines.append(int(ctx * cfg.major.token_threshold))
        return min(lines)

    def _low_water_tokens(self, ctx: int) -> int:
        """The occupancy a summary's rebuilt view aims under: the low-water mark (summary.low_water of
        the window), and never above the lowest trigger line."""
        return min(self._trigger_line_tokens(ctx), int(ctx * self.config.summary.low_water))

    def _tail_budget(self, summary_text: str, besides_tokens: int) -> tuple[int, int]:
        """(the configured tail budget, the room the rebuilt view leaves for a tail under the
        low-water mark, given the tokens of everything it holds besides summary and tail)."""
        ctx = self.context_tokens
        if ctx is None:
            return self.config.tail.cap_tokens, self.config.tail.cap_tokens
        room = (self._low_water_tokens(ctx) - self.accounting.fixed_tokens - self.counter.count(summary_text)
                - self._summary_frame_tokens() - besides_tokens - self.reply_reserve_tokens())
        room = max(0, room)
        return min(self.config.tail.budget_tokens(ctx), room), room

    def _widen_tail(self, tail: SegmentTail, budget_tokens: int) -> tuple[int, int, dict[int, Message]]:
        """The tail widened by whole groups that fit the budget with their tool results archived
        (:func:`ctxfold.tail.widen_tail`): (start, tokens, view index -> the marker that stands in for
        it). The plain tail, unchanged, when no group before it needs archiving to fit or the archive
        cannot be written."""
        start = tail.start
        if start == 0 or tail.num_tokens >= budget_tokens:
            return start, tail.num_tokens, {}
        tokens = self.accounting.tokens()
        flags = self.accounting.flags()
        archived = tokens.copy()
        head = widened_preview_chars(budget_tokens, self.config.minor.archive_preview_chars)
        # Only the results the budget could reach matter: at least a marker's header each.
        seen = 0
        for i in range(start - 1, -1, -1):
            m = self.view[i]
            if m.role is not Role.TOOL or is_marker(m.text):
                continue
            marker = make_marker(SAMPLE_ARCHIVE_ID, m.text, head)
            if len(marker) < len(m.text):
                archived[i] = min(int(tokens[i]), self.accounting.message_tokens(replace(m, content=marker)))
            seen += 1
            if seen * _MARKER_MIN_TOKENS > budget_tokens:
                break
        wide = widen_tail(tokens, flags, self.accounting.group_starts(), archived, tail=tail,
                          budget_tokens=budget_tokens)
        if not wide.archived:
            return start, tail.num_tokens, {}
        stand_ins: dict[int, Message] = {}
        for i in wide.archived:
            result = archive_whole(self.view[i], self.store, head_chars=head, tail_chars=0,
                                   count_tokens=self.counter.count, index=i)
            if result.report.error is not None:
                return start, tail.num_tokens, {}  # the plain tail: nothing may enter as a marker unwritten
            stand_ins[i] = result.messages[0]
        return wide.start, wide.num_tokens, stand_ins

    def _summary_frame_tokens(self) -> int:
        """Tokens the frame around a summary adds (the pointer to the history dump included), with this
        conversation's counter, plus a message's template frame: counted once."""
        if self._frame_tokens is None:
            self._frame_tokens = self.counter.count(frame_summary("", SAMPLE_ARCHIVE_ID)) + _FRAME_TOKENS
        return self._frame_tokens

    def _fits(self, result: Message) -> bool:
        ctx = self.context_tokens
        if ctx is None or self.occupancy_bound_tokens([result]) <= ctx:
            return True  # even the bound fits: no need to count (the common case, far from the window)
        return self.occupancy_tokens() + self.accounting.message_tokens(result) <= ctx

    def _unseen_start(self) -> int:
        """View index of the first message the model has not seen yet (len(view) when none)."""
        first = self._first_unseen
        if first is not None:
            for i in range(len(self.view) - 1, -1, -1):
                if self.view[i] is first:
                    return i
        return len(self.view)

    def _track_unseen(self, m: Message) -> None:
        """The model has seen everything up to its own latest answer; what follows it is new."""
        if m.role is Role.ASSISTANT:
            self._first_unseen = None
        elif self._first_unseen is None:
            self._first_unseen = m

    def _at_turn_start(self) -> bool:
        return any(m.is_user_turn for m in self.view[self._unseen_start():])

    def _new_turn(self) -> None:
        self._turn.number += 1
        self._turn.failures = 0
        self._turn.gave_up = False

    def _failed(self, trigger: str, reason: str, before: int, why: str, timings: dict[str, float], *,
                summary: _Summary | None = None, dump: Path | None = None, give_up: bool = False,
                guard_step: str | None = None) -> CompactionEvent:
        """Record a summary pass that was not applied. ``give_up``: no retry can do better this turn.
        A manual pass or a step of the window guard that fails leaves the automatic passes alone."""
        if trigger not in ("manual", "guard"):
            self._turn.failures += 1
            if give_up or self._turn.failures >= self.config.max_consecutive_failures:
                self._turn.gave_up = True
        event = CompactionEvent(
            kind="summary", trigger=trigger, reason=reason, applied=False, tokens_before=before,
            tokens_after=before, summary=summary.text if summary else None,
            summarizer=summary.summarizer if summary else None,
            history_dump=str(dump) if dump is not None else None, seconds=timings, failure=why,
            guard_step=guard_step,
        )
        if self.session is not None:
            self.session.log_state({**self._state(), "failure": why})
        self._record(event)
        return event

    def _ingest(self, messages: Iterable[Message], shown: Sequence[Message] | None = None, *, log: bool = True) -> None:
        """Log originals and show them (or their stand-ins) in the view. ``log=False``: the caller has
        logged them already."""
        messages = list(messages)
        shown = messages if shown is None else list(shown)
        first = len(self.originals)
        if log and self.session is not None:  # the log first: memory never holds what the log does not
            self.session.append_messages(messages)
        self.originals.extend(messages)
        for m in messages:
            if m.role is Role.ASSISTANT:
                bisect.insort(self._answer_tokens, self._answer_size_tokens(m))
        for k, m in enumerate(shown):
            self.view.append(m)
            self.view_origins.append(first + k)
            if m.is_user_turn:
                self._turn.request = m
                self._user_turns.append(len(self.view) - 1)
            self._track_unseen(m)
        self._pending_bound_tokens += sum(map(_tokens_bound, shown))

    def _answer_size_tokens(self, m: Message) -> int:
        """What an answer took to write: its text, reasoning and calls (templates drop an old answer's
        reasoning from later requests, but the model wrote it within the reply's budget)."""
        count = self.counter.count
        n = count(m.text) + (count(m.reasoning) if m.reasoning else 0)
        return n + sum(count(c.name) + count(c.arguments) for c in m.tool_calls)

    def _rewrite(self, view: list[Message], origins: list[int]) -> None:
        self.view = view
        self.view_origins = origins
        self._user_turns = _user_turn_indexes(view)
        self._accounting.reset(self.header, view)
        self._pending_bound_tokens = 0

    def _kv_figures(self, old: Sequence[Message], new: Sequence[Message]) -> KvPlanFigures:
        """Reuse of the engine's KV cache across a rewrite: the exact common prefix (page-aligned),
        what must be prefilled again, and what a position-shifting engine could move instead
        (verbatim spans found again after the divergence: approximate)."""
        if self.kv_plan == "tokens":
            plan = plan_kv_resync(self._request_ids(old), self._request_ids(new),
                                  page_size_tokens=self.page_size_tokens, min_shift_tokens=MIN_SHIFT_TOKENS)
            return KvPlanFigures(tokens_reused=plan.reuse_tokens, tokens_to_prefill=plan.prefill_tokens,
                                 tokens_shift_reusable=plan.shifted_tokens, exact=True)
        new_tokens = self.accounting.tokens()
        k = 0
        while k < min(len(old), len(new)) and old[k] is new[k]:
            k += 1
        common = self.accounting.prefix_tokens + int(new_tokens[:k].sum())
        reused = common - common % self.page_size_tokens
        old_ids = {id(m) for m in old[k:]}
        shiftable = int(sum(int(new_tokens[i]) for i in range(k, len(new)) if id(new[i]) in old_ids))
        return KvPlanFigures(tokens_reused=reused, tokens_to_prefill=self.accounting.total_tokens - reused,
                             tokens_shift_reusable=shiftable)

    def _request_ids(self, messages: Sequence[Message]) -> npt.NDArray[np.int32]:
        """The token ids of the request for ``messages``, as a server would tokenize the prompt."""
        rendered = self.accounting.renderer.render(replace(self.header, messages=list(messages)),
                                                   self.accounting.options)
        tokenizer = self.counter.tokenizer  # type: ignore[attr-defined]
        return np.asarray(tokenizer.encode(rendered.text(), add_special_tokens=False).ids, dtype=np.int32)

    def _request_index(self) -> int:
        """View index of this turn's request, -1 when it is not in the view (summarized away)."""
        request = self._turn.request
        if request is not None:
            for i in range(len(self.view) - 1, -1, -1):
                if self.view[i] is request:
                    return i
        return -1

    def _state(self) -> dict[str, Any]:
        return {"turn": self._turn.number, "failures": self._turn.failures, "gave_up": self._turn.gave_up,
                "request_index": self._request_index(), "occupancy_tokens": self.occupancy_tokens(),
                "compactions": len(self.events), "rewrites": self._rewrites, "dumped": self._dumped,
                "history_id": self._history_id}

    def _load_state(self, state: dict[str, Any]) -> None:
        # The turn's request is the last real user turn in the view: turns that arrived after the
        # last logged state are in the view, not in the state.
        request = next((m for m in reversed(self.view) if m.is_user_turn), None)
        self._turn = _TurnState(number=int(state.get("turn", 0)), failures=int(state.get("failures", 0)),
                                gave_up=bool(state.get("gave_up", False)), request=request)
        self._rewrites = int(state.get("rewrites", 0))
        self._dumped = int(state.get("dumped", 0))
        history_id = state.get("history_id")
        self._history_id = history_id if isinstance(history_id, str) else None

    def _log_view(self, event: CompactionEvent) -> None:
        if self.session is None:
            return
        entries = [ViewEntry(o, None if o >= 0 and m is self.originals[o] else m)
                   for m, o in zip(self.view, self.view_origins, strict=True)]
        dump = Path(event.history_dump) if event.history_dump else None
        figures: dict[str, Any] = {"tokens_before": event.tokens_before, "tokens_after": event.tokens_after}
        # Why the configured summarizer did not write this summary, and which guard step ran: in the
        # log, where an operator reading a session finds them.
        if event.summary_failure is not None:
            figures["summary_failure"] = event.summary_failure
        if event.guard_step is not None:
            figures["guard_step"] = event.guard_step
        self.session.log_view(entries, kind=event.kind, reason=event.reason, dump=dump, state=self._state(),
                              figures=figures)

    def _record(self, event: CompactionEvent) -> None:
        self.events.append(event)
        self.observer.compaction_finished(event)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


# Template tokens around one message, at most (role markers, thinking markers, a tool result's frame).
_FRAME_TOKENS = 32
# Appending can re-render the messages of the previous user turn (thinking markers move with the last
# user message): what that can add, at most.
_RERENDER_FRAME_TOKENS = 64


def _user_turn_indexes(view: Sequence[Message]) -> list[int]:
    return [i for i, m in enumerate(view) if m.is_user_turn]


def _tokens_bound(m: Message) -> int:
    """An upper bound of a message's tokens: its UTF-8 bytes plus the template's frame."""
    n = _utf8_len(m.text) + _utf8_len(m.reasoning or "")
    n += sum(_utf8_len(c.name) + _utf8_len(c.arguments) + 16 for c in m.tool_calls)
    return n + _FRAME_TOKENS


def _utf8_len(text: str) -> int:
    # isascii() is O(1) on CPython's compact strings: most texts need no encoding to be measured.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class _Summary:
    text: str
    summarizer: str
    cut_reason: str
    fallback_from: str | None  # why the configured summarizer was not used, when the extractive one stood in


MIN_SHIFT_TOKENS = 16  # the shortest verbatim run worth moving instead of recomputing (llama.cpp --cache-reuse)
# A marker's header alone (the 64-hex id and the recall hint), in tokens, at least.
_MARKER_MIN_TOKENS = 40
# An archive id as a marker or the summary frame's pointer shows one, to size them before anything is
# written: hex digits of a sha256, which tokenize worse than text (about two characters a token).
SAMPLE_ARCHIVE_ID = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def frame_summary(summary: str, history_id: str | None) -> str:
    """The summary as the rebuilt view shows it: framed, with a pointer to the full history."""
    pointer = (f'The conversation before this summary is archived: read_archive("{history_id}") gives it '
               "(JSON lines, one message each; the first line names the earlier part, if any).\n"
               if history_id else "")
    # Frames never nest, whatever a summary holds: lines of an earlier frame inside it are dropped.
    body = "\n".join(line for line in summary.rstrip().splitlines()
                     if not line.lstrip().startswith(("[ctxfold compacted ", "[End of summary.")))
    return f"{FRAME_OPEN}\n{body}\n{pointer}{FRAME_CLOSE}"


def _open_call_group(view: Sequence[Message], end: int) -> int:
    """Index of the assistant message whose calls are still waiting for results in view[:end]
    (the group is open at ``end``), else -1."""
    answered: set[str | None] = set()
    for i in range(end - 1, -1, -1):
        m = view[i]
        if m.role is Role.TOOL:
            answered.add(m.tool_call_id)
        elif m.role is Role.ASSISTANT:
            return i if any(c.id not in answered for c in m.tool_calls) else -1
        # A user message can sit between a call and its results (queued, or typed meanwhile): go on.
    return -1


def keep_turns_alternating(view: list[Message], origins: list[int], n: int) -> None:
    """For a template that wants user and assistant turns to alternate: where a user message ctxfold
    wrote (the summary, the resume instruction) meets another user message, an acknowledgement in the
    assistant's turn goes between them. Part of the summary (flagged so: it is no turn, no tail reaches
    into it, and a later summary carries nothing of it). In place, ``origins`` beside ``view``."""
    i = 1
    while i < len(view):
        if (view[i - 1].role is Role.USER and view[i].role is Role.USER
                and (origins[i - 1] < 0 or origins[i] < 0)):
            view.insert(i, Message(Role.ASSISTANT, SUMMARY_ACKNOWLEDGEMENT, id=f"ctxfold-summary-{n}-ack-{i}",
                                   summary=True, extra={SUMMARY_TEXT_KEY: ""}))
            origins.insert(i, -1)
        i += 1


SUMMARY_ACKNOWLEDGEMENT = "Understood. I will continue from the summary above."


def resume_message(n: int) -> Message:
    """The hidden instruction that ends a mid-turn rebuild, so the model resumes the task."""
    return Message(
        Role.USER,
        "[ctxfold] The conversation above was compacted while you were working. Continue the task from the "
        "summary exactly where it left off: do not ask the user to confirm, do not repeat completed work, and "
        "do not mention the compaction.",
        id=f"ctxfold-resume-{n}", resume=True,
    )


class AsyncCompactor:
    """asyncio variant: the same compactor, its work run in a thread under an asyncio lock."""

    def __init__(self, compactor: Compactor) -> None:
        self.sync = compactor
        self._lock = asyncio.Lock()

    async def before_request(self, queued: Sequence[Message] = ()) -> CompactionEvent | None:
        async with self._lock:
            return await asyncio.to_thread(self.sync.before_request, queued)

    async def append(self, *messages: Message) -> None:
        async with self._lock:
            await asyncio.to_thread(self.sync.append, *messages)

    async def append_tool_result(self, result: Message) -> AppendResult:
        async with self._lock:
            return await asyncio.to_thread(self.sync.append_tool_result, result)

    async def compact_now(self, reason: str = "manual compaction") -> CompactionEvent:
        async with self._lock:
            return await asyncio.to_thread(self.sync.compact_now, reason)
