"""Where a compactor's journal is persisted, and by whom: the synchronous driver's side of the log.

The compaction core writes into the conversation's journal (:mod:`ctxfold.compaction.journal`). A
:class:`LogWriter` opens that journal for a compactor and says where it goes:

- a session directory (``session_dir``): the writer loads or creates it and commits the journal to it
  (:meth:`LogWriter.commit`) at the end of every call of the compactor;
- a stored session's journal (``session_log``, :class:`~ctxfold.compaction.store.buffer.BufferedLog`):
  its owner commits it (the proxy, once a request); :meth:`LogWriter.commit` does nothing;
- neither: no log is kept.

An archive given apart from the session (``archive``: shared by several conversations, or in object
storage) takes the archived outputs and history dumps a commit holds, before the directory takes the
records that name them (write-ahead). Without a session directory the journal then carries those
alone (the core writes no records where no log is kept).

A directory or archive that refuses a commit does not stop the conversation: the batch stays in the
journal, first in line for the next commit, and the failure is logged once and kept
(:attr:`LogWriter.unwritten`) until a commit succeeds (:meth:`LogWriter.flush` raises it). Not for
ever: once what waits is over ``max_unwritten_bytes``, a call of the compactor tries the commit first
and, while it is still refused, raises :class:`~ctxfold.errors.LogBacklogError` before it changes
anything (:meth:`LogWriter.call`), so memory stays bounded and the caller learns that its log is stuck.
"""

from __future__ import annotations

import errno
import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from ctxfold import fastjson
from ctxfold.chat.messages import Conversation
from ctxfold.compaction.archive import ArchiveStore, MemoryBackend
from ctxfold.compaction.archive.index import INDEX_FILE
from ctxfold.compaction.archive.marker import parse_marker
from ctxfold.compaction.archive.store import ARCHIVE_FILE_SUFFIX, Backend
from ctxfold.compaction.eventlog import ResumedState
from ctxfold.compaction.journal import ARCHIVE_BLOB_PREFIX, Batch, Journal, JournalArchive
from ctxfold.compaction.session import Session
from ctxfold.compaction.store.buffer import BufferedLog
from ctxfold.errors import ArchiveError, LogBacklogError

log = logging.getLogger("ctxfold.compaction.compactor")  # what a compactor's user configures

# What may wait in memory for a session directory or an archive that refuses writes, by default: far
# more than the records and archived outputs of one agent's turn, far less than a process's memory.
MAX_UNWRITTEN_BYTES = 64 << 20
_NOTHING: AbstractContextManager[None] = nullcontext()


