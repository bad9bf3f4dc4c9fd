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

Everything is durable in the session directory, so a restarted proxy finds every conversation again
and resumes it on its next request. With a shared store (``ctxfold serve --store redis://...``) the
same sessions, under the same relative names, live in Redis instead, and any number of proxy
processes serve any request of any conversation (see "a shared store" in :class:`SessionStore`, and
docs/store.md). A session whose log cannot be read is set aside (quarantined, see
:meth:`SessionStore.find`): it affects no other session, and its conversation continues in a new one.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ctxfold import fastjson
from ctxfold.archive import ArchiveStore
from ctxfold.archive.store import LocalBackend, make_private_dir, refuse_symlink
from ctxfold.compactor import Compactor
from ctxfold.eventlog import encode_event
from ctxfold.messages import Conversation
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
from ctxfold.serve.loaded import LoadedKey, LoadedSessions
from ctxfold.serve.quota import DiskQuota
from ctxfold.serve.routing import ProxySession, route
from ctxfold.session import EVENTS_FILE
from ctxfold.store import (
    DEFAULT_LEASE_MS,
    Batch,
    BufferedLog,
    Lease,
    LeaseLost,
    Spooled,
    SpoolingStore,
    Store,
    StoredSession,
    StoreError,
    StoreUnavailable,
)
from ctxfold.store.redis_store import default_owner

log = logging.getLogger("ctxfold.serve")

CompactorFactory = Callable[[Conversation, Path], Compactor]
# A compactor writing to a shared store's buffered log: the header (empty messages: resume the log),
# where it would live on disk (names the key), the log.
StoreCompactorFactory = Callable[[Conversation, Path, BufferedLog], Compactor]

_ARCHIVE_ID = re.compile(rb"[0-9a-f]{64}")



def copy_referenced_archive(history: bytes, read: Callable[[str], bytes | None], write: Callable[[str, bytes], None]
                            ) -> int:
    """Copy the archived outputs that ``history`` (a forked session's copied events) refers to: each id
    in it that ``read`` finds (``read(id)``: the bytes, None when absent) is written with ``write``.
    Ids are content digests, so a copy is the same bytes under the same name. Returns how many."""
    copied = 0
    for aid in dict.fromkeys(m.decode() for m in _ARCHIVE_ID.findall(history)):
        data = read(aid)
        if data is not None:
            write(aid, data)
            copied += 1
    return copied


WARNING_HEADER = "X-Ctxfold-Warning"  # what the proxy could not do for a request, one header each
# OSError numbers that mean the data directory cannot take a write: the request then passes through
# uncompacted (the client sends its history again with the next request, so nothing is lost).
# (Not EIO: a read can fail with it too, after an answer has begun, where passing through is too late.)
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM})
STORAGE_ERROR_HOLD_S = 60.0  # /health reports a failed write for this long after it
MIN_FREE_BYTES = 1 << 20  # below this, /health calls the data directory full


def is_storage_error(error: BaseException) -> bool:
    """Whether ``error`` is the data directory refusing a write (full, read-only, no permission)."""
    return (isinstance(error, OSError) and not isinstance(error, ConnectionError)
            and error.errno in STORAGE_ERRNOS)


QUARANTINE_FILE = "QUARANTINED"  # in a session directory set aside: why


# With a shared store, the sessions of one key leased (and so routed among) per request: the most recent.
MAX_LEASED_SESSIONS_PER_KEY = 16


class SessionBusy(StoreError):
    """Another replica holds a session's lease for longer than a request waits: the request passes
    through uncompacted."""


