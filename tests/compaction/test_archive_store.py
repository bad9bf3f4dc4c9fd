"""The archive store: content addressing, atomic writes, id validation, local and fsspec backends."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctxfold.compaction.archive import ArchiveStore, FsspecBackend, LocalBackend, check_id, content_id
from ctxfold.errors import IntegrityError

TRICKY = [
    "",
    "plain",
    "crlf\r\nline\rcr\n",
    "unicode: 中文 ü é 🙂 \u2028 \x00 nul",
    "lone surrogate \ud800 survives",
    "x" * 100_000,
]


@pytest.mark.parametrize("text", TRICKY)
def test_put_get_is_byte_exact_and_content_addressed(tmp_path: Path, text: str) -> None:
    store = ArchiveStore(tmp_path / "archive")
    aid = store.put(text)
    assert aid == content_id(text)
    raw = (tmp_path / "archive" / f"{aid}.txt").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == aid
    assert store.get(aid) == text
    # A fresh store over the same directory reads the same bytes back.
    assert ArchiveStore(tmp_path / "archive").get(aid) == text


def test_same_content_is_stored_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ArchiveStore(tmp_path)
    aid = store.put("hello world")
    writes: list[str] = []
    real = LocalBackend.write_atomic
    monkeypatch.setattr(LocalBackend, "write_atomic", lambda self, n, d: (writes.append(n), real(self, n, d)))
    assert ArchiveStore(tmp_path).put("hello world") == aid  # a new store finds it on disk
    assert store.put("hello world") == aid
    assert writes == []
    assert store.ids() == [aid]


def test_read_slices_in_characters(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    aid = store.put("ab中cd🙂e")
    assert store.read(aid, 2, 3) == "中cd"
    assert store.read(aid, 5) == "🙂e"
    assert store.read(aid, 50, 3) == ""
    with pytest.raises(IndexError):
        store.read(aid, -1)


@pytest.mark.parametrize(
    "bad",
    ["../../etc/passwd", "/etc/passwd", "A" * 64, "a" * 63, "a" * 65, "a" * 64 + "\n", "g" * 64, "", 7, None, ["a"]],
)
def test_malformed_ids_never_become_paths(tmp_path: Path, bad: object) -> None:
    store = ArchiveStore(tmp_path / "a")
    assert not store.exists(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="64 lowercase hex"):
        store.get(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        check_id(bad)


def test_unknown_id_is_a_key_error(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="no archive"):
        ArchiveStore(tmp_path).get("0" * 64)


def test_corrupt_file_is_detected(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    aid = store.put("original text")
    (tmp_path / f"{aid}.txt").write_bytes(b"tampered")
    with pytest.raises(IntegrityError, match="does not match its sha256"):
        ArchiveStore(tmp_path).get(aid)


def test_ids_ignore_temp_and_foreign_files(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    aid = store.put("kept")
    (tmp_path / ".tmp-abc.part").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ("f" * 64 + ".txt.bak")).write_text("x")
    assert store.ids() == [aid]


def test_stale_temp_files_are_swept_on_open(tmp_path: Path) -> None:
    old = tmp_path / ".tmp-old.part"
    fresh = tmp_path / ".tmp-fresh.part"
    old.write_bytes(b"left by a crash")
    fresh.write_bytes(b"another writer, still running")
    past = time.time() - 3600
    os.utime(old, (past, past))
    ArchiveStore(tmp_path)
    assert not old.exists()
    assert fresh.exists()


def test_store_directory_is_created_on_first_write_only(tmp_path: Path) -> None:
    root = tmp_path / "session" / "archive"
    store = ArchiveStore(root)
    assert store.ids() == [] and not root.exists()
    store.put("x")
    assert root.is_dir()


def test_file_url_is_the_local_backend(tmp_path: Path) -> None:
    store = ArchiveStore(f"file://{tmp_path}/arc")
    assert isinstance(store.backend, LocalBackend)
    aid = store.put("via file url")
    assert (tmp_path / "arc" / f"{aid}.txt").read_text() == "via file url"


@pytest.mark.parametrize("text", TRICKY)
def test_fsspec_memory_backend(text: str, request: pytest.FixtureRequest) -> None:
    url = f"memory://ctxfold-test/{request.node.name}/archive"
    store = ArchiveStore(url)
    assert isinstance(store.backend, FsspecBackend)
    assert store.ids() == []
    aid = store.put(text)
    assert store.exists(aid)
    again = ArchiveStore(url)  # another process would see the same objects
    assert again.get(aid) == text
    assert again.ids() == [aid]
    assert again.put(text) == aid


@given(st.text())
def test_any_text_round_trips(text: str) -> None:
    store = ArchiveStore("memory://ctxfold-test/hypothesis")
    assert store.get(store.put(text)) == text


def test_object_store_client_errors_become_archive_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage client's own exception type (not OSError) still leaves the output inline."""
    from ctxfold.chat.messages import Message, Role, ToolCall
    from ctxfold.compaction.archive import ArchiveParams, archive_mid_turn

    class ClientError(Exception):
        pass

    store = ArchiveStore("memory://ctxfold-test/client-error")
    assert isinstance(store.backend, FsspecBackend)

    def refuse(path: str, data: bytes) -> None:
        raise ClientError("SlowDown: reduce your request rate")

    monkeypatch.setattr(store.backend.fs, "pipe_file", refuse)
    msgs = [
        Message(role=Role.ASSISTANT, id="a", tool_calls=(ToolCall("c", "run", "{}"),)),
        Message(role=Role.TOOL, content="x" * 5000, id="t", tool_call_id="c"),
    ]
    new, rep = archive_mid_turn(msgs, store, ArchiveParams(keep_recent_tool_results=0))
    assert new == msgs and rep.left_inline == ("t",)
    assert rep.error is not None and "ClientError: SlowDown" in rep.error


def test_memory_backend_round_trips_without_a_disk() -> None:
    from ctxfold.compaction.archive import MemoryBackend

    store = ArchiveStore(MemoryBackend())
    aid = store.put("héllo\n" * 100)
    assert store.get(aid) == "héllo\n" * 100
    assert store.ids() == [aid]
    assert store.location == "<memory>"
