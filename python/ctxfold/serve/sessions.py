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
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ctxfold import fastjson
from ctxfold.chat.messages import Conversation
from ctxfold.compaction.archive import ArchiveStore
from ctxfold.compaction.archive.store import LocalBackend, make_private_dir, refuse_symlink
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.session import EVENTS_FILE
from ctxfold.compaction.store import (
    DEFAULT_LEASE_MS,
    SpoolingStore,
    Store,
)
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
from ctxfold.serve.quota import DiskQuota
from ctxfold.serve.routing import ProxySession, route
from ctxfold.serve.shared_sessions import (
    SharedSessions,
    StoreCompactorFactory,
    copy_referenced_archive,
    one_line,
)

log = logging.getLogger("ctxfold.serve")

CompactorFactory = Callable[[Conversation, Path], Compactor]

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
        # A shared store (Redis): sessions live there, not in the data directory (serve/shared_sessions.py).
        self.shared: SharedSessions | None = None
        if store is not None:
            if make_store_compactor is None:
                raise ValueError("a shared store needs make_store_compactor")
            self.shared = SharedSessions(store, self.cache, make_store_compactor, data_dir=self.data_dir,
                                         lease_ms=lease_ms, owner=owner or default_owner(),
                                         create_in_thread=create_in_thread, note_quarantine=self._quarantine_note)
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
        if self.shared is not None:
            entry = await self.shared.sync_key(key, warnings)
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
            if self.shared is not None:
                fork = await self.shared.fork(key, chosen.parent, chosen.num_common)
            else:
                fork = await self._fork_in_data_dir(key, chosen.parent, chosen.num_common)
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
        if self.shared is not None:
            s = await self.shared.create(key, conversation)
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

    # -- a shared store (serve/shared_sessions.py) ---------------------------------------------------
    @property
    def store(self) -> Store | None:
        return self.shared.store if self.shared is not None else None

    @property
    def spool(self) -> SpoolingStore | None:
        return self.shared.spool if self.shared is not None else None

    async def commit(self, session: ProxySession, *, unless_only_appends: bool = False,
                     release: bool = False) -> None:
        """:meth:`SharedSessions.commit`; nothing for a session in the data directory."""
        if self.shared is not None:
            await self.shared.commit(session, unless_only_appends=unless_only_appends, release=release)

    async def finish(self, key: ConversationKey) -> None:
        """The request on ``key`` is over (:meth:`SharedSessions.finish`); nothing in the data directory."""
        if self.shared is not None:
            await self.shared.finish(key)

    def note_store_error(self, key: ConversationKey, error: BaseException) -> str:
        return self._shared().note_store_error(key, error)

    async def replay_spool(self) -> None:
        if self.shared is not None:
            await self.shared.replay_spool()

    async def store_problem(self) -> str | None:
        return await self.shared.store_problem() if self.shared is not None else None

    async def aclose(self) -> None:
        if self.shared is not None:
            await self.shared.aclose()

    def _shared(self) -> SharedSessions:
        if self.shared is None:  # not an assert: python -O must not turn this into an AttributeError
            raise RuntimeError("the shared-store path is used without a store")
        return self.shared

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


def _current_log_size(s: ProxySession) -> int:
    """The size of a session's log: as its open log counts it (no system call), else from a stat."""
    counted: int | None = getattr(s.compactor.session, "log_nbytes", None)  # a Session's; None: not open
    return counted if counted is not None else _log_size(s.path)


def _log_size(path: Path) -> int:
    try:
        return os.stat(path / EVENTS_FILE).st_size
    except OSError:
        return 0