class SessionStore:
    """The sessions of one data directory, loaded lazily, one asyncio lock per (tenant, key). At most
    ``max_loaded_sessions`` sessions, and event logs of ``max_loaded_bytes`` in all, stay loaded:
    whole keys go, least recently used first (see :meth:`trim`), closing their files. A session's
    log is open only once it was written to since it was loaded, so open files stay within the
    bound too."""

    def __init__(self, data_dir: Path, make_compactor: CompactorFactory, *,
                 max_loaded_sessions: int = DEFAULT_MAX_LOADED_CONVERSATIONS, create_in_thread: bool = True,
                 max_loaded_bytes: int = DEFAULT_MAX_LOADED_BYTES, tenant_header: str = "Authorization",
                 tenant_key: bytes | None = None, durable: bool = True, store: Store | None = None,
                 make_store_compactor: StoreCompactorFactory | None = None, lease_ms: int = DEFAULT_LEASE_MS,
                 owner: str | None = None, quota: DiskQuota | None = None) -> None:
        self.cache = LoadedSessions(max_loaded_sessions, max_loaded_bytes)
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / "sessions"  # the anonymous tenant's
        self.make_compactor = make_compactor
        self.tenant_header = tenant_header
        self._tenant_key = tenant_key
        self.durable = durable
        # Building a compactor blocks (an fsync, object storage) or not (mkdir and a write): only then is
        # a worker thread worth its two context switches (Python work in it holds the loop anyway).
        self.create_in_thread = create_in_thread
        self.num_quarantined = 0  # sessions set aside since start (metric)
        self.num_forks = 0  # sessions forked from another since start (metric)
        # The last failure to write the data directory: (monotonic time, reason), for /health.
        self.storage_error: tuple[float, str] | None = None
        # A shared store (Redis): sessions live there, not in the data directory (see the store section).
        self.store = store
        if store is not None and make_store_compactor is None:
            raise ValueError("a shared store needs make_store_compactor")
        self.make_store_compactor = make_store_compactor
        self.lease_ms = lease_ms
        self.owner = owner or default_owner()
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the app: archive reads from worker threads
        self._set_aside: set[str] = set()  # store sessions whose log cannot be read (this process's view)
        self._renewers: dict[str, asyncio.Task[None]] = {}  # key -> the task renewing its leases
        # Leases this process could not release (the store was down): still its own until they run out,
        # so the next request renews one rather than waiting up to its whole time for itself.
        self._unreleased: dict[str, tuple[Lease, float]] = {}  # session id -> (lease, monotonic s when held)
        self.num_store_errors = 0  # requests passed through because the store failed (metric)
        self.num_lease_waits = 0  # requests that waited for another replica's lease (metric)
        # The data directory's per-tenant accounts (serve.quota); a shared store keeps its own.
        self.quota = quota if store is None else None

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

    def archive_prefix(self, session_dir: Path) -> str:
        """The archive's place in shared object storage: ``tenants/<tenant>/<key>`` for a tenant (its
        conversations with one key share it), ``<key>/<n>`` for the anonymous tenant (each conversation
        its own: see :meth:`archive_dir`)."""
        parts = self.key_of(session_dir).split("/")
        return f"{parts[1]}/{session_dir.name}" if parts[0] == "sessions" else f"tenants/{parts[1]}/{parts[3]}"

    def archive_dir(self, session_dir: Path) -> Path:
        """Where a session's archive is kept in the data directory. A tenant's sessions of one key share
        one (they fork from each other, and a marker copied from one resolves in the other). Without a
        credential there is no tenant to keep clients apart, and a key (a guessable X-Ctxfold-Session, a
        common opening) is no secret: each anonymous conversation has its own, and a fork copies the
        archived outputs its copied history refers to (:func:`copy_referenced_archive`)."""
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
        if s.store_id is None:  # a store session counts what it commits (commit)
            s.log_nbytes = _current_log_size(s)
            if self.quota is not None:
                self.quota.note(s.path, s.log_nbytes)

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

        A session whose log cannot be read is set aside (a ``QUARANTINED`` file says why), counted,
        logged, and said in ``warnings``: the request goes on as if it were not there."""
        if self.store is not None:
            entry = await self._sync_key(key, warnings)
        elif (found := self.cache.get(key)) is not None:
            entry = found
        else:
            # A key never seen has no directory: no thread hop to find that out.
            loaded: list[ProxySession] = []
            if (self.data_dir / key).is_dir():
                loaded = await asyncio.to_thread(self._load_key, key, warnings)
            entry = self.cache.put(key, loaded)
        chosen = route(entry.sessions, system, messages)
        if chosen.session is None and chosen.parent is not None:
            if self.store is not None:
                fork = await self._fork_in_store(key, chosen.parent, chosen.num_common)
            else:
                fork = await self._fork_in_data_dir(key, chosen.parent, chosen.num_common)
            self.cache.add(entry, fork)
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
        if self.store is not None:
            s = await self._create_in_store(key, conversation)
            self.cache.add(entry, s)
            return s
        path = self._new_path(key)
        if self.quota is not None:
            self.quota.admit(path)  # QuotaExceeded: nothing is written
        # The whole history goes in at construction: a conversation first seen long (a proxy put in front
        # of a running agent) is compacted once by the next pass, not by a hard trigger per tool
        # result while it is read in.
        conv = Conversation(messages=list(conversation.messages), id=f"{key}/{path.name}",
                            system=conversation.system, tools=conversation.tools, source_format="openai",
                            source="ctxfold serve")
        try:
            if self.create_in_thread:
                compactor = await asyncio.to_thread(self.make_compactor, conv, path)
            else:
                compactor = self.make_compactor(conv, path)
        except BaseException:
            if self.quota is not None:
                self.quota.forget(path)
            raise
        s = ProxySession(key, path, compactor)
        self.cache.add(entry, s)
        return s

    def _new_path(self, key: ConversationKey) -> Path:
        self._refuse_links(key)
        folder = self.data_dir / key
        # After the highest number in use: set aside, left on disk by the bounds, or without a log
        # after a crash. One listing, not a probe per number.
        taken = [int(e) for e in os.listdir(folder) if e.isdigit()] if folder.is_dir() else []
        return folder / f"{max(taken, default=-1) + 1:04d}"

    async def _fork_in_data_dir(self, key: ConversationKey, parent: ProxySession, num_common: int) -> ProxySession:
        path = self._new_path(key)
        if self.quota is not None:
            self.quota.admit(path)  # QuotaExceeded: nothing is written
        try:
            return await asyncio.to_thread(self._fork, key, parent, num_common, path)
        except BaseException:
            if self.quota is not None:
                self.quota.forget(path)
            raise

    def _fork(self, key: ConversationKey, parent: ProxySession, num_common: int, path: Path) -> ProxySession:
        """A new session continuing ``parent``'s first ``num_common`` messages: its log is the parent's
        up to the event that appended the first message after them (every compaction of that prefix
        and its state kept), with the history dumps those compactions wrote. The archive is the
        key's, shared. Written whole under a temporary name and renamed into place: a crash leaves
        the fork or nothing."""
        kept: list[bytes] = []
        dumps: list[str] = []
        with open(parent.path / EVENTS_FILE, "rb") as f:
            for raw in f.read().split(b"\n"):
                try:
                    event = fastjson.loads(raw)
                except ValueError:  # a torn last line (the parent was read whole when loaded)
                    break
                if event.get("type") == "append" and int(event.get("index", 0)) >= num_common:
                    break
                if event.get("type") == "view" and event.get("dump"):
                    dumps.append(str(event["dump"]))
                if event.get("type") == "header" and isinstance(event.get("conversation"), dict):
                    # The fork's own name; the rest of the header (system prompt, tools) is the parent's.
                    event["conversation"]["id"] = f"{key}/{path.name}"
                    raw = fastjson.dumps_record(event)
                kept.append(raw + b"\n")
        make_private_dir(path)
        for dump in dumps:
            src = parent.path / dump
            dst = path / dump
            make_private_dir(dst.parent)
            LocalBackend(dst.parent).write_atomic(dst.name, src.read_bytes())
        if is_anonymous_key(key):  # its own archive: what its history refers to, nothing else of the parent's
            from_parent, to_fork = ArchiveStore(self.archive_dir(parent.path)), ArchiveStore(self.archive_dir(path))

            def read(aid: str) -> bytes | None:
                return from_parent.get(aid).encode("utf-8", "surrogatepass") if from_parent.exists(aid) else None

            def write(aid: str, data: bytes) -> None:
                to_fork.put(data.decode("utf-8", "surrogatepass"))

            copy_referenced_archive(b"".join(kept), read, write)
        LocalBackend(path).write_atomic(EVENTS_FILE, b"".join(kept))
        compactor = self.make_compactor(Conversation(messages=[]), path)  # resumes from the log
        s = ProxySession(key, path, compactor, calibration=parent.calibration,
                         inject_recall=parent.inject_recall)
        if len(compactor.originals) == num_common:
            s.wire = list(parent.wire[:num_common])  # as the client sent them: the next compare is of dicts
        else:
            s.note_wire([])
        s.log_nbytes = _log_size(path)
        self.num_forks += 1
        return s

    def _refuse_links(self, key: ConversationKey) -> None:
        """OSError when a folder between the data directory and the key's is a symbolic link: the
        proxy writes only into directories of its data directory, never where a link planted there
        points. (The data directory itself may be a link: the operator chose it.)"""
        folder = self.data_dir
        for part in key.split("/"):
            folder = folder / part
            refuse_symlink(folder)

    def _load_key(self, key: ConversationKey, warnings: list[str] | None) -> list[ProxySession]:
        """The key's sessions, least recently used first: the most recently written ones that fit the
        bounds (a key with more sessions than ``max_loaded_sessions``, or logs beyond
        ``max_loaded_bytes``, leaves its oldest on disk, where ``ctxfold restore`` reads them; a
        request that would continue one of those forks or starts anew instead)."""
        folder = self.data_dir / key
        self._refuse_links(key)
        if not folder.is_dir():
            return []
        found: list[tuple[float, int, Path]] = []
        for entry in os.listdir(folder):
            path = folder / entry
            if entry != "archive":
                refuse_symlink(path)
            try:
                st = os.stat(path / EVENTS_FILE)
            except OSError:
                continue
            if not os.path.lexists(path / QUARANTINE_FILE):
                found.append((st.st_mtime, st.st_size, path))
        found.sort(key=lambda f: (f[0], f[2].name), reverse=True)  # newest first
        chosen: list[tuple[int, Path]] = []
        total = 0
        for _, size, path in found:
            if chosen and (len(chosen) >= self.cache.max_sessions or total + size > self.cache.max_bytes):
                break
            chosen.append((size, path))
            total += size
        out = []
        for size, path in reversed(chosen):
            try:
                compactor = self.make_compactor(Conversation(messages=[]), path)  # resumes from the log
            except Exception as e:  # noqa: BLE001 - whatever is wrong with this log concerns this session alone
                self._quarantine(path, e, warnings)
                continue
            s = ProxySession(key, path, compactor)
            s.note_wire([])
            s.log_nbytes = size
            out.append(s)
        return out

    def _quarantine(self, path: Path, error: Exception, warnings: list[str] | None) -> None:
        reason = self._quarantine_note(path, error, None)
        try:
            LocalBackend(path).write_atomic(QUARANTINE_FILE, (reason + "\n").encode())
        except OSError as e:  # a read-only data directory: set aside for this process only
            log.error("cannot mark %s as set aside: %s", path, e)
        self._quarantine_warning(reason, warnings)

    def _quarantine_note(self, where: object, error: Exception, warnings: list[str] | None) -> str:
        reason = _one_line(error)
        self.num_quarantined += 1
        log.error("session %s set aside: its event log cannot be read (%s); its conversation continues in a "
                  "new session; `ctxfold restore` salvages what is readable", where, reason)
        self._quarantine_warning(reason, warnings)
        return reason

    def _quarantine_warning(self, reason: str, warnings: list[str] | None) -> None:
        if warnings is not None:
            warnings.append(f"a stored session of this conversation could not be read ({reason}); it was set "
                            "aside and the conversation continues in a new session")

    # -- a shared store -----------------------------------------------------------------------------
    # With a shared store (Redis), a key's sessions are ``<key>/<nnnn>`` there (the same relative names
    # as in a data directory), their archive is the blobs of ``<key>/archive``, and any replica serves
    # any request. Per request, under the key's lock: every session of the key is leased (waiting while
    # another replica holds it); one whose grant is not the token this process held last plus one was
    # written elsewhere and is read again; the compactor writes to a BufferedLog whose batch is
    # committed under the lease (:meth:`commit`) after the compaction step and after the answer; the
    # leases are released when the request ends (:meth:`finish`), so the next request may go to any
    # replica. Leases are renewed while a request works (a long summary): a replica that stalls past
    # its lease loses the session, and its writes are refused by the fencing token.

    @staticmethod
    def _numbered(key: ConversationKey, ids: list[str]) -> list[str]:
        """The ids of ``key``'s sessions among ``ids`` (not its archive, nor a longer key's), oldest first."""
        depth = key.count("/") + 1
        found = [i for i in ids if i.count("/") == depth and i.rsplit("/", 1)[1].isdigit()]
        return sorted(found, key=lambda i: int(i.rsplit("/", 1)[1]))

    def _archive_id(self, key: ConversationKey, session_id: str) -> str:
        """The store's id of a session's archive: the key's for a tenant, the session's own for the
        anonymous tenant (see :meth:`archive_dir`)."""
        return f"{session_id}/archive" if is_anonymous_key(key) else f"{key}/archive"

    def _store(self) -> Store:
        if self.store is None:  # not an assert: python -O must not turn this into an AttributeError
            raise RuntimeError("the shared-store path is used without a store")
        return self.store

    async def _acquire(self, session_id: str) -> Lease:
        """The session's lease, waiting while another replica holds it (it releases it when its request
        ends, or it expires); SessionBusy after twice the lease's time."""
        store = self._store()
        held = self._unreleased.pop(session_id, None)
        if held is not None:
            try:
                if await store.renew(held[0]):
                    return held[0]
            except StoreError:
                self._unreleased[session_id] = held
                raise
        deadline = time.monotonic() + 2 * self.lease_ms / 1000
        pause_s = 0.005
        waited = False
        while True:
            lease = await store.acquire(session_id, owner=self.owner, ttl_ms=self.lease_ms)
            if lease is not None:
                return lease
            if not waited:
                waited = True
                self.num_lease_waits += 1
            if time.monotonic() > deadline:
                raise SessionBusy(f"session {session_id} stays leased by another replica (more than "
                                  f"{2 * self.lease_ms} ms)")
            await asyncio.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.1)

    def _start_renewing(self, key: ConversationKey) -> None:
        if key not in self._renewers:
            self._renewers[key] = asyncio.get_running_loop().create_task(self._renew_loop(key))

    async def _renew_loop(self, key: ConversationKey) -> None:
        """Renew the leases of ``key``'s sessions every third of their time while a request holds them."""
        store = self._store()
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            entry = self.cache.peek(key)
            for s in list(entry.sessions) if entry is not None else []:
                if s.lease is None:
                    continue
                try:
                    if not await store.renew(s.lease):
                        log.warning("lease on session %s expired while a request worked on it; its next write "
                                    "goes through only if no other replica took it over", s.store_id)
                except StoreError as e:
                    log.warning("cannot renew the lease on session %s: %s", s.store_id, e)

    def _fetcher(self, key: ConversationKey, session_id: str) -> Callable[[str], bytes]:
        """A blob reader for the compactor's archive, which reads in worker threads (read_archive): the
        key's archive, then the session's own blobs (an archive written while the store was down went
        to the spool with the session's batch). OSError when the store cannot answer."""

        def fetch(name: str) -> bytes:
            loop = self.loop
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if loop is None or running is loop:  # on the loop's own thread: waiting would deadlock it
                raise FileNotFoundError(f"{name}: not readable from the event loop's thread")
            future = asyncio.run_coroutine_threadsafe(self._get_blob(key, session_id, name), loop)
            try:
                return future.result(timeout=30)
            except StoreUnavailable as e:
                raise OSError(errno.EIO, str(e)) from None

        return fetch

    async def _get_blob(self, key: ConversationKey, session_id: str, name: str) -> bytes:
        store = self._store()
        try:
            return await store.get_blob(self._archive_id(key, session_id), name)
        except FileNotFoundError:
            return await store.get_blob(session_id, name)

    def _store_path(self, session_id: str) -> Path:
        return self.data_dir / session_id  # never written: names the key (key_of, archive_prefix)

    async def _build(self, key: ConversationKey, session_id: str, conversation: Conversation,
                     stored: StoredSession | None) -> tuple[Compactor, BufferedLog]:
        if self.make_store_compactor is None:
            raise RuntimeError("a shared store needs make_store_compactor")
        blog = BufferedLog(session_id, stored, fetch=self._fetcher(key, session_id), source=self._store().url)
        path = self._store_path(session_id)
        # Reading a long conversation back (parsing, counting) would hold the loop: a worker thread then.
        big = stored is not None and len(stored.events) > 64 or len(conversation.messages) > 64
        if big or self.create_in_thread:
            compactor = await asyncio.to_thread(self.make_store_compactor, conversation, path, blog)
        else:
            compactor = self.make_store_compactor(conversation, path, blog)
        return compactor, blog

    async def _load_from_store(self, key: ConversationKey, session_id: str, warnings: list[str] | None) -> ProxySession | None:
        """The stored session, or None when it holds no events yet (its first write never landed) or
        cannot be read (set aside for this process, counted, logged, said in ``warnings``)."""
        try:
            stored = await self._store().read(session_id)
            if not stored.events:
                return None
            compactor, blog = await self._build(key, session_id, Conversation(messages=[]), stored)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever is wrong with this log concerns this session alone
            self._set_aside.add(session_id)
            self._quarantine_note(f"{self._store().url} {session_id}", e, warnings)
            return None
        s = ProxySession(key, self._store_path(session_id), compactor, store_id=session_id, log=blog)
        s.note_wire([])
        s.log_nbytes = sum(len(encode_event(e)) for e in stored.events)
        return s

    async def _sync_key(self, key: ConversationKey, warnings: list[str] | None) -> LoadedKey:
        """``key``'s sessions as the store holds them now, each leased by this process until
        :meth:`finish`: the ones loaded before and untouched since are kept, the others read again."""
        store = self._store()
        entry = self.cache.get(key) or self.cache.put(key, [])
        ids = [i for i in self._numbered(key, await store.sessions(key + "/")) if i not in self._set_aside]
        # The most recent ones: the others stay in the store (restore reads them), as a data directory
        # leaves its oldest on disk. Each costs a lease per request, so a client that edits its history
        # at every request (a fork each time) costs a bounded number of round trips.
        ids = ids[-min(self.cache.max_sessions, MAX_LEASED_SESSIONS_PER_KEY):]
        self._start_renewing(key)
        loaded = {s.store_id: s for s in entry.sessions}
        kept: list[ProxySession] = []
        held: list[Lease] = []
        try:
            for session_id in ids:
                lease = await self._acquire(session_id)
                held.append(lease)
                s = loaded.get(session_id)
                # The token after this process's last one, or that one itself (a lease it could not
                # release, renewed): nobody else wrote since.
                if s is None or s.broken or lease.token not in (s.token, s.token + 1):
                    s = await self._load_from_store(key, session_id, warnings)
                    if s is None:
                        await self._release_quietly(held.pop())
                        continue
                s.lease, s.token = lease, lease.token
                kept.append(s)
        except BaseException:
            for lease in held:
                await self._release_quietly(lease)
            for s in kept:
                s.lease = None
            raise
        # Least recently used first: the sessions used before keep their order, the ones just read go first.
        order = {id(s): k for k, s in enumerate(entry.sessions)}
        kept.sort(key=lambda s: order.get(id(s), -1))
        self.cache.replace(entry, kept)
        return entry

    async def _new_store_id(self, key: ConversationKey) -> Lease:
        """A lease on a new session id of ``key``: the first grant ever for that id (token 1), so two
        replicas creating a session at once never get the same one."""
        store = self._store()
        taken = [int(i.rsplit("/", 1)[1]) for i in self._numbered(key, await store.sessions(key + "/"))]
        n = max(taken, default=-1) + 1
        while True:
            # new: the store counts it against the tenant's bound (QuotaExceeded at the bound).
            lease = await store.acquire(f"{key}/{n:04d}", owner=self.owner, ttl_ms=self.lease_ms, new=True)
            if lease is not None and lease.token == 1:
                return lease
            if lease is not None:
                await self._release_quietly(lease)
            n += 1

    async def _create_in_store(self, key: ConversationKey, conversation: Conversation) -> ProxySession:
        lease = await self._new_store_id(key)
        session_id = lease.session_id
        conv = Conversation(messages=list(conversation.messages), id=session_id, system=conversation.system,
                            tools=conversation.tools, source_format="openai", source="ctxfold serve")
        try:
            compactor, blog = await self._build(key, session_id, conv, None)
        except BaseException:
            await self._release_quietly(lease)
            raise
        s = ProxySession(key, self._store_path(session_id), compactor, store_id=session_id, log=blog, lease=lease,
                         token=lease.token)
        return s

    async def _fork_in_store(self, key: ConversationKey, parent: ProxySession, num_common: int) -> ProxySession:
        """:meth:`_fork` through the store: the new session's events are the parent's up to the first
        append of a message after the common prefix (renumbered from 0), with the history dumps those
        events name. A parent read back as its checkpoint keeps its last compaction only when that
        compaction lies within the prefix (else the fork starts uncompacted and compacts again)."""
        store = self._store()
        parent_id = parent.store_id
        if parent_id is None:
            raise RuntimeError("a session in the data directory forked through the store")
        stored = await store.read(parent_id)
        lease = await self._new_store_id(key)
        session_id = lease.session_id
        try:
            kept: list[dict[str, Any]] = []
            blobs: list[tuple[str, bytes]] = []
            for event in stored.events:
                if event.get("type") == "append" and int(event.get("index", 0)) >= num_common:
                    break
                event = dict(event)
                if event.get("type") == "view" and event.get("dump"):
                    name = str(event["dump"])
                    blobs.append((name, await store.get_blob(parent_id, name)))
                if event.get("type") == "header" and isinstance(event.get("conversation"), dict):
                    event["conversation"] = {**event["conversation"], "id": session_id}
                event["seq"] = len(kept)
                kept.append(event)
            if is_anonymous_key(key):  # its own archive: what its history refers to (see archive_dir)
                found: dict[str, bytes] = {}
                for aid in dict.fromkeys(m.decode() for m in _ARCHIVE_ID.findall(
                        b"".join(encode_event(e) for e in kept))):
                    try:
                        found[aid] = await self._get_blob(key, parent_id, f"archive/{aid}.txt")
                    except FileNotFoundError:
                        continue
                for aid, data in found.items():
                    await store.put_blob(self._archive_id(key, session_id), f"archive/{aid}.txt", data)
            await store.append(lease, Batch(tuple(blobs), tuple(kept)))
            compactor, blog = await self._build(key, session_id, Conversation(messages=[]),
                                                StoredSession(session_id, kept))
        except BaseException:
            await self._release_quietly(lease)
            raise
        s = ProxySession(key, self._store_path(session_id), compactor, calibration=parent.calibration,
                         inject_recall=parent.inject_recall, store_id=session_id, log=blog, lease=lease,
                         token=lease.token)
        if len(compactor.originals) == num_common:
            s.wire = list(parent.wire[:num_common])
        else:
            s.note_wire([])
        s.log_nbytes = sum(len(encode_event(e)) for e in kept)
        self.num_forks += 1
        return s

    async def commit(self, session: ProxySession, *, unless_only_appends: bool = False,
                     release: bool = False) -> None:
        """Write what the session's compactor logged since the last commit, under its lease: the
        archive's blobs to the key's archive, then the rest as one batch; a checkpoint after a
        compaction. Nothing for a session in the data directory. Raises StoreUnavailable (Spooled:
        the batch waits in the local spool, memory and store+spool agree) or LeaseLost; after any
        failure but Spooled the session is marked broken and its key unloaded (read again next time).

        ``unless_only_appends``: nothing when only messages wait (the step before forwarding, when
        nothing fired): they go with the answer's commit, one write (and one fsync of Redis's
        append-only file) fewer per request. Nothing is acknowledged to the client before the
        answer, and a request that gets none is sent again with those messages. ``release``: the
        request's last write: the lease goes in the same call (when there was something to write;
        else :meth:`finish` releases it)."""
        blog, lease = session.log, session.lease
        if self.store is None or blog is None or session.broken:
            return
        if unless_only_appends and blog.only_appends_pending:
            return
        batch = blog.take()
        if not batch:
            return
        if lease is None:
            session.broken = True
            raise LeaseLost(f"session {session.store_id}: written outside a request's lease")
        store = self.store
        rest = batch
        archive = [(n, d) for n, d in batch.blobs if n.startswith("archive/")]
        try:
            if archive:
                try:
                    for name, data in archive:
                        await store.put_blob(self._archive_id(session.key, session.store_id or ""), name, data)
                    rest = Batch(tuple((n, d) for n, d in batch.blobs if not n.startswith("archive/")), batch.events)
                except StoreUnavailable:
                    pass  # all of it under the session's own name: spooled with its events
            await store.append(lease, rest, release=release)
        except Spooled:
            session.log_nbytes += sum(len(encode_event(e)) for e in batch.events)
            raise
        except (StoreError, ValueError):
            session.broken = True
            raise
        session.log_nbytes += sum(len(encode_event(e)) for e in batch.events)
        if release and batch.events:
            session.lease = None  # released by the append
        if any(e.get("type") == "view" for e in batch.events):
            try:
                await store.checkpoint(lease)
            except (StoreError, ValueError) as e:  # the events are stored: a later checkpoint folds them
                log.info("no checkpoint of session %s now: %s", session.store_id, e)

    async def finish(self, key: ConversationKey) -> None:
        """The request on ``key`` is over: stop renewing, release its leases (the next request of the
        conversation may go to any replica), forget sessions whose memory went ahead of the store."""
        task = self._renewers.pop(key, None)
        if task is not None:
            task.cancel()
        entry = self.cache.peek(key)
        if entry is None:
            return
        for s in entry.sessions:
            if s.lease is not None:
                await self._release_quietly(s.lease)
                s.lease = None
        if any(s.broken for s in entry.sessions):
            self.cache.unload(key)

    async def _release_quietly(self, lease: Lease) -> None:
        try:
            await self._store().release(lease)
        except StoreError as e:  # it expires on its own, or this process renews it next time
            self._unreleased[lease.session_id] = (lease, time.monotonic())
            log.info("cannot release the lease on session %s: %s", lease.session_id, e)

    def note_store_error(self, key: ConversationKey, error: BaseException) -> str:
        """A request passed through because the store failed: counted; the key's sessions are read
        again next time unless what failed waits in the spool. Returns the reason, one line."""
        self.num_store_errors += 1
        if not isinstance(error, Spooled):
            entry = self.cache.peek(key)
            for s in entry.sessions if entry is not None else []:
                s.broken = True
        if isinstance(error, LeaseLost):
            return f"another proxy process took this conversation over: {_one_line(error)}"
        if isinstance(error, SessionBusy):
            return f"the conversation is busy on another proxy process: {_one_line(error)}"
        return f"the session store failed: {_one_line(error)}"

    @property
    def spool(self) -> SpoolingStore | None:
        return self.store if isinstance(self.store, SpoolingStore) else None

    async def replay_spool(self) -> None:
        """Write what the spool holds (oldest first) if the store is back."""
        now = time.monotonic()
        for session_id, (lease, since) in list(self._unreleased.items()):
            if now - since > lease.ttl_ms / 1000:  # ran out: the next grant is anyone's
                del self._unreleased[session_id]
        spool = self.spool
        if spool is not None and spool.num_pending:
            await spool.replay()

    async def store_problem(self) -> str | None:
        """Why the shared store cannot take the sessions' writes now, or None: it does not answer, or
        writes wait in the local spool."""
        if self.store is None:
            return None
        try:
            await self.replay_spool()
            await self.store.exists("health-probe")
        except StoreError as e:
            return f"the session store is unreachable: {_one_line(e)}"
        spool = self.spool
        if spool is not None and spool.num_pending:
            return (f"{spool.num_pending} session writes wait in the local spool ({spool.dir}) for the store "
                    f"{spool.url}")
        return None

    async def aclose(self) -> None:
        for task in self._renewers.values():
            task.cancel()
        self._renewers.clear()
        if self.store is not None:
            await self.store.close()

    # -- storage ----------------------------------------------------------------------------------
    def note_storage_error(self, error: BaseException) -> str:
        """Remember a failed write for /health; returns the reason, one line."""
        reason = f"the data directory cannot be written: {_one_line(error)}"
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
            return f"the data directory cannot be written: {_one_line(e)}"
        if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
            return f"the data directory's file system has {st.f_bavail * st.f_frsize} bytes left"
        if self.storage_error is not None and time.monotonic() - self.storage_error[0] < STORAGE_ERROR_HOLD_S:
            return self.storage_error[1]
        return None

    def close(self) -> None:
        for s in self.loaded():
            s.compactor.close()


def _current_log_size(s: ProxySession) -> int:
    """The size of a session's log: as its open log counts it (no system call), else from a stat."""
    counted: int | None = getattr(s.compactor.session, "log_nbytes", None)  # a Session's; None: not open
    return counted if counted is not None else _log_size(s.path)


def _log_size(path: Path) -> int:
    try:
        return os.stat(path / EVENTS_FILE).st_size
    except OSError:
        return 0


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:300]
