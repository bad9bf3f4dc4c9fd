"""Crash safety and failing disks.

Faults are injected at every system call the writer makes (open, write, fsync, close, replace,
in the order it makes them): first as exceptions, then by killing a forked process with SIGKILL at
that call, with a half-done write where the call is a write. After each: no archive name ever holds
partial content, and the conversation holds either the original output or a marker whose archive
reads back whole.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat.messages import Message, Role, ToolCall
from ctxfold.compaction.archive import (
    ArchiveParams,
    ArchiveStore,
    archive_turn_start,
    is_archived_text,
    restore,
)
from ctxfold.compaction.archive.store import LocalBackend
from ctxfold.errors import ArchiveError
from helpers.subprocess_env import can_mount, ctxfold_env

SYSCALLS = ("open", "write", "fsync", "close", "replace")
PARAMS = ArchiveParams(keep_recent_user_turns=1, archive_threshold_chars=1000, archive_preview_chars=100)


def conversation(turns: int, first: int = 0) -> list[Message]:
    out: list[Message] = []
    for t in range(first, first + turns):
        out.append(Message(role=Role.USER, content=f"turn {t}", id=f"u{t}"))
        for k in range(2):
            cid = f"c{t}.{k}"
            out.append(Message(role=Role.ASSISTANT, id=f"a{t}.{k}", tool_calls=(ToolCall(cid, "run", "{}"),)))
            body = f"output {t}.{k}\n" + "".join(f"{t}:{k}:{j} " for j in range(2000))
            out.append(Message(role=Role.TOOL, content=body, id=f"t{t}.{k}", tool_call_id=cid))
    return out


def assert_no_partial_archive(root: Path) -> None:
    """Every file under an archive name holds exactly the content that hashes to that name."""
    for path in root.glob("*.txt"):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.stem, f"partial archive {path.name}"


def assert_consistent(compacted: list[Message], original: list[Message], store: ArchiveStore) -> None:
    """Each tool output is the original or a marker that resolves, and restore gives the original."""
    for new, old in zip(compacted, original, strict=True):
        assert new.id == old.id and new.tool_call_id == old.tool_call_id
        if new.text != old.text:
            assert is_archived_text(new.text, store)
    assert restore(compacted, store, strict=True) == original


class Injector:
    """Counts the writer's system calls and runs ``action`` at the ``fail_at``-th one (1-based)."""

    def __init__(self, fail_at: int, action: Callable[[str, Callable[..., Any], tuple[Any, ...]], Any]) -> None:
        self.fail_at = fail_at
        self.action = action
        self.calls: list[str] = []

    @contextmanager
    def installed(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[Injector]:
        for name in SYSCALLS:
            real = getattr(os, name)

            def hooked(*args: Any, _name: str = name, _real: Callable[..., Any] = real, **kw: Any) -> Any:
                self.calls.append(_name)
                if len(self.calls) == self.fail_at:
                    return self.action(_name, _real, args)
                return _real(*args, **kw)

            monkeypatch.setattr(os, name, hooked)
        try:
            yield self
        finally:
            monkeypatch.undo()


def count_syscalls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    inj = Injector(0, lambda *a: None)
    with inj.installed(monkeypatch):
        archive_turn_start(conversation(3), ArchiveStore(tmp_path / "count"), PARAMS)
    return len(inj.calls)


def test_exception_at_every_write_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = conversation(3)
    total = count_syscalls(tmp_path, monkeypatch)
    assert total >= 2 * 4 * len(SYSCALLS) - 8  # four outputs to archive, each a full write sequence
    seen_steps = set()
    for k in range(1, total + 1):
        root = tmp_path / f"k{k}"

        def fail(name: str, real: Callable[..., Any], args: tuple[Any, ...]) -> Any:
            seen_steps.add(name)
            raise OSError(errno.EIO, f"injected I/O error at {name}")

        store = ArchiveStore(root)
        with Injector(k, fail).installed(monkeypatch):
            compacted, report = archive_turn_start(original, store, PARAMS)
        assert report.error is not None and "EIO" in report.error
        assert report.left_inline, "an output that could not be written must be reported as left inline"
        assert_no_partial_archive(root)
        assert not list(root.glob(".tmp-*")), "a failed write must remove its temp file"
        assert_consistent(compacted, original, store)
        # Once the disk works again the next pass finishes the job.
        done, again = archive_turn_start(compacted, ArchiveStore(root), PARAMS)
        assert again.error is None and len(again.archived) + len(report.archived) == 4
        assert_consistent(done, original, store)
    assert seen_steps == set(SYSCALLS)


def _child(root: Path, session: Path, inj: Injector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two passes as an agent would run them, saving the session after each."""
    with inj.installed(monkeypatch):
        store = ArchiveStore(root)
        history = conversation(3)
        history, _ = archive_turn_start(history, store, PARAMS)
        session.write_text(json.dumps([m.text for m in history]))
        history, _ = archive_turn_start(history + conversation(2, first=3), store, PARAMS)
        session.write_text(json.dumps([m.text for m in history]))


@pytest.mark.slow  # one fork per system call of two passes
def test_sigkill_at_every_write_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = conversation(5)
    outcomes = set()
    temps_left = 0
    k = 0
    while True:
        k += 1
        root, session = tmp_path / f"k{k}" / "archive", tmp_path / f"k{k}" / "session.json"

        def die(name: str, real: Callable[..., Any], args: tuple[Any, ...]) -> Any:
            if name == "write":  # leave half the bytes on disk, as a kill mid-write would
                fd, data = args
                real(fd, bytes(data)[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                _child(root, session, Injector(k, die), monkeypatch)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed:
            assert os.WEXITSTATUS(status) == 0, f"child failed at k={k}"
        assert_no_partial_archive(root)
        store = ArchiveStore(root)
        if session.exists():
            texts = json.loads(session.read_text())
            compacted = [dataclasses.replace(m, content=t) for m, t in zip(original, texts, strict=False)]
            assert_consistent(compacted, original[: len(compacted)], store)
            outcomes.add("session saved")
        else:
            outcomes.add("nothing saved")
        # Reopening after the crash sweeps the temp files the kill left behind.
        temps_left += len(list(root.glob(".tmp-*")))
        LocalBackend(root).sweep_stale_temps(older_than_s=0)
        assert not list(root.glob(".tmp-*"))
        if not killed:
            break
    assert k > 30  # every call of both passes was a kill point
    assert outcomes == {"session saved", "nothing saved"}
    assert temps_left > 0  # kills mid-write did leave partial temp files, and none was ever taken for an archive


@pytest.mark.parametrize(
    ("err", "where"), [(errno.ENOSPC, "write"), (errno.EROFS, "open"), (errno.EACCES, "open"), (errno.EDQUOT, "fsync")]
)
def test_full_or_read_only_disk_keeps_outputs_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, err: int, where: str
) -> None:
    root = tmp_path / "archive"
    root.mkdir()
    original = conversation(6)
    store = ArchiveStore(root)
    name = errno.errorcode[err]

    def refuse(*args: Any, **kw: Any) -> Any:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, where, refuse)
    with caplog.at_level(logging.WARNING, logger="ctxfold.compaction.archive"):
        first, rep1 = archive_turn_start(original, store, PARAMS)
        second, rep2 = archive_turn_start(first + conversation(1, first=6), store, PARAMS)
    monkeypatch.undo()
    assert first == original  # nothing archived, nothing lost
    assert second[: len(original)] == original
    assert rep1.archived == () and name in (rep1.error or "") and rep1.left_inline[0] == "t0.0"
    assert rep2.archived == () and rep2.left_inline
    warnings = [r for r in caplog.records if r.name == "ctxfold.compaction.archive"]
    assert len(warnings) == 1 and name in warnings[0].getMessage()  # reported once, not per output
    assert store.write_failures == 2  # each pass stops at its first failure
    assert list(root.iterdir()) == []  # no temp file, no partial archive
    # Space freed: the next pass archives everything that was left inline.
    third, rep3 = archive_turn_start(second, store, PARAMS)
    assert rep3.error is None and len(rep3.archived) == 12
    assert restore(third, store, strict=True) == second


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_real_read_only_directory(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    root.mkdir()
    root.chmod(0o500)
    try:
        original = conversation(3)
        compacted, rep = archive_turn_start(original, ArchiveStore(root), PARAMS)
        assert compacted == original and rep.error is not None and "EACCES" in rep.error
        assert list(root.iterdir()) == []
    finally:
        root.chmod(0o700)


_CHILD = r"""
import json, logging, sys
from pathlib import Path
from ctxfold.compaction.archive import ArchiveParams, ArchiveStore, archive_turn_start, restore
from ctxfold.chat.messages import Message, Role, ToolCall

root = Path(sys.argv[1])
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("ctxfold.compaction.archive").addHandler(Keep())
msgs = []
for t in range(6):
    msgs.append(Message(role=Role.USER, content=f"turn {t}", id=f"u{t}"))
    msgs.append(Message(role=Role.ASSISTANT, id=f"a{t}", tool_calls=(ToolCall(f"c{t}", "run", "{}"),)))
    msgs.append(Message(role=Role.TOOL, content=f"{t}" * 20000, id=f"t{t}", tool_call_id=f"c{t}"))
store = ArchiveStore(root)
params = ArchiveParams(keep_recent_user_turns=1, archive_preview_chars=100)
first, rep1 = archive_turn_start(msgs, store, params)
second, rep2 = archive_turn_start(first, store, params)
print(json.dumps({
    "archived": len(rep1.archived) + len(rep2.archived),
    "errors": [rep1.error, rep2.error],
    "left_inline": list(rep1.left_inline),
    "restored": restore(second, store, strict=True) == msgs,
    "log": records,
    "names": sorted(p.name for p in root.iterdir()),
}))
"""



@pytest.mark.slow  # a fresh interpreter per file system
@pytest.mark.skipif(not can_mount(), reason="needs unshare -m (mount namespaces) to mount a real file system")
@pytest.mark.parametrize(
    ("mount", "err"),
    [
        ("mount --bind {d} {d} && mount -o remount,bind,ro {d}", "EROFS"),  # a real read-only file system
        ("mount -t tmpfs -o size=48k tmpfs {d}", "ENOSPC"),  # a real full disk: room for two outputs
    ],
)
def test_real_read_only_or_full_file_system(tmp_path: Path, mount: str, err: str) -> None:
    """The kernel, not an injected fault, refuses the write; the outputs stay inline, once reported."""
    import subprocess
    import sys

    root = tmp_path / "archive"
    root.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = ctxfold_env()
    cmd = f"{mount.format(d=root)} && exec {sys.executable} {script} {root}"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["restored"]  # nothing lost
    assert err in got["errors"][0] and err in got["errors"][1]
    assert len(got["log"]) == 1 and err in got["log"][0]  # reported once for both passes
    assert all(not n.startswith(".tmp-") for n in got["names"])  # the failed temp file was removed
    if err == "EROFS":
        assert got["archived"] == 0 and got["names"] == [] and got["left_inline"] == ["t0", "t1", "t2", "t3", "t4"]
    else:
        assert got["archived"] == 2 and len(got["names"]) == 2  # what fit was archived, the rest stayed inline


def test_failure_between_parts_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message with two big text parts whose second write fails keeps both parts inline, and the
    report does not claim the first."""
    from ctxfold.chat.messages import ContentPart

    parts = (ContentPart("text", "A" * 5000, {"type": "text"}), ContentPart("text", "B" * 5000, {"type": "text"}))
    msgs = [
        Message(role=Role.ASSISTANT, id="a", tool_calls=(ToolCall("c", "run", "{}"),)),
        Message(role=Role.TOOL, content=parts, id="t", tool_call_id="c"),
    ]
    store = ArchiveStore(tmp_path)
    real_put = store.put
    calls = []

    def second_fails(text: str) -> str:
        calls.append(text)
        if len(calls) == 2:
            raise ArchiveError("injected: disk full")
        return real_put(text)

    monkeypatch.setattr(store, "put", second_fails)
    from ctxfold.compaction.archive import archive_mid_turn

    new, rep = archive_mid_turn(msgs, store, ArchiveParams(keep_recent_tool_results=0))
    assert new == msgs and rep.archived == () and rep.left_inline == ("t",)
    monkeypatch.undo()
    done, rep2 = archive_mid_turn(new, store, ArchiveParams(keep_recent_tool_results=0))
    assert len(rep2.archived) == 2 and [a.part for a in rep2.archived] == [0, 1]
    assert restore(done, store, strict=True) == msgs
