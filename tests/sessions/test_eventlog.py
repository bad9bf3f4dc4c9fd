"""The one event codec (ctxfold.compaction.eventlog) over every log it reads: a session directory's events.jsonl,
the local store and Redis (a real redis-server on loopback), and `ctxfold restore` of each.

Fuzzed with random bytes and crafted records (nesting 100,000 deep, numbers of thousands of digits,
invalid UTF-8, fields of the wrong type): a salvage keeps every readable record and names each one
left out; --strict refuses with one line; nothing is ever an internal error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxfold.chat.formats import dumps
from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.cli import EXIT_INPUT, EXIT_OK, main
from ctxfold.compaction.eventlog import MAX_RECORD_DEPTH, decode_event, load_events
from ctxfold.compaction.session import Session, ViewEntry
from ctxfold.compaction.store import StoredSession
from ctxfold.compaction.store.redis_store import RedisStore
from ctxfold.errors import FormatError
from helpers.redis_server import RedisServer

SID = "0123456789abcdef0123456789abcdef/0000"

# -- what goes into a log: garbage of every shape ------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _nested(depth: int) -> bytes:
    return b'{"seq": 1, "type": "append", "message": ' + b"[" * depth + b"]" * depth + b"}"


# Lines that can never be a record: each must be skipped and named, whatever else the log holds.
unreadable_lines = st.one_of(
    st.binary(max_size=40).filter(lambda b: b"\n" not in b and _not_a_record(b)),
    st.sampled_from([
        b"", b"not json", b"{", b"[1, 2]", b'"a string"', b"null", b"1e999", b"\xff\xfe\x00",
        b'{"seq": "1", "type": "append"}', b'{"seq": -1, "type": "append"}', b'{"seq": 1.5, "type": "state"}',
        b'{"type": "append"}', b'{"seq": 1, "type": "nonsense"}', b'{"seq": 1, "type": ["append"]}',
        b'{"seq": 1' + b"9" * 5000 + b', "type": "append"}',
        _nested(MAX_RECORD_DEPTH + 1), _nested(100_000), b"[" * 100_000,
    ]),
)

# Records that parse but may hold anything in their fields: read or named, never a crash.
_field_values = st.one_of(_json, st.integers(min_value=-(2**70), max_value=2**70),
                          st.sampled_from([float("inf"), float("nan"), "9" * 5000]))
crafted_records = st.builds(
    lambda kind, seq, extra: json.dumps({"seq": seq, "type": kind, **extra}).encode(),
    st.sampled_from(["header", "append", "view", "state"]),
    st.integers(min_value=0, max_value=50),
    st.dictionaries(st.sampled_from(["conversation", "message", "index", "view", "state", "compactions", "role"]),
                    _field_values, max_size=4))

any_line = st.one_of(unreadable_lines, crafted_records)


def _not_a_record(data: bytes) -> bool:
    return decode_event(data, location="x").event is None


def _conversation() -> Conversation:
    return Conversation(messages=[], id="c", system="be brief")


def _messages(n: int) -> list[Message]:
    return [Message(Role.USER if k % 2 == 0 else Role.ASSISTANT, f"message {k}") for k in range(n)]


def _good_log(root: Path, n: int = 6) -> tuple[list[bytes], list[Message]]:
    """A real log's lines: a header, n messages, a compaction after the fourth."""
    msgs = _messages(n)
    s = Session(root, durable=False)
    s.create(_conversation())
    s.append_messages(msgs[:4])
    s.log_view([ViewEntry(-1, Message(Role.USER, "summary", summary=True)), ViewEntry(3)], kind="summary",
               reason="test", dump=None, state={"k": 1})
    s.append_messages(msgs[4:])
    s.close()
    return s.events_path.read_bytes().splitlines(), msgs


def _write_log(root: Path, lines: list[bytes]) -> Session:
    root.mkdir(parents=True, exist_ok=True)
    (root / "events.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    return Session(root)


# -- properties ---------------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(any_line, max_size=8), data=st.data())
def test_any_log_salvages_without_error_and_strict_refuses_with_a_format_error(
        tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], data: st.DataObject) -> None:
    root = tmp_path_factory.mktemp("log")
    good, _ = _good_log(root / "good")
    mixed = list(good)
    for line in lines:  # the garbage anywhere among a real log's lines
        mixed.insert(data.draw(st.integers(0, len(mixed)), label="position"), line)
    session = _write_log(root / "s", mixed)
    resumed = session.load(salvage=True)
    assert all(where.startswith("line ") or where == "the first record" for where, _ in resumed.skipped)
    # What a salvage gives back can be written out (restore's output recurses).
    resumed.conversation.messages = resumed.originals
    dumps(resumed.conversation, "openai", indent=1)
    try:
        strict = Session(root / "s").load()
    except FormatError:
        assert resumed.skipped
    else:
        assert not resumed.skipped and strict.originals == resumed.originals


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(unreadable_lines, min_size=1, max_size=6), data=st.data())
def test_unreadable_lines_lose_themselves_alone_and_each_is_named(
        tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], data: st.DataObject) -> None:
    root = tmp_path_factory.mktemp("log")
    good, msgs = _good_log(root / "good")
    mixed: list[bytes | None] = list(good)
    for line in lines:
        mixed.insert(data.draw(st.integers(1, len(mixed)), label="position"), line)  # after the header
    session = _write_log(root / "s", [line for line in mixed if line is not None])
    resumed = session.load(salvage=True)
    assert resumed.originals == msgs
    bad_lines = [f"line {k + 1}" for k, line in enumerate(mixed) if line in lines]
    named = [where for where, why in resumed.skipped if why.startswith("not an event")]
    assert named == bad_lines
    assert resumed.conversation.system == "be brief"


