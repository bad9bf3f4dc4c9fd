"""The compactor: every trigger of both seeds, fail-open behaviour, sessions and resume.

Counts come from the real DeepSeek V4 tokenizer and chat template, so "fits" and "does not fit"
mean what they would mean for that model.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat.integrity import count_orphans, validate
from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.compaction.archive import ArchiveStore, archive_whole, is_archived_text, is_marker, restore
from ctxfold.compaction.archive.store import LocalBackend
from ctxfold.compaction.compactor import AsyncCompactor, CompactionEvent, Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session
from ctxfold.compaction.summarize import CallableSummarizer, OpenAICompatibleSummarizer, SummaryRequest
from ctxfold.errors import LogBacklogError
from ctxfold.tokens.counting import TokenCounter, load_counter
from ctxfold.tokens.templates import get_template
from helpers.scripted_server import ScriptedServer

SYSTEM = "You are a coding agent working in a repository. Use the tools; read before you edit."
TOOLS = (ToolSpec("read", "read lines of a file", {"type": "object", "properties": {
    "path": {"type": "string"}, "start": {"type": "integer"}, "count": {"type": "integer"}}}),)


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return load_counter("deepseek-v4")


def header() -> Conversation:
    return Conversation([], id="t", system=SYSTEM, tools=TOOLS)


def readme_lines(start: int, count: int) -> str:
    return "\n".join(f"{n:4d}  The ds4 engine keeps section {n} of the README about KV cache pages and prefill."
                     for n in range(start, start + count))


def make(counter: TokenCounter, tmp_path: Path | None = None, **cfg: Any) -> Compactor:
    policy = cfg.pop("policy", "both")
    config = CompactConfig.preset(policy, **cfg)
    return Compactor(header(), config=config, counter=counter, template=get_template("deepseek-v4"),
                     session_dir=tmp_path / "session" if tmp_path is not None else None, durable=False)


_ids = iter(range(10**9))


def call(name: str, **args: Any) -> Message:
    cid = f"call_{next(_ids)}"
    return Message(Role.ASSISTANT, "", id=cid + "-m", tool_calls=(ToolCall(cid, name, json.dumps(args)),))


def result(for_call: Message, text: str, **kw: Any) -> Message:
    c = for_call.tool_calls[0]
    return Message(Role.TOOL, text, id=c.id + "-r", tool_call_id=c.id, name=c.name, **kw)


def user(text: str) -> Message:
    return Message(Role.USER, text, id=f"u{next(_ids)}")


def assert_sound(c: Compactor) -> None:
    assert validate(c.view) == [] or count_orphans(c.view) == 0
    assert count_orphans(c.view) == 0
    ctx = c.config.context_tokens
    if ctx is not None:
        assert c.occupancy_tokens() <= ctx


# -- ds4: the hard trigger, the soft trigger, and its validation log --------------------------------------

def test_ds4_validation_log_hard_then_soft(counter: TokenCounter, tmp_path: Path) -> None:
    """--ctx 12000: read README lines 1-500, then 500 more. The second result does not fit: hard
    compaction, the result is appended after it, work goes on. Then, resumed from the session, a
    follow-up question: soft compaction first, and the summary keeps that lines 1-500 were read."""
    c = make(counter, tmp_path, policy="ds4", context_tokens=12000, max_output_tokens=1024)
    c.append(user("Read README.md lines 1-500 and tell me what it says about KV pages."))
    c.before_request()
    first = call("read", path="README.md", start=1, count=500)
    c.append(first)
    r1 = c.append_tool_result(result(first, readme_lines(1, 500)[:21000]))
    assert r1.fitted and not r1.events
    c.before_request()
    second = call("read", path="README.md", start=501, count=500)
    c.append(second)
    big = readme_lines(501, 500)[:29500]
    r2 = c.append_tool_result(result(second, big))
    assert r2.fitted, "the result must be appended after the hard compaction"
    hard = [e for e in r2.events if e.kind == "summary"]
    assert hard and hard[0].applied and hard[0].trigger == "hard"
    assert hard[0].reason == "tool result would exceed context"
    assert c.view[-1].text == big and c.view[-2] is second  # call then its result, verbatim
    assert_sound(c)
    c.before_request()  # the model continues with the second chunk available
    assert_sound(c)
    c.append(Message(Role.ASSISTANT, "Lines 501-1000 continue the KV page section.", id="a-done"))
    c.close()

    # A reusable session: resume it in a new compactor and ask a follow-up question.
    c2 = make(counter, tmp_path, policy="ds4", context_tokens=12000, max_output_tokens=1024)
    assert c2.view == c.view
    c2.append(user("Which lines of README.md have you read so far?"))
    event = c2.before_request()
    assert event is not None and event.kind == "summary" and event.trigger == "soft"
    assert event.reason == "soft limit before user turn"
    assert c2.view[-1].text.startswith("Which lines")  # the new turn stays after the tail
    summary = next(m for m in c2.view if m.summary)
    assert "README.md" in summary.text and "500" in summary.text
    assert_sound(c2)
    restored = Session(tmp_path / "session").restore()
    assert [m.id for m in restored.messages] == [m.id for m in c2.originals]


def test_soft_trigger_free_tokens_rule_on_small_windows(counter: TokenCounter) -> None:
    """ds4: free <= min(8192, ctx/4) fires; at ctx 12000 that is 75% occupancy, not 85%."""
    c = make(counter, policy="ds4", context_tokens=12000, max_output_tokens=512)
    c.append(user("go"))
    c.before_request()
    for k in range(40):
        a = call("read", path="README.md", start=k * 20, count=20)
        c.append(a)
        c.append_tool_result(result(a, readme_lines(k * 20, 20)))
        event = c.before_request()
        if event is not None:
            used = event.tokens_before
            assert event.trigger == "soft" and event.reason == "soft limit before tool continuation"
            assert 12000 - used <= 3000 and used < 0.85 * 12000 + 600
            assert event.tokens_after < event.tokens_before
            assert c.view[-1].resume and c.view[-1].id.startswith("ctxfold-resume")
            return
    pytest.fail("the soft trigger never fired")


def test_hard_trigger_last_resort_archives_what_cannot_fit(counter: TokenCounter, tmp_path: Path) -> None:
    c = make(counter, tmp_path, policy="ds4", context_tokens=6000, max_output_tokens=512)
    c.append(user("dump the log"))
    c.before_request()
    a = call("read", path="build.log", start=1, count=10**6)
    c.append(a)
    huge = readme_lines(1, 2000)  # ~40k tokens: fits in no compaction
    r = c.append_tool_result(result(a, huge))
    assert not r.fitted
    last = r.events[-1]
    assert last.kind == "last_resort" and last.applied
    shown = c.view[-1]
    assert shown.tool_call_id == a.tool_calls[0].id and shown.is_error
    assert "read_archive" in shown.text and is_marker(shown.text.splitlines()[0]) or "read_archive" in shown.text
    assert_sound(c)
    # Nothing is lost: the archive restores the original output, and so does the session.
    assert restore([shown], c.store)[0].text == huge
    assert Session(tmp_path / "session").restore().messages[-1].text == huge


# -- Datus: minor at turn start, mid-turn archive and summary stages, manual ------------------------------

def test_turn_start_minor_archives_outputs_older_than_the_kept_turns(counter: TokenCounter, tmp_path: Path) -> None:
    c = make(counter, tmp_path, policy="datus", context_tokens=200_000)
    outputs = []
    for turn in range(6):
        c.append(user(f"turn {turn}: look at part {turn}"))
        c.before_request()
        a = call("read", path=f"part{turn}.txt")
        c.append(a)
        out = result(a, readme_lines(turn * 100, 60))
        outputs.append(out)
        c.append_tool_result(out)
        c.before_request()
        c.append(Message(Role.ASSISTANT, f"part {turn} read", id=f"done{turn}"))
    c.append(user("turn 6: summarise"))
    event = c.before_request()
    assert event is not None and event.kind == "archive" and event.trigger == "turn_start"
    # Seven real user turns, 4 kept: the outputs of turns 0..2 are older than the 4th most recent
    # user turn (turn 3). Turns 0 and 1 went at the start of turn 5; turn 2 goes now.
    assert {a.message_id for a in event.archived} == {outputs[2].id}
    by_id = {m.id: m for m in c.view}
    for k in range(6):
        shown = by_id[outputs[k].id]
        assert is_marker(shown.text) == (k < 3)
    assert restore(c.view, c.store) == [c.originals[o] for o in c.view_origins]
    assert c.before_request() is None  # idempotent: nothing left to archive
    assert_sound(c)


def test_mid_turn_archive_stage_then_summary_stage(counter: TokenCounter, tmp_path: Path) -> None:
    c = make(counter, tmp_path, policy="datus", context_tokens=16000, max_output_tokens=1024)
    request = user("Refactor the store module; read every part first.")
    c.append(request)
    c.before_request()
    kinds: list[str] = []
    typed = Message(Role.USER, "and keep the public API stable", id="typed", queued=True)
    for k in range(60):
        a = call("read", path=f"store/part{k}.py")
        c.append(a)
        c.append_tool_result(result(a, readme_lines(k * 50, 40)))
        event = c.before_request(queued=[typed] if k == 1 else ())
        if event is not None:
            kinds.append(event.kind)
            if event.kind == "archive":
                assert event.trigger == "mid_turn"
                # the newest keep_recent_tool_results (5) outputs are never archived
                recent = [m for m in c.view if m.role is Role.TOOL][-5:]
                assert not any(is_marker(m.text) for m in recent)
            if event.kind == "summary":
                assert event.trigger == "mid_turn"
                assert c.view[0] is request  # the turn's request stays verbatim, first
                assert c.view[1].id == "typed"  # then what the user typed while the turn ran
                assert c.view[2].summary
                assert c.view[-1].resume  # ends with the hidden continue instruction
                break
        assert_sound(c)
    assert kinds and kinds[0] == "archive" and kinds[-1] == "summary"
    assert_sound(c)


def test_queued_messages_are_counted_and_follow_the_rewrite(counter: TokenCounter) -> None:
    c = make(counter, policy="datus", context_tokens=16000, max_output_tokens=1024)
    c.append(user("start"))
    c.before_request()
    for k in range(30):
        a = call("read", path=f"f{k}")
        c.append(a)
        c.append_tool_result(result(a, readme_lines(k * 50, 40)))
        if c.occupancy_tokens() > 0.85 * 16000:
            break
    q = Message(Role.USER, "also keep the old API", id="q1")
    c.before_request(queued=[q])
    shown = c.view[-1]
    assert shown.id == "q1" and shown.queued and not shown.is_user_turn
    assert_sound(c)


def test_manual_compaction_runs_even_with_automatic_passes_off(counter: TokenCounter) -> None:
    c = make(counter, policy="both", context_tokens=100_000,
             major={"enabled": False}, minor={"enabled": False}, soft={"enabled": False})
    for k in range(8):
        c.append(user(f"question {k}"))
        assert c.before_request() is None
        c.append(Message(Role.ASSISTANT, readme_lines(k * 10, 30), id=f"a{k}"))
    event = c.compact_now()
    assert event.applied and event.trigger == "manual" and event.kind == "summary"
    assert event.tokens_after < event.tokens_before
    assert c.view[0].summary and c.view[-1].id == "a7"


def test_unknown_window_skips_token_triggers_but_not_minor_or_manual(counter: TokenCounter) -> None:
    c = make(counter, policy="both", context_tokens=None)
    for k in range(7):
        c.append(user(f"turn {k}"))
        c.before_request()
        a = call("read", path=f"p{k}")
        c.append(a)
        c.append_tool_result(result(a, readme_lines(k * 1000, 400)))  # huge, but the window is unknown
        c.before_request()
        c.append(Message(Role.ASSISTANT, "ok", id=f"ok{k}"))
    kinds = {e.kind for e in c.events}
    assert kinds == {"archive"}  # the turn-start pass only
    assert c.compact_now().applied


def test_a_rewrite_that_would_not_shrink_is_not_applied(counter: TokenCounter) -> None:
    c = make(counter, context_tokens=100_000)
    c.append(user("hi"))
    c.before_request()
    before = list(c.view)
    event = c.compact_now()
    assert not event.applied and event.failure is not None
    assert c.view == before


def test_gives_up_for_the_turn_when_the_compacted_view_is_still_over(counter: TokenCounter) -> None:
    c = make(counter, policy="ds4", context_tokens=8000, max_output_tokens=512)
    for k in range(3):
        c.append(user(f"q{k}"))
        c.before_request()
        c.append(Message(Role.ASSISTANT, readme_lines(k * 100, 40), id=f"a{k}"))
    c.append(user("Here is the whole file: " + readme_lines(0, 300)[:30000]))  # alone over the soft line
    first = c.before_request()
    assert first is not None and first.applied
    # The summary could not bring the view under the line (the file is the new request, never
    # summarized unseen), so the breaker is set; the guard still made the request fit, by archiving
    # the pasted file behind a marker the model can read back.
    assert [e.trigger for e in c.events] == ["soft", "guard", "guard", "guard"]
    assert c.events[-1].guard_step == "oversized_message" and c.occupancy_tokens() <= 8000
    assert c.before_request() is None  # gave up for this turn: no compaction loop
    c.append(Message(Role.ASSISTANT, "ok", id="ok"))
    for k in range(3):  # a new turn tries again: the policy's own pass, not the guard's
        c.append(user(f"again {k}: " + readme_lines(k * 100, 100)))
        c.before_request()
        c.append(Message(Role.ASSISTANT, "ok", id=f"ok{k}"))
    assert c.events[-1].trigger == "soft" and c.events[-1].applied


# -- fail-open --------------------------------------------------------------------------------------------

class CountingFailures:
    """A summarizer that always fails, and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.inner = CallableSummarizer(self._gen, name="broken")

    def _gen(self, request: SummaryRequest) -> Iterator[str]:
        self.calls += 1
        raise RuntimeError("model server exploded")
        yield ""  # pragma: no cover

    @property
    def name(self) -> str:
        return "broken"

    def summarize(self, request: SummaryRequest, **kw: Any) -> Any:
        return self.inner.summarize(request, **kw)

    async def asummarize(self, request: SummaryRequest, **kw: Any) -> Any:
        return await self.inner.asummarize(request, **kw)


