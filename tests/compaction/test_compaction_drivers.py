"""The compaction core asks for summaries instead of calling a model (ctxfold.compaction.effects): the
synchronous driver (Compactor) and the asyncio one (AsyncCompactor) must give the same views and events,
a summarizer's failure must reach the core as the failure it is, and the window guard never asks a model."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxfold.chat.formats import load
from ctxfold.chat.messages import Conversation, Message, Role, ToolCall
from ctxfold.compaction.archive_pass import archive_pass
from ctxfold.compaction.compactor import AsyncCompactor, Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.effects import SummaryCall, no_calls, run_async, run_sync
from ctxfold.compaction.outcome import settle
from ctxfold.compaction.summarize import (
    CallableSummarizer,
    ExtractiveSummarizer,
    SummaryRequest,
    SummaryResult,
)
from ctxfold.compaction.summary_pass import summary_pass
from ctxfold.demo import demo_conversation
from ctxfold.replay import default_reply_reserve, feed_recorded
from ctxfold.tokens.counting import load_counter

COUNTER = load_counter("estimate:deepseek-v4")


def written_summary(request: SummaryRequest) -> Iterator[str]:
    """A model's summary stand-in that depends on what it was asked: the same request, the same text."""
    digest = hashlib.sha256("".join(m.text for m in request.messages).encode()).hexdigest()[:16]
    yield "## Goals\n- continue the task\n"
    yield f"## State\n- {len(request.messages)} messages summarized ({digest})\n"


def head_of(conv: Conversation) -> Conversation:
    return Conversation([], id=conv.id, system=conv.system, tools=conv.tools)


def config_for(conv: Conversation, ctx: int) -> CompactConfig:
    return CompactConfig.preset("both", context_tokens=ctx,
                                reply_reserve_tokens=default_reply_reserve(conv, COUNTER.count, ctx))


def replay_sync(conv: Conversation, ctx: int) -> Compactor:
    c = Compactor(head_of(conv), config=config_for(conv, ctx), counter=COUNTER,
                  summarizer=CallableSummarizer(written_summary, name="scripted", counter=COUNTER))
    for m in conv.messages:
        feed_recorded(c, m)
    c.before_request()
    return c


async def replay_async(conv: Conversation, ctx: int) -> Compactor:
    c = Compactor(head_of(conv), config=config_for(conv, ctx), counter=COUNTER,
                  summarizer=CallableSummarizer(written_summary, name="scripted", counter=COUNTER))
    driver = AsyncCompactor(c)
    for m in conv.messages:
        if m.role is Role.ASSISTANT:
            await driver.before_request()
            await driver.append(m)
        elif m.role is Role.TOOL:
            await driver.append_tool_result(m)
        else:
            await driver.append(m)
    await driver.before_request()
    return c


def outcome(c: Compactor) -> tuple[object, ...]:
    events = [(e.kind, e.trigger, e.applied, e.tokens_before, e.tokens_after, e.summary, e.summarizer, e.tail_start,
               e.guard_step) for e in c.events]
    return ([(m.role, m.id, m.text) for m in c.view], list(c.view_origins), events)


def same_under_both_drivers(conversations: list[Conversation], ctx: int) -> int:
    """Asserts the drivers agree on every conversation; returns the summaries the model wrote."""
    written = 0
    for conv in conversations:
        sync = replay_sync(conv, ctx)
        assert outcome(asyncio.run(replay_async(conv, ctx))) == outcome(sync), f"{conv.id} at ctx {ctx}"
        written += sum(e.applied and e.summarizer == "scripted" for e in sync.events)
    return written


def test_the_drivers_agree_on_the_demo() -> None:
    conv = demo_conversation()
    assert same_under_both_drivers([conv], 4096) > 0  # the model's summaries went through the effect


@pytest.mark.slow
@pytest.mark.parametrize("ctx", [8192, 32768])
def test_the_drivers_agree_on_every_shared_trace(traces_dir: Path, ctx: int) -> None:
    conversations = [conv for path in sorted(traces_dir.rglob("*"))
                     if path.suffix in (".json", ".jsonl", ".traj") and path.is_file() for conv in load(path)]
    assert same_under_both_drivers(conversations, ctx) > 0


def long_conversation(n: int) -> Conversation:
    messages = [Message(Role.USER, "Fix the parser, please.", id="u0")]
    for k in range(n):
        messages.append(Message(Role.ASSISTANT, f"Reading part {k}.", id=f"a{k}"))
        messages.append(Message(Role.USER, f"part {k}: " + "lorem ipsum dolor sit amet " * 60, id=f"u{k + 1}"))
    return Conversation(messages)


