"""Replay a recorded conversation through the compactor and report what it did.

Each assistant message of the recording is one model request. Before it, the messages recorded
since the previous request are appended (tool results through the hard trigger) and the compactor
runs; the recorded answer is then appended as it was recorded. The report holds per-request
occupancy and every compaction event, and the checks that must hold: no request over the window,
no orphaned tool result, and the original rebuilt byte for byte from the session.

The compactor judges every request with its own counter. ``verify=`` counts every request it let
go with a second, exact counter as well (the model's tokenizer and chat template), so a policy that
counts optimistically is caught: ``overflows_verified`` beside ``overflows``. A request where no fit
exists (the compactor raised NoFitError before it) is not sent and is reported apart as unfittable,
with the reason.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxfold.chat.codec import encode_message
from ctxfold.chat.integrity import count_orphans
from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.compaction.compactor import CompactionEvent, Compactor, Observer
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.cost import CompactionCost, PriceTable
from ctxfold.compaction.session import Session
from ctxfold.errors import NoFitError
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import TokenCounter
from ctxfold.tokens.templates import ChatTemplate
from ctxfold.tokens.templates.jinja_loading import JinjaChatTemplate


@dataclass(frozen=True, slots=True)
class RequestPoint:
    """One model request of the replay."""

    index: int  # request number, from 0
    message_index: int  # index in the recording of the assistant message this request produced
    prompt_tokens: int  # tokens of the request as sent (system, tools, view, generation prompt)
    occupancy_tokens: int  # prompt tokens plus the reply reserve
    recorded_prompt_tokens: int | None  # the provider's own count for this request, where recorded
    reply_reserve_tokens: int = 0  # the reserve this request was judged with (Compactor.reply_reserve_tokens)
    verified_prompt_tokens: int | None = None  # the request counted with the verifying counter, where given


@dataclass(frozen=True, slots=True)
class Verifier:
    """A second counter every request of a replay is also counted with: the truth to judge by."""

    counter: TokenCounter
    template: ChatTemplate | JinjaChatTemplate | None = None

    @property
    def name(self) -> str:
        return self.counter.name + (f" + {self.template.name}" if self.template is not None else "")


@dataclass(slots=True)
class ReplayReport:
    """Everything a replay of one conversation measured. ``to_json`` gives the documented report entry."""

    conversation_id: str
    source: str
    context_tokens: int | None
    reply_reserve_tokens: int
    messages: int
    requests: list[RequestPoint] = field(default_factory=list)
    events: list[tuple[int, CompactionEvent]] = field(default_factory=list)  # (request index, event)
    overflows: int = 0  # requests whose occupancy exceeded the window, by the compactor's own count
    overflows_verified: int = 0  # the same by the verifying counter (None in the JSON without one)
    verified_by: str | None = None  # the verifying counter's name
    unfittable: list[tuple[int, str]] = field(default_factory=list)  # (message index, why): no fit existed
    orphans: int = 0  # orphaned tool results seen in any view after a rewrite, and in the final view
    restore_exact: bool = False  # the session restored the recording byte for byte
    min_gain_waits: int = 0  # automatic summaries the minimum-gain rule put off (Compactor.min_gain_waits)
    prices: PriceTable | None = None  # what the cost figures are priced with (the config's cost section)
    seconds: float = 0.0  # wall time of the whole replay
    seconds_in_ctxfold: float = 0.0  # of which spent inside the compactor
    session_dir: str | None = None

    @property
    def peak_occupancy_tokens(self) -> int:
        return max((r.occupancy_tokens for r in self.requests), default=0)

    @property
    def compactions(self) -> dict[str, int]:
        """Applied compactions by kind ("archive", "summary", "last_resort")."""
        return dict(Counter(e.kind for _, e in self.events if e.applied))

    @property
    def tokens_archived(self) -> int:
        return sum(e.tokens_before - e.tokens_after for _, e in self.events if e.applied and e.kind == "archive")

    @property
    def tokens_summarized(self) -> int:
        return sum(e.tokens_before - e.tokens_after for _, e in self.events if e.applied and e.kind == "summary")

    @property
    def requests_between_summaries(self) -> list[int]:
        """Requests from one applied summary to the next (the first counts from the start): how often
        a steady conversation compacts."""
        at = [i for i, e in self.events if e.applied and e.kind == "summary"]
        return [b - a for a, b in zip([0, *at], at, strict=False)]

    @property
    def guard_steps(self) -> dict[str, int]:
        """How often each step of the window guard ran and was applied."""
        return dict(Counter(e.guard_step for _, e in self.events if e.applied and e.guard_step is not None))

    @property
    def kv_tokens_reused(self) -> int:
        return sum(e.kv.tokens_reused for _, e in self.events if e.kv is not None)

    @property
    def kv_tokens_prefilled(self) -> int:
        return sum(e.kv.tokens_to_prefill for _, e in self.events if e.kv is not None)

    @property
    def costs(self) -> list[CompactionCost]:
        """The cost figures of the applied compactions that have them (the summaries)."""
        return [e.cost for _, e in self.events if e.applied and e.cost is not None]

    def cost_totals(self) -> dict[str, Any]:
        """The cost figures summed over the conversation's compactions (ctxfold.compaction.cost)."""
        costs = self.costs
        out: dict[str, Any] = {
            "cache_tokens_written": sum(c.cache_tokens_written for c in costs),
            "saving_tokens": sum(c.saving_tokens for c in costs),
            "summary_prompt_tokens": sum(c.summary_prompt_tokens for c in costs),
            "summary_cached_tokens": sum(c.summary_cached_tokens for c in costs),
            "summary_output_tokens": sum(c.summary_output_tokens for c in costs),
            "min_gain_waits": self.min_gain_waits,
        }
        if self.prices is not None:
            p = self.prices
            inval, save = sum(c.invalidated(p) for c in costs), sum(c.saving(p) for c in costs)
            out["money"] = {"currency": p.currency, "invalidated": round(inval, 6), "saving": round(save, 6),
                            "net": round(save - inval, 6)}
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "conversation": self.conversation_id,
            "source": self.source,
            "context_tokens": self.context_tokens,
            "reply_reserve_tokens": self.reply_reserve_tokens,
            "messages": self.messages,
            "requests": len(self.requests),
            "compactions": self.compactions,
            "peak_occupancy_tokens": self.peak_occupancy_tokens,
            "tokens_archived": self.tokens_archived,
            "tokens_summarized": self.tokens_summarized,
            "overflows": self.overflows,
            "overflows_verified": self.overflows_verified if self.verified_by is not None else None,
            "verified_by": self.verified_by,
            "unfittable": [{"message": i, "reason": why} for i, why in self.unfittable],
            # Every request over the window by either count, with the reply reserve it was judged with.
            "over_window": [{"request": r.index, "message": r.message_index, "occupancy_tokens": r.occupancy_tokens,
                             "verified_prompt_tokens": r.verified_prompt_tokens,
                             "reply_reserve_tokens": r.reply_reserve_tokens}
                            for r in self.requests if self.context_tokens is not None and (
                                r.occupancy_tokens > self.context_tokens or (
                                    r.verified_prompt_tokens is not None
                                    and r.verified_prompt_tokens + r.reply_reserve_tokens > self.context_tokens))],
            "guard_steps": self.guard_steps,
            "requests_between_summaries": self.requests_between_summaries,
            "orphans": self.orphans,
            "restore_exact": self.restore_exact,
            "kv_tokens_reused": self.kv_tokens_reused,
            "kv_tokens_prefilled": self.kv_tokens_prefilled,
            **self.cost_totals(),
            "seconds": round(self.seconds, 4),
            "seconds_in_ctxfold": round(self.seconds_in_ctxfold, 4),
            "occupancy": [r.occupancy_tokens for r in self.requests],
            "events": [
                {"request": i, "kind": e.kind, "trigger": e.trigger, "reason": e.reason, "applied": e.applied,
                 "tokens_before": e.tokens_before, "tokens_after": e.tokens_after, "archived": len(e.archived),
                 "summarizer": e.summarizer, "summary_fallback": e.summary_fallback,
                 "summary_failure": e.summary_failure, "tail_rule": e.tail_rule,
                 "tail_tokens": e.tail_tokens, "failure": e.failure, "guard_step": e.guard_step,
                 "kv_tokens_reused": e.kv.tokens_reused if e.kv else None,
                 "kv_tokens_prefilled": e.kv.tokens_to_prefill if e.kv else None,
                 "cost": e.cost.to_json(self.prices) if e.cost else None}
                for i, e in self.events
            ],
        }


