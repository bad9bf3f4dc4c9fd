"""Malformed input: a FormatError that names the file, the line or index, and what was expected."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ctxfold.chat import formats
from ctxfold.chat.messages import Role
from ctxfold.errors import FormatError

CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}


def _write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def test_truncated_json_names_file_line_and_expectation(tmp_path: Path) -> None:
    text = json.dumps([{"role": "user", "content": "hi"}, CALL, RESULT], indent=1)
    p = _write(tmp_path, "cut.json", text[: len(text) // 2])
    with pytest.raises(FormatError) as e:
        formats.load(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}, line ")
    assert "invalid JSON" in msg and "expected one JSON document" in msg


def test_truncated_last_jsonl_line_names_that_line(tmp_path: Path) -> None:
    lines = [json.dumps({"role": "user", "content": "hi"}), json.dumps(CALL), json.dumps(RESULT)[:-7]]
    p = _write(tmp_path, "cut.jsonl", "\n".join(lines))
    with pytest.raises(FormatError, match=r"cut\.jsonl, line 3: invalid JSON.*expected one complete JSON value"):
        formats.load(p)
    # Lenient: the broken line is skipped and counted; the rest loads.
    report = formats.read_path(p, lenient=True)
    assert len(report.skipped) == 1 and "line 3" in report.skipped[0]
    (conv,) = report.conversations
    assert [m.role for m in conv.messages] == [Role.USER, Role.ASSISTANT]
    assert conv.meta["skipped_records"] == 1


def test_wrong_types_name_the_message_and_field() -> None:
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 42}]
    with pytest.raises(FormatError, match=r"<string>, message 1: 'content' is a JSON number; expected an array"):
        formats.loads(json.dumps(bad), "openai")
    bad_call = [{"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": 7, "arguments": "{}"}}]}]
    with pytest.raises(FormatError, match=r"message 0: 'tool_calls'\[0\].function.name is a JSON number; expected a st"):
        formats.loads(json.dumps(bad_call), "openai")
    with pytest.raises(FormatError, match=r"<string>, document: 'messages' is a JSON object; expected an array"):
        formats.loads(json.dumps({"messages": {"role": "user"}}), "openai")


def test_unknown_role_lists_the_roles_expected() -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
    with pytest.raises(FormatError) as e:
        formats.loads(json.dumps(msgs), "openai", source="chat.json")
    assert str(e.value) == ("chat.json, message 1: unknown 'role' 'robot'; expected one of system, developer, "
                            "user, assistant, tool")
    (conv,) = formats.loads(json.dumps(msgs), "openai", lenient=True)
    assert len(conv.messages) == 1 and conv.meta["skipped_records"] == 1


def test_result_without_call_is_an_error_where_the_api_requires_pairing() -> None:
    msgs = [{"role": "user", "content": "hi"}, RESULT]
    with pytest.raises(FormatError, match=r"message 1: tool result for call 'c1' has no earlier assistant"):
        formats.loads(json.dumps(msgs), "openai")
    anth = {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]}
    with pytest.raises(FormatError, match=r"message 0: tool result for call 'toolu_9'"):
        formats.loads(json.dumps(anth), "anthropic")
    (conv,) = formats.loads(json.dumps(msgs), "openai", lenient=True)
    assert [m.role for m in conv.messages] == [Role.USER]


def test_tool_message_without_call_id_says_what_is_missing() -> None:
    with pytest.raises(FormatError, match="tool message has no 'tool_call_id'; expected the id of the call"):
        formats.loads(json.dumps([{"role": "tool", "content": "x"}]), "openai")


def test_invalid_utf8_names_the_byte_and_line(tmp_path: Path) -> None:
    good = json.dumps({"role": "user", "content": "hi"}).encode()
    bad = b'{"role": "user", "content": "caf\xe9"}'
    p = _write(tmp_path, "latin1.jsonl", good + b"\n" + bad + b"\n" + good)
    with pytest.raises(FormatError) as e:
        formats.load(p)
    assert str(e.value).startswith(f"{p}, line 2: invalid UTF-8 at byte {len(good) + 1 + 32}")
    assert "expected a UTF-8 encoded" in str(e.value)
    report = formats.read_path(p, lenient=True)
    assert len(report.skipped) == 1 and "line 2" in report.skipped[0]
    assert len(report.conversations[0].messages) == 2


def test_a_50_mb_message_loads_in_linear_time() -> None:
    big = "x" * (50 * 1024 * 1024)
    data = json.dumps([{"role": "user", "content": "read it"}, CALL,
                       {"role": "tool", "tool_call_id": "c1", "content": big}]).encode()
    t0 = time.perf_counter()
    (conv,) = formats.loads(data)
    elapsed_s = time.perf_counter() - t0
    assert conv.messages[2].content == big
    assert elapsed_s < 5.0  # json.loads of 50 MB takes ~0.1 s; anything quadratic would take minutes
    # Truncated in the middle of the big string: a clear error, not a hang.
    with pytest.raises(FormatError, match=r"line 1: invalid JSON: Unterminated string"):
        formats.loads(data[: len(data) // 2])


def test_unknown_shape_and_unknown_format_name() -> None:
    with pytest.raises(FormatError, match="cannot tell which trace format this is; expected one of openai"):
        formats.loads(json.dumps({"hello": "world"}))
    with pytest.raises(FormatError, match="unknown format 'chatml'; expected one of openai, anthropic"):
        formats.loads("[]", "chatml")
    with pytest.raises(FormatError, match=r"line 1: starts with 'hello'; expected a JSON object or array"):
        formats.loads("hello")
    with pytest.raises(FormatError, match="empty input"):
        formats.loads(b"")
    with pytest.raises(FormatError, match="cannot read the file"):
        formats.load("/nonexistent/trace.json")


def test_detection_reads_the_content_not_the_extension(tmp_path: Path, synthetic_traces_dir: Path) -> None:
    src = synthetic_traces_dir / "claude_code" / "session.jsonl"
    p = _write(tmp_path, "session.txt", src.read_bytes())
    assert formats.detect_format(p.read_bytes()) == "claude_code"
    assert formats.load(p)[0].id == formats.load(src)[0].id
    anth = {"system": "be brief", "messages": [{"role": "user", "content": "hi"}]}
    assert formats.detect_format(json.dumps(anth)) == "anthropic"
    assert formats.detect_format(json.dumps([CALL, RESULT])) == "openai"
    assert formats.detect_format("\n".join(json.dumps(m) for m in [CALL, RESULT])) == "openai"


def test_lenient_skips_bad_records_inside_a_real_format() -> None:
    runs = [{"task_id": 1, "trial": 0, "traj": [{"role": "user", "content": "hi"}]},
            {"task_id": 2, "trial": 0, "traj": "not a list"}]
    with pytest.raises(FormatError, match=r"index 1: 'traj' is a JSON string; expected an array"):
        formats.loads(json.dumps(runs), "tau_bench")
    report = formats.read(json.dumps(runs), "tau_bench", lenient=True)
    assert [c.id for c in report.conversations] == ["conv:task1-trial0"]
    assert report.skipped == ("<string>, index 1: 'traj' is a JSON string; expected an array",)


def test_agent_log_errors_name_the_line_or_event() -> None:
    head = {"type": "user", "uuid": "u1", "sessionId": "s", "message": {"role": "user", "content": "hi"}}
    bad = {"type": "assistant", "uuid": "a1", "sessionId": "s", "message": "oops"}
    text = "\n".join(json.dumps(r) for r in [{"type": "progress", "uuid": "p", "sessionId": "s"}, head, bad])
    with pytest.raises(FormatError, match=r"<string>, line 3: 'message' is a JSON string; expected an object"):
        formats.loads(text)
    (conv,) = formats.loads(text, lenient=True)
    assert [m.id for m in conv.messages] == ["u1"] and conv.meta["skipped_records"] == 1
    assert conv.meta["ignored_records"] == {"progress": 1}
    events = [{"id": 0, "source": "user", "action": "message", "args": {"content": "go"}},
              {"id": 1, "source": "agent", "note": "neither action nor observation"}]
    with pytest.raises(FormatError, match=r"event 1: event has neither 'action' nor 'observation'"):
        formats.loads(json.dumps(events), "openhands")