@settings(max_examples=100, deadline=None)
@given(lines=st.lists(any_line, max_size=8), positions=st.lists(st.integers(0, 20), max_size=8))
def test_a_stores_records_salvage_the_same_way(lines: list[bytes], positions: list[int]) -> None:
    """What a store read (events, and what it could not decode, each where it stood) loads without error."""
    events: list[dict[str, Any]] = [
        {"seq": 0, "type": "header", "version": 1, "conversation": {"system": "s"}},
        *({"seq": 1 + k, "type": "append", "index": k, "message": {"role": "user", "content": f"m{k}"}}
          for k in range(4))]
    stored = StoredSession(SID, events=list(events))
    for k, line in enumerate(lines):
        record = decode_event(line, location=f"stream entry 0-{100 + k}")
        if record.event is None:
            stored.unreadable.append((min(positions[k] if k < len(positions) else 0, len(events)), record))
    stored.unreadable.sort(key=lambda u: u[0])
    resumed = load_events(stored.records(), source="store", salvage=True)
    assert [m.text for m in resumed.originals] == ["m0", "m1", "m2", "m3"]
    assert [w for w, why in resumed.skipped] == [r.location for _, r in stored.unreadable]


@settings(max_examples=100, deadline=None)
@given(raw=st.one_of(st.binary(max_size=60), st.builds(lambda v: json.dumps(v).encode(), _json),
                     st.sampled_from([b"[" * 100_000, b'{"through": 1e999, "events": []}',
                                      b'{"through": 3, "events": [' + b"[" * 5000 + b"]" * 5000 + b"]}"])))
def test_a_checkpoint_of_any_shape_reads_or_is_named(raw: bytes) -> None:
    out = StoredSession(SID)
    RedisStore._read_checkpoint(raw, out)
    load_events(out.records(), source="store", salvage=True)  # never raises


# -- the commands --------------------------------------------------------------------------------------

def test_restore_of_a_log_with_a_record_nested_100000_deep_names_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good, msgs = _good_log(tmp_path / "good")
    _write_log(tmp_path / "s", [*good[:3], _nested(100_000), *good[3:]])
    out = tmp_path / "o.json"
    assert main(["restore", str(tmp_path / "s"), "-o", str(out)]) == EXIT_OK
    err = capsys.readouterr().err
    assert "line 4: skipped: not an event: nested deeper than" in err and "Traceback" not in err
    assert [m["content"] for m in json.loads(out.read_text())["messages"]][-len(msgs):] == [m.text for m in msgs]


def test_restore_of_an_empty_or_garbage_log_fails_and_writes_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    for name, content in (("empty", b""), ("garbage", b"\x00\x01 not a log\n{]\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "events.jsonl").write_bytes(content)
        assert main(["restore", str(tmp_path / name), "-o", str(out)]) == EXIT_INPUT
        err = capsys.readouterr().err
        assert "no message could be read" in err.strip().splitlines()[-1] and not out.exists()


def test_restore_of_a_file_says_it_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _good_log(tmp_path / "s")
    assert main(["restore", str(tmp_path / "s" / "events.jsonl"), "-o", str(tmp_path / "o.json")]) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert "a file, not a session directory" in err and f"restore the folder that holds it: {tmp_path / 's'}" in err


def _stored_with_bad_entries(redis_server: RedisServer) -> list[Message]:
    """A session in Redis whose stream holds, among its good records, one that is not JSON, one without
    its fields, and one nested 100,000 deep (written by hand: ctxfold never writes such)."""
    from ctxfold.compaction.store import Batch

    msgs = _messages(4)

    async def body() -> None:
        store = RedisStore(redis_server.url)
        lease = await store.acquire(SID, owner="t")
        assert lease is not None
        events = [{"seq": 0, "type": "header", "version": 1, "conversation": {"system": "be brief"}},
                  *({"seq": 1 + k, "type": "append", "index": k, "message": {"role": m.role.value, "content": m.text}}
                    for k, m in enumerate(msgs[:2]))]
        await store.append(lease, Batch(events=tuple(events)))
        key = store._key(SID, "ev")
        # Entries the proxy never writes, between the good ones (ids past the last good one).
        await store.client.xadd(key, {"e": b"not json"}, id="0-4")
        await store.client.xadd(key, {"other": b"field"}, id="0-5")
        await store.client.xadd(key, {"e": _nested(100_000)}, id="0-6")
        for k, m in enumerate(msgs[2:]):
            await store.client.xadd(key, {"e": json.dumps({"seq": 6 + k, "type": "append", "index": 2 + k,
                                                           "message": {"role": m.role.value, "content": m.text}})},
                                    id=f"0-{7 + k}")
        await store.close()

    asyncio.run(body())
    return msgs


def test_restore_from_a_store_salvages_and_strict_refuses(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, redis_server: RedisServer) -> None:
    msgs = _stored_with_bad_entries(redis_server)
    out = tmp_path / "o.json"
    assert main(["restore", SID, "--store", redis_server.url, "-o", str(out)]) == EXIT_OK
    err = capsys.readouterr().err
    for entry, why in (("0-4", "not JSON"), ("0-5", "not JSON"), ("0-6", "nested deeper than")):
        assert f"stream entry {entry}: skipped: not an event: {why}" in err, err
    assert "salvaged 4 messages; 3 records left out" in err and "Traceback" not in err
    assert [m["content"] for m in json.loads(out.read_text())["messages"]][-4:] == [m.text for m in msgs]
    out.unlink()
    assert main(["restore", SID, "--store", redis_server.url, "-o", str(out), "--strict"]) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stream entry 0-4" in err and "Traceback" not in err
    assert not out.exists()