class LogWriter:
    """A compactor's journal and where it is persisted. Not thread-safe: the compactor's lock serialises it."""

    def __init__(self, session_dir: str | Path | None = None, session_log: BufferedLog | None = None, *,
                 archive: ArchiveStore | None = None, durable: bool = True, fsync_appends: bool = True,
                 max_unwritten_bytes: int = MAX_UNWRITTEN_BYTES) -> None:
        if isinstance(max_unwritten_bytes, bool) or not isinstance(max_unwritten_bytes, int) or max_unwritten_bytes < 1:
            raise ValueError(f"max_unwritten_bytes must be a whole number of bytes >= 1, got {max_unwritten_bytes!r}")
        self.max_unwritten_bytes = max_unwritten_bytes
        self.unwritten_nbytes = 0  # the size of what waited when the last commit failed (0 once one succeeds)
        self._depth = 0  # calls in progress (a step may append): only the outermost is checked
        self._sized = (0, 0)  # (events, their bytes) of the pending batch measured already: see _measure
        self.directory: Session | None = None
        self.journal: Journal | None = session_log
        self.external = archive  # the archive given apart from the session, if any
        self.unwritten: OSError | None = None  # why the last commit to the directory failed, if it did
        #: The conversation read back (None for a new one): the compactor resumes it.
        self.resumed: ResumedState | None = None
        if session_dir is not None:
            if session_log is not None:
                raise ValueError("give session_dir or session_log, not both")
            self.directory = Session(session_dir, durable=durable, fsync_appends=fsync_appends)
            self.resumed = self.directory.load() if self.directory.exists() else None
            self.journal = self.directory.journal()
        elif session_log is not None:
            if archive is not None:
                raise ValueError("a stored session's archive is where its store puts it: give no archive with session_log")
            if session_log.exists():
                self.resumed = session_log.load()
        elif archive is not None:
            self.journal = Journal()  # carries the archive's writes to the commit, and nothing else
        #: Whether a log of the conversation is kept (a directory, a store): the core writes records then.
        self.keeps_log = session_dir is not None or session_log is not None

    @property
    def commits(self) -> bool:
        """Whether this writer persists the journal itself (to a directory, an archive given apart)."""
        return self.directory is not None or self.external is not None

    def archive(self) -> ArchiveStore:
        """The conversation's archive, written through its journal: the one given apart, the directory's
        ``archive/``, or the store's; else memory."""
        backend: Backend = MemoryBackend()
        index_path = None
        if self.external is not None and self.journal is not None:
            # Its own search index (a temporary one): the given archive's file may be shared by
            # compactors whose pending outputs differ, and each would drop the others' from it.
            backend = JournalArchive(self.journal, committed=self.external.backend)
        elif self.directory is not None and self.journal is not None:
            backend = self.directory.journal_archive(self.journal)
            index_path = self.directory.archive_dir / INDEX_FILE  # kept between processes
        elif self.journal is not None:
            backend = self.journal.archive_backend()
        if self.resumed is not None and isinstance(backend, JournalArchive):
            # The core never asks the archive what it holds (JournalArchive.exists): the markers of the
            # view read back name outputs stored before the records that show them (write-ahead), so
            # they are known, and a marker is never archived again after a restart.
            backend.known.update(f"{m.archive_id}{ARCHIVE_FILE_SUFFIX}" for m in
                                 map(parse_marker, (v.text for v in self.resumed.conversation.messages))
                                 if m is not None)
        return ArchiveStore(backend, index_path=index_path)

    def start(self, header: Conversation) -> None:
        """A new conversation: a new directory's empty log (FileExistsError when another writer made one
        since), and the header as the journal's first record."""
        if self.directory is not None:
            self.directory.open_new()
        if self.journal is not None and self.keeps_log:
            self.journal.create(header)

    # -- history dumps' names ------------------------------------------------------------------------
    def dump_location(self, name: Path) -> str:
        """Where a history dump the journal named can be read: its path in the session directory, else
        its name in the session's store."""
        return str(self.directory.root / name) if self.directory is not None else str(name)

    def dump_name(self, history_dump: str | None) -> Path | None:
        """A history dump's name in its session (what the log records) from an event's figure."""
        if history_dump is None:
            return None
        if self.directory is not None:
            return Path(history_dump).relative_to(self.directory.root)
        return Path(history_dump)

    # -- persisting --------------------------------------------------------------------------------
    def call(self) -> AbstractContextManager[None]:
        """One call of the compactor: refused before it starts while too much waits (:meth:`check_room`),
        committed when it ends, also when it raised (a refusal is logged too). Nothing to do for a
        writer that does not commit (the journal's owner commits it, if any)."""
        return self if self.commits else _NOTHING

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, *exc_info: object) -> None:
        self.exit()

    def enter(self) -> None:
        """A call starts (:meth:`call`, or a driver that runs one step across threads): the outermost
        is refused while too much waits (an inner one, an append inside a request step, is not: the
        outer one has changed state already)."""
        if self._depth == 0 and self.unwritten is not None:
            self.check_room()
        self._depth += 1

    def exit(self) -> None:
        """A call ends: what it logged is committed, an inner call's too (the messages a step appends
        are on disk before it waits for a summary)."""
        self._depth -= 1
        self.commit()

    def check_room(self) -> None:
        """LogBacklogError while what waits for a refusing directory or archive is over the bound (the
        commit is tried first: it may take writes again). The bound is checked before a call, so what
        waits can pass it by what one call logs."""
        if self.unwritten is None or self.unwritten_nbytes <= self.max_unwritten_bytes:
            return
        self.commit()
        if self.unwritten is not None and self.unwritten_nbytes > self.max_unwritten_bytes:
            raise LogBacklogError(
                self.unwritten.errno or errno.EIO,
                f"{self._where()} has refused writes ({self.unwritten.strerror or self.unwritten}) while "
                f"{_size(self.unwritten_nbytes)} of its log waited in memory, over the "
                f"{_size(self.max_unwritten_bytes)} bound: nothing was done and nothing is lost; call again "
                "once it takes writes (flush() says whether it does)")

    def commit(self) -> None:
        """Write what the journal holds to the archive given apart and the session directory; see the
        module docstring for a refusal."""
        journal = self.journal
        if not self.commits or journal is None or not journal.num_pending:
            return
        # Written from a snapshot and dropped from the journal once stored: a reader without the lock
        # (a recall tool) finds a blob in one place or the other throughout.
        batch = journal.pending()
        try:
            rest = batch
            if self.external is not None:
                archived, rest = batch.split_archived()
                _write_archived(self.external, archived)
            if self.directory is not None:
                self.directory.commit(rest)
        except OSError as e:
            if self.unwritten is None:
                log.warning("%s cannot be written (%s); the conversation goes on in memory and what it logged is "
                            "written with the next call, up to %s", self._where(), e, _size(self.max_unwritten_bytes))
            self.unwritten = e
            self.unwritten_nbytes = self._measure(batch)
            return
        journal.drop(batch)
        self.unwritten_nbytes, self._sized = 0, (0, 0)
        if self.unwritten is not None:
            log.warning("%s is written again: nothing was lost", self._where())
        self.unwritten = None

    def _measure(self, batch: Batch) -> int:
        """What ``batch`` (all that waits) takes on disk, about what it holds in memory. Measured only
        when a commit failed, so a call whose commit succeeds pays nothing for the bound; the events
        measured by an earlier failure are still first in the batch, and are not encoded again."""
        num_sized, events_nbytes = self._sized
        events_nbytes += sum(len(fastjson.dumps(e)) + 1 for e in batch.events[num_sized:])
        self._sized = (len(batch.events), events_nbytes)
        return events_nbytes + sum(len(data) for _, data in batch.blobs)

    def _where(self) -> str:
        if self.directory is None:
            return f"archive {self.external.location if self.external is not None else ''}"
        return f"session {self.directory.root}"

    def flush(self) -> None:
        """Commit now; OSError when the directory still cannot be written."""
        self.commit()
        if self.unwritten is not None:
            raise self.unwritten

    def close(self) -> None:
        """Flush (OSError when it cannot: nothing is lost while the compactor lives), then close the log."""
        try:
            self.flush()
        finally:
            if self.directory is not None:
                self.directory.close()


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MB" if num_bytes >= 2**20 else f"{num_bytes:,} bytes"


def _write_archived(archive: ArchiveStore, blobs: list[tuple[str, bytes]]) -> None:
    """Write archived outputs (``archive/<name>`` blobs) to ``archive``; OSError when it refuses one."""
    for name, data in blobs:
        try:
            archive.backend.write_atomic(name[len(ARCHIVE_BLOB_PREFIX):], data)
        except (ValueError, ArchiveError) as e:  # a backend's refusal in its own words: a refusal
            raise OSError(errno.EIO, f"{type(e).__name__}: {e}") from e
