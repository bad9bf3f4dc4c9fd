"""Sessions: one directory per conversation, so compaction is durable and lossless.

Layout::

    <session_dir>/
      events.jsonl          append-only event log (header, appended messages, views, state)
      history/NNNNNN-<sha256>.jsonl   full-history dumps, written before every rewrite
      archive/              the archive store of archived tool outputs (ctxfold.compaction.archive)

The event log is the source of truth. Every original message is logged once, in order, as it is
appended; a compaction logs the new view as references to those originals plus the messages it
wrote (summary, markers, resume instruction). So:

- restore = the originals in log order: the full history, byte for byte, through any number of
  compactions;
- resume = the last view plus every original appended after it, and the last saved state.

Each event is one line, written by a single ``write`` on an ``O_APPEND`` descriptor (a batch of
appended messages: one ``write`` for all) and fsynced (unless ``durable=False``; with
``fsync_appends=False`` the header and appended messages wait for the next fsynced event). A
process killed mid-write leaves at most one torn last line, which
resume ignores and the next append cuts off, so a session is always the old view or the new one,
never a mix. History dumps are written whole to a temporary name and renamed into place before the
view event that points at them is logged (write-ahead).

A compactor does not write here itself: it writes into its journal (:mod:`ctxfold.compaction.journal`)
and its driver persists the journal's batches with :meth:`Session.commit`. The one-record methods
(:meth:`Session.create`, :meth:`Session.append_messages`, ...) write each record at once, through the
same journal and commit, for code that keeps a session without a compactor.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Self

from ctxfold.chat.messages import Conversation, Message
from ctxfold.compaction.archive.store import LocalBackend, make_private_dir, refuse_symlink
from ctxfold.compaction.eventlog import (
    LOG_VERSION,
    Event,
    Record,
    ResumedState,
    ViewEntry,
    decode_event,
    encode_event,
    load_events,
)
from ctxfold.compaction.journal import Batch, Journal, JournalArchive, history_dump_text

__all__ = ["ARCHIVE_DIR", "EVENTS_FILE", "HISTORY_DIR", "LOG_VERSION", "ResumedState", "Session", "ViewEntry",
           "history_dump_text"]

EVENTS_FILE = "events.jsonl"
HISTORY_DIR = "history"
ARCHIVE_DIR = "archive"


def _open_log(path: Path, flags: int) -> int:
    """``os.open`` of an event log: mode 0600 (it holds a user's conversation), and never through a
    symbolic link (O_NOFOLLOW), which a write would follow to a file of the link's choosing."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_symlink(path)
        raise


class Session:
    """The directory of one conversation. Not thread-safe: the compactor that owns it serialises access."""

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True, fsync_appends: bool = True) -> None:
        self.root = Path(root)
        self.events_path = self.root / EVENTS_FILE
        self.durable = durable  # fsync events (dumps are always durable); off for replays and benchmarks
        # With durable, fsync the header and appended messages too. Off where they have another durable
        # home (the proxy: the client sends its whole history with every request): they are then
        # written (a killed process loses nothing) and made durable by the next fsynced event (a
        # compaction).
        self.fsync_appends = fsync_appends
        self._fd: int | None = None
        # What the writes below go through (each written at once); load() and open_new() place its
        # numbering after the log on disk.
        self._journal = Journal()
        self._positioned = False
        # The seq after the last event on disk, where known (load, open_new, a write): events below it
        # are not written again (a batch written whole whose fsync failed is on disk all the same).
        self._written_seq: int | None = None
        self._backends: dict[str, LocalBackend] = {}  # history/, archive/: one each (a backend sweeps its folder)
        # The log's size in bytes while this object holds it open for writing (measured once at the
        # opening, then counted write by write); None otherwise. The proxy's memory bound reads it
        # after every request: counting spares a stat system call per request.
        self.log_nbytes: int | None = None

    # -- paths ------------------------------------------------------------------------------------
    @property
    def history_dir(self) -> Path:
        return self.root / HISTORY_DIR

    @property
    def archive_dir(self) -> Path:
        return self.root / ARCHIVE_DIR

    def exists(self) -> bool:
        return self.events_path.is_file()

    # -- writing ----------------------------------------------------------------------------------
    def journal(self) -> Journal:
        """The journal this session's one-record methods write through, continuing its log (read with
        :meth:`load` first, when it exists): for a compactor whose driver commits it here (:meth:`commit`).
        Whoever takes it owns it: its writes and the one-record methods' are not to be mixed."""
        return self._journal

    def journal_archive(self, journal: Journal) -> JournalArchive:
        """The session's archive through ``journal``: writes pending in it, reads from it, then from
        ``archive/``."""
        return JournalArchive(journal, self._backend(ARCHIVE_DIR))

    def _backend(self, folder: str) -> LocalBackend:
        backend = self._backends.get(folder)
        if backend is None:
            backend = self._backends[folder] = LocalBackend(self.root / folder)
        return backend

    def commit(self, batch: Batch) -> None:
        """Write what a journal held: its blobs atomically under ``history/`` and ``archive/`` (each
        fsynced: a view names them), then its events with one ``write``, all or none, fsynced when
        ``durable`` (the header and appended messages only with ``fsync_appends``). OSError when the
        disk refuses. What was written before the failure is not written again by the next commit of
        the same records: blobs are content-addressed, and events the log holds already are skipped."""
        for name, data in batch.blobs:
            folder, file = name.split("/", 1)
            make_private_dir(self.root / folder)
            self._backend(folder).write_atomic(file, data)
        events = batch.events
        if events and self._written_seq is not None and events[0]["seq"] < self._written_seq:
            events = tuple(e for e in events if e["seq"] >= self._written_seq)  # a retry: some are on disk
        if events:
            sync = self.fsync_appends or any(e.get("type") not in ("header", "append") for e in events)
            self._write_events(events, sync=sync)

    def open_new(self) -> None:
        """Make the directory and a new, empty log, for a journal whose first record is the header:
        FileExistsError when a session is here already."""
        make_private_dir(self.root)
        try:  # O_EXCL: a new log, so no torn tail to cut (see _open), and no race with another creator
            self._fd = _open_log(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)
            self.log_nbytes = 0
        except FileExistsError:
            raise FileExistsError(f"{self.events_path}: a session already exists here; resume it with "
                                  "Session.load()") from None
        self._positioned = True
        self._written_seq = 0

    def create(self, conversation: Conversation) -> None:
        """Start a new session for ``conversation`` (its header; messages are appended one by one)."""
        self.open_new()
        self._journal.create(conversation)
        self._write_through()

    # The writes one by one, each written at once: for code that keeps a session without a compactor
    # (tests, tools). A compactor writes into its journal and its driver commits it.
    def append_messages(self, messages: Iterable[Message]) -> None:
        """Log original messages, in order: one event per message, all in one write (all or none)."""
        self._journal.append_messages(messages)
        self._write_through()

    def write_history_dump(self, messages: Sequence[Message], conversation: Conversation, *,
                           first_index: int = 0, previous: str | None = None) -> Path:
        """Write history as JSONL under history/ (atomically) and return its path.

        A dump holds the originals ``first_index`` onwards; its header line names the dump before
        it (``previous``), so each compaction writes only what came since the last one and the
        dumps together hold the whole history (see :meth:`Journal.write_history_dump` for its name).
        """
        if not self._positioned:  # numbered after the dumps on disk, as a loaded session's are
            self._journal.num_dumps = max(self._journal.num_dumps, self._num_dumps())
        name = self._journal.write_history_dump(messages, conversation, first_index=first_index, previous=previous)
        self._write_through()
        return self.root / name

    def log_view(self, view: Sequence[ViewEntry], *, kind: str, reason: str, dump: Path | None,
                 state: dict[str, Any], figures: dict[str, Any] | None = None) -> None:
        """Log a rewrite of the view. The view entries must refer to originals already logged."""
        # The dump's name in the session (history/<file>), from the path write_history_dump gave
        # (under this session's root, relative or not) or from the name itself.
        name = Path(*dump.parts[-2:]) if dump is not None and len(dump.parts) >= 2 else dump
        self._journal.log_view(view, kind=kind, reason=reason, state=state, figures=figures, dump=name)
        self._write_through()

    def log_state(self, state: dict[str, Any]) -> None:
        """Log compactor state (breaker, occupancy) that changed without a rewrite."""
        self._journal.log_state(state)
        self._write_through()

    def _write_through(self) -> None:
        batch = self._journal.pending()
        try:
            self.commit(batch)
        except BaseException:
            if batch.events and self._written_seq is not None and self._written_seq > batch.events[-1]["seq"]:
                self._journal.drop(batch)  # on disk, only its fsync failed: written, not to be written again
            else:
                self._journal.discard(batch)  # not written: the next record takes the same numbers
            raise
        self._journal.drop(batch)

    def _num_dumps(self) -> int:
        return sum(1 for _ in self.history_dir.glob("*.jsonl")) if self.history_dir.is_dir() else 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.log_nbytes = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> int:
        if self._fd is None:
            make_private_dir(self.root)
            self._cut_torn_tail()
            self._fd = _open_log(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            self.log_nbytes = os.fstat(self._fd).st_size
        return self._fd

    def _cut_torn_tail(self) -> None:
        """Drop a last line cut off by a crash so the next event starts on a line of its own."""
        try:
            with os.fdopen(_open_log(self.events_path, os.O_RDWR), "rb+") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                if size == 0:
                    return
                f.seek(size - 1)
                if f.read(1) == b"\n":
                    return
                # Walk back to the previous newline; the events are small, read the tail in blocks.
                pos = size
                while pos > 0:
                    step = min(65536, pos)
                    f.seek(pos - step)
                    block = f.read(step)
                    nl = block.rfind(b"\n")
                    if nl >= 0:
                        f.truncate(pos - step + nl + 1)
                        return
                    pos -= step
                f.truncate(0)
        except FileNotFoundError:
            return

    def _write_events(self, events: Sequence[Event], *, sync: bool = True) -> None:
        data = b"".join(encode_event(e) + b"\n" for e in events)
        fd = self._open()
        written = os.write(fd, data)
        if written != len(data):
            # A short write on a full disk: take the part back, so the log holds the whole batch or
            # none of it (memory, updated after the log, holds none of it either).
            os.ftruncate(fd, os.fstat(fd).st_size - written)
            self.close()
            raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes); disk full?",
                          str(self.events_path))
        self._written_seq = events[-1]["seq"] + 1  # on disk now, whatever the fsync below does
        if self.log_nbytes is not None:
            self.log_nbytes += written
        if self.durable and sync:
            os.fsync(fd)

    # -- reading ----------------------------------------------------------------------------------
    def read_records(self) -> tuple[list[Record], int]:
        """Each line's record (or why it holds none), and how many torn last lines were left out (0 or
        1: a write cut off by a crash, which the next append cuts away)."""
        with open(self.events_path, "rb") as f:
            lines = f.read().split(b"\n")
        torn = 1 if lines[-1] else 0  # after the final "\n" comes an empty string; anything else is torn
        return [decode_event(raw, location=f"line {i + 1}") for i, raw in enumerate(lines[:-1])], torn

    def load(self, *, salvage: bool = False) -> ResumedState:
        """Read the log: the current view, every original, and the last saved state.

        A line that cannot be read raises FormatError. With ``salvage``, it is left out instead and
        noted in :attr:`ResumedState.skipped` (where, why), so every readable record comes back (see
        :mod:`ctxfold.compaction.eventlog`)."""
        if not self.exists():
            raise FileNotFoundError(f"{self.events_path}: no session here (expected {EVENTS_FILE})")
        records, torn = self.read_records()
        resumed = load_events(records, source=str(self.events_path), salvage=salvage)
        resumed.torn_lines = torn
        self._journal = Journal(next_seq=resumed.next_seq, num_originals=len(resumed.originals),
                                num_dumps=self._num_dumps())
        self._positioned = True
        self._written_seq = resumed.next_seq
        return resumed

    def restore(self, *, salvage: bool = False) -> Conversation:
        """The full original conversation, as it was appended, through any number of compactions.
        ``salvage``: every readable message, leaving out what cannot be read (see :meth:`load`)."""
        resumed = self.load(salvage=salvage)
        conv = resumed.conversation
        conv.messages = resumed.originals
        return conv
