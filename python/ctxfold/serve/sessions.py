"""The proxy's sessions: which stored conversation a request continues, and its compactor.

A chat.completions client sends the whole history with every request. The proxy keeps each
conversation as a ctxfold session (event log, history dumps, archive) under its data directory,
per tenant:

    <data_dir>/sessions/<key>/<n>/                   the anonymous tenant's sessions (no credential)
    <data_dir>/tenants/<tenant>/sessions/<key>/<n>/  a tenant's sessions
    .../sessions/<key>/archive/                      the archive the key's sessions share

The tenant is a keyed hash (HMAC-SHA256) of the credential the client presents (the Authorization
header, or the header the operator names), never the credential itself: two API keys never share a
directory, an archive or a lock, and nothing on disk gives a key away. The HMAC key comes from the
operator (a file, or ``CTXFOLD_TENANT_KEY``), else it is generated once into ``<data_dir>/tenant.key``
(0600), so tenants keep their directories across restarts.

Within a tenant, the key is the ``X-Ctxfold-Session`` header when the client sends one, else a digest
of the system prompt and the first message. Several sessions can share a key (two conversations that
start alike, or a client that rewrote its history). A request continues the one whose stored messages
are the longest prefix of the messages it carries; re-sends an answered request (a retry, a
regeneration: its messages are a session's minus the answers the proxy recorded) by continuing that
session without recording a second answer; and when its history diverges from every session (an
edited message, different tool calls sent back), forks the session it shares the longest prefix with:
the new session's log is the parent's up to that prefix (its counts, archive references and
summaries kept), then the request's own messages.

Messages are compared by what the model sees (role, content, tool calls, the call a result answers),
not by their JSON bytes, so a client may drop a field or reorder keys; reasoning is left out because
clients are told to drop it when they send history back. The common case, a client that sends its
history back as it sent it before, costs one comparison of dicts (in C): each session keeps the dict
each of its messages last came in, and falls back to :func:`fingerprint_wire` only where a dict differs.

Sessions are kept through the :class:`~ctxfold.compaction.store.Store` interface, one path for both
stores (:mod:`ctxfold.serve.stored_sessions`): by default a
:class:`~ctxfold.compaction.store.LocalStore` rooted at the data directory (the layout above, which every
earlier version wrote and ``ctxfold restore`` reads), so a restarted proxy finds every conversation again
and resumes it on its next request; with a shared store (``ctxfold serve --store redis://...``) the
same sessions, under the same relative names, live in Redis instead, and any number of proxy
processes serve any request of any conversation (docs/store.md). A session whose log cannot be read is
set aside (quarantined, see :meth:`SessionStore.find`): it affects no other session, and its
conversation continues in a new one.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ctxfold.chat.messages import Conversation
from ctxfold.compaction.archive.store import make_private_dir
from ctxfold.compaction.store import (
    DEFAULT_LEASE_MS,
    LocalStore,
    SpoolingStore,
    Store,
)
from ctxfold.compaction.store.local import QUARANTINE_FILE
from ctxfold.compaction.store.redis_store import default_owner
from ctxfold.serve import DEFAULT_MAX_LOADED_BYTES, DEFAULT_MAX_LOADED_CONVERSATIONS
from ctxfold.serve.keys import (
    ANONYMOUS_TENANT,
    SESSION_HEADER,
    ConversationKey,
    fingerprint_wire,
    is_anonymous_key,
    load_tenant_key,
    scope_of,
    session_key,
    tenant_of,
)
from ctxfold.serve.loaded import LoadedSessions
from ctxfold.serve.object_archive import ObjectArchives
from ctxfold.serve.quota import DiskQuota
from ctxfold.serve.routing import ProxySession, route
from ctxfold.serve.stored_sessions import (
    StoreCompactorFactory,
    StoredSessions,
    copy_referenced_archive,
    one_line,
)

__all__ = ["QUARANTINE_FILE", "WARNING_HEADER", "SessionStore", "StoreCompactorFactory", "copy_referenced_archive",
           "is_storage_error"]

log = logging.getLogger("ctxfold.serve")

WARNING_HEADER = "X-Ctxfold-Warning"  # what the proxy could not do for a request, one header each
# OSError numbers that mean the data directory cannot take a write: the request then passes through
# uncompacted (the client sends its history again with the next request, so nothing is lost).
# (Not EIO: a read can fail with it too, after an answer has begun, where passing through is too late.)
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM})
STORAGE_ERROR_HOLD_S = 60.0  # /health reports a failed write for this long after it
MAX_UNSTORED_NOTES = 4096  # conversations whose last answer the store refused, said on their next request
MIN_FREE_BYTES = 1 << 20  # below this, /health calls the data directory full


def is_storage_error(error: BaseException) -> bool:
    """Whether ``error`` is the data directory refusing a write (full, read-only, no permission)."""
    return (isinstance(error, OSError) and not isinstance(error, ConnectionError)
            and error.errno in STORAGE_ERRNOS)



class SessionStore:
    """The proxy's sessions, in one :class:`~ctxfold.compaction.store.Store`: a
    :class:`~ctxfold.compaction.store.LocalStore` rooted at the data directory unless ``store`` is given
    (a shared one: Redis), loaded lazily, one asyncio lock per (tenant, key). What the store does per
    request (leases, reads, creating, forking, commits) is :class:`StoredSessions`'. At most
    ``max_loaded_sessions`` sessions, and event logs of ``max_loaded_bytes`` in all, stay loaded: whole
    keys go, least recently used first (see :meth:`trim`)."""

    def __init__(self, data_dir: Path, make_compactor: StoreCompactorFactory, *,
                 max_loaded_sessions: int = DEFAULT_MAX_LOADED_CONVERSATIONS, archive_url: str | None = None,
                 max_loaded_bytes: int = DEFAULT_MAX_LOADED_BYTES, tenant_header: str = "Authorization",
                 tenant_key: bytes | None = None, fsync: str = "always", store: Store | None = None,
                 lease_ms: int = DEFAULT_LEASE_MS, owner: str | None = None, quota: DiskQuota | None = None) -> None:
        self.cache = LoadedSessions(max_loaded_sessions, max_loaded_bytes)
        self.data_dir = Path(data_dir)
        self.tenant_header = tenant_header
        self._tenant_key = tenant_key
        self.num_quarantined = 0  # sessions set aside since start (metric)
        self.num_forks = 0  # sessions forked from another since start (metric)
        # The last failure to write the data directory: (monotonic time, reason), for /health.
        self.storage_error: tuple[float, str] | None = None
        # Sessions whose last answer the store refused, oldest first: session id -> why, said to the next
        # request this process routes to them (those that never come back are forgotten past
        # MAX_UNSTORED_NOTES).
        self._unstored: OrderedDict[str, str] = OrderedDict()
        if store is None:
            store = LocalStore(self.data_dir, fsync=fsync)
        # The data directory's per-tenant accounts (serve.quota); a shared store keeps its own.
        self.quota = quota if not store.shared else None
        # ``archive_url``: archived outputs in object storage shared by replicas (serve.object_archive).
        self.cache.on_leave = lambda sessions: self.forget_sessions([s.store_id for s in sessions if s.store_id])
        self.stored = StoredSessions(store, self.cache, make_compactor, data_dir=self.data_dir, lease_ms=lease_ms,
                                     owner=owner or default_owner(),
                                     note_quarantine=self._quarantine_note, quota=self.quota,
                                     archives=ObjectArchives(archive_url) if archive_url is not None else None)

    # -- keys -------------------------------------------------------------------------------------
    def tenant_key(self) -> bytes:
        if self._tenant_key is None:
            self._tenant_key = load_tenant_key(self.data_dir)
        return self._tenant_key

    def key_for(self, headers: Mapping[str, str], system: str | None,
                messages: Sequence[Mapping[str, Any]]) -> ConversationKey:
        """The store's key of a request: its tenant (from the credential header) and, within it, the
        ``X-Ctxfold-Session`` header's value or the digest of its opening. Checked by the caller:
        the session header's length."""
        credential = headers.get(self.tenant_header)
        tenant = tenant_of(self.tenant_key(), credential) if credential else ANONYMOUS_TENANT
        key = session_key(headers.get(SESSION_HEADER), system,
                          fingerprint_wire(messages[0]) if messages else None)
        return scope_of(tenant, key)

    def key_of(self, session_dir: Path) -> ConversationKey:
        """The store's key of a session directory (inverse of where :meth:`create` puts it)."""
        return ConversationKey(Path(session_dir).parent.relative_to(self.data_dir).as_posix())

    def archive_dir(self, session_dir: Path) -> Path:
        """Where a session's archive is kept in the data directory (the store's ``<key>/archive`` or
        ``<key>/<n>/archive``). A tenant's sessions of one key share one (they fork from each other,
        and a marker copied from one resolves in the other). Without a credential there is no tenant
        to keep clients apart, and a key (a guessable X-Ctxfold-Session, a common opening) is no
        secret: each anonymous conversation has its own, and a fork copies the archived outputs its
        copied history refers to (:func:`copy_referenced_archive`)."""
        return session_dir / "archive" if is_anonymous_key(self.key_of(session_dir)) else session_dir.parent / "archive"

    def lock(self, key: str) -> asyncio.Lock:
        return self.cache.lock(key)

    # -- bounds -----------------------------------------------------------------------------------
    def trim(self) -> list[str]:
        """Close and forget the least recently used keys while more than ``max_loaded_sessions``
        sessions or ``max_loaded_bytes`` of logs are loaded (:meth:`LoadedSessions.trim`); returns them.
        Everything is stored: the next request of an evicted conversation loads it again and continues
        the same session."""
        return self.cache.trim(self._measure)

    def _measure(self, s: ProxySession) -> None:
        # The session counts what it commits (StoredSessions.commit): the data directory's accounts follow.
        if self.quota is not None:
            self.quota.note(s.path, s.log_nbytes)

    def forget_sessions(self, session_ids: list[str]) -> None:
        """Sessions gone from memory (unloaded, an expiry sweep's first of all): the local store drops what
        it remembers of them (it reads them again if they come back)."""
        if isinstance(self.store, LocalStore):
            self.store.forget(session_ids)

    def unload(self, key: str) -> None:
        """Close and forget ``key``'s sessions if loaded (before its sessions are deleted, under its lock)."""
        self.cache.unload(key)

    @property
    def num_locked(self) -> int:
        """Loaded keys whose lock is held: requests under way, an answer not yet recorded."""
        return self.cache.num_locked

    @property
    def num_sessions(self) -> int:
        return self.cache.num_sessions

    @property
    def loaded_bytes(self) -> int:
        """Event-log bytes of the loaded sessions, as last measured."""
        return self.cache.nbytes

    def loaded(self) -> list[ProxySession]:
        return self.cache.sessions()

    # -- routing ----------------------------------------------------------------------------------
    async def find(self, key: ConversationKey, system: str | None, messages: Sequence[Mapping[str, Any]],
                   warnings: list[str] | None = None) -> ProxySession | None:
        """The session a request (its system prompt and messages) continues, or None for a new
        conversation. Under ``lock(key)``. In order: the session whose stored messages are the longest
        prefix of ``messages``; one that the request re-sends an answered request of (its
        :attr:`ProxySession.resend_drop` set); a fork of the one it shares the longest prefix with.

        A session whose log cannot be read is set aside (in a data directory a ``QUARANTINED`` file
        says why), counted, logged, and said in ``warnings``: the request goes on as if it were not there."""
        entry = await self.stored.sync_key(key, warnings)
        chosen = route(entry.sessions, system, messages)
        sid = chosen.session.store_id if chosen.session is not None else None
        unstored = self._unstored.pop(sid, None) if sid is not None else None
        if unstored is not None and warnings is not None:
            warnings.append(f"the last answer of this conversation was not stored ({unstored}); this request "
                            "carries it again")
        if chosen.session is None and chosen.parent is not None:
            fork = await self.stored.fork(key, chosen.parent, chosen.num_common)
            self.cache.add(entry, fork)
            self.num_forks += 1
            return fork
        if chosen.session is None:
            return None
        if chosen.continues and self.quota is not None:
            self.quota.check(key)  # its new messages would be stored: refused at the bytes bound
        self.cache.use(entry, chosen.session)
        return chosen.session

    async def create(self, key: ConversationKey, conversation: Conversation) -> ProxySession:
        """A new session holding ``conversation`` (system prompt, tools, messages). Under ``lock(key)``,
        after :meth:`find`."""
        entry = self.cache.peek(key) or self.cache.put(key, [])  # find() loaded it, unless trimmed since
        s = await self.stored.create(key, conversation)
        self.cache.add(entry, s)
        return s

    def _quarantine_note(self, where: object, error: Exception, warnings: list[str] | None) -> str:
        reason = one_line(error)
        self.num_quarantined += 1
        log.error("session %s set aside: its event log cannot be read (%s); its conversation continues in a "
                  "new session; `ctxfold restore` salvages what is readable", where, reason)
        self._quarantine_warning(reason, warnings)
        return reason

    def _quarantine_warning(self, reason: str, warnings: list[str] | None) -> None:
        if warnings is not None:
            warnings.append(f"a stored session of this conversation could not be read ({reason}); it was set "
                            "aside and the conversation continues in a new session")

    # -- the store (serve/stored_sessions.py) ---------------------------------------------------------
    @property
    def store(self) -> Store:
        return self.stored.store

    @property
    def spool(self) -> SpoolingStore | None:
        return self.stored.spool

    async def commit(self, session: ProxySession, *, unless_only_appends: bool = False,
                     release: bool = False) -> None:
        """:meth:`StoredSessions.commit`."""
        await self.stored.commit(session, unless_only_appends=unless_only_appends, release=release)

    async def finish(self, key: ConversationKey) -> None:
        """The request on ``key`` is over (:meth:`StoredSessions.finish`)."""
        await self.stored.finish(key)

    def note_store_error(self, key: ConversationKey, error: BaseException) -> str:
        """A request passed through because the store failed (:meth:`StoredSessions.note_store_error`).
        A local store's disk refusing a write (full, read-only) is also remembered for /health."""
        reason = self.stored.note_store_error(key, error)
        cause = error.__cause__
        if cause is not None and is_storage_error(cause):
            return self.note_storage_error(cause)
        return reason

    def note_unstored_answer(self, session: ProxySession, error: BaseException) -> str:
        """The store refused an answer the client has (with its request's messages, which wait for the
        answer's commit when nothing compacted): counted and kept for /health as a pass-through is, and
        said to the next request this process routes to the session (which carries them again). Per
        process: under --workers or replicas, the next request may go to another. Returns the reason."""
        reason = self.note_store_error(session.key, error)
        if session.store_id is None:
            return reason
        self._unstored[session.store_id] = reason
        self._unstored.move_to_end(session.store_id)
        while len(self._unstored) > MAX_UNSTORED_NOTES:
            self._unstored.popitem(last=False)
        return reason

    async def replay_spool(self) -> None:
        await self.stored.replay_spool()

    async def store_problem(self) -> str | None:
        return await self.stored.store_problem()

    async def aclose(self) -> None:
        await self.stored.aclose()

    # -- storage ----------------------------------------------------------------------------------
    def note_storage_error(self, error: BaseException) -> str:
        """Remember a failed write for /health; returns the reason, one line."""
        reason = f"the data directory cannot be written: {one_line(error)}"
        self.storage_error = (time.monotonic(), reason)
        return reason

    def storage_problem(self) -> str | None:
        """Why the data directory cannot take the sessions' writes now, or None: a probe file written
        and removed, the space left, and a failed write of a request in the last minute."""
        probe = self.data_dir / f".health-probe-{os.getpid()}"
        try:
            make_private_dir(self.data_dir)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"ok\n")
            finally:
                os.close(fd)
                os.unlink(probe)
            st = os.statvfs(self.data_dir)
        except OSError as e:
            return f"the data directory cannot be written: {one_line(e)}"
        if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
            return f"the data directory's file system has {st.f_bavail * st.f_frsize} bytes left"
        if self.storage_error is not None and time.monotonic() - self.storage_error[0] < STORAGE_ERROR_HOLD_S:
            return self.storage_error[1]
        return None

    def close(self) -> None:
        for s in self.loaded():
            s.compactor.close()
