"""Session log: restore through rewrites, resume after a torn write, collision-free dumps."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ctxfold.chat.codec import decode_message, encode_message
from ctxfold.chat.messages import ContentPart, Conversation, Message, Role, ToolCall, ToolSpec, Usage
from ctxfold.compaction.session import Session, ViewEntry
from ctxfold.errors import FormatError
from helpers.subprocess_env import can_mount, ctxfold_env


def _conversation() -> Conversation:
    msgs = [
        Message(Role.USER, "fix the bug in parser.py", id="u1"),
        Message(Role.ASSISTANT, "", id="a1", tool_calls=(ToolCall("c1", "bash", '{"cmd": "cat parser.py"}'),),
                reasoning="look first", usage=Usage(100, 20, 64)),
        Message(Role.TOOL, "x" * 5000, id="t1", tool_call_id="c1", name="bash"),
        Message(Role.ASSISTANT, (ContentPart("text", "done"), ContentPart("image", data={"url": "u"})), id="a2"),
    ]
    return Conversation(msgs, id="conv", system="be brief", tools=(ToolSpec("bash", "run", {"type": "object"}),))


def test_codec_round_trips_every_field() -> None:
    for m in _conversation().messages + [Message(Role.USER, "q", queued=True), Message(Role.USER, "r", resume=True)]:
        assert decode_message(json.loads(json.dumps(encode_message(m)))) == m


def test_restore_and_resume_through_rewrites(tmp_path: Path) -> None:
    conv = _conversation()
    s = Session(tmp_path / "s", durable=False)
    s.create(conv)
    s.append_messages(conv.messages[:3])
    dump = s.write_history_dump(conv.messages[:3], conv)
    summary = Message(Role.USER, "summary", id="sum1", summary=True)
    s.log_view([ViewEntry(-1, summary), ViewEntry(2)], kind="summary", reason="test", dump=dump,
               state={"failures": 1})
    s.append_messages(conv.messages[3:])
    s.close()

    resumed = Session(tmp_path / "s").load()
    assert resumed.conversation.messages == [summary, conv.messages[2], conv.messages[3]]
    assert resumed.view_origins == [-1, 2, 3]
    assert resumed.state == {"failures": 1}
    assert resumed.num_compactions == 1
    restored = Session(tmp_path / "s").restore()
    assert restored.messages == conv.messages
    assert restored.system == conv.system and restored.tools == conv.tools
    lines = dump.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["type"] == "header"


@pytest.mark.parametrize(("durable", "fsync_appends", "expected"), [
    (True, True, ["header", "append", "view"]),  # one write and one fsync for the three appended messages
    (True, False, ["view"]),  # the view event's fsync makes the header and appends before it durable too
    (False, True, []),
])
def test_which_events_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool,
                                  fsync_appends: bool, expected: list[str]) -> None:
    import os

    s = Session(tmp_path / "s", durable=durable, fsync_appends=fsync_appends)
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:  # the real fsync, noting which event it made durable
        last = json.loads(s.events_path.read_bytes().splitlines()[-1])
        synced.append(last["type"])
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    conv = _conversation()
    s.create(conv)
    s.append_messages(conv.messages[:3])
    s.log_view([ViewEntry(2)], kind="summary", reason="test", dump=None, state={})
    s.close()
    assert synced == expected
    assert Session(tmp_path / "s").restore().messages == conv.messages[:3]  # written either way


_FULL_DISK_CHILD = """
import json, sys
from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.compaction.session import Session

s = Session(sys.argv[1], durable=False)
s.create(Conversation(messages=[], system="s"))
batches = 0
error = None
try:
    for k in range(1000):  # three messages a batch, each 3 KB: the file system fills up mid-batch
        s.append_messages([Message(Role.USER, f"{k}-{j} " + "x" * 3000) for j in range(3)])
        batches += 1
except OSError as e:
    error = str(e)
