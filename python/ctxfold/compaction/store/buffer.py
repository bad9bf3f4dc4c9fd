"""The journal of a session in a store: what the proxy's compactors write, and the batch the proxy commits.

A :class:`BufferedLog` is the :class:`ctxfold.compaction.journal.Journal` of a session read back from a
store (or new in it): the compactor writes its records and blobs into it, and the proxy takes the batch
with :meth:`~ctxfold.compaction.journal.Journal.take` and commits it with one ``await store.append(lease,
batch)`` before it answers the client.

Why a journal, and not a synchronous Redis client in the compactor's worker thread, or the worker thread
calling into the event loop:

- One round trip per request, not one per event: a request's appends, a compaction's dump and view all
  go in one fenced script call (all or none), so the fencing check and the ordering are per batch.
- No second client, connection pool and error path to keep in step with the asyncio one, and no
  deadlock where the compactor runs on the event loop's own thread (the proxy builds small sessions
  there): the compactor never waits on I/O at all.
- Durability is unchanged where it matters: the proxy answers only after the commit, so nothing is
  acknowledged to a client before the store (or the local spool) holds it; a process that dies
  before the commit loses only what no client was told about, and the client sends it again (it
  sends its whole history with every request).

The write-ahead order holds within the batch: the store writes its blobs before its events, so a view
event never names a dump that is not stored.

After a failed commit other than :class:`ctxfold.compaction.store.spool.Spooled` (the batch is in the spool), the
compactor's memory is ahead of the store: the caller drops the compactor and loads the session again.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable, Iterable, Iterator

from ctxfold.chat.messages import Conversation
from ctxfold.compaction.eventlog import ResumedState, load_events
from ctxfold.compaction.journal import ARCHIVE_BLOB_PREFIX, Journal, JournalArchive
from ctxfold.compaction.store.base import StoredSession, check_session_id

BlobFetch = Callable[[str], Awaitable[bytes]]  # blob name -> bytes from the store; FileNotFoundError when absent
BlobList = Callable[[], Awaitable[list[str]]]  # the archive's blob names in the store; OSError when it cannot say


class BufferedLog(Journal):
    """One stored session's journal. Not thread-safe: the compactor that owns it serialises access."""

    def __init__(self, session_id: str, stored: StoredSession | None = None, *,
                 fetch: BlobFetch | None = None, list_blobs: BlobList | None = None,
                 source: str = "store") -> None:
        events = stored.events if stored is not None else []
        super().__init__(next_seq=stored.next_seq if stored is not None else 0,
                         num_originals=sum(1 for e in events if e.get("type") == "append"),
                         num_dumps=sum(1 for e in events if e.get("type") == "view" and e.get("dump")))
        self.session_id = check_session_id(session_id)
        self.source = f"{source} {session_id}"
        self._stored = stored
        self._exists = bool(stored is not None and (stored.events or stored.unreadable))
        self._fetch = fetch
        self._list_blobs = list_blobs

    def exists(self) -> bool:
        return self._exists

    def load(self) -> ResumedState:
        """The stored session (from the records given at construction; they are dropped after this).
        FormatError for any record that cannot be read: a session is resumed whole or not at all."""
        if not self._exists or self._stored is None:
            raise FileNotFoundError(f"{self.source}: no such session")
        resumed = load_events(self._stored.records(), source=self.source)
        self._stored = None  # the compactor holds the state now: no second copy of every original
        return resumed

    def create(self, conversation: Conversation) -> None:
        if self._exists:
            raise FileExistsError(f"{self.source}: a session already exists here; load it instead")
        self._exists = True
        self._stored = None
        super().create(conversation)

    def archive_backend(self) -> BufferedArchive:
        """The session's archive: writes join the pending batch as ``archive/<sha256>.txt`` blobs; reads
        come from them, else from what the event loop fetched with ``fetch`` before
        (:meth:`BufferedArchive.fetch`)."""
        return BufferedArchive(self)


class BufferedArchive(JournalArchive):
    """The archive of a :class:`BufferedLog`'s session.

    The store is asynchronous and its readers (a recall call, the search index) run in worker threads:
    the event loop fetches what a reader will need first (:meth:`fetch`, :meth:`relist`), and the reader
    takes it from memory. Nothing here waits on the store from another thread.
    """

    def __init__(self, log: BufferedLog) -> None:
        super().__init__(log, location=f"{log.source} archive")
        self.log = log
        self._fetched: dict[str, bytes] = {}  # read from the store for a reader that has not taken them yet
        self._unreadable: dict[str, str] = {}  # names whose fetch failed, and why
        self._listed: set[str] = set()  # the store's names at the last relist
        self._list_error: str | None = None

    async def fetch(self, names: Iterable[str]) -> None:
        """Reads ``names`` from the store for a reader to come. A name pending or fetched already is
        skipped, and one the store lacks is left out (the reader finds no such name); a failed read is
        kept as the reason the reader's read fails."""
        fetch = self.log._fetch
        for name in names:
            if fetch is None or name in self._fetched or self.journal.pending_blob(ARCHIVE_BLOB_PREFIX + name) is not None:
                continue
            self._unreadable.pop(name, None)
            try:
                self._fetched[name] = await fetch(ARCHIVE_BLOB_PREFIX + name)
            except FileNotFoundError:
                continue
            except OSError as e:
                self._unreadable[name] = str(e)
                continue
            finally:
                # A search's first fetch reads every archived text: the other conversations' callbacks
                # run between two reads, not after the last.
                await asyncio.sleep(0)
            self.known.add(name)

    async def relist(self) -> list[str]:
        """The names the store holds now (another replica may have archived some), which :meth:`names`
        answers with from then on; the failure, when the store cannot say, is what it raises."""
        listed: list[str] = []
        self._list_error = None
        if self.log._list_blobs is not None:
            try:
                listed = await self.log._list_blobs()
            except OSError as e:
                self._list_error = str(e)
        self._listed = {b.split("/", 1)[1] for b in listed if b.startswith(ARCHIVE_BLOB_PREFIX)}
        return sorted(self._listed)

    def _read_committed(self, name: str) -> bytes:
        data = self._fetched.pop(name, None)
        if data is not None:
            return data
        if name in self._unreadable:
            raise OSError(errno.EIO, self._unreadable[name])
        raise FileNotFoundError(f"{self.location}: no {name} (not fetched from the store)")

    def names(self) -> Iterator[str]:
        """The names committed or fetched before, those pending and those the store listed at the last
        :meth:`relist`. OSError when that listing failed."""
        if self._list_error is not None:
            raise OSError(errno.EIO, self._list_error)
        return iter(sorted(self.known | self._listed | self.pending_names()))
