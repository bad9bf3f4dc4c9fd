"""The search index of one conversation's archive: SQLite's FTS5 (the standard library's ``sqlite3``),
a cache of the archive that can always be rebuilt from it.

One table, ``docs``, an FTS5 table with the trigram tokenizer: a row per archived text (a tool output
or a history dump), its id and its text. The trigram tokenizer indexes every three characters, so a
literal query of three characters or more finds exactly the texts that contain it (case-insensitively),
whatever its punctuation: ``FileNotFoundError: 'a.py'`` is found as it was written, where a word
tokenizer would have split it. Shorter queries and regular expressions read every row (they cannot use
the index; they still read the local copy, not the archive).

The index is kept in step with the archive at each search (:meth:`ArchiveIndex.sync`): ids the archive
lists that the index lacks are read and added, ids it no longer lists (an expired key's archive) are
dropped. So a missing index file is rebuilt from the archive on the next search, and an index that
cannot be read (a corrupt file, a different schema) is deleted and rebuilt. Nothing is lost with it:
the archive is the record, the index only a copy arranged for finding.

Thread-safe: the proxy searches in worker threads, and two requests of one conversation may search at
once; one lock serialises the connection's use.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ctxfold.errors import ArchiveError, IntegrityError

if TYPE_CHECKING:
    from ctxfold.compaction.archive.store import ArchiveStore

log = logging.getLogger("ctxfold.compaction.archive")
T = TypeVar("T")

INDEX_FILE = "search-index.sqlite"  # beside the archive's files, in a local archive directory
SCHEMA_VERSION = 1
TRIGRAM_MIN_CHARS = 3  # the trigram tokenizer matches queries of three characters or more


class ArchiveIndex:
    """The FTS5 index of one archive. ``path``: the index's file; None keeps a private temporary
    database (on disk, deleted when closed): for an archive that is not a local directory (Redis,
    object storage), whose index is then a cache of this process, rebuilt from the archive once."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._ids: set[str] | None = None  # the ids indexed, once read
        self._fts = True  # FTS5 with the trigram tokenizer is there (else a plain table: see _connection)
        self.rebuilds = 0  # times the index was found unreadable and made again
        # Archive ids that could not be read (left out, said in answers). Replaced, never changed in place:
        # the event loop reads it while a worker thread may be syncing.
        self.unreadable: frozenset[str] = frozenset()

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def sync(self, store: ArchiveStore) -> int:
        """Bring the index in step with ``store``; returns the number of texts indexed. Raises
        ArchiveError when the archive cannot be listed."""
        with self._lock:
            return self._guarded(lambda: self._sync(store))

    def indexed_ids(self) -> frozenset[str]:
        """The ids indexed as of the last sync (none before the first): what a caller that must fetch
        texts ahead of a sync can leave out."""
        return frozenset(self._ids or ())

    def rows(self, literal: str | None) -> list[tuple[str, str]]:
        """(id, text) of every indexed text that may contain ``literal`` (case-insensitively; every
        text when ``literal`` is None or shorter than the trigram), in id order."""
        with self._lock:
            return self._guarded(lambda: list(self._rows(literal)))

    # -- inside the lock -----------------------------------------------------------------------------
    def _guarded(self, work: Callable[[], T]) -> T:
        """``work``; when the index cannot be read, once more on an index made again from nothing."""
        try:
            return work()
        except sqlite3.DatabaseError as e:
            log.warning("search index %s cannot be read (%s): rebuilding it from the archive",
                        self.path or "<temporary>", e)
            self._reset()
            self.rebuilds += 1
        return work()

    def _connection(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # check_same_thread=False: worker threads take turns under self._lock.
        db = sqlite3.connect("" if self.path is None else self.path, timeout=10.0, check_same_thread=False,
                             isolation_level=None)
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}, expected {SCHEMA_VERSION}")
            try:
                db.execute("CREATE VIRTUAL TABLE IF NOT EXISTS docs USING fts5(id UNINDEXED, text, tokenize='trigram')")
                self._fts = True
            except sqlite3.OperationalError as e:
                if "no such module" not in str(e) and "no such tokenizer" not in str(e):
                    raise
                # An SQLite built without FTS5 (or older than 3.34's trigram tokenizer): the same rows,
                # every search reads them all. Slower for literal queries, the same answers.
                db.execute("CREATE TABLE IF NOT EXISTS docs (id TEXT PRIMARY KEY, text TEXT)")
                self._fts = False
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            db.close()
            raise
        self._db = db
        return db

    def _reset(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        self._ids = None
        if self.path is not None:
            for suffix in ("", "-journal", "-wal", "-shm"):
                try:
                    os.unlink(f"{self.path}{suffix}")
                except FileNotFoundError:
                    pass

    def _sync(self, store: ArchiveStore) -> int:
        db = self._connection()
        if self._ids is None:
            self._ids = {row[0] for row in db.execute("SELECT id FROM docs")}
        try:
            stored = set(store.ids())
        except OSError as e:
            raise ArchiveError(f"cannot list the archive under {store.location}: {e}") from e
        gone = self._ids - stored
        new = sorted(stored - self._ids - self.unreadable)
        if not gone and not new:
            return len(self._ids)
        db.execute("BEGIN")
        try:
            for aid in gone:
                db.execute("DELETE FROM docs WHERE id = ?", (aid,))
            for aid in new:
                try:
                    text = store.get(aid)
                except KeyError:
                    continue  # listed, then gone (expired) before it was read
                except (ArchiveError, IntegrityError) as e:
                    log.warning("archived text %s left out of the search index: %s", aid, e)
                    self.unreadable = self.unreadable | {aid}
                    continue
                db.execute("INSERT INTO docs (id, text) VALUES (?, ?)", (aid, _sqlite_text(text)))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            self._ids = None
            raise
        self._ids = {row[0] for row in db.execute("SELECT id FROM docs")}
        return len(self._ids)

    def _rows(self, literal: str | None) -> Iterator[tuple[str, str]]:
        db = self._connection()
        # FTS5 ends a string at a NUL, and SQLite cannot take a lone surrogate: such a query reads every row.
        if literal is None or len(literal) < TRIGRAM_MIN_CHARS or not self._fts or _sqlite_text(literal) != literal \
                or "\x00" in literal:
            cursor = db.execute("SELECT id, text FROM docs ORDER BY id")
        else:
            phrase = '"' + literal.replace('"', '""') + '"'  # one FTS5 string: no query syntax in it
            cursor = db.execute("SELECT id, text FROM docs WHERE docs MATCH ? ORDER BY id", (phrase,))
        for aid, text in cursor:
            yield str(aid), str(text)


def _sqlite_text(text: str) -> str:
    """``text`` as SQLite can hold it: a lone surrogate (JSON can carry one) becomes ``?``, one
    character for one, so offsets into the index's copy are offsets into the archived text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text
