"""Where sessions are kept: a local directory (the default) or Redis/Valkey, behind one interface.

- :mod:`ctxfold.compaction.store.base`: the :class:`Store` interface, :class:`Lease` and the errors (a :class:`~ctxfold.compaction.journal.Batch` is what its append takes);
- :mod:`ctxfold.compaction.store.local`: :class:`LocalStore`, today's session files;
- :mod:`ctxfold.compaction.store.redis_store`: :class:`RedisStore`, streams, checkpoints and fenced leases in Redis;
- :mod:`ctxfold.compaction.store.spool`: :class:`SpoolingStore`, a bounded local spool for writes the store refused;
- :mod:`ctxfold.compaction.store.buffer`: :class:`BufferedLog`, how the synchronous compactor writes to a store;
- :mod:`ctxfold.compaction.store.quota`: per-account bounds and idle-session expiry in Redis (:class:`StoreLimits`);

The records themselves, and reading, folding and salvaging them, are :mod:`ctxfold.compaction.eventlog`'s: one
codec for a session directory and every store.
"""

from __future__ import annotations

import asyncio
import os

from ctxfold.chat.messages import Conversation
from ctxfold.compaction.eventlog import ResumedState, fold_events, load_events, restore_events
from ctxfold.compaction.journal import Batch
from ctxfold.compaction.store.base import (
    DEFAULT_LEASE_MS,
    Lease,
    LeaseLost,
    NoSuchSession,
    QuotaExceeded,
    SessionId,
    SpoolFull,
    Store,
    StoredSession,
    StoreError,
    StoreLimits,
    StoreUnavailable,
)
from ctxfold.compaction.store.buffer import BufferedLog
from ctxfold.compaction.store.local import LocalStore
from ctxfold.compaction.store.spool import DEFAULT_SPOOL_MAX_BYTES, Spooled, SpoolingStore

__all__ = [
    "DEFAULT_LEASE_MS", "DEFAULT_SPOOL_MAX_BYTES", "Batch", "BufferedLog", "Lease", "LeaseLost", "LocalStore",
    "NoSuchSession", "QuotaExceeded", "SessionId", "SpoolFull", "Spooled", "SpoolingStore", "Store", "StoreError", "StoreLimits",
    "StoreUnavailable", "StoredSession", "fold_events", "is_shared_url", "load_events", "open_store", "read_from_store",
    "read_restored", "restore_async", "restore_events", "restore_from_store",
]

REDIS_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


def is_shared_url(url: str | os.PathLike[str]) -> bool:
    """Whether ``url`` names a store several processes can share (Redis/Valkey), not a directory."""
    text = os.fspath(url)
    return "://" in text and text.split("://", 1)[0] in REDIS_SCHEMES


def open_store(url: str | os.PathLike[str], *, spool_dir: str | os.PathLike[str] | None = None,
               spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES, limits: StoreLimits | None = None) -> Store:
    """The store ``url`` names: ``redis://``, ``rediss://``, ``unix://``, ``valkey://`` (see
    :class:`ctxfold.compaction.store.redis_store.RedisStore` for its options), else a local directory (a path or
    ``file://``). With ``spool_dir``, a shared store's appends that fail are spooled there; with
    ``limits``, a shared store bounds its accounts and expires idle sessions. Connects lazily:
    opening never fails for an unreachable server."""
    text = os.fspath(url)
    if is_shared_url(text):
        from ctxfold.compaction.store.redis_store import RedisStore

        store: Store = RedisStore(text, limits=limits)
        if spool_dir is not None:
            store = SpoolingStore(store, spool_dir, max_bytes=spool_max_bytes)
        return store
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"store {text!r}: expected a directory, file://, redis://, rediss://, unix:// or valkey:// URL")
    return LocalStore(text.removeprefix("file://"))


async def read_restored(store: Store, session_id: str, *, salvage: bool = False) -> ResumedState:
    """The session ``session_id`` read back with every original as its conversation's messages: the full
    history, through any number of compactions and checkpoints. Strict: FormatError for a record that
    cannot be read; ``salvage``: every readable record, each one left out named in ``skipped``
    (:func:`ctxfold.compaction.eventlog.load_events`). NoSuchSession when the store holds none."""
    stored = await store.read(session_id)
    if not stored.events and not stored.unreadable:
        raise NoSuchSession(f"{store.url}: no session {session_id!r}")
    return restore_events(stored.records(), source=f"{store.url} {session_id}", salvage=salvage)


async def restore_async(store: Store, session_id: str) -> Conversation:
    """The full original conversation of ``session_id`` (strict :func:`read_restored`)."""
    return (await read_restored(store, session_id)).conversation


def read_from_store(url: str, session_id: str, *, salvage: bool = False) -> ResumedState:
    """:func:`read_restored` from the store ``url`` (what ``ctxfold restore --store`` prints);
    StoreUnavailable when it cannot be read."""

    async def run() -> ResumedState:
        store = open_store(url)
        try:
            return await read_restored(store, session_id, salvage=salvage)
        finally:
            await store.close()

    return asyncio.run(run())


def restore_from_store(url: str, session_id: str) -> Conversation:
    """The full original conversation of ``session_id`` in the store ``url`` (strict: see
    :func:`read_from_store`)."""
    return read_from_store(url, session_id).conversation