def feed_recorded(compactor: Compactor, message: Message) -> None:
    """Hand one recorded message to ``compactor`` the way an agent loop would: a model request
    (``before_request``) before each assistant message, tool results through the hard trigger."""
    if message.role is Role.ASSISTANT:
        compactor.before_request()
        compactor.append(message)
    elif message.role is Role.TOOL:
        compactor.append_tool_result(message)
    else:
        compactor.append(message)


def default_reply_reserve(conversation: Conversation, count: Callable[[str], int], context_tokens: int | None) -> int:
    """The reply reserve for a replay: the longest recorded answer (what the model really needed),
    at least 256 tokens and at most a quarter of the window."""
    longest = max((count(m.text) + count(m.reasoning or "") + sum(count(c.arguments) for c in m.tool_calls)
                   for m in conversation.messages if m.role is Role.ASSISTANT), default=0)
    reserve = max(256, longest)
    return reserve if context_tokens is None else min(reserve, context_tokens // 4)


def replay_conversation(
    conversation: Conversation,
    *,
    config: CompactConfig,
    make_compactor: Callable[..., Compactor] = Compactor,
    session_dir: str | Path | None = None,
    observer: Observer | None = None,
    on_request: Callable[[RequestPoint], None] | None = None,
    verify: Verifier | None = None,
    **compactor_kwargs: Any,
) -> ReplayReport:
    """Replay ``conversation`` (see the module docstring). Without ``session_dir`` the session lives in
    a temporary directory removed afterwards."""
    if session_dir is None:
        with tempfile.TemporaryDirectory(prefix="ctxfold-replay-") as tmp:
            report = replay_conversation(conversation, config=config, make_compactor=make_compactor,
                                         session_dir=Path(tmp) / "session", observer=observer,
                                         on_request=on_request, verify=verify, **compactor_kwargs)
            report.session_dir = None
            return report
    t_start = time.perf_counter()
    head = Conversation([], id=conversation.id, system=conversation.system, tools=conversation.tools,
                        source_format=conversation.source_format, source=conversation.source, meta=conversation.meta)
    compactor = make_compactor(head, config=config, session_dir=session_dir, durable=False, observer=observer,
                               **compactor_kwargs)
    report = ReplayReport(conversation_id=conversation.id, source=conversation.source,
                          context_tokens=config.context_tokens, reply_reserve_tokens=config.reply_reserve(),
                          messages=len(conversation.messages), session_dir=str(session_dir),
                          verified_by=verify.name if verify is not None else None,
                          prices=PriceTable.from_config(config.cost))
    verifier = None
    if verify is not None:
        verifier = RequestAccounting(verify.counter, verify.template)
        verifier.reset(compactor.header, [])
    in_ctxfold = 0.0
    seen_events = 0
    ctx = config.context_tokens
    try:
        for index, message in enumerate(conversation.messages):
            t0 = time.perf_counter()
            if message.role is Role.ASSISTANT:
                try:
                    compactor.before_request()
                except NoFitError as exc:
                    # Not sent: the recording goes on with the answer the model gave, as it happened.
                    report.unfittable.append((index, str(exc)))
                    report.events.extend((len(report.requests), e) for e in compactor.events[seen_events:])
                    seen_events = len(compactor.events)
                    compactor.append(message)
                    in_ctxfold += time.perf_counter() - t0
                    continue
                in_ctxfold += time.perf_counter() - t0
                point = _record_request(report, compactor, message, index, seen_events, ctx, verifier, observer)
                seen_events = len(compactor.events)
                if on_request is not None:
                    on_request(point)
                t0 = time.perf_counter()
                compactor.append(message)
            else:
                feed_recorded(compactor, message)
            in_ctxfold += time.perf_counter() - t0
        new_events = compactor.events[seen_events:]
        report.events.extend((len(report.requests), e) for e in new_events)
        report.orphans += count_orphans(compactor.view)
        report.min_gain_waits = compactor.min_gain_waits
    except BaseException:
        with contextlib.suppress(OSError):  # the error in flight is the one to report, not a log left unwritten
            compactor.close()
        raise
    compactor.close()  # OSError when the session could not be written: the replay did not keep it
    report.restore_exact = _restore_exact(Path(session_dir), conversation)
    report.seconds = time.perf_counter() - t_start
    report.seconds_in_ctxfold = in_ctxfold
    return report


def _record_request(report: ReplayReport, compactor: Compactor, message: Message, index: int, seen_events: int,
                    ctx: int | None, verifier: RequestAccounting | None, observer: Observer | None) -> RequestPoint:
    """One model request of a replay, after the compactor ran: its point (occupancy, reply reserve, the
    verifying count), the checks on it (over the window, orphans after a rewrite), and the compactions
    that ran before it (``compactor.events`` from ``seen_events``) with their prefill reported."""
    occupancy = compactor.occupancy_tokens()
    reserve = compactor.reply_reserve_tokens()
    verified = None
    if verifier is not None:
        verifier.sync(compactor.view)
        verified = verifier.total_tokens
    point = RequestPoint(
        index=len(report.requests), message_index=index,
        prompt_tokens=occupancy - reserve, occupancy_tokens=occupancy,
        recorded_prompt_tokens=message.usage.prompt_tokens if message.usage else None,
        reply_reserve_tokens=reserve, verified_prompt_tokens=verified,
    )
    report.requests.append(point)
    if ctx is not None and occupancy > ctx:
        report.overflows += 1
    if ctx is not None and verified is not None and verified + reserve > ctx:
        report.overflows_verified += 1
    new_events = compactor.events[seen_events:]
    if any(e.applied for e in new_events):
        report.orphans += count_orphans(compactor.view)
    report.events.extend((point.index, e) for e in new_events)
    if observer is not None:
        # No engine runs in a replay: the plan's prefill is reported as done at once.
        for e in new_events:
            if e.applied and e.kv is not None:
                observer.prefill_progress(e.kv.tokens_to_prefill, e.kv.tokens_to_prefill)
    return point


def _restore_exact(session_dir: Path, original: Conversation) -> bool:
    """Byte-for-byte: the restored messages encode to exactly the original's encoding."""
    restored = Session(session_dir).restore()
    if len(restored.messages) != len(original.messages):
        return False
    return all(encode_message(a) == encode_message(b) for a, b in zip(restored.messages, original.messages, strict=True))

