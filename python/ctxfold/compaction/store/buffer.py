"""How the synchronous compactor writes to an asynchronous store: into a buffer the proxy commits.

A :class:`BufferedLog` is a :class:`ctxfold.compaction.session.SessionLog`, as a session directory is, and keeps
what it is given in memory: event records with the next seqs, and history dumps (and archived outputs, through
:meth:`BufferedLog.archive_backend`) as blobs. The proxy takes the batch with :meth:`BufferedLog.take`
and commits it with one ``await store.append(lease, batch)`` before it answers the client.

Why a buffer, and not a synchronous Redis client in the compactor's worker thread, or the worker thread
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
import hashlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ctxfold.chat.messages import Conversation, Message
from ctxfold.compaction.eventlog import Event, EventBuilder, ResumedState, ViewEntry, load_events
from ctxfold.compaction.session import history_dump_text
from ctxfold.compaction.store.base import Batch, StoredSession, check_session_id

BlobFetch = Callable[[str], Awaitable[bytes]]  # blob name -> bytes from the store; FileNotFoundError when absent
BlobList = Callable[[], Awaitable[list[str]]]  # the archive's blob names in the store; OSError when it cannot say


class BufferedLog:
    """One session's event log, buffered for a store. Not thread-safe: the compactor that owns it
    serialises access (as with :class:`Session`)."""

    def __init__(self, session_id: str, stored: StoredSession | None = None, *,
                 fetch: BlobFetch | None = None, list_blobs: BlobList | None = None,
                 source: str = "store") -> None:
        self.session_id = check_session_id(session_id)
        self.source = f"{source} {session_id}"
        self._stored = stored
        self._exists = bool(stored is not None and (stored.events or stored.unreadable))
        events = stored.events if stored is not None else []
        self._log = EventBuilder(next_seq=stored.next_seq if stored is not None else 0,
                                 num_originals=sum(1 for e in events if e.get("type") == "append"))
        self._num_dumps = sum(1 for e in events if e.get("type") == "view" and e.get("dump"))
        self._events: list[Event] = []
        self._blobs: dict[str, bytes] = {}  # pending, in insertion order
        self._fetch = fetch
        self._list_blobs = list_blobs

    # -- what the compactor calls (SessionLog) ---------------------------------------------
    def exists(self) -> bool:
        return self._exists

    def load(self) -> ResumedState:
        """The stored session (from the records given at construction; they are dropped after this).
        FormatError for any record that cannot be read: a session is resumed whole or not at all."""
        if not self._exists or self._stored is None:
            raise FileNotFoundError(f"{self.source}: no such session")
        resumed = load_events(self._stored.records(), source=self.source)
        self._stored = None  # the compactor holds the state now: no second copy of every original
        self._log = EventBuilder(next_seq=resumed.next_seq, num_originals=len(resumed.originals))
        return resumed

    def create(self, conversation: Conversation) -> None:
        if self._exists:
            raise FileExistsError(f"{self.source}: a session already exists here; load it instead")
        self._exists = True
        self._stored = None
        self._add(self._log.header(conversation))

    def append_messages(self, messages: Iterable[Message]) -> None:
        self._add(self._log.appends(messages))

    def write_history_dump(self, messages: Sequence[Message], conversation: Conversation, *,
                           first_index: int = 0, previous: str | None = None) -> Path:
        """The dump as :meth:`Session.write_history_dump` names and writes it, kept as a pending blob."""
        text = history_dump_text(messages, conversation, first_index=first_index, previous=previous)
        data = text.encode()
        name = f"history/{self._num_dumps:06d}-{hashlib.sha256(data).hexdigest()[:16]}.jsonl"
        self._num_dumps += 1
        self._blobs[name] = data
        return Path(name)  # relative: the blob's name, which the view event records

    def log_view(self, view: Sequence[ViewEntry], *, kind: str, reason: str, dump: Path | None,
                 state: dict[str, Any], figures: dict[str, Any] | None = None) -> None:
        self._add(self._log.view(view, kind=kind, reason=reason, state=state, figures=figures,
                                 dump=dump.as_posix() if dump is not None else None))

    def log_state(self, state: dict[str, Any]) -> None:
        self._add(self._log.state(state))

    def close(self) -> None:
        return None

    # -- what the proxy calls ---------------------------------------------------------------------
    def take(self) -> Batch:
        """The pending blobs and events, in order, as one batch; the buffer is empty after it."""
        batch = Batch(tuple(self._blobs.items()), tuple(self._events))
        self._blobs = {}
        self._events = []
        return batch

    @property
    def num_pending(self) -> int:
        return len(self._events) + len(self._blobs)

    @property
    def only_appends_pending(self) -> bool:
        """Whether what waits is messages alone (no header, view, state or blob): what a client sends
        again with its next request anyway."""
        return not self._blobs and all(e.get("type") == "append" for e in self._events)

    def archive_backend(self) -> BufferedArchive:
        """An archive backend (:class:`ctxfold.compaction.archive.store.Backend`) for this session's compactor:
        writes join the pending batch as ``archive/<sha256>.txt`` blobs; reads come from them, else
        from what the event loop fetched with ``fetch`` before (:meth:`BufferedArchive.fetch`)."""
        return BufferedArchive(self)

    def _add(self, events: list[Event]) -> None:
        self._events += events
        self._log.taken(events)


class BufferedArchive:
    """The archive of a :class:`BufferedLog`'s session. Archive files are content-addressed: a name
    written again holds the same bytes, so "exists" may say False for one the store holds (it is then
    written once more) without harm.

    The store is asynchronous and its readers (a recall call, the search index) run in worker threads:
    the event loop fetches what a reader will need first (:meth:`fetch`, :meth:`relist`), and the reader
    takes it from memory. Nothing here waits on the store from another thread.
    """

    def __init__(self, log: BufferedLog) -> None:
        self.log = log
        self.location = f"{log.source} archive"
        self._known: set[str] = set()  # names committed or fetched before
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
            if fetch is None or name in self._fetched or f"archive/{name}" in self.log._blobs:
                continue
            self._unreadable.pop(name, None)
            try:
                self._fetched[name] = await fetch(f"archive/{name}")
            except FileNotFoundError:
                continue
            except OSError as e:
                self._unreadable[name] = str(e)
                continue
            finally:
                # A search's first fetch reads every archived text: the other conversations' callbacks
                # run between two reads, not after the last.
                await asyncio.sleep(0)
            self._known.add(name)

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
        self._listed = {b.split("/", 1)[1] for b in listed if b.startswith("archive/")}
        return sorted(self._listed)

    def exists(self, name: str) -> bool:
        return name in self._known or f"archive/{name}" in self.log._blobs

    def read_bytes(self, name: str) -> bytes:
        # One lookup, not a test then a read: the event loop may take the pending batch between two
        # steps of a reader in a worker thread.
        pending = self.log._blobs.get(f"archive/{name}")
        if pending is not None:
            return pending
        data = self._fetched.pop(name, None)
        if data is not None:
            return data
        if name in self._unreadable:
            raise OSError(errno.EIO, self._unreadable[name])
        raise FileNotFoundError(f"{self.location}: no {name} (not fetched from the store)")

    def write_atomic(self, name: str, data: bytes) -> None:
        self.log._blobs[f"archive/{name}"] = bytes(data)
        self._known.add(name)

    def names(self) -> Iterator[str]:
        """The names committed or fetched before, those pending and those the store listed at the last
        :meth:`relist`. OSError when that listing failed."""
        if self._list_error is not None:
            raise OSError(errno.EIO, self._list_error)
        pending = {b.split("/", 1)[1] for b in self.log._blobs if b.startswith("archive/")}
        return iter(sorted(self._known | self._listed | pending))
