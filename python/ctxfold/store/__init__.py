"""Where sessions are kept: a local directory (the default) or Redis/Valkey, behind one interface.

- :mod:`ctxfold.store.base`: the :class:`Store` interface, :class:`Lease`, :class:`Batch` and the errors;
- :mod:`ctxfold.store.local`: :class:`LocalStore`, today's session files;
- :mod:`ctxfold.store.redis_store`: :class:`RedisStore`, streams, checkpoints and fenced leases in Redis;
- :mod:`ctxfold.store.spool`: :class:`SpoolingStore`, a bounded local spool for writes the store refused;
- :mod:`ctxfold.store.buffer`: :class:`BufferedLog`, how the synchronous compactor writes to a store;
- :mod:`ctxfold.store.events`: the records themselves, loading and folding them.
"""

from __future__ import annotations

import asyncio
import os

from ctxfold.messages import Conversation
from ctxfold.store.base import (
    DEFAULT_LEASE_MS,
    Batch,
    Lease,
    LeaseLost,
    NoSuchSession,
    SpoolFull,
    Store,
    StoredSession,
    StoreError,
    StoreUnavailable,
)
from ctxfold.store.buffer import BufferedLog
from ctxfold.store.events import fold_events, load_events, restore_events
from ctxfold.store.local import LocalStore
from ctxfold.store.spool import DEFAULT_SPOOL_MAX_BYTES, Spooled, SpoolingStore

__all__ = [
    "DEFAULT_LEASE_MS", "DEFAULT_SPOOL_MAX_BYTES", "Batch", "BufferedLog", "Lease", "LeaseLost", "LocalStore",
    "NoSuchSession", "SpoolFull", "Spooled", "SpoolingStore", "Store", "StoreError", "StoreUnavailable",
    "StoredSession", "fold_events", "is_shared_url", "load_events", "open_store", "restore_events",
    "restore_from_store",
]

REDIS_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


def is_shared_url(url: str | os.PathLike[str]) -> bool:
    """Whether ``url`` names a store several processes can share (Redis/Valkey), not a directory."""
    text = os.fspath(url)
    return "://" in text and text.split("://", 1)[0] in REDIS_SCHEMES


def open_store(url: str | os.PathLike[str], *, spool_dir: str | os.PathLike[str] | None = None,
               spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES) -> Store:
    """The store ``url`` names: ``redis://``, ``rediss://``, ``unix://``, ``valkey://`` (see
    :class:`ctxfold.store.redis_store.RedisStore` for its options), else a local directory (a path or
    ``file://``). With ``spool_dir``, a shared store's appends that fail are spooled there. Connects
    lazily: opening never fails for an unreachable server."""
    text = os.fspath(url)
    if is_shared_url(text):
        from ctxfold.store.redis_store import RedisStore

        store: Store = RedisStore(text)
        if spool_dir is not None:
            store = SpoolingStore(store, spool_dir, max_bytes=spool_max_bytes)
        return store
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"store {text!r}: expected a directory, file://, redis://, rediss://, unix:// or valkey:// URL")
    return LocalStore(text.removeprefix("file://"))


async def restore_async(store: Store, session_id: str) -> Conversation:
    stored = await store.read(session_id)
    if not stored.events:
        raise NoSuchSession(f"{store.url}: no session {session_id!r}")
    return restore_events(stored.events, source=f"{store.url} {session_id}")


def restore_from_store(url: str, session_id: str) -> Conversation:
    """The full original conversation of ``session_id`` in the store ``url``, through any number of
    compactions and checkpoints (what ``ctxfold restore`` prints). NoSuchSession when it holds none,
    StoreUnavailable when it cannot be read."""

    async def run() -> Conversation:
        store = open_store(url)
        try:
            return await restore_async(store, session_id)
        finally:
            await store.close()

    return asyncio.run(run())