class Raising:
    """A summarizer outside the contract: it raises instead of returning a failed result."""

    name = "raising"

    def summarize(self, *args: object, **kwargs: object) -> SummaryResult:
        raise RuntimeError("model server fell over")

    async def asummarize(self, *args: object, **kwargs: object) -> SummaryResult:
        raise RuntimeError("model server fell over")


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_summarizer_that_raises_is_a_failure_the_core_records(driver: str) -> None:
    """The driver throws the summarizer's exception into the core at its yield: the extractive summary
    stands in, and the event says why."""
    c = Compactor(Conversation([]), config=CompactConfig(context_tokens=65536), counter=COUNTER,
                  summarizer=Raising())  # type: ignore[arg-type]
    c.append(*long_conversation(40).messages)
    event = c.compact_now() if driver == "sync" else asyncio.run(AsyncCompactor(c).compact_now())
    assert event.applied and event.summary_fallback
    assert event.summary_failure == "raising raised RuntimeError: model server fell over"


def test_the_asyncio_driver_awaits_summaries_on_the_loop_and_works_in_a_thread() -> None:
    """The summary is awaited in the loop's thread (no bridge back to it); the core's own work runs in a
    worker thread unless it is asked to run inline."""
    loop_threads: list[int] = []
    core_threads: list[int] = []

    async def generate(request: SummaryRequest) -> object:
        loop_threads.append(threading.get_ident())
        yield "## Goals\n- go on\n"

    c = Compactor(Conversation([]), config=CompactConfig(context_tokens=65536), counter=COUNTER,
                  summarizer=CallableSummarizer(generate, name="async", counter=COUNTER))
    c.append(*long_conversation(40).messages)

    def step() -> object:
        core_threads.append(threading.get_ident())
        event = yield from c.compact_now_step()
        core_threads.append(threading.get_ident())
        return event

    async def main() -> int:
        await run_async(step(), c._lock)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert loop_threads == [loop_thread]
    assert core_threads and loop_thread not in core_threads
    assert c.events[-1].applied and c.events[-1].summarizer == "async"


def test_a_step_that_must_ask_no_model_says_so_when_it_does() -> None:
    def asks() -> object:
        request = SummaryRequest(messages=(), system=None, tools=(), reason="test", max_tokens=8, cap_tokens=8,
                                 room_tokens=None)
        yield SummaryCall(ExtractiveSummarizer(), request, None)

    with pytest.raises(RuntimeError, match="asks no model asked for a summary from extractive"):
        no_calls(asks())  # type: ignore[arg-type]


def test_run_sync_returns_a_steps_outcome_without_calls() -> None:
    def plain() -> object:
        return 42
        yield  # a generator that asks nothing

    assert run_sync(plain()) == 42  # type: ignore[arg-type]
    assert no_calls(plain()) == 42  # type: ignore[arg-type]


def snapshot(c: Compactor) -> tuple[object, ...]:
    """Everything of a compactor a pass could change, by value and by identity."""
    turn = c.state.turn
    return ([id(m) for m in c.view], list(c.view_origins), len(c.events), turn.failures, turn.gave_up,
            c._rewrites, c._dumped, c._history_id, c._archive_watermark, c.occupancy_tokens())


@pytest.mark.parametrize("kind", ["summary", "archive"])
def test_a_pass_only_plans_and_settle_applies_the_plan(kind: str) -> None:
    """A pass reads the compactor and returns its plan (ctxfold.compaction.outcome): the view, the
    turn's breaker, the rewrite's bookkeeping and the event list change only when the plan is settled,
    and settling it gives the view it planned."""
    c = Compactor(Conversation([]), config=CompactConfig.preset("both", context_tokens=65536), counter=COUNTER)
    for m in long_conversation(30).messages:
        c.append(m)
        if m.role is Role.USER:
            c.before_request()
        elif kind == "archive":  # and a bulky tool output after each answer
            call = ToolCall(f"call-{m.id}", "shell", "{}")
            c.append(Message(Role.ASSISTANT, "", id=f"c-{m.id}", tool_calls=(call,)))
            c.append_tool_result(Message(Role.TOOL, "log line\n" * 800, id=f"r-{m.id}", tool_call_id=call.id,
                                         name="shell"))
    before = snapshot(c)
    if kind == "summary":
        planned = run_sync(summary_pass(c, trigger="manual", reason="test", mid_turn=False))
    else:
        planned = archive_pass(c, stage="all", trigger="guard", reason="test")
    assert snapshot(c) == before
    assert planned.event is not None and planned.rewrite is not None
    event = settle(c, planned)
    assert event is not None and event.applied and event.tokens_after < event.tokens_before
    assert c.view == planned.rewrite.view and c.view_origins == planned.rewrite.origins
    assert c.events[-1] is event and snapshot(c) != before
    if kind == "summary":
        assert c._rewrites == before[5] + 1 and event.kv is not None and event.cost is not None