def test_summarizer_failures_fall_back_and_the_breaker_stops_calling_it(counter: TokenCounter) -> None:
    broken = CountingFailures()
    config = CompactConfig.preset("both", context_tokens=100_000)
    c = Compactor(header(), config=config, counter=counter, summarizer=broken)  # type: ignore[arg-type]
    events: list[CompactionEvent] = []
    for k in range(5):
        c.append(user(f"q{k}"))
        c.append(Message(Role.ASSISTANT, readme_lines(k * 100, 50), id=f"a{k}"))
        events.append(c.compact_now())
    assert all(e.applied and e.summary_fallback for e in events)
    assert all(e.summarizer is not None and e.summarizer.startswith("extractive") for e in events)
    assert broken.calls == config.max_consecutive_failures  # then it is not called again this turn
    assert "model server exploded" in (events[0].summary_failure or "")


class CancelsItself:
    """A summarizer that stops itself (its own caller went away) and says so: a failed result."""

    name = "stops"

    def summarize(self, request: SummaryRequest, **kw: Any) -> Any:
        from ctxfold.compaction.summarize.base import failed

        return failed(self.name, "cancelled", 0.0)

    async def asummarize(self, request: SummaryRequest, **kw: Any) -> Any:
        return self.summarize(request)


def test_a_summarizer_that_cancels_itself_never_leaves_an_empty_summary(counter: TokenCounter) -> None:
    config = CompactConfig.preset("both", context_tokens=100_000)
    c = Compactor(header(), config=config, counter=counter, summarizer=CancelsItself())  # type: ignore[arg-type]
    c.append(user("q"))
    c.append(Message(Role.ASSISTANT, readme_lines(0, 50), id="a"))
    event = c.compact_now()
    assert event.applied and event.summary_fallback
    assert event.summarizer is not None and event.summarizer.startswith("extractive")
    assert "cancelled" in (event.summary_failure or "")
    summary = next(m for m in c.view if m.is_summary)
    assert summary.text.strip() and "readme" in summary.text.lower()


