"""Sessions in a local directory: today's session files (:mod:`ctxfold.compaction.session`), behind the store interface.

``<root>/<session id>/events.jsonl`` holds the records one a line, exactly as :class:`Session` writes
them (so a session written either way loads either way), and blobs are files under the session's
directory (``history/``, ``archive/``). An id whose last name is ``archive`` (the proxy's archive of a
key, ``<key>/archive``) is an archive directory itself: its ``archive/<sha256>.txt`` blobs are its files
``<sha256>.txt``, the layout :class:`ctxfold.compaction.archive.ArchiveStore` reads. So the proxy's data
directory is a local store rooted there, and what earlier versions wrote in it loads as it is.

Appends are one ``write`` on an ``O_APPEND`` descriptor, fsynced as ``fsync`` says: ``always`` (the
default), ``compactions`` (only batches that hold more than the session's header and messages: a
view, a state, a blob; the proxy's default, since a client sends its messages again with every
request) or ``never``. Blobs are always written atomically and fsynced. A torn last line (a crash
mid-write) is ignored on reading and cut before the next append.

A session set aside (:meth:`LocalStore.quarantine`: its log cannot be read) keeps a ``QUARANTINED``
file saying why, and is listed no more.

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
from ctxfold.compaction.journal import Batch
from ctxfold.compaction.session import ARCHIVE_DIR, EVENTS_FILE, HISTORY_DIR, Session
from ctxfold.compaction.store.base import (
    BLOB_NAME_PATTERN,
    DEFAULT_LEASE_MS,
    FSYNC_MODES,
    Lease,
    LeaseLost,
    StoredSession,
    StoreUnavailable,
    batch_seqs_contiguous,
    check_blob_name,
    check_session_id,
    refuse_to_fold,
)

QUARANTINE_FILE = "QUARANTINED"  # in a session directory set aside: why
# Blobs up to this size are read on the event loop (about 30 us from the page cache), larger ones in a
# worker thread.
LOOP_READ_MAX_BYTES = 256 * 1024

P = ParamSpec("P")
T = TypeVar("T")


class LocalStore:
    """A :class:`ctxfold.compaction.store.base.Store` in a local directory (the default; nothing to install)."""

    shared = False

    def __init__(self, root: str | os.PathLike[str], *, fsync: str = "always") -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync: expected one of {', '.join(FSYNC_MODES)}, got {fsync!r}")
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync = fsync
        self._fence: dict[str, int] = {}  # session id -> last token granted
        self._leases: dict[str, tuple[str, int, float]] = {}  # session id -> (owner, token, expiry monotonic s)
        self._next: dict[str, int] = {}  # session id -> next seq, once read or written
        # Sessions whose log this process wrote last (whole lines): no torn tail to look for before an append.
        self._clean: set[str] = set()

    def _dir(self, session_id: str) -> Path:
        return self.root / check_session_id(session_id)

    def _blob_path(self, session_id: str, name: str) -> Path:
        folder, file = check_blob_name(name).split("/")
        if folder == ARCHIVE_DIR and session_id.rsplit("/", 1)[-1] == ARCHIVE_DIR:
            return self._dir(session_id) / file  # an archive directory's own files (module docstring)
        return self._dir(session_id) / folder / file

    # -- reading ----------------------------------------------------------------------------------
    async def exists(self, session_id: str) -> bool:
        return (self._dir(session_id) / EVENTS_FILE).is_file()

    async def sessions(self, prefix: str = "") -> list[str]:
        """The ids of the stored sessions that start with ``prefix``, sorted; not the ones set aside.
        Walks only the folder the prefix names (the proxy asks for one key's sessions per request)."""
        start = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        out = []
        if start.is_dir():
            for dirpath, dirnames, filenames in os.walk(start):
                rel = os.path.relpath(dirpath, self.root)
                if EVENTS_FILE in filenames and rel != "." and QUARANTINE_FILE not in filenames:
                    out.append(Path(rel).as_posix())
                # ids have up to 5 names (check_session_id): no deeper
                dirnames[:] = [d for d in dirnames if d not in (HISTORY_DIR, ARCHIVE_DIR) and rel.count(os.sep) < 4]
        return sorted(s for s in out if s.startswith(prefix))

    async def get_blob(self, session_id: str, name: str) -> bytes:
        # A small file on the event loop: its read is about as quick as a thread hop. A large one in a
        # worker thread: a read of megabytes would hold every other conversation for milliseconds.
        path = self._blob_path(session_id, name)
        try:
            if path.stat().st_size <= LOOP_READ_MAX_BYTES:
                return path.read_bytes()
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StoreUnavailable(f"{path}: {e.strerror or e}") from e

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

    def _syncs(self, batch: Batch) -> bool:
        """Whether appending ``batch`` ends with an fsync (see ``fsync`` in the module docstring)."""
        if self.fsync == "compactions":
            return any(e.get("type") not in ("header", "append") for e in batch.events)
        return self.fsync == "always" and bool(batch.events)

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
        clean = sid in self._clean
        self._clean.discard(sid)  # until this write is whole
        _append_lines(self._dir(sid), events, sync=self._syncs(batch), clean=clean)
        self._clean.add(sid)
        self._next[sid] = event_seq(events[-1]) + 1

    async def append(self, lease: Lease, batch: Batch, *, release: bool = False) -> None:
        # A batch without an fsync (the messages of a request and its answer) in this thread: a write
        # is quicker than the two context switches of a worker thread. An fsync (a compaction, blobs)
        # in a worker thread: the proxy's other conversations do not wait for the disk.
        if batch.blobs or self._syncs(batch):
            await asyncio.to_thread(self._guard, "appending events", self._append, lease, batch)
        else:
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
        self._clean.add(lease.session_id)
        return stored.next_seq - 1

    async def checkpoint(self, lease: Lease) -> int:
        return await asyncio.to_thread(self._guard, "writing a checkpoint", self._checkpoint, lease)

    def _put_blob(self, session_id: str, name: str, data: bytes) -> None:
        path = self._blob_path(session_id, name)
        make_private_dir(path.parent)
        LocalBackend(path.parent).write_atomic(path.name, data)

    async def put_blob(self, session_id: str, name: str, data: bytes) -> None:
        # A blob is written atomically, fsync and all: in a worker thread (see append).
        await asyncio.to_thread(self._guard, f"writing {name}", self._put_blob, session_id, name, data)

    async def blob_names(self, session_id: str) -> list[str]:
        # On the event loop, as get_blob: a directory listing.
        folder = self._dir(session_id)
        own_archive = session_id.rsplit("/", 1)[-1] == ARCHIVE_DIR  # its files are the blobs (_blob_path)
        places = [(folder, ARCHIVE_DIR)] if own_archive else [(folder / ARCHIVE_DIR, ARCHIVE_DIR),
                                                               (folder / HISTORY_DIR, HISTORY_DIR)]
        out: list[str] = []
        for place, kind in places:
            try:
                with os.scandir(place) as it:
                    names = [f"{kind}/{e.name}" for e in it]
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StoreUnavailable(f"{place}: {e.strerror or e}") from e
            out.extend(n for n in names if BLOB_NAME_PATTERN.fullmatch(n))
        return sorted(out)

    def _quarantine(self, session_id: str, reason: str) -> None:
        LocalBackend(self._dir(session_id)).write_atomic(QUARANTINE_FILE, (reason + "\n").encode())

    async def quarantine(self, session_id: str, reason: str) -> None:
        await asyncio.to_thread(self._guard, "setting a session aside", self._quarantine, session_id, reason)

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
        if new:
            # The session's directory, made here and only here: None when the id is taken (a session, one
            # set aside, one whose first write never landed), so the caller tries the next. The first
            # grant of the id (token 1), whatever this process granted for a directory deleted since.
            if not self._guard("making a session directory", _make_new_dir, self._dir(session_id)):
                return None
            self._fence.pop(session_id, None)
            self._next.pop(session_id, None)
            self._clean.discard(session_id)
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

    def forget(self, session_ids: list[str]) -> None:
        """Drop what this process remembers of sessions deleted from the directory (an expiry sweep's)
        or gone from its memory: their fencing tokens, next numbers and checked paths, which are read
        again from the directory if they come back. A long-running proxy would otherwise keep an entry
        for every session it ever served. A session still leased is kept."""
        for sid in session_ids:
            if sid in self._leases:
                continue
            self._fence.pop(sid, None)
            self._next.pop(sid, None)
            self._clean.discard(sid)

    @property
    def num_remembered(self) -> int:
        """Sessions this process holds a fencing token of (what :meth:`forget` frees)."""
        return len(self._fence)

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


def _make_new_dir(folder: Path) -> bool:
    """Make ``folder`` (mode 0700, its parents too); False when it exists already."""
    make_private_dir(folder.parent)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        return False
    return True


def _append_lines(folder: Path, events: list[Event], *, sync: bool = True, clean: bool = False) -> None:
    """Append records as lines of ``folder/events.jsonl``: one write, then (``sync``) fsync; all or
    none. ``clean``: the log ends with a whole line (this process wrote it last): nothing to cut."""
    path = os.path.join(folder, EVENTS_FILE)  # not pathlib's join: one of these per request
    if not clean:
        make_private_dir(folder)
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
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
