"""The LangChain middleware in a real ``create_agent`` loop (no network: a scripted agent model, a
deterministic summary model): it compacts under a small window, sends nothing over it, never orphans a
tool result, answers the recall tools (search_archive, read_archive), gives the model the same messages
sync and async, and resumes from its session directory after a restart. Then, on the shared traces, beside SummarizationMiddleware."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest

pytest.importorskip("langchain.agents", reason="the langchain extra is not installed (pip install '.[langchain]')")

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, BaseMessage, FunctionMessage, HumanMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver

from ctxfold.chat.integrity import count_orphans
from ctxfold.chat.messages import Conversation, ToolCall
from ctxfold.compaction.archive import MARKER_PREFIX, answer_read_archive
from ctxfold.integrations.langchain import CtxfoldMiddleware, to_ctxfold, tool_spec
from ctxfold.tokens.accounting import RequestAccounting
from helpers.langchain_helpers import ScriptedModel, SummaryModel, shown

CTX = 8192
SYSTEM = "You are a careful coding agent."
CONFIG: Any = {"configurable": {"thread_id": "t1"}}


@tool
def shell(cmd: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> ToolMessage:
    """Run a shell command and return its output."""
    body = "\n".join(f"{cmd}: line {i} of the output " + "x" * 30 for i in range(25))
    # An id of its own, so two runs of one script hold the same messages (LangGraph would draw a uuid).
    return ToolMessage(content=body, tool_call_id=tool_call_id, id=f"r-{tool_call_id}")


def run_shell(k: int) -> AIMessage:
    return AIMessage(content=f"step {k}", id=f"a{k}",
                     tool_calls=[{"id": f"c{k}", "name": "shell", "args": {"cmd": f"make test-{k}"}}])


def recall_first_marker() -> Any:
    """Turns that run the shell until the model is shown an archived output, then read it back once."""
    recalled: list[int] = []

    def turn(k: int) -> Any:
        def answer(messages: list[BaseMessage]) -> AIMessage:
            marker = next((m.text for m in messages if isinstance(m, ToolMessage)
                           and m.text.startswith(MARKER_PREFIX)), None)
            if marker is None or recalled:
                return run_shell(k)
            recalled.append(k)
            archive_id = re.search(r"id=([0-9a-f]{64})", marker).group(1)  # type: ignore[union-attr]
            return AIMessage(content="", id=f"a{k}", tool_calls=[
                {"id": f"c{k}", "name": "read_archive", "args": {"id": archive_id, "limit": 500}}])
        return answer
    return turn


RecallCall = Callable[[str, int, BaseMessage], tuple[str, dict[str, Any]]]  # (marker id, round, last message)


def after_first_marker(rounds: int, calls: list[RecallCall]) -> list[Any]:
    """Turns that run the shell until the model is shown an archived output (the round whose result it
    was and the marker's id noted), then make ``calls`` one by one, each given the message before it
    (the answer to the previous one), then answer."""
    seen: list[tuple[str, int]] = []

    def turn(k: int) -> Any:
        def answer(messages: list[BaseMessage]) -> AIMessage:
            if not seen:
                marker = next((m for m in messages if isinstance(m, ToolMessage)
                               and m.text.startswith(MARKER_PREFIX)), None)
                if marker is None:
                    return run_shell(k)
                archive_id = re.search(r"id=([0-9a-f]{64})", marker.text).group(1)  # type: ignore[union-attr]
                seen.append((archive_id, int(marker.tool_call_id.removeprefix("c"))))
            if not calls:
                return AIMessage(content="done", id=f"fin{k}")
            name, args = calls.pop(0)(*seen[0], messages[-1])
            return AIMessage(content="", id=f"a{k}", tool_calls=[{"id": f"c{k}", "name": name, "args": args}])
        return answer
    return [turn(k) for k in range(rounds)]


def search_last_line(archive_id: str, k: int, last: BaseMessage) -> tuple[str, dict[str, Any]]:
    return "search_archive", {"query": f"make test-{k}: line 24 of the output"}


def read_at_the_hit(archive_id: str, k: int, last: BaseMessage) -> tuple[str, dict[str, Any]]:
    """read_archive at the first match the search answer gives for the archived output."""
    hit = re.search(rf"^\d+\. id={archive_id} .*\n   at (\d+): ", last.text, re.MULTILINE)
    assert hit is not None, last.text
    return "read_archive", {"id": archive_id, "offset": int(hit.group(1)), "limit": 200}


def answers(state: dict[str, Any], name: str) -> list[ToolMessage]:
    """The tool results answering the calls of ``name``, in order."""
    ids = [str(c["id"]) for m in state["messages"] if isinstance(m, AIMessage) for c in m.tool_calls
           if c["name"] == name]
    by_id = {m.tool_call_id: m for m in state["messages"] if isinstance(m, ToolMessage)}
    return [by_id[i] for i in ids]


def script(rounds: int, *, recall: bool = False, start: int = 0) -> list[Any]:
    """One user turn: ``rounds`` tool rounds, then an answer (ids numbered from ``start``)."""
    make = recall_first_marker() if recall else run_shell
    return [*(make(k) for k in range(start, start + rounds)), AIMessage(content="done", id=f"fin{start}")]


def agent(model: ScriptedModel, middleware: CtxfoldMiddleware, saver: InMemorySaver | None = None) -> Any:
    return create_agent(model, [shell], middleware=[middleware], system_prompt=SYSTEM,
                        checkpointer=saver or InMemorySaver())


def middleware(**kwargs: Any) -> CtxfoldMiddleware:
    return CtxfoldMiddleware(context_tokens=CTX, summarizer=SummaryModel(words=60), **kwargs)


def turn(text: str, n: int) -> dict[str, Any]:
    return {"messages": [HumanMessage(text, id=f"u{n}")]}


def test_compacts_within_the_window_without_orphans() -> None:
    model, mw = ScriptedModel(script=script(16)), middleware()
    agent(model, mw).invoke(turn("fix the failing test", 0), CONFIG)
    kinds = {e.kind for e in mw.events if e.applied}
    assert {"archive", "summary"} <= kinds, kinds
    assert all(e.summarizer in (None, "langchain:SummaryModel") and not e.summary_fallback for e in mw.events)
    c = mw.compactor("t1")
    assert c is not None and len(c.originals) == 1 + 16 * 2  # the state before the last call, in order
    accounting = RequestAccounting(mw.counter, None)
    header = Conversation([], system=SYSTEM, tools=(tool_spec(shell), *map(tool_spec, mw.recall_tools)))
    reserve = mw.config.reply_reserve()
    for seen in model.seen:
        view = [to_ctxfold(m, i) for i, m in enumerate(seen[1:])]  # the system message is the header's
        assert accounting.count_view(header, view) + reserve <= CTX
        assert count_orphans(view) == 0
    assert any(m.additional_kwargs.get("lc_source") == "ctxfold" and "Task state:" in m.text
               for m in model.seen[-1]), "the summary model's summary is in the view"
    # The recall tools are registered with the agent, offered once something was archived.
    assert model.bound[0] == ["shell"] and {"read_archive", "search_archive"} <= set(model.bound[-1])


def test_the_recall_tools_are_counted_even_without_other_tools() -> None:
    mw = middleware()
    mw.compact_messages([HumanMessage("hi", id="u0")], thread_id="t")  # an agent with no tools of its own
    c = mw.compactor("t")
    assert c is not None and [t.name for t in c.header.tools] == ["read_archive", "search_archive"]


def test_recall_tool_answers_an_archived_output() -> None:
    model, mw = ScriptedModel(script=script(12, recall=True)), middleware()
    state = agent(model, mw).invoke(turn("fix the failing test", 0), CONFIG)
    call = next(c for m in state["messages"] if isinstance(m, AIMessage) for c in m.tool_calls
                if c["name"] == "read_archive")
    answer = next(m for m in state["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == call["id"])
    c = mw.compactor("t1")
    assert c is not None
    expected = answer_read_archive(c.store, ToolCall(id=call["id"], name="read_archive",
                                                     arguments=json.dumps(call["args"])))
    assert answer.text == expected.text and answer.status == "success"
    assert "make test-" in answer.text and answer.text.startswith("[read_archive id=")


@pytest.mark.parametrize("run", ["sync", "async"])
def test_search_finds_an_archived_output_and_read_archive_reads_it_back(run: str) -> None:
    model, mw = ScriptedModel(script=after_first_marker(14, [search_last_line, read_at_the_hit])), middleware()
    graph = agent(model, mw)
    state = graph.invoke(turn("fix the failing test", 0), CONFIG) if run == "sync" else \
        asyncio.run(graph.ainvoke(turn("fix the failing test", 0), CONFIG))
    [found], [read] = answers(state, "search_archive"), answers(state, "read_archive")
    query = next(c["args"]["query"] for m in state["messages"] if isinstance(m, AIMessage) for c in m.tool_calls
                 if c["name"] == "search_archive")
    assert found.status == "success" and found.text.startswith(f"[search_archive {json.dumps(query)} (literal")
    # Read back from where the search said the text lies, in the archived output it named.
    header, _, text = read.text.partition("\n")
    assert read.status == "success" and header.startswith("[read_archive id=")
    assert f"id={header.split('id=')[1].split()[0]} tool output" in found.text
    assert text.startswith(query)
    assert "search_archive" in model.bound[-1]


def test_a_search_with_no_match_and_a_bad_regex_are_answers_the_model_reads() -> None:
    def nothing(archive_id: str, k: int, last: BaseMessage) -> tuple[str, dict[str, Any]]:
        return "search_archive", {"query": "no-such-text-in-any-output"}

    def bad_regex(archive_id: str, k: int, last: BaseMessage) -> tuple[str, dict[str, Any]]:
        return "search_archive", {"query": "line (\\d+", "regex": True}

    model, mw = ScriptedModel(script=after_first_marker(14, [nothing, bad_regex])), middleware()
    state = agent(model, mw).invoke(turn("fix the failing test", 0), CONFIG)
    none, bad = answers(state, "search_archive")
    assert none.status == "success" and ": 0 matching texts of " in none.text and "no hits" in none.text
    # Without the regex package (the search extra) a regular expression is refused, as plainly.
    assert bad.status == "error" and ("is not a valid regular expression" in bad.text if
                                      importlib.util.find_spec("regex") else "not installed" in bad.text)
    assert state["messages"][-1].text == "done"  # the agent went on after both


def test_recall_tool_mistakes_are_tool_errors() -> None:
    model, mw = ScriptedModel(script=[
        AIMessage(content="", id="a0", tool_calls=[{"id": "c0", "name": "read_archive", "args": {"id": "nope"}}]),
        AIMessage(content="done", id="fin")]), middleware()
    state = agent(model, mw).invoke(turn("read it", 0), CONFIG)
    answer = state["messages"][-2]
    assert isinstance(answer, ToolMessage) and answer.status == "error" and "is not an archive id" in answer.text


def test_sync_and_async_send_the_same_messages() -> None:
    sync_model, async_model = ScriptedModel(script=script(16)), ScriptedModel(script=script(16))
    sync_mw, async_mw = middleware(), middleware()
    agent(sync_model, sync_mw).invoke(turn("fix the failing test", 0), CONFIG)
    asyncio.run(agent(async_model, async_mw).ainvoke(turn("fix the failing test", 0), CONFIG))
    assert any(e.kind == "summary" and e.applied for e in async_mw.events)
    assert [shown(s) for s in sync_model.seen] == [shown(s) for s in async_model.seen]
    assert sync_model.bound == async_model.bound


def test_resume_after_restart_gives_the_same_view(tmp_path: Path) -> None:
    turns = [turn("fix the failing test", 0), turn("now the docs", 1)]
    whole = ScriptedModel(script=script(12) + script(12, start=12))
    one = middleware(session_dir=tmp_path / "one")
    a = agent(whole, one)
    for t in turns:
        a.invoke(t, CONFIG)

    # The same conversation, with the process "restarted" between the turns: a new middleware (and
    # agent) on the same session directory, the checkpointer's state kept (a persistent one in life).
    split, saver = ScriptedModel(script=script(12) + script(12, start=12)), InMemorySaver()
    before = middleware(session_dir=tmp_path / "two")
    agent(split, before, saver).invoke(turns[0], CONFIG)
    before.close()
    after = middleware(session_dir=tmp_path / "two")
    agent(split, after, saver).invoke(turns[1], CONFIG)

    assert [shown(s) for s in split.seen] == [shown(s) for s in whole.seen]
    c_one, c_after = one.compactor("t1"), after.compactor("t1")
    assert c_one is not None and c_after is not None
    assert c_after.view == c_one.view and c_after.originals == c_one.originals
    assert any(e.applied for e in before.events), "the view resumed is a compacted one"
    assert any(e.applied for e in after.events), "the resumed session goes on compacting"


def test_a_rewritten_state_starts_a_new_session(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    memory = middleware()
    memory.compact_messages([HumanMessage("first", id="u0")], thread_id="t")
    with caplog.at_level(logging.WARNING, "ctxfold.langchain"):
        memory.compact_messages([HumanMessage("other", id="x0")], thread_id="t")
    assert "no longer continue the conversation" in caplog.text
    c = memory.compactor("t")
    assert c is not None and [m.id for m in c.originals] == ["x0"]

    stored = middleware(session_dir=tmp_path)
    stored.compact_messages([HumanMessage("first", id="u0")], thread_id="t")
    stored.compact_messages([HumanMessage("other", id="x0")], thread_id="t")  # kept aside, in this process
    stored.close()
    again = middleware(session_dir=tmp_path)  # and after a restart
    with caplog.at_level(logging.WARNING, "ctxfold.langchain"):
        again.compact_messages([HumanMessage("third", id="y0")], thread_id="t")
    assert "do not continue the session" in caplog.text
    assert (tmp_path / "t.replaced-1").is_dir() and (tmp_path / "t.replaced-2").is_dir()


def test_bad_input_passes_through_named_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    mw = middleware()
    orphan = [HumanMessage("hi", id="u0"), ToolMessage("out", tool_call_id="nowhere", id="r0")]
    with caplog.at_level(logging.WARNING, "ctxfold.langchain"):
        assert mw.compact_messages(orphan, thread_id="a") == orphan
        assert mw.compact_messages(orphan, thread_id="a") == orphan
    assert "'nowhere', which no earlier AIMessage made" in caplog.text
    assert caplog.text.count("nowhere") == 1  # one warning per thread and reason; each request counted
    assert sum(mw.passed_through.values()) == 2

    legacy = [HumanMessage("hi", id="u0"), FunctionMessage(content="x", name="f", id="f0")]
    with caplog.at_level(logging.WARNING, "ctxfold.langchain"):
        assert mw.compact_messages(legacy, thread_id="b") == legacy
    assert "message 1 (FunctionMessage, id 'f0'): a message type ctxfold does not know" in caplog.text


def test_the_summarizer_adapter_runs_sync_and_async() -> None:
    from ctxfold.chat.messages import Message, Role
    from ctxfold.compaction.summarize import build_summary_request
    from ctxfold.integrations.langchain import ChatModelSummarizer

    summarizer = ChatModelSummarizer(SummaryModel(words=20))
    request = build_summary_request([Message(role=Role.USER, content="fix it", id="u")], cap_tokens=200)
    a, b = summarizer.summarize(request), asyncio.run(summarizer.asummarize(request))
    assert a.ok and a.text.startswith("Task state:") and a.summarizer == "langchain:SummaryModel"
    assert (b.ok, b.text, b.cut_reason, b.summarizer) == (a.ok, a.text, a.cut_reason, a.summarizer)


# -- beside SummarizationMiddleware, on the shared traces -------------------------------------------------

def _bench() -> Any:
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_langchain.py"
    spec = importlib.util.spec_from_file_location("bench_langchain_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_side_by_side_on_the_traces(traces_dir: Path) -> None:
    bench = _bench()
    rows = bench.side_by_side(traces_dir, windows=(8192, 16384, 32768))
    print("\n" + bench.table(rows))
    for row in rows:
        if row.middleware == "ctxfold":
            assert row.over_window == 0 and row.orphans == 0, row