class FullDisk(LocalBackend):
    """An archive directory on a disk that fills up and is freed again (``full``)."""

    full = False

    def write_atomic(self, name: str, data: bytes) -> None:
        if self.full:
            raise OSError(28, "No space left on device")
        super().write_atomic(name, data)


class RefusingSessionDisk:
    """Session directories' commits refused (a full disk) while ``full``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = True
        real_commit = Session.commit

        def commit(session: Session, batch: Any) -> None:
            if self.full:
                raise OSError(28, "No space left on device")
            real_commit(session, batch)

        monkeypatch.setattr(Session, "commit", commit)


@pytest.mark.parametrize("with_session", [True, False], ids=["session", "no-session"])
def test_an_archive_given_apart_that_refuses_writes_loses_nothing(counter: TokenCounter, tmp_path: Path,
                                                                  with_session: bool) -> None:
    """An archive given to the compactor (``store=``) is written by the commit after each call, not by
    the passes: while its disk is full the passes still archive and summarize, every marker still
    reads back (from the journal), the session's log waits for the archive (it never names an output
    the archive lacks), and the first commit after the disk is freed writes everything."""
    config = CompactConfig.preset("both", context_tokens=8000, max_output_tokens=512)
    disk = FullDisk(tmp_path / "archive")
    store = ArchiveStore(disk)
    session_dir = tmp_path / "session" if with_session else None

    def compactor() -> Compactor:
        return Compactor(header(), config=config, counter=counter, template=get_template("deepseek-v4"),
                         session_dir=session_dir, durable=False, store=ArchiveStore(disk))

    c = compactor()
    c.append(user("go"))
    c.before_request()
    disk.full = True
    for k in range(30):
        a = call("read", path=f"p{k}")
        c.append(a)
        c.append_tool_result(result(a, readme_lines(k * 50, 30)))
        c.before_request()
    kinds = {e.kind for e in c.events if e.applied}
    assert {"archive", "summary"} <= kinds, kinds
    assert c.unwritten is not None and "No space left" in str(c.unwritten)
    archived = {a.archive_id for e in c.events if e.applied for a in e.archived}
    assert archived and all(c.store.get(aid) for aid in archived)  # read back from the journal
    assert not store.ids()  # nothing reached the full disk
    if with_session:  # the log waits for the archive: it names no archived output the archive lacks
        assert not re.findall(r"[0-9a-f]{64}", (tmp_path / "session" / "events.jsonl").read_text())
    disk.full = False
    c.append(user("the disk has room again"))
    assert c.unwritten is None
    assert archived <= set(store.ids())
    if with_session:
        assert Session(tmp_path / "session").restore().messages == c.originals
        resumed = compactor()
        assert resumed.view == c.view and resumed.view_origins == c.view_origins
        restore(resumed.view, store, strict=True)  # every marker of the resumed view reads from the archive
    c.close()


class WatchedArchive(LocalBackend):
    """An archive directory that records every read and listing it is asked for."""

    def __init__(self, root: Path) -> None:
        self.reads: list[str] = []
        super().__init__(root)

    def exists(self, name: str) -> bool:
        self.reads.append(f"exists {name}")
        return super().exists(name)

    def read_bytes(self, name: str) -> bytes:
        self.reads.append(f"read {name}")
        return super().read_bytes(name)

    def names(self) -> Iterator[str]:
        self.reads.append("names")
        return super().names()


def test_the_compaction_core_never_reads_an_archive_given_apart(counter: TokenCounter, tmp_path: Path) -> None:
    """The passes archive outputs and summarize through the conversation's journal without asking the
    archive given apart anything (not even whether it holds an output: content-addressed, a second write
    holds the same bytes), before and after a restart; its reader (a recall, a restore) reads it."""
    archive = WatchedArchive(tmp_path / "archive")
    archive.reads.clear()  # its own sweep of stale temporary files, when it is opened
    config = CompactConfig.preset("both", context_tokens=8000, max_output_tokens=512)

    def compactor() -> Compactor:
        return Compactor(header(), config=config, counter=counter, template=get_template("deepseek-v4"),
                         session_dir=tmp_path / "session", durable=False, store=ArchiveStore(archive))

    c = compactor()
    c.append(user("go"))
    for k in range(30):
        a = call("read", path=f"p{k}")
        c.before_request()
        c.append(a)
        c.append_tool_result(result(a, readme_lines(k * 50, 30)))
    assert any(e.archived for e in c.events) and any(e.kind == "summary" and e.applied for e in c.events)
    resumed = compactor()
    for k in range(30, 40):
        a = call("read", path=f"p{k}")
        resumed.before_request()
        resumed.append(a)
        resumed.append_tool_result(result(a, readme_lines(k * 50, 30)))
    assert archive.reads == []
    restored = restore(resumed.view, resumed.store, strict=True)
    assert restored == [resumed.originals[o] if o >= 0 else m for m, o in zip(resumed.view, resumed.view_origins,
                                                                           strict=True)]
    first = next(a.archive_id for e in c.events for a in e.archived)
    assert resumed.store.get(first)  # a reader (a recall) reads what the first process archived
    assert archive.reads


def test_a_marker_read_back_after_a_restart_is_never_archived_again(counter: TokenCounter, tmp_path: Path) -> None:
    """The core never asks the archive what it holds; the markers of a view read back are known all the
    same (write-ahead: their outputs were stored before the records that show them), so a marker longer
    than a later preview (an error output's, twice as long) is not archived again as if it were an output."""
    def compactor() -> Compactor:
        return make(counter, tmp_path, context_tokens=100_000)

    c = compactor()
    a = call("run", cmd="pytest")
    failure = result(a, readme_lines(0, 80), is_error=True)
    marker = archive_whole(failure, c.store, head_chars=2000, tail_chars=0).messages[0]
    assert is_marker(marker.text) and len(marker.text) > 2000
    c.append(user("run the tests"), a, marker)
    c.close()
    resumed = compactor()
    assert is_archived_text(marker.text, resumed.store)
    again = archive_whole(resumed.view[-1], resumed.store, head_chars=500, tail_chars=0)
    assert again.messages[0] is resumed.view[-1] and not again.report.archived
    assert restore(resumed.view, resumed.store, strict=True)[-1].text == failure.text


def test_the_asyncio_driver_writes_an_archive_given_apart(counter: TokenCounter, tmp_path: Path) -> None:
    """AsyncCompactor commits after each step as the synchronous driver does, with no session directory
    too: every output its passes archived is in the given archive when the step returns."""
    store = ArchiveStore(tmp_path / "archive")
    config = CompactConfig.preset("both", context_tokens=8000, max_output_tokens=512)
    ac = AsyncCompactor(Compactor(header(), config=config, counter=counter, template=get_template("deepseek-v4"),
                                  store=store))

    async def loop() -> None:
        await ac.append(user("go"))
        for k in range(30):
            a = call("read", path=f"p{k}")
            await ac.append(a)
            await ac.append_tool_result(result(a, readme_lines(k * 50, 30)))
            await ac.before_request()

    asyncio.run(loop())
    archived = {a.archive_id for e in ac.sync.events if e.applied for a in e.archived}
    assert archived and archived <= set(store.ids())


def test_a_session_directory_that_refuses_writes_loses_nothing(counter: TokenCounter, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The disk refuses the session's writes for a while (full): the conversation goes on in memory,
    compactions included, the failure is logged and kept, and the first commit that succeeds writes
    everything in order, so the directory restores and resumes to what memory holds."""
    c = make(counter, tmp_path, policy="both", context_tokens=8000, max_output_tokens=512)
    c.append(user("go"))
    c.before_request()
    disk = RefusingSessionDisk(monkeypatch)
    for k in range(30):
        a = call("read", path=f"p{k}")
        c.append(a)
        c.append_tool_result(result(a, readme_lines(k * 50, 30)))
        c.before_request()
    assert any(e.applied for e in c.events), "the conversation compacted while the disk was full"
    assert c.unwritten is not None and "No space left" in str(c.unwritten)
    assert sum("cannot be written" in r.message for r in caplog.records) == 1  # said once, not per call
    with pytest.raises(OSError, match="No space left"):
        c.flush()
    disk.full = False
    c.append(user("the disk has room again"))
    assert c.unwritten is None
    assert "written again" in caplog.text
    assert Session(tmp_path / "session").restore().messages == c.originals
    resumed = make(counter, tmp_path)
    assert resumed.view == c.view and resumed.view_origins == c.view_origins
    c.close()


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_what_waits_for_a_refusing_session_directory_is_bounded(counter: TokenCounter, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, driver: str) -> None:
    """While the disk refuses the session's writes, what waits in memory grows only to its bound: past it,
    a call tries the commit, and while it is still refused raises LogBacklogError before it changes
    anything; once the disk has room the same call goes through and the directory holds everything."""
    config = CompactConfig.preset("both", context_tokens=8000, max_output_tokens=512)
    c = Compactor(header(), config=config, counter=counter, template=get_template("deepseek-v4"),
                  session_dir=tmp_path / "session", durable=False, max_unwritten_bytes=20_000)
    disk = RefusingSessionDisk(monkeypatch)
    c.append(user("go"))
    refused = None
    for k in range(40):
        a = call("read", path=f"p{k}")
        try:
            if driver == "sync":
                c.before_request()
            else:
                asyncio.run(AsyncCompactor(c).before_request())
            c.append(a)
            c.append_tool_result(result(a, readme_lines(k * 50, 30)))
        except LogBacklogError as e:
            refused = e
            break
    assert refused is not None and "No space left" in str(refused) and "20,000 bytes bound" in str(refused)
    assert c._log.unwritten_nbytes > 20_000
    view, originals, events = list(c.view), list(c.originals), len(c.events)
    with pytest.raises(LogBacklogError, match="nothing is lost"):
        c.append(user("still full"))
    assert (c.view, c.originals, len(c.events)) == (view, originals, events)  # the refused call did nothing
    disk.full = False
    c.append(user("the disk has room again"))
    assert c.unwritten is None
    assert Session(tmp_path / "session").restore().messages == c.originals
    c.close()


@pytest.mark.parametrize("bound", [0, -5, "64", 1.5, True])
def test_a_backlog_bound_that_is_not_a_number_of_bytes_is_refused(counter: TokenCounter, bound: Any) -> None:
    with pytest.raises(ValueError, match="max_unwritten_bytes must be a whole number of bytes >= 1"):
        Compactor(header(), counter=counter, max_unwritten_bytes=bound)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_step_admitted_under_the_bound_is_never_refused_halfway(counter: TokenCounter, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, driver: str) -> None:
    """A request step appends several messages; once admitted it runs to its end even when what it
    logs takes the backlog over the bound (a refusal halfway would leave some of its messages in and
    say nothing was done): the next call is the one refused, before it changes anything."""
    c = Compactor(header(), config=CompactConfig.preset("both", context_tokens=100_000), counter=counter,
                  template=get_template("deepseek-v4"), session_dir=tmp_path / "session", durable=False,
                  max_unwritten_bytes=2000)
    disk = RefusingSessionDisk(monkeypatch)
    a = call("read", path="p")
    new = [user("u" * 5000), a, result(a, "r"), user("after")]
    if driver == "sync":
        c.run(c.request_step(new))
    else:
        asyncio.run(AsyncCompactor(c).run(c.request_step(new)))
    assert c.originals[-4:] == new
    assert c._log.unwritten_nbytes > 2000
    with pytest.raises(LogBacklogError):
        c.append(user("refused"))
    assert c.originals[-1] is new[-1]
    disk.full = False
    c.append(user("the disk has room again"))
    assert Session(tmp_path / "session").restore().messages == c.originals


# -- the HTTP summarizer on loopback, through the compactor ------------------------------------------------

@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    s = ScriptedServer()
    yield s
    s.close()


def test_summary_written_by_a_model_over_http_streams_to_the_observer(counter: TokenCounter,
                                                                      server: ScriptedServer) -> None:
    server.bodies.clear()
    server.handler = server.stream_pieces(["Goal: read README.md. ", "Read lines 1-500. ", "Next: 501-1000."])
    seen: list[str] = []

    class Ui:
        def compaction_started(self, reason: str, kind: str) -> None:
            seen.append(f"start:{kind}")

        def summary_token(self, text: str) -> None:
            seen.append(text)

        def compaction_finished(self, event: CompactionEvent) -> None:
            seen.append(f"end:{event.applied}")

        def prefill_progress(self, done_tokens: int, total_tokens: int) -> None:
            pass

    summ = OpenAICompatibleSummarizer(server.url, "m", api_key="k")
    config = CompactConfig.preset("both", context_tokens=100_000)
    c = Compactor(header(), config=config, counter=counter, summarizer=summ, observer=Ui())
    for k in range(4):
        c.append(user(f"q{k}"))
        c.append(Message(Role.ASSISTANT, readme_lines(k * 100, 50), id=f"a{k}"))
    event = c.compact_now("manual")
    assert event.applied and not event.summary_fallback
    assert event.summary == "Goal: read README.md. Read lines 1-500. Next: 501-1000."
    assert seen[0] == "start:summary" and seen[-1] == "end:True" and "Read lines 1-500. " in seen
    body = server.bodies[-1]
    # The request is the conversation so far plus one internal user message: a cached prefix.
    assert body["stream"] is True and body["messages"][0]["content"] == SYSTEM
    assert [m["content"] for m in body["messages"][1:-1]][:2] == ["q0", readme_lines(0, 50)]
    assert "durable" in body["messages"][-1]["content"].lower() and body["messages"][-1]["role"] == "user"


def test_http_500_falls_back_to_the_extractive_summary(counter: TokenCounter, server: ScriptedServer) -> None:
    server.handler = server.error(500, '{"error": {"message": "boom"}}')
    summ = OpenAICompatibleSummarizer(server.url, "m", api_key="k")
    c = Compactor(header(), config=CompactConfig.preset("both", context_tokens=100_000), counter=counter,
                  summarizer=summ)
    for k in range(4):
        c.append(user(f"q{k}"))
        c.append(Message(Role.ASSISTANT, readme_lines(k * 100, 50), id=f"a{k}"))
    event = c.compact_now()
    assert event.applied and event.summary_fallback and "500" in (event.summary_failure or "")


# -- concurrency and asyncio -------------------------------------------------------------------------------

def test_threads_share_one_compactor_safely(counter: TokenCounter) -> None:
    c = make(counter, context_tokens=50_000)
    c.append(user("go"))

    def worker(w: int) -> None:
        for k in range(20):
            a = call("read", path=f"w{w}-{k}")
            c.append(a)
            c.append_tool_result(result(a, readme_lines(k, 10)))
            c.before_request()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count_orphans(c.view) == 0
    assert len(c.originals) == 1 + 4 * 20 * 2
    assert c.accounting.total_tokens == c.accounting.count_view(c.header, c.view)


def test_async_variant(counter: TokenCounter) -> None:
    async def main() -> CompactionEvent:
        ac = AsyncCompactor(make(counter, context_tokens=100_000))
        for k in range(4):
            await ac.append(user(f"q{k}"), Message(Role.ASSISTANT, readme_lines(k * 100, 50), id=f"a{k}"))
            await ac.before_request()
        return await ac.compact_now()

    assert asyncio.run(main()).applied


# -- the KV plan over token ids ------------------------------------------------------------------------------

def test_token_level_kv_plan_agrees_with_the_accounting(counter: TokenCounter) -> None:
    config = CompactConfig.preset("both", context_tokens=100_000)
    c = Compactor(header(), config=config, counter=counter, template=get_template("deepseek-v3.2"),
                  kv_plan="tokens", page_size_tokens=16)
    seg = Compactor(header(), config=config, counter=counter, template=get_template("deepseek-v3.2"))
    turns = [(user(f"q{k}"), Message(Role.ASSISTANT, readme_lines(k * 100, 50), id=f"a{k}")) for k in range(6)]
    for comp in (c, seg):
        for turn in turns:
            comp.append(*turn)
            comp.before_request()
    exact, approx = c.compact_now().kv, seg.compact_now().kv
    assert exact is not None and approx is not None and exact.exact and not approx.exact
    # The ids a server would tokenize add up to what the accounting counted, message by message.
    assert exact.tokens_reused + exact.tokens_to_prefill == c.accounting.total_tokens
    assert exact.tokens_reused % 16 == 0 and exact.tokens_reused >= c.accounting.prefix_tokens - 16
    assert exact.tokens_to_prefill == approx.tokens_to_prefill
    assert exact.tokens_shift_reusable > 0  # the verbatim tail could be moved by a shifting engine


def test_token_level_kv_plan_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="kv_plan='tokens' needs a tokenizer.json counter"):
        Compactor(header(), counter=load_counter("estimate:deepseek-v4"), template=get_template("deepseek-v3.2"),
                  kv_plan="tokens")


def test_repeated_compactions_carry_the_summary_without_nesting(counter: TokenCounter) -> None:
    c = make(counter, context_tokens=100_000)
    for k in range(5):
        c.append(user(f"goal {k}: fix module{k}.py"), Message(Role.ASSISTANT, readme_lines(k * 100, 40), id=f"a{k}"))
        assert c.compact_now().applied or k == 0
    summary = c.view[0].text
    assert summary.count("Summary of the earlier conversation") == 1
    assert summary.count("## Earlier summary") <= 1
    assert "module0.py" in summary  # the first goal survives four rewrites


def test_the_model_can_read_the_history_behind_a_summary(counter: TokenCounter, tmp_path: Path) -> None:
    """Each summary points at the history since the previous one, in the archive, readable with the
    recall tool; following the chain gives back every message, each dump written once."""
    from ctxfold.chat.codec import decode_message
    from ctxfold.compaction.archive import read_archive

    c = make(counter, tmp_path, context_tokens=100_000)
    for k in range(3):
        c.append(user(f"goal {k}"), Message(Role.ASSISTANT, readme_lines(k * 100, 40), id=f"a{k}"))
        assert c.compact_now().applied
    pointer = c.view[0].text.split('read_archive("')[1].split('")')[0]
    history: list[Message] = []
    while pointer:
        answer = read_archive(c.store, {"id": pointer, "offset": 0, "limit": 100_000})  # what the model gets
        header, *records = [json.loads(x) for x in answer.splitlines() if x.startswith("{")]
        history = [decode_message(r) for r in records] + history
        pointer = header["previous"]
    assert [m.id for m in history] == [m.id for m in c.originals]
    assert len(list((tmp_path / "session" / "history").iterdir())) == 3


def test_before_request_far_from_the_window_measures_only_what_is_new(counter: TokenCounter,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing fires: the trigger check is O(new messages), whatever the length of the conversation."""
    import ctxfold.compaction.compactor as compactor_module

    c = make(counter, context_tokens=1_000_000)
    c.append(*[user(f"question {k}") for k in range(300)])
    c.before_request()
    c.before_request()  # counted once; from here on only new messages are measured
    measured: list[Message] = []
    real = compactor_module.tokens_bound
    monkeypatch.setattr(compactor_module, "tokens_bound", lambda m: measured.append(m) or real(m))
    for k in range(5):
        c.append(user(f"follow-up {k}"))
        assert c.before_request() is None
    assert len(measured) == 5
    assert c.occupancy_tokens() <= c.occupancy_bound_tokens()


def test_archive_due_only_when_an_output_worth_archiving_slid_behind_the_kept_turns(counter: TokenCounter,
                                                                                     tmp_path: Path) -> None:
    c = make(counter, tmp_path, context_tokens=1_000_000, minor={"keep_recent_user_turns": 1})
    for k in range(6):  # a chat: many turns, no tool output
        c.append(user(f"question {k}"), Message(Role.ASSISTANT, f"answer {k}"))
        assert not c.archive_due([user(f"question {k + 1}")])
        c.before_request()
    tool_call = call("read", path="README.md", start=1, count=400)
    # The output and the turn that slides past it may both be among the messages still to come.
    assert c.archive_due([tool_call, result(tool_call, readme_lines(1, 400)), user("next question")])
    c.append(tool_call, result(tool_call, readme_lines(1, 400)))
    assert not c.archive_due()  # the output is in the newest turn: kept
    assert c.archive_due([user("next question")])  # a new turn slides the window past it
    c.append(user("next question"))
    c.before_request()  # the turn-start pass archives it
    assert [e.kind for e in c.events if e.applied] == ["archive"]
    assert not c.archive_due([Message(Role.ASSISTANT, "ok"), user("and another")])  # judged already


def test_quiet_holds_until_a_line_could_be_reached_and_follows_a_new_window(counter: TokenCounter) -> None:
    c = make(counter, context_tokens=100_000)
    c.append(user("word " * 2_000))  # 10,000 bytes: far below every line of a 100k window
    assert c.quiet() and c.before_request() is None
    assert not c.quiet([user("word " * 20_000)])  # 100,000 more bytes could reach a line: counting decides
    c.config = replace(c.config, context_tokens=12_000)  # the proxy's calibration replaces the config
    assert not c.quiet()
    c.config = replace(c.config, context_tokens=None)
    assert c.quiet([user("word " * 20_000)])  # no known window: no token trigger


# -- hysteresis: a rewrite lands at the low-water mark, not at the trigger line ---------------------------------

@pytest.mark.parametrize("low_water", [0.6, 0.8])
def test_a_summary_rewrite_lands_under_the_low_water_mark(counter: TokenCounter, low_water: float) -> None:
    from ctxfold.demo import demo_conversation
    from ctxfold.replay import replay_conversation

    ctx = 16384
    cfg = CompactConfig.preset("both", context_tokens=ctx, reply_reserve_tokens=1024)
    cfg = replace(cfg, summary=replace(cfg.summary, low_water=low_water))
    report = replay_conversation(demo_conversation(), config=cfg, counter=counter)
    summaries = [e for _, e in report.events if e.applied and e.kind == "summary"]
    assert summaries and all(e.tokens_after <= low_water * ctx for e in summaries)
    gaps = report.requests_between_summaries
    assert len(gaps) == len(summaries) and min(gaps) >= 3  # not a compaction on every request
    if low_water == 0.6:
        assert report.overflows == 0 and report.restore_exact
