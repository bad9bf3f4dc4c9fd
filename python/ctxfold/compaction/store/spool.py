"""A bounded local spool in front of a shared store: what could not be written is kept and replayed.

When the store is unreachable or fails part way through an append, :class:`SpoolingStore` writes the
batch (its lease, blobs and events) to a file of its own in the spool directory, fsyncs it, and raises
:class:`Spooled` (a :class:`StoreUnavailable`): the caller passes the request through with a warning,
and the batch is durable on this machine. Later batches of the same session go to the spool behind it,
so a session's events never reach the store out of order. Every append first replays the spool, in
the order it was written, oldest first (at most once a second while the store stays down, so a dead
store costs each request one failed attempt at most); :meth:`SpoolingStore.replay` may also be called
on a timer. A batch is removed from the spool only once the store has acknowledged it. Replays write
nothing twice: the store skips events whose seq it holds already.

Layout::

    <spool dir>/NNNNNNNNNNNNNNNNNNNN.batch     one batch, JSON, written whole (temp file, fsync, rename)
    <spool dir>/NNNNNNNNNNNNNNNNNNNN.refused   a batch the store refused on replay (see below)
    <spool dir>/NNNNNNNNNNNNNNNNNNNN.corrupt   a batch file that could not be read at startup

Bounded: the spool holds at most ``max_bytes`` (default 64 MiB) of pending batches; a batch that would go
past it is not kept and :class:`SpoolFull` is raised. Nothing acknowledged to a client is lost either
way: a full spool means the request is answered as a pass-through while its messages stay with the
client, which sends its whole history again with its next request.

A session with batches in the spool gets no new lease (:meth:`SpoolingStore.acquire` raises
:class:`StoreUnavailable`, so its request passes through, labelled) until they are written: a new
grant carries a later fencing token, which would refuse the spooled batches (this process's own) and
lose answers the client was given.

A spooled batch is still refused on replay when another replica took the session's lease meanwhile
(its fencing token is later) or the store lacks the events before it. The new holder built its
session from the client's history, which holds the spooled messages too. The batch is renamed
``.refused`` and kept for the operator, a warning is logged and :attr:`SpoolingStore.num_refused`
counts it (the proxy's metrics and ``/health`` show it). Refused batches do not count against the
bound of pending ones; they are kept up to ``max_bytes`` of their own, the oldest removed first.

A spool file that cannot be read at startup (cut short by a full disk, edited) is renamed
``.corrupt``, named in a warning and in :attr:`SpoolingStore.set_aside`, and the rest is replayed.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ctxfold import fastjson
from ctxfold.compaction.archive.store import LocalBackend, make_private_dir
from ctxfold.compaction.eventlog import event_seq
from ctxfold.compaction.journal import Batch
from ctxfold.compaction.store.base import (
    DEFAULT_LEASE_MS,
    Lease,
    LeaseLost,
    SpoolFull,
    Store,
    StoredSession,
    StoreUnavailable,
    batch_seqs_contiguous,
    check_blob_name,
    check_session_id,
)

log = logging.getLogger("ctxfold.compaction.store")

DEFAULT_SPOOL_MAX_BYTES = 64 * 1024 * 1024
# While the store is down, try it again at most this often (each try can cost a connect timeout).
RETRY_INTERVAL_S = 1.0
_SUFFIX = ".batch"
_REFUSED = ".refused"
_CORRUPT = ".corrupt"


class Spooled(StoreUnavailable):
    """The store is unavailable; the batch is kept in the local spool and is written when it is back."""


@dataclass(slots=True)
class _Entry:
    name: str  # file name in the spool directory
    nbytes: int
    lease: Lease
    batch: Batch


def _encode(lease: Lease, batch: Batch) -> bytes:
    return fastjson.dumps_record({
        "lease": {"session_id": lease.session_id, "token": lease.token, "owner": lease.owner, "ttl_ms": lease.ttl_ms},
        "blobs": [[name, base64.b64encode(data).decode()] for name, data in batch.blobs],
        "events": list(batch.events),
    })


def _decode(data: bytes) -> tuple[Lease, Batch]:
    """ValueError (with the reason) for a file that is not a whole batch."""
    try:
        raw = fastjson.loads(data)
        lease = Lease(check_session_id(raw["lease"]["session_id"]), int(raw["lease"]["token"]),
                      str(raw["lease"]["owner"]), int(raw["lease"].get("ttl_ms", DEFAULT_LEASE_MS)))
        blobs = tuple((check_blob_name(n), base64.b64decode(d, validate=True)) for n, d in raw["blobs"])
        events = tuple(raw["events"])
        if not all(isinstance(e, dict) and type(e.get("seq")) is int for e in events):
            raise ValueError("an event without a whole-number seq")
        batch_seqs_contiguous(events)
    except (KeyError, TypeError, ValueError, RecursionError, binascii.Error) as e:
        raise ValueError(f"not a spooled batch: {type(e).__name__}: {e}"[:300]) from None
    return lease, Batch(blobs, events)


class SpoolingStore:
    """``inner`` with a local spool for its appends. Reads see the store plus what is spooled; every
    other call goes to ``inner``. For one process: the spool directory must not be shared."""

    def __init__(self, inner: Store, spool_dir: str | os.PathLike[str], *,
                 max_bytes: int = DEFAULT_SPOOL_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"spool max_bytes must be >= 1, got {max_bytes}")
        self.inner = inner
        self.url = inner.url
        self.shared = inner.shared
        self.dir = Path(spool_dir)
        self.max_bytes = max_bytes
        make_private_dir(self.dir)
        self._backend = LocalBackend(self.dir)
        self._entries: list[_Entry] = []
        self._refused: list[tuple[str, int]] = []  # (file name, bytes), oldest first
        self.num_refused = 0  # batches the store refused on replay since this process started
        self.set_aside: list[Path] = []  # batch files that could not be read at startup
        self._counter = 0
        self._next_try = 0.0  # time.monotonic() before which a failed store is not tried again
        for name in sorted(os.listdir(self.dir)):
            path = self.dir / name
            stem, _, suffix = name.partition(".")
            if not stem.isdigit() or "." + suffix not in (_SUFFIX, _REFUSED, _CORRUPT):
                continue  # a temporary file of an interrupted write, or not the spool's
            self._counter = max(self._counter, int(stem) + 1)
            if name.endswith(_REFUSED):
                self._refused.append((name, path.stat().st_size))
            if not name.endswith(_SUFFIX):
                continue
            data = path.read_bytes()
            try:
                lease, batch = _decode(data)
            except ValueError as e:
                aside = path.with_name(stem + _CORRUPT)
                os.replace(path, aside)
                self.set_aside.append(aside)
                log.warning("spool file %s cannot be read (%s); set aside as %s, the rest is replayed",
                            path, e, aside)
                continue
            self._entries.append(_Entry(name, len(data), lease, batch))

    @property
    def nbytes(self) -> int:
        """Bytes of the batches waiting to be written (what ``max_bytes`` bounds)."""
        return sum(e.nbytes for e in self._entries)

    @property
    def refused_nbytes(self) -> int:
        """Bytes of the refused batches kept for the operator (bounded by ``max_bytes`` of their own)."""
        return sum(n for _, n in self._refused)

    @property
    def num_pending(self) -> int:
        return len(self._entries)

    def _spool(self, lease: Lease, batch: Batch, why: StoreUnavailable) -> Spooled:
        data = _encode(lease, batch)
        if self.nbytes + len(data) > self.max_bytes:
            raise SpoolFull(f"{why}; the local spool {self.dir} is full ({self.nbytes:,} of {self.max_bytes:,} "
                            "bytes), so this write is not kept") from why
        name = f"{self._counter:020d}{_SUFFIX}"
        try:
            self._backend.write_atomic(name, data)
        except OSError as e:
            raise StoreUnavailable(f"{why}; the local spool {self.dir} cannot keep it either: {e}") from why
        self._counter += 1
        self._entries.append(_Entry(name, len(data), lease, batch))
        return Spooled(f"{why}; kept in the local spool {self.dir}, to be written when the store is back")

    async def replay(self, *, force: bool = False) -> bool:
        """Write the spooled batches to the store, oldest first, until one fails; True when the spool has
        nothing pending left. Without ``force``, does nothing for a second after a failed try."""
        if not self._entries:
            return True
        if not force and time.monotonic() < self._next_try:
            return False
        while self._entries:
            entry = self._entries[0]
            try:
                await self.inner.append(entry.lease, entry.batch)
            except StoreUnavailable:
                self._next_try = time.monotonic() + RETRY_INTERVAL_S
                return False
            except (LeaseLost, ValueError) as e:
                self._keep_refused(entry, e)
            else:
                os.unlink(self.dir / entry.name)
            self._entries.pop(0)
        return True

    def _keep_refused(self, entry: _Entry, why: Exception) -> None:
        refused = entry.name[: -len(_SUFFIX)] + _REFUSED
        os.replace(self.dir / entry.name, self.dir / refused)
        self.num_refused += 1
        self._refused.append((refused, entry.nbytes))
        log.warning("spooled batch %s of session %s refused by the store: %s; its %d event(s) are kept as %s",
                    entry.name, entry.lease.session_id, why, len(entry.batch.events), self.dir / refused)
        while self.refused_nbytes > self.max_bytes and len(self._refused) > 1:
            oldest, _ = self._refused.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / oldest)
            log.warning("refused spool batch %s removed: refused batches are kept up to %d bytes",
                        self.dir / oldest, self.max_bytes)

    def _pending_for(self, session_id: str) -> list[_Entry]:
        return [e for e in self._entries if e.lease.session_id == session_id]

    async def append(self, lease: Lease, batch: Batch, *, release: bool = False) -> None:
        """:meth:`Store.append`; :class:`Spooled` when the batch went to the spool instead (the store is
        down, or earlier batches of the session wait there), :class:`SpoolFull` when it could not."""
        await self.replay()
        if self._pending_for(lease.session_id):
            raise self._spool(lease, batch, StoreUnavailable(
                f"store {self.url}: earlier writes of session {lease.session_id} are not written yet"))
        try:
            # Spooled, the lease is kept (the spool replays under it) and runs out on its own.
            await self.inner.append(lease, batch, release=release)
        except StoreUnavailable as e:
            self._next_try = time.monotonic() + RETRY_INTERVAL_S
            raise self._spool(lease, batch, e) from e

    async def read(self, session_id: str) -> StoredSession:
        """The store's events, then the spooled ones it does not hold yet."""
        stored = await self.inner.read(session_id)
        for entry in self._pending_for(session_id):
            stored.events += [e for e in entry.batch.events if event_seq(e) >= stored.next_seq]
        return stored

    async def checkpoint(self, lease: Lease) -> int:
        if self._pending_for(lease.session_id):
            raise StoreUnavailable(f"store {self.url}: session {lease.session_id} has writes in the local spool; "
                                   "no checkpoint until they are written")
        return await self.inner.checkpoint(lease)

    async def exists(self, session_id: str) -> bool:
        return bool(self._pending_for(session_id)) or await self.inner.exists(session_id)

    async def sessions(self, prefix: str = "") -> list[str]:
        return await self.inner.sessions(prefix)

    async def put_blob(self, session_id: str, name: str, data: bytes) -> None:
        await self.inner.put_blob(session_id, name, data)

    async def blob_names(self, session_id: str) -> list[str]:
        spooled = {n for entry in self._pending_for(session_id) for n, _ in entry.batch.blobs}
        return sorted(spooled | set(await self.inner.blob_names(session_id)))

    async def get_blob(self, session_id: str, name: str) -> bytes:
        for entry in reversed(self._pending_for(session_id)):
            for n, data in entry.batch.blobs:
                if n == name:
                    return data
        return await self.inner.get_blob(session_id, name)

    async def acquire(self, session_id: str, *, owner: str, ttl_ms: int = DEFAULT_LEASE_MS,
                      new: bool = False) -> Lease | None:
        """The lease, once what the spool holds of the session is written under the tokens it was written
        with (a new grant would fence those out). StoreUnavailable while any of it still waits."""
        if self._pending_for(session_id):
            await self.replay(force=True)
            if waiting := self._pending_for(session_id):
                raise StoreUnavailable(
                    f"store {self.url}: {len(waiting)} earlier write(s) of session {session_id} wait in the local "
                    "spool; no new lease until the store takes them")
        return await self.inner.acquire(session_id, owner=owner, ttl_ms=ttl_ms, new=new)

    async def renew(self, lease: Lease) -> bool:
        return await self.inner.renew(lease)

    async def release(self, lease: Lease) -> None:
        await self.inner.release(lease)

    async def quarantine(self, session_id: str, reason: str) -> None:
        await self.inner.quarantine(session_id, reason)

    async def close(self) -> None:
        await self.inner.close()
