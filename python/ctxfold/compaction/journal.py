"""What the compactor writes, kept in memory until its driver persists it: the one event-log writer.

The compaction core does no I/O. Everything a pass would write (a conversation's header, its messages,
a history dump, a rewrite of the view, a change of state, an archived output) goes into the
conversation's :class:`Journal`: records numbered by :class:`~ctxfold.compaction.eventlog.EventBuilder`
(the one codec every log is written and read with) and blobs by name. A driver takes what is pending as
one :class:`Batch` and persists it, blobs before the records that name them (write-ahead):

- the library's :class:`~ctxfold.compaction.compactor.Compactor` with a session directory commits it to
  the directory (:meth:`ctxfold.compaction.session.Session.commit`) at the end of every call;
- the proxy commits it to its session store with one ``await store.append(lease, batch)`` per request
  (:class:`ctxfold.compaction.store.buffer.BufferedLog`, the journal of a stored session).

A batch that cannot be written stays in the journal (:meth:`Journal.pending`, then :meth:`Journal.drop`
once it is written) and is written first by the next commit: memory and the journal always agree, and
the log lags behind them by what is pending, never by a hole.

Archived outputs go through :meth:`Journal.archive_backend`: writes join the pending batch as
``archive/<sha256>.txt`` blobs, reads come from them first, then from where committed ones are read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxfold import fastjson
from ctxfold.chat.codec import encode_conversation_header, encode_message
from ctxfold.chat.messages import Conversation, Message
from ctxfold.compaction.archive.store import Backend
from ctxfold.compaction.eventlog import Event, EventBuilder, ViewEntry

__all__ = ["ARCHIVE_BLOB_PREFIX", "HISTORY_BLOB_PREFIX", "Batch", "Journal", "JournalArchive", "history_dump_text"]

HISTORY_BLOB_PREFIX = "history/"
ARCHIVE_BLOB_PREFIX = "archive/"


@dataclass(frozen=True, slots=True)
class Batch:
    """What a journal held when it was taken: blobs first, then events (contiguous ``seq``), all or none."""

    blobs: tuple[tuple[str, bytes], ...] = ()  # (blob name, bytes)
    events: tuple[Event, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.blobs or self.events)

    def split_archived(self) -> tuple[list[tuple[str, bytes]], Batch]:
        """(its archived outputs, the batch without them): for a driver that stores those elsewhere."""
        archived = [(n, d) for n, d in self.blobs if n.startswith(ARCHIVE_BLOB_PREFIX)]
        return archived, Batch(tuple((n, d) for n, d in self.blobs if not n.startswith(ARCHIVE_BLOB_PREFIX)), self.events)


def history_dump_text(messages: Sequence[Message], conversation: Conversation, *, first_index: int = 0,
                      previous: str | None = None) -> str:
    """A history dump: a header line (the conversation, where this part starts, the part before
    it), then one message a line. Deterministic: no clock in it. Encodable as UTF-8 (see
    :func:`fastjson.dumps_text`)."""
    header = {"type": "header", "first_index": first_index, "previous": previous,
              "conversation": encode_conversation_header(conversation)}
    return "".join(fastjson.dumps_text(line, separators=None) + "\n" for line in [header, *map(encode_message, messages)])


class Journal:
    """One conversation's pending records and blobs. Not thread-safe: the compactor that owns it
    serialises access (its lock), and its driver takes the batch under the same lock.

    ``next_seq``, ``num_originals`` and ``num_dumps`` continue a log read back (its next record number,
    its originals, its history dumps: the next dump's name counts them)."""

    def __init__(self, *, next_seq: int = 0, num_originals: int = 0, num_dumps: int = 0) -> None:
        self._log = EventBuilder(next_seq=next_seq, num_originals=num_originals)
        self.num_dumps = num_dumps  # history dumps so far: the next one's number
        self._events: list[Event] = []
        self._blobs: dict[str, bytes] = {}  # pending, in insertion order

    # -- what the compaction core writes ------------------------------------------------------------
    def create(self, conversation: Conversation) -> None:
        """A new session's first record: its header (system prompt, tools)."""
        self._add(self._log.header(conversation))

    def append_messages(self, messages: Iterable[Message]) -> None:
        """Original messages, in order: one record each."""
        self._add(self._log.appends(messages))

    def write_history_dump(self, messages: Sequence[Message], conversation: Conversation, *,
                           first_index: int = 0, previous: str | None = None) -> Path:
        """A history dump as a pending blob; its name (``history/NNNNNN-<sha256 prefix>.jsonl``, relative to
        the session), which the view event records. A sequence number and the content's digest:
        deterministic (a replay is reproducible to the token), and two different dumps never share one."""
        data = history_dump_text(messages, conversation, first_index=first_index, previous=previous).encode()
        name = f"{HISTORY_BLOB_PREFIX}{self.num_dumps:06d}-{hashlib.sha256(data).hexdigest()[:16]}.jsonl"
        self.num_dumps += 1
        self._blobs[name] = data
        return Path(name)

    def log_view(self, view: Sequence[ViewEntry], *, kind: str, reason: str, dump: Path | None,
                 state: dict[str, Any], figures: dict[str, Any] | None = None) -> None:
        """A rewrite of the view; its entries refer to originals already appended."""
        self._add(self._log.view(view, kind=kind, reason=reason, state=state, figures=figures,
                                 dump=dump.as_posix() if dump is not None else None))

    def log_state(self, state: dict[str, Any]) -> None:
        """Compactor state (breaker, occupancy) that changed without a rewrite."""
        self._add(self._log.state(state))

    def archive_backend(self) -> JournalArchive:
        """An archive backend for this conversation's compactor whose writes join the pending batch."""
        return JournalArchive(self)

    # -- what a driver calls --------------------------------------------------------------------------
    def take(self) -> Batch:
        """The pending blobs and events, in order, as one batch; the journal is empty after it."""
        batch = Batch(tuple(self._blobs.items()) if self._blobs else (), tuple(self._events))
        if self._blobs:
            self._blobs = {}
        self._events = []
        return batch

    def pending(self) -> Batch:
        """What waits, as one batch, left in the journal until :meth:`drop` says it is written: a reader
        finds a blob here until it is on disk (:class:`JournalArchive`)."""
        return Batch(tuple(self._blobs.items()) if self._blobs else (), tuple(self._events))

    def drop(self, batch: Batch) -> None:
        """``batch`` (from :meth:`pending`) is written: out of the journal, whatever was added since stays."""
        del self._events[:len(batch.events)]
        for name, _ in batch.blobs:
            self._blobs.pop(name, None)

    def discard(self, batch: Batch) -> None:
        """Give up ``batch``, all that waits (from :meth:`pending`), unwritten: out of the journal, and its
        records' numbers (seq, originals, dumps) free again, as if they had never been written."""
        if len(batch.events) != len(self._events) or len(batch.blobs) != len(self._blobs):
            raise ValueError("only all that waits is discarded")
        self._events, self._blobs = [], {}
        self._log.next_seq -= len(batch.events)
        self._log.num_originals -= sum(1 for e in batch.events if e.get("type") == "append")
        self.num_dumps -= sum(1 for name, _ in batch.blobs if name.startswith(HISTORY_BLOB_PREFIX))

    @property
    def num_pending(self) -> int:
        return len(self._events) + len(self._blobs)

    @property
    def only_appends_pending(self) -> bool:
        """Whether what waits is messages alone (no header, view, state or blob): what a client sends
        again with its next request anyway."""
        return not self._blobs and all(e.get("type") == "append" for e in self._events)

    def pending_blob(self, name: str) -> bytes | None:
        return self._blobs.get(name)

    def _add(self, events: list[Event]) -> None:
        self._events += events
        self._log.taken(events)


class JournalArchive:
    """The archive of a :class:`Journal`'s conversation. Writes are pending blobs; reads take a pending
    one, else a committed one from ``committed`` (a session directory's archive, an archive given
    apart), else none.

    ``exists`` is what the compaction core asks before it archives an output, and it never waits on
    the archive: it answers from what this object wrote or was handed (:attr:`known`), the pending
    blobs among them. Archive files are content-addressed, so a False for a name stored by another
    process, or before a restart, only has it written once more with the same bytes; a reader that
    must know (a restore) reads instead."""

    def __init__(self, journal: Journal, committed: Backend | None = None, location: str = "<journal>") -> None:
        self.journal = journal
        self.committed = committed
        self.location = committed.location if committed is not None else location
        self.known: set[str] = set()  # names written here (pending, then committed) or read back before

    def exists(self, name: str) -> bool:
        return name in self.known or self.journal.pending_blob(ARCHIVE_BLOB_PREFIX + name) is not None

    def read_bytes(self, name: str) -> bytes:
        # One lookup, not a test then a read: a driver may take the pending batch between two steps
        # of a reader in a worker thread.
        pending = self.journal.pending_blob(ARCHIVE_BLOB_PREFIX + name)
        if pending is not None:
            return pending
        data = self._read_committed(name)
        self.known.add(name)
        return data

    def _read_committed(self, name: str) -> bytes:
        if self.committed is None:
            raise FileNotFoundError(f"{self.location}: no {name}")
        return self.committed.read_bytes(name)

    def write_atomic(self, name: str, data: bytes) -> None:
        self.journal._blobs[ARCHIVE_BLOB_PREFIX + name] = bytes(data)
        self.known.add(name)

    def pending_names(self) -> set[str]:
        # A snapshot first (one C call under the GIL): the committing thread may drop names meanwhile.
        return {b.removeprefix(ARCHIVE_BLOB_PREFIX) for b in tuple(self.journal._blobs) if b.startswith(ARCHIVE_BLOB_PREFIX)}

    def names(self) -> Iterator[str]:
        committed = set(self.committed.names()) if self.committed is not None else set()
        return iter(sorted(committed | self.pending_names()))

