"""The proxy's sessions in a :class:`~ctxfold.compaction.store.Store`: leased per request, committed under the lease.

One path for both stores: :class:`~ctxfold.compaction.store.LocalStore` rooted at the data directory
(the default) and :class:`~ctxfold.compaction.store.RedisStore` (``--store``, shared by replicas). A
key's sessions are ``<key>/<nnnn>`` (in a data directory: its folders, as every earlier version wrote
them), their archive is the blobs of ``<key>/archive`` (a tenant's) or ``<key>/<nnnn>/archive`` (an
anonymous conversation's). Per request, under the key's lock: every session of the key is leased
(waiting while another replica holds it); one whose grant is not the token this process held last plus
one was written elsewhere and is read again; the compactor writes to a
:class:`~ctxfold.compaction.store.BufferedLog` whose batch is committed under the lease
(:meth:`StoredSessions.commit`) after the compaction step and after the answer; the leases are released
when the request ends (:meth:`StoredSessions.finish`), so the next request may go to any replica. With a
shared store, leases are renewed while a request works (a long summary): a replica that stalls past its
lease loses the session, and its writes are refused by the fencing token.

What a store that is not shared spares (a local directory is one process's): the listing of a loaded
key's sessions and the renewal task, per request (nobody else writes them), and checkpoints (they fold
a log to spare a network store's reads; a local log is read from the disk, and every earlier version
of ctxfold reads it unfolded).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ctxfold.chat.messages import Conversation
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.eventlog import encode_event
from ctxfold.compaction.journal import ARCHIVE_BLOB_PREFIX
from ctxfold.compaction.store import (
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
from ctxfold.compaction.store.base import SessionId
from ctxfold.compaction.store.buffer import BlobFetch, BlobList
from ctxfold.serve.keys import ConversationKey, is_anonymous_key
from ctxfold.serve.loaded import LoadedKey, LoadedSessions
from ctxfold.serve.object_archive import ObjectArchives, archive_prefix
from ctxfold.serve.quota import DiskQuota
from ctxfold.serve.routing import ProxySession

log = logging.getLogger("ctxfold.serve")

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

# A compactor writing to a store's buffered log: the header (empty messages: resume the log), the
# session's path under the data directory (names the key; a local store's directory), the log.
StoreCompactorFactory = Callable[[Conversation, Path, BufferedLog], Compactor]


def records_nbytes(events: Iterable[dict[str, Any]]) -> int:
    """The bytes ``events`` take as log records (one line each, as a local store writes them)."""
    return sum(len(encode_event(e)) + 1 for e in events)

# The sessions of one key leased (and so routed among) per request: the most recent.
MAX_LEASED_SESSIONS_PER_KEY = 16


class SessionBusy(StoreError):
    """Another replica holds a session's lease for longer than a request waits: the request passes
    through uncompacted."""


class StoredSessions:
    """The store side of :class:`~ctxfold.serve.sessions.SessionStore`: reading, creating, forking,
    committing and leasing a key's sessions (see the module docstring)."""

    def __init__(self, store: Store, cache: LoadedSessions, make_store_compactor: StoreCompactorFactory, *,
                 data_dir: Path, lease_ms: int, owner: str,
                 note_quarantine: Callable[[object, Exception, list[str] | None], str],
                 quota: DiskQuota | None = None, archives: ObjectArchives | None = None) -> None:
        self.store = store
        self.cache = cache
        self.make_store_compactor = make_store_compactor
        self.data_dir = data_dir  # names a session's key (key_of, archive_prefix); a local store's root
        self.lease_ms = lease_ms
        self.owner = owner
        # Where archived outputs live when not among the store's blobs: object storage (--archive-url).
        self.archives = archives
        self._archive_error: str | None = None  # the kind of the last failure to write it (logged when it changes)
        self._note_quarantine = note_quarantine
        # The data directory's per-tenant accounts (serve.quota), for a local store; a shared store keeps its own.
        self.quota = quota
        self._set_aside: set[str] = set()  # sessions whose log cannot be read (this process's view)
        self._renewers: dict[str, asyncio.Task[None]] = {}  # key -> the task renewing its leases
        # Leases this process could not release (the store was down): still its own until they run out,
        # so the next request renews one rather than waiting up to its whole time for itself.
        self._unreleased: dict[str, tuple[Lease, float]] = {}  # session id -> (lease, monotonic s when held)
        self.num_store_errors = 0  # requests passed through because the store failed (metric)
        self.num_lease_waits = 0  # requests that waited for another replica's lease (metric)


    @staticmethod
    def _numbered(key: ConversationKey, ids: list[str]) -> list[SessionId]:
        """The ids of ``key``'s sessions among ``ids`` (not its archive, nor a longer key's), oldest first."""
        depth = key.count("/") + 1
        found = [SessionId(i) for i in ids if i.count("/") == depth and i.rsplit("/", 1)[1].isdigit()]
        return sorted(found, key=lambda i: int(i.rsplit("/", 1)[1]))

    def _archive_id(self, key: ConversationKey, session_id: str) -> str:
        """The store's id of a session's archive: the key's for a tenant, the session's own for the
        anonymous tenant (see :meth:`SessionStore.archive_dir`)."""
        return f"{session_id}/archive" if is_anonymous_key(key) else f"{key}/archive"

    async def _put_archived(self, key: ConversationKey, session_id: str, name: str, data: bytes) -> None:
        """Write an archived output where the session's archive lives: object storage, else the store.
        OSError or StoreUnavailable when it cannot be written."""
        if self.archives is not None:
            await self.archives.put(archive_prefix(key, session_id), name, data)
        else:
            await self.store.put_blob(self._archive_id(key, session_id), name, data)

    async def _acquire(self, session_id: str) -> Lease:
        """The session's lease, waiting while another replica holds it (it releases it when its request
        ends, or it expires); SessionBusy after twice the lease's time."""
        store = self.store
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
        store = self.store
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

    def _fetcher(self, key: ConversationKey, session_id: str) -> BlobFetch:
        """A blob reader for the compactor's archive, which the event loop calls before a recall call
        reads (:class:`~ctxfold.compaction.store.buffer.BufferedArchive`): the key's archive, then the
        session's own blobs (an archive written while the store was down went to the spool with the
        session's batch). OSError when the store cannot answer."""

        async def fetch(name: str) -> bytes:
            try:
                return await self._get_blob(key, session_id, name)
            except StoreUnavailable as e:
                raise OSError(errno.EIO, str(e)) from None

        return fetch

    def _lister(self, key: ConversationKey, session_id: str) -> BlobList:
        """The names of the archive's blobs in the store, for the search index (like :meth:`_fetcher`):
        the key's archive and the session's own archived blobs. OSError when the store cannot answer."""
        store = self.store

        async def names() -> list[str]:
            try:
                archived = (await self.archives.names(archive_prefix(key, session_id)) if self.archives is not None
                            else await store.blob_names(self._archive_id(key, session_id)))
                return archived + await store.blob_names(session_id)
            except StoreUnavailable as e:
                raise OSError(errno.EIO, str(e)) from None

        return names

    async def _get_blob(self, key: ConversationKey, session_id: str, name: str) -> bytes:
        """An archived output: from where the session's archive lives, else from the session's own blobs
        (where a commit puts what that place would not take). FileNotFoundError when in neither."""
        try:
            if self.archives is not None:
                return await self.archives.get(archive_prefix(key, session_id), name)
            return await self.store.get_blob(self._archive_id(key, session_id), name)
        except OSError as e:
            try:
                return await self.store.get_blob(session_id, name)
            except FileNotFoundError:
                raise e from None  # not there either: why the archive's place failed is the reason

    def _store_path(self, session_id: str) -> Path:
        return self.data_dir / session_id  # never written: names the key (key_of, archive_prefix)

    async def _build(self, key: ConversationKey, session_id: str, conversation: Conversation,
                     stored: StoredSession | None) -> tuple[Compactor, BufferedLog]:
        blog = BufferedLog(session_id, stored, fetch=self._fetcher(key, session_id),
                           list_blobs=self._lister(key, session_id), source=self.store.url)
        path = self._store_path(session_id)
        # Reading a long conversation back (parsing, counting) would hold the loop: a worker thread then.
        big = stored is not None and len(stored.events) > 64 or len(conversation.messages) > 64
        if big:
            compactor = await asyncio.to_thread(self.make_store_compactor, conversation, path, blog)
        else:
            compactor = self.make_store_compactor(conversation, path, blog)
        return compactor, blog

    async def _load_from_store(self, key: ConversationKey, session_id: SessionId,
                               warnings: list[str] | None) -> ProxySession | None:
        """The stored session, or None when it holds no events yet (its first write never landed) or
        cannot be read (set aside, counted, logged, said in ``warnings``)."""
        try:
            stored = await self.store.read(session_id)
            if not stored.events and not stored.unreadable:
                return None
            compactor, blog = await self._build(key, session_id, Conversation(messages=[]), stored)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever is wrong with this log concerns this session alone
            await self._quarantine(session_id, e, warnings)
            return None
        s = ProxySession(key, self._store_path(session_id), compactor, store_id=session_id, log=blog)
        s.note_wire([])
        s.log_nbytes = records_nbytes(stored.events)
        return s

    async def _quarantine(self, session_id: SessionId, error: Exception, warnings: list[str] | None) -> None:
        """Set a session whose log cannot be read aside: for this process, and in the store where it can
        say so (a local store's ``QUARANTINED`` file); counted, logged, said in ``warnings``."""
        self._set_aside.add(session_id)
        reason = self._note_quarantine(f"{self.store.url} {session_id}", error, warnings)
        try:
            await self.store.quarantine(session_id, reason)
        except (OSError, StoreError) as e:  # a read-only data directory: set aside for this process only
            log.error("cannot mark %s as set aside: %s", session_id, e)

    async def sync_key(self, key: ConversationKey, warnings: list[str] | None) -> LoadedKey:
        """``key``'s sessions as the store holds them now, each leased by this process until
        :meth:`finish`: the ones loaded before and untouched since are kept, the others read again.
        A store that is not shared is listed only when the key is not loaded: nobody else writes it."""
        store = self.store
        found = self.cache.get(key)
        entry = found or self.cache.put(key, [])
        if found is not None and not store.shared:
            ids = [s.store_id for s in entry.sessions if s.store_id is not None and not s.broken]
        else:
            ids = [i for i in self._numbered(key, await store.sessions(key + "/")) if i not in self._set_aside]
        # The most recent ones: the others stay in the store (restore reads them). Each costs a lease per
        # request, so a client that edits its history at every request (a fork each time) costs a bounded
        # number of round trips.
        ids = ids[-min(self.cache.max_sessions, MAX_LEASED_SESSIONS_PER_KEY):]
        if store.shared:
            self._start_renewing(key)
        loaded = {s.store_id: s for s in entry.sessions}
        kept: list[ProxySession] = []
        held: list[Lease] = []
        nbytes = 0
        try:
            for session_id in reversed(ids):  # newest first: the oldest stay out past the bytes bound
                lease = await self._acquire(session_id)
                held.append(lease)
                s = loaded.get(session_id)
                # The token after this process's last one, or that one itself (a lease it could not
                # release, renewed): nobody else wrote since.
                if s is None or s.broken or lease.token not in (s.token, s.token + 1):
                    s = await self._load_from_store(key, session_id, warnings)
                    if s is None or (kept and nbytes + s.log_nbytes > self.cache.max_bytes):
                        await self._release_quietly(held.pop())
                        if s is not None:
                            s.compactor.close()
                        continue
                s.lease, s.token = lease, lease.token
                nbytes += s.log_nbytes
                kept.append(s)
        except BaseException:
            for lease in held:
                await self._release_quietly(lease)
            for s in kept:
                s.lease = None
            raise
        kept.reverse()  # oldest first, as listed
        # Least recently used first: the sessions used before keep their order, the ones just read go first.
        order = {id(s): k for k, s in enumerate(entry.sessions)}
        kept.sort(key=lambda s: order.get(id(s), -1))
        self.cache.replace(entry, kept)
        return entry

    async def _new_store_id(self, key: ConversationKey) -> Lease:
        """A lease on a new session id of ``key``: the first grant ever for that id (token 1), so two
        replicas creating a session at once never get the same one. Counted against the tenant's
        bounds first (QuotaExceeded: nothing is written): by the store itself (``new``), or by the data
        directory's accounts."""
        store = self.store
        taken = [int(i.rsplit("/", 1)[1]) for i in self._numbered(key, await store.sessions(key + "/"))]
        n = max(taken, default=-1) + 1
        while True:
            session_id = f"{key}/{n:04d}"
            if self.quota is not None:
                self.quota.admit(self._store_path(session_id))
            try:
                lease = await store.acquire(session_id, owner=self.owner, ttl_ms=self.lease_ms, new=True)
            except BaseException:
                self._forget(session_id)
                raise
            if lease is not None and lease.token == 1:
                return lease
            self._forget(session_id)
            if lease is not None:
                await self._release_quietly(lease)
            n += 1

    def _forget(self, session_id: str) -> None:
        """A session counted in the data directory's accounts is not made after all."""
        if self.quota is not None:
            self.quota.forget(self._store_path(session_id))

    async def _abandon(self, lease: Lease) -> None:
        """A new session's making failed: uncounted, its lease given up."""
        self._forget(lease.session_id)
        await self._release_quietly(lease)

    async def create(self, key: ConversationKey, conversation: Conversation) -> ProxySession:
        lease = await self._new_store_id(key)
        session_id = SessionId(lease.session_id)
        # The whole history goes in at construction: a conversation first seen long (a proxy put in front
        # of a running agent) is compacted once by the next pass, not by a hard trigger per tool
        # result while it is read in.
        conv = Conversation(messages=list(conversation.messages), id=session_id, system=conversation.system,
                            tools=conversation.tools, source_format="openai", source="ctxfold serve")
        try:
            compactor, blog = await self._build(key, session_id, conv, None)
        except BaseException:
            await self._abandon(lease)
            raise
        return ProxySession(key, self._store_path(session_id), compactor, store_id=session_id, log=blog,
                            lease=lease, token=lease.token)

    async def fork(self, key: ConversationKey, parent: ProxySession, num_common: int) -> ProxySession:
        """A new session continuing ``parent``'s first ``num_common`` messages: its events are the
        parent's up to the first append of a message after the common prefix (renumbered from 0; every
        compaction of that prefix and its state kept), with the history dumps those events name, written
        as one batch (a crash leaves the fork or nothing). A tenant's archive is the key's, shared; an
        anonymous conversation's is its own, so the archived outputs its copied history refers to are
        copied. A parent read back as its checkpoint keeps its last compaction only when that
        compaction lies within the prefix (else the fork starts uncompacted and compacts again)."""
        store = self.store
        parent_id = parent.store_id
        if parent_id is None:
            raise RuntimeError("a session without a store id is forked")
        stored = await store.read(parent_id)
        lease = await self._new_store_id(key)
        session_id = SessionId(lease.session_id)
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
            await self._copy_archived(key, parent_id, session_id, kept, blobs)
            await store.append(lease, Batch(tuple(blobs), tuple(kept)))
            compactor, blog = await self._build(key, session_id, Conversation(messages=[]),
                                                StoredSession(session_id, kept))
        except BaseException:
            await self._abandon(lease)
            raise
        # What went out in the parent's requests was seen, answered or not: a client that leaves the
        # answers out of its history (mini-swe-agent drops a malformed one) forks at every request, and
        # a fork that counted its prefix unseen would never summarize it, leaving it all to the guard.
        compactor.mark_seen(min(num_common, parent.compactor.seen_originals()))
        s = ProxySession(key, self._store_path(session_id), compactor, calibration=parent.calibration,
                         inject_recall=parent.inject_recall, store_id=session_id, log=blog, lease=lease,
                         token=lease.token)
        if len(compactor.originals) == num_common:
            s.wire = list(parent.wire[:num_common])
        else:
            s.note_wire([])
        s.log_nbytes = records_nbytes(kept)
        return s

    async def _copy_archived(self, key: ConversationKey, parent_id: str, session_id: str,
                             kept: list[dict[str, Any]], blobs: list[tuple[str, bytes]]) -> None:
        """Copy the outputs a fork's history (``kept``) names where it reads them: an anonymous one's to its archive
        (its own), those the parent kept with its log, or the archive refuses, to its first batch (``blobs``).
        StoreUnavailable for a failed read: no fork without one."""
        own = set(await self.store.blob_names(parent_id))
        for aid in dict.fromkeys(m.decode() for m in _ARCHIVE_ID.findall(b"".join(encode_event(e) for e in kept))):
            name = f"{ARCHIVE_BLOB_PREFIX}{aid}.txt"
            if name not in own and not is_anonymous_key(key):
                continue  # in the key's archive, which the fork shares
            try:
                data = await self._get_blob(key, parent_id, name)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StoreUnavailable(f"archived output {aid[:12]} of session {parent_id} cannot be read for "
                                       f"its fork: {e}") from e
            if name in own:
                blobs.append((name, data))
                continue
            try:
                await self._put_archived(key, session_id, name, data)
            except OSError:  # object storage refuses it: with the fork's first batch, as a commit does
                blobs.append((name, data))

    async def commit(self, session: ProxySession, *, unless_only_appends: bool = False,
                     release: bool = False) -> None:
        """Write what the session's compactor logged since the last commit, under its lease: the
        archive's blobs to the key's archive, then the rest as one batch; a checkpoint after a
        compaction (a shared store's: see the module docstring). Raises StoreUnavailable (Spooled:
        the batch waits in the local spool, memory and store+spool agree) or LeaseLost; after any
        failure but Spooled the session is marked broken and its key unloaded (read again next time).

        ``unless_only_appends``: nothing when only messages wait (the step before forwarding, when
        nothing fired): they go with the answer's commit, one write fewer per request on the way
        upstream (a round trip and an fsync of Redis's append-only file; a file append in the data
        directory). Nothing is acknowledged to the client before the answer, and a request that gets
        none is sent again with those messages; a store that refuses the answer's commit is said on
        the conversation's next request (:meth:`SessionStore.note_unstored_answer`). ``release``:
        the request's last write: the lease goes in the same call (when there was something to
        write; else :meth:`finish` releases it)."""
        blog, lease = session.log, session.lease
        if blog is None or session.broken:
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
        archive, without = batch.split_archived()
        try:
            if archive and await self._write_archived(session, archive):
                rest = without
            await store.append(lease, rest, release=release)
        except Spooled:
            session.log_nbytes += records_nbytes(batch.events)
            raise
        except BaseException:  # the batch was taken: memory is ahead of the store, which is read again
            session.broken = True
            raise
        session.log_nbytes += records_nbytes(batch.events)
        if release and batch.events:
            session.lease = None  # released by the append
        if store.shared and any(e.get("type") == "view" for e in batch.events):
            try:
                await store.checkpoint(lease)
            except (StoreError, ValueError) as e:  # the events are stored: a later checkpoint folds them
                log.info("no checkpoint of session %s now: %s", session.store_id, e)

    async def _write_archived(self, session: ProxySession, blobs: list[tuple[str, bytes]]) -> bool:
        """Write a batch's archived outputs where the session's archive lives; False when that refuses them
        (they then go with the batch, under the session's own name: spooled with its events when the
        store is down, and read from there)."""
        where = self.archives.url if self.archives is not None else "the store"
        try:
            for name, data in blobs:
                await self._put_archived(session.key, session.store_id or "", name, data)
        except StoreUnavailable:
            return False
        except OSError as e:  # object storage: said once per kind of failure (its text names a session's path)
            kind = f"{type(e).__name__} {e.errno}"
            if kind != self._archive_error:
                log.warning("archived outputs cannot be written to %s (%s); they are kept with each session's "
                            "own log instead, where recalls read them", where, e)
            self._archive_error = kind
            return False
        if self._archive_error is not None:
            log.warning("archived outputs are written to %s again", where)
            self._archive_error = None
        return True

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
            await self.store.release(lease)
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
            return f"another proxy process took this conversation over: {one_line(error)}"
        if isinstance(error, SessionBusy):
            return f"the conversation is busy on another proxy process: {one_line(error)}"
        return f"the session store failed: {one_line(error)}"

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
        try:
            await self.replay_spool()
            await self.store.exists("health-probe")
        except StoreError as e:
            return f"the session store is unreachable: {one_line(e)}"
        spool = self.spool
        if spool is not None and spool.num_pending:
            return (f"{spool.num_pending} session writes wait in the local spool ({spool.dir}) for the store "
                    f"{spool.url}")
        return None

    async def aclose(self) -> None:
        for task in self._renewers.values():
            task.cancel()
        self._renewers.clear()
        await self.store.close()


def one_line(error: BaseException) -> str:
    """An error as one line of at most 300 characters, for a header, a log line or /health."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:300]
