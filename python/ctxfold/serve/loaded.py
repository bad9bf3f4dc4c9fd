"""The conversations a proxy keeps in memory: per key, its loaded sessions (least recently used first),
one asyncio lock per key, and the bounds on both (sessions, event-log bytes) that :meth:`trim` keeps by
closing whole keys, least recently used first. What is evicted is stored, but for the messages of a
request that got no answer (they wait for an answer's commit), which its client sends again: the next
request of an evicted conversation loads it again."""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ctxfold.serve.routing import ProxySession


@dataclass(slots=True)
class LoadedKey:
    """The loaded sessions of one key, least recently used first."""

    sessions: list[ProxySession]
    nbytes: int = 0  # their event logs' bytes, as last measured


class LoadedSessions:
    """Loaded keys and their locks, bounded in sessions and bytes. A lock lives as long as its key is
    loaded, or someone holds or awaits it: the table does not grow with every conversation ever seen,
    and a key never has two locks."""

    def __init__(self, max_sessions: int, max_bytes: int) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_loaded_sessions: must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._loaded_locks: dict[str, asyncio.Lock] = {}  # the locks of the keys loaded
        self._keys: OrderedDict[str, LoadedKey] = OrderedDict()  # least recently used first
        self._num_sessions = 0
        self._num_bytes = 0
        # Told the sessions that leave memory (unloaded, or no longer among their key's): the store
        # forgets what it remembers of them (LocalStore.forget).
        self.on_leave: Callable[[list[ProxySession]], None] = lambda sessions: None

    def lock(self, key: str) -> asyncio.Lock:
        lock = self._loaded_locks.get(key) or self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    # -- entries ------------------------------------------------------------------------------------
    def get(self, key: str) -> LoadedKey | None:
        """The key's entry, marked most recently used; None when it is not loaded."""
        entry = self._keys.get(key)
        if entry is not None:
            self._keys.move_to_end(key)
        return entry

    def peek(self, key: str) -> LoadedKey | None:
        """The key's entry, if loaded, without marking it used."""
        return self._keys.get(key)

    def put(self, key: str, sessions: list[ProxySession]) -> LoadedKey:
        """A key loaded with ``sessions`` (perhaps none yet)."""
        entry = LoadedKey(sessions, sum(s.log_nbytes for s in sessions))
        self._keys[key] = entry
        self._loaded_locks[key] = self.lock(key)
        self._num_sessions += len(sessions)
        self._num_bytes += entry.nbytes
        return entry

    def add(self, entry: LoadedKey, session: ProxySession) -> None:
        """A session joins a loaded key (a new conversation, a fork)."""
        entry.sessions.append(session)
        self._num_sessions += 1
        entry.nbytes += session.log_nbytes
        self._num_bytes += session.log_nbytes

    def replace(self, entry: LoadedKey, sessions: list[ProxySession]) -> None:
        """A key's loaded sessions are now ``sessions`` (a shared store's listing read again)."""
        nbytes = sum(s.log_nbytes for s in sessions)
        self._num_sessions += len(sessions) - len(entry.sessions)
        self._num_bytes += nbytes - entry.nbytes
        kept = {id(s) for s in sessions}
        left = [s for s in entry.sessions if id(s) not in kept]
        entry.sessions, entry.nbytes = sessions, nbytes
        if left:
            self.on_leave(left)

    @staticmethod
    def use(entry: LoadedKey, session: ProxySession) -> None:
        """``session`` is the key's most recently used."""
        if entry.sessions[-1] is not session:
            entry.sessions.remove(session)
            entry.sessions.append(session)

    # -- bounds -------------------------------------------------------------------------------------
    def trim(self, measure: Callable[[ProxySession], None]) -> list[str]:
        """Close and forget the least recently used keys while more than ``max_sessions`` sessions or
        ``max_bytes`` of logs are loaded; returns them. A key whose lock is held stays (its sessions are
        in use). ``measure`` first brings the last used session's :attr:`~ProxySession.log_nbytes` up to
        date: its log grew by the request and its answer."""
        if self._keys:
            entry = self._keys[next(reversed(self._keys))]
            before = entry.nbytes
            for s in entry.sessions[-1:]:  # the session the request used is last
                measure(s)
            entry.nbytes = sum(s.log_nbytes for s in entry.sessions)
            self._num_bytes += entry.nbytes - before
        evicted: list[str] = []
        for key in list(self._keys):
            if self._num_sessions <= self.max_sessions and self._num_bytes <= self.max_bytes:
                break
            lock = self._locks.get(key)
            if lock is not None and lock.locked():
                continue
            self.unload(key)
            evicted.append(key)
        return evicted

    def unload(self, key: str) -> None:
        """Close and forget ``key``'s sessions, if loaded."""
        entry = self._keys.pop(key, None)
        if entry is None:
            return
        for s in entry.sessions:
            s.compactor.close()
        self._num_sessions -= len(entry.sessions)
        self._num_bytes -= entry.nbytes
        self._loaded_locks.pop(key, None)
        self.on_leave(entry.sessions)

    # -- figures ------------------------------------------------------------------------------------
    @property
    def num_locked(self) -> int:
        """Loaded keys whose lock is held: requests under way, an answer not yet recorded."""
        return sum(1 for lock in list(self._loaded_locks.values()) if lock.locked())

    @property
    def num_sessions(self) -> int:
        return self._num_sessions

    @property
    def nbytes(self) -> int:
        """Event-log bytes of the loaded sessions, as last measured."""
        return self._num_bytes

    def sessions(self) -> list[ProxySession]:
        return [s for entry in self._keys.values() for s in entry.sessions]
