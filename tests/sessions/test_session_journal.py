"""A compactor's journal committed to its session directory: what a failing disk, a relative path, a
reader without the lock and a later process see. Each test holds a case a review of the journal found."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.compaction import session as session_module
from ctxfold.compaction.archive.index import INDEX_FILE
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session, ViewEntry
from ctxfold.tokens.counting import load_counter

COUNTER = load_counter("estimate:deepseek-v4")


def long_conversation(turns: int = 12) -> Conversation:
    messages = []
    for k in range(turns):
        messages += [Message(Role.USER, f"question {k} " + "words " * 200, id=f"u{k}"),
                     Message(Role.ASSISTANT, f"answer {k} " + "more " * 200, id=f"a{k}")]
    return Conversation(messages, id="t", system="sys")


def test_an_fsync_that_fails_after_the_write_does_not_write_the_records_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The records are on disk when fsync fails: the next commit must not write them again (a log
    with one seq twice does not load)."""
    c = Compactor(Conversation([], id="t", system="sys"), counter=COUNTER, session_dir=tmp_path / "s")
    real_fsync = os.fsync
    failures = iter([True])

    def flaky_fsync(fd: int) -> None:
        if next(failures, False):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(session_module.os, "fsync", flaky_fsync)
    c.append(Message(Role.USER, "first", id="u1"))
    assert c.unwritten is not None  # not known to be durable: said so
    c.append(Message(Role.USER, "second", id="u2"))
    assert c.unwritten is None
    c.close()
    seqs = [json.loads(line)["seq"] for line in (tmp_path / "s" / "events.jsonl").read_text().splitlines()]
    assert seqs == sorted(set(seqs))
    assert [m.text for m in Session(tmp_path / "s").restore().messages] == ["first", "second"]


def test_a_one_record_write_whose_fsync_fails_is_not_numbered_again(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    s = Session(tmp_path / "s")
    s.create(Conversation([], system="sys"))
    monkeypatch.setattr(session_module.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError):
        s.append_messages([Message(Role.USER, "on disk, not synced", id="u1")])
    monkeypatch.undo()
    s.append_messages([Message(Role.USER, "next", id="u2")])
    s.close()
    assert [m.text for m in Session(tmp_path / "s").restore().messages] == ["on disk, not synced", "next"]


def test_a_session_at_a_relative_path_records_its_dumps_by_their_name(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = Session(Path("sessions") / "a")
    conv = Conversation([Message(Role.USER, "hi", id="u1")], system="sys")
    s.create(conv)
    s.append_messages(conv.messages)
    dump = s.write_history_dump(conv.messages, conv)
    s.log_view([ViewEntry(0)], kind="summary", reason="test", dump=dump, state={})
    s.close()
    view = [json.loads(line) for line in (tmp_path / "sessions" / "a" / "events.jsonl").read_text().splitlines()][-1]
    assert view["dump"] == dump.relative_to(Path("sessions") / "a").as_posix()
    assert view["dump"].startswith("history/")


def test_a_session_directory_keeps_its_search_index(tmp_path: Path) -> None:
    c = Compactor(long_conversation(), counter=COUNTER, session_dir=tmp_path / "s")
    assert c.store.index_path == tmp_path / "s" / "archive" / INDEX_FILE
    c.close()


def test_a_reader_without_the_lock_finds_each_archived_text_while_it_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recall tool reads the archive without the compactor's lock: between the journal and the disk
    an archived text is in one place or the other, never in neither."""
    c = Compactor(long_conversation(), counter=COUNTER, session_dir=tmp_path / "s")
    real_commit = Session.commit
    seen: list[str] = []

    def commit(self: Session, batch: object) -> None:
        for name, _ in batch.blobs:
            if name.startswith("archive/"):
                seen.append(c.store.get(name.removeprefix("archive/").removesuffix(".txt"))[:8])
        real_commit(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(Session, "commit", commit)
    assert c.compact_now().applied
    assert seen  # the history dump's copy in the archive, at least
    c.close()


def test_a_new_session_object_numbers_dumps_after_those_on_disk(tmp_path: Path) -> None:
    conv = Conversation([Message(Role.USER, "hi", id="u1")], system="sys")
    first = Session(tmp_path / "s").write_history_dump(conv.messages, conv)
    second = Session(tmp_path / "s").write_history_dump(conv.messages, conv, first_index=1)
    assert (first.name[:6], second.name[:6]) == ("000000", "000001")


def test_a_compactor_without_a_session_directory_has_none(tmp_path: Path) -> None:
    assert Compactor(Conversation([]), counter=COUNTER).session is None
    c = Compactor(Conversation([]), counter=COUNTER, session_dir=tmp_path / "s",
                  config=CompactConfig.preset("both"))
    assert c.session is not None and c.session.root == tmp_path / "s"
    c.close()
