"""Sessions in a local directory: today's session files (:mod:`ctxfold.compaction.session`), behind the store interface.

``<root>/<session id>/events.jsonl`` holds the records one a line, exactly as :class:`Session` writes
them (so a session written either way loads either way), and blobs are files under the session's
directory (``history/``, ``archive/``). Appends are one ``write`` on an ``O_APPEND`` descriptor and an
fsync; a torn last line (a crash mid-write) is ignored on reading and cut before the next append.

The lease lives in this process: the local store is for one process (``shared`` is False), so the
lease and its fencing token only order this process's own writers (the fence is kept in memory and
checked before every write). A checkpoint rewrites the log as its fold (same format, written to a temp
file and renamed), so it must not run while a :class:`Session` holds the same log open for appending.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from ctxfold.compaction.archive.store import LocalBackend, make_private_dir, refuse_symlink
from ctxfold.compaction.eventlog import Event, encode_event, event_seq, fold_events
from ctxfold.compaction.session import EVENTS_FILE, Session
from ctxfold.compaction.store.base import (
    DEFAULT_LEASE_MS,
    Batch,
    Lease,
    LeaseLost,
    StoredSession,
    StoreUnavailable,
    batch_seqs_contiguous,
    check_blob_name,
    check_session_id,
    refuse_to_fold,
)

P = ParamSpec("P")
T = TypeVar("T")


class LocalStore:
    """A :class:`ctxfold.compaction.store.base.Store` in a local directory (the default; nothing to install)."""

    shared = False

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self._fence: dict[str, int] = {}  # session id -> last token granted
        self._leases: dict[str, tuple[str, int, float]] = {}  # session id -> (owner, token, expiry monotonic s)
        self._next: dict[str, int] = {}  # session id -> next seq, once read

    def _dir(self, session_id: str) -> Path:
        return self.root / check_session_id(session_id)

    # -- reading ----------------------------------------------------------------------------------
    async def exists(self, session_id: str) -> bool:
        return (self._dir(session_id) / EVENTS_FILE).is_file()

    async def sessions(self, prefix: str = "") -> list[str]:
        out = []
        if self.root.is_dir():
            for dirpath, dirnames, filenames in os.walk(self.root):
                rel = os.path.relpath(dirpath, self.root)
                if EVENTS_FILE in filenames and rel != ".":
                    out.append(Path(rel).as_posix())
                dirnames[:] = [d for d in dirnames if d not in ("history", "archive") and rel.count(os.sep) < 3]
        return sorted(s for s in out if s.startswith(prefix))

    def _read(self, session_id: str) -> StoredSession:
        session = Session(self._dir(session_id))
        out = StoredSession(session_id)
        if session.exists():
            records, _ = session.read_records()  # a torn last line: not written
            for record in records:
                if record.event is None:
                    out.unreadable.append((len(out.events), record))
                else:
                    out.events.append(record.event)
        self._next[session_id] = out.next_seq
        return out

    async def read(self, session_id: str) -> StoredSession:
        return await asyncio.to_thread(self._guard, "reading the session", self._read, session_id)

    # -- writing ----------------------------------------------------------------------------------
    def _check_fence(self, lease: Lease) -> None:
        fence = self._fence.get(lease.session_id, 0)
        if fence > lease.token:
            raise LeaseLost(f"{self._dir(lease.session_id)}: write refused: the session's lease was granted to "
                            f"another writer (fencing token {fence})")

    def _append(self, lease: Lease, batch: Batch) -> None:
        sid = lease.session_id
        batch_seqs_contiguous(batch.events)
        self._check_fence(lease)
        for name, data in batch.blobs:
            self._put_blob(sid, name, data)
        nxt = self._next[sid] if sid in self._next else self._read(sid).next_seq
        events = [e for e in batch.events if event_seq(e) >= nxt]  # the rest is stored already (a replay)
        if not events:
            return
        if event_seq(events[0]) != nxt:
            raise ValueError(f"{self._dir(sid)}: events missing before seq {event_seq(events[0])} "
                             f"(the log expects {nxt})")
        _append_lines(self._dir(sid), events)
        self._next[sid] = event_seq(events[-1]) + 1

    async def append(self, lease: Lease, batch: Batch, *, release: bool = False) -> None:
        # In this thread: an append is one write and an fsync, which the proxy's loop has waited for
        # until now too; a thread hop would cost more than it frees for small batches.
        self._guard("appending events", self._append, lease, batch)
        if release:
            await self.release(lease)

    def _checkpoint(self, lease: Lease) -> int:
        self._check_fence(lease)
        stored = self._read(lease.session_id)
        refuse_to_fold(stored, str(self.root))
        if not stored.events:
            return -1
        folded = fold_events(stored.events)
        LocalBackend(self._dir(lease.session_id)).write_atomic(
            EVENTS_FILE, b"".join(encode_event(e) + b"\n" for e in folded))
        return stored.next_seq - 1

    async def checkpoint(self, lease: Lease) -> int:
        return await asyncio.to_thread(self._guard, "writing a checkpoint", self._checkpoint, lease)

    def _put_blob(self, session_id: str, name: str, data: bytes) -> None:
        folder, file = check_blob_name(name).split("/")
        make_private_dir(self._dir(session_id))
        LocalBackend(self._dir(session_id) / folder).write_atomic(file, data)

    async def put_blob(self, session_id: str, name: str, data: bytes) -> None:
        self._guard(f"writing {name}", self._put_blob, session_id, name, data)

    async def get_blob(self, session_id: str, name: str) -> bytes:
        folder, file = check_blob_name(name).split("/")
        path = self._dir(session_id) / folder / file
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StoreUnavailable(f"{path}: {e.strerror or e}") from e

    # -- the lease --------------------------------------------------------------------------------
    async def acquire(self, session_id: str, *, owner: str, ttl_ms: int = DEFAULT_LEASE_MS,
                      new: bool = False) -> Lease | None:
        # No accounts here (new is for StoreLimits): the proxy's data directory keeps its own (serve.quota).
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        check_session_id(session_id)
        held = self._leases.get(session_id)
        now = time.monotonic()
        if held is not None and held[2] > now:
            return None
        token = self._fence.get(session_id, 0) + 1
        self._fence[session_id] = token
        self._leases[session_id] = (owner, token, now + ttl_ms / 1000)
        return Lease(session_id, token, owner, ttl_ms)

    async def renew(self, lease: Lease) -> bool:
        held = self._leases.get(lease.session_id)
        now = time.monotonic()
        if held is None or held[:2] != (lease.owner, lease.token) or held[2] <= now:
            return False
        self._leases[lease.session_id] = (lease.owner, lease.token, now + lease.ttl_ms / 1000)
        return True

    async def release(self, lease: Lease) -> None:
        held = self._leases.get(lease.session_id)
        if held is not None and held[:2] == (lease.owner, lease.token):
            del self._leases[lease.session_id]

    async def close(self) -> None:
        return None

    def _guard(self, what: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn``; a failing disk (full, read-only, I/O error) as StoreUnavailable, which the proxy
        handles like an unreachable Redis. A symbolic link where a directory should be stays an OSError."""
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise
            raise StoreUnavailable(f"{self.root}: {what} failed: {e.strerror or e}") from e


def _append_lines(folder: Path, events: list[Event]) -> None:
    """Append records as lines of ``folder/events.jsonl``: one write, then fsync; all or none."""
    make_private_dir(folder)
    path = folder / EVENTS_FILE
    refuse_symlink(path)
    # Session's own tail cutter: a line torn by a crash ends before the first new one starts.
    Session(folder)._cut_torn_tail()
    data = b"".join(encode_event(e) + b"\n" for e in events)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        written = os.write(fd, data)
        if written != len(data):
            os.ftruncate(fd, os.fstat(fd).st_size - written)
            raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes); disk full?", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)