print(json.dumps({"batches": batches, "error": error, "restored": len(Session(sys.argv[1]).restore().messages)}))
"""


@pytest.mark.skipif(not can_mount(), reason="needs unshare -m (mount namespaces) to mount a real file system")
def test_a_full_disk_keeps_whole_batches_of_appends(tmp_path: Path) -> None:
    """On a real full file system, a batch of appends that does not fit leaves no part of itself."""
    root = tmp_path / "fs"
    root.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_FULL_DISK_CHILD)
    cmd = f"mount -t tmpfs -o size=64k tmpfs {root} && exec {sys.executable} {script} {root}/s"
    done = subprocess.run(["unshare", "-m", "sh", "-c", cmd], check=False, capture_output=True, text=True,
                          env=ctxfold_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["error"] is not None and got["batches"] > 0
    assert got["restored"] == 3 * got["batches"]  # whole batches, and the session still loads


def test_text_any_json_string_can_hold_is_logged_and_restored(tmp_path: Path) -> None:
    # A lone surrogate (a JSON escape the proxy's clients may send) and NaN in a usage figure.
    odd = [Message(Role.USER, "half a pair: \ud83d, and \u00e9\u4e2d", id="u1"),
           Message(Role.ASSISTANT, "ok", id="a1", usage=Usage(10, 2, None, {"ratio": float("nan")}))]
    conv = Conversation(odd, id="odd", system="sys \udfff")
    s = Session(tmp_path / "s", durable=False)
    s.create(conv)
    s.append_messages(odd)
    dump = s.write_history_dump(odd, conv)
    s.close()
    for path in (tmp_path / "s" / "events.jsonl", dump):
        path.read_bytes().decode("utf-8")  # valid UTF-8: the surrogates are written as escapes
    restored = Session(tmp_path / "s").restore()
    assert [m.content for m in restored.messages] == [m.content for m in odd] and restored.system == conv.system
    ratio = restored.messages[1].usage.extra["ratio"]  # type: ignore[union-attr]
    assert math.isnan(ratio)  # NaN came back as NaN, not as null
    assert json.loads(dump.read_text().splitlines()[1])["content"] == odd[0].content


def test_history_dumps_never_collide(tmp_path: Path) -> None:
    conv = _conversation()
    s = Session(tmp_path, durable=False)
    paths = {s.write_history_dump(conv.messages[:k % 4 + 1], conv) for k in range(50)}
    assert len(paths) == 50
    assert sorted(p.name for p in (tmp_path / "history").iterdir()) == sorted(p.name for p in paths)


def test_log_nbytes_counts_the_open_log_without_a_stat(tmp_path: Path) -> None:
    conv = _conversation()
    s = Session(tmp_path, durable=False)
    assert s.log_nbytes is None  # not open
    s.create(conv)
    assert s.log_nbytes == s.events_path.stat().st_size > 0
    s.append_messages(conv.messages[:2])
    s.log_state({"turn": 1})
    assert s.log_nbytes == s.events_path.stat().st_size
    s.close()
    assert s.log_nbytes is None  # closed: someone else may write
    with open(s.events_path, "ab") as f:
        f.write(b'{"seq": 9, "type": "append", "mess')  # a torn tail, cut when the log is opened again
    s2 = Session(tmp_path, durable=False)
    s2.load()
    s2.append_messages(conv.messages[2:])
    assert s2.log_nbytes == s2.events_path.stat().st_size
    s2.close()


def test_torn_last_line_is_ignored_and_cut(tmp_path: Path) -> None:
    conv = _conversation()
    s = Session(tmp_path, durable=False)
    s.create(conv)
    s.append_messages(conv.messages[:2])
    s.close()
    with open(s.events_path, "ab") as f:
        f.write(b'{"seq": 3, "type": "append", "mess')  # a write cut off by a crash
    resumed = Session(tmp_path).load()
    assert resumed.torn_lines == 1
    assert resumed.originals == conv.messages[:2]
    s2 = Session(tmp_path, durable=False)
    s2.load()
    s2.append_messages(conv.messages[2:])
    s2.close()
    assert Session(tmp_path).restore().messages == conv.messages


def test_corrupt_middle_line_names_the_line(tmp_path: Path) -> None:
    conv = _conversation()
    s = Session(tmp_path, durable=False)
    s.create(conv)
    s.close()
    with open(s.events_path, "ab") as f:
        f.write(b"not json\n")
    with pytest.raises(FormatError, match="line 2"):
        Session(tmp_path).load()


def test_missing_session_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no session here"):
        Session(tmp_path / "nope").load()


def test_kill_at_any_point_leaves_old_or_new_view(tmp_path: Path) -> None:
    """SIGKILL a writer at many points; every survivor resumes to a consistent view."""
    script = textwrap.dedent(
        """
        import sys
        from ctxfold.chat.messages import Conversation, Message, Role
        from ctxfold.compaction.session import Session, ViewEntry
        root = sys.argv[1]
        s = Session(root)
        conv = Conversation([], id="k")
        s.create(conv)
        n = 0
        for round in range(10_000):
            batch = [Message(Role.USER, f"m{n + i} " + "y" * 2000, id=f"m{n + i}") for i in range(3)]
            s.append_messages(batch)
            n += 3
            dump = s.write_history_dump(batch, conv)
            s.log_view([ViewEntry(-1, Message(Role.USER, f"sum{round}", summary=True)), ViewEntry(n - 1)],
                       kind="summary", reason="r", dump=dump, state={"round": round})
            print(round, flush=True)
        """
    )
    env = ctxfold_env()
    for trial in range(6):
        root = tmp_path / f"s{trial}"
        proc = subprocess.Popen([sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        for _ in range(2 + trial * 3):  # let it get a few rounds in, a different number each trial
            proc.stdout.readline()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        resumed = Session(root).load()
        view = resumed.conversation.messages
        round_ = resumed.state.get("round", -1)
        # The view is exactly the one logged last, plus originals appended after it.
        if round_ >= 0:
            assert view[0].text == f"sum{round_}"
            assert view[1].id == f"m{3 * round_ + 2}"
            assert [m.id for m in view[2:]] == [m.id for m in resumed.originals[3 * round_ + 3:]]
        assert [m.id for m in resumed.originals] == [f"m{i}" for i in range(len(resumed.originals))]
        for d in root.glob("history/*.jsonl"):
            assert d.read_text().endswith("\n")  # no partial dump is ever visible under its final name


# -- salvage ------------------------------------------------------------------------------------------

def _session_with_garbage(root: Path) -> tuple[Session, list[Message]]:
    """A session of 8 messages and a compaction, with line 5 (the 4th message) replaced by garbage."""
    conv = _conversation()
    msgs = [Message(Role.USER if k % 2 == 0 else Role.ASSISTANT, f"message {k}") for k in range(8)]
    s = Session(root, durable=False)
    s.create(conv)
    for m in msgs[:6]:
        s.append_messages([m])
    s.log_view([ViewEntry(origin=-1, message=Message(Role.USER, "summary")), ViewEntry(origin=5)], kind="summary",
               reason="test", dump=None, state={})
    s.append_messages(msgs[6:])
    s.close()
    lines = s.events_path.read_bytes().splitlines(keepends=True)
    assert json.loads(lines[4])["index"] == 3
    lines[4] = b'{"seq": 4, "type": "app\x00garbage\n'
    s.events_path.write_bytes(b"".join(lines))
    return Session(root), msgs


def test_salvage_keeps_every_readable_record_and_names_what_it_left_out(tmp_path: Path) -> None:
    s, msgs = _session_with_garbage(tmp_path / "s")
    with pytest.raises(FormatError, match="line 5"):
        s.load()
    resumed = s.load(salvage=True)
    assert [m.text for m in resumed.originals] == [m.text for m in msgs[:3] + msgs[4:]]
    assert [where for where, _ in resumed.skipped] == ["line 5", "line 6", "line 8"]  # the garbage, the gap, the view
    assert "not an event" in resumed.skipped[0][1] and "missing" in resumed.skipped[1][1]
    assert resumed.conversation.system == _conversation().system


def test_restore_salvages_and_strict_refuses(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from ctxfold.cli import EXIT_INPUT, EXIT_OK, main

    _, msgs = _session_with_garbage(tmp_path / "s")
    out = tmp_path / "o.json"
    assert main(["restore", str(tmp_path / "s"), "-o", str(out)]) == EXIT_OK
    err = capsys.readouterr().err
    assert "line 5: skipped: not an event" in err and "salvaged 7 messages; 3 records left out" in err
    assert [m["content"] for m in json.loads(out.read_text())["messages"]][-7:] == [
        m.text for m in msgs[:3] + msgs[4:]]
    assert main(["restore", str(tmp_path / "s"), "-o", str(out), "--strict"]) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 5" in err and "Traceback" not in err
