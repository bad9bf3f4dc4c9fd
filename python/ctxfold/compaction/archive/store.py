"""Content-addressed archive of one conversation's tool outputs.

Each content is stored once, under the hex sha256 of its UTF-8 bytes, in ``<root>/<sha256>.txt``.
The layout is flat: one conversation archives hundreds of outputs, not millions, so shard folders
would only add a syscall per write.

Writes are atomic: a temp file in the same directory is written, flushed, fsynced, renamed over the
final name, and the directory is fsynced. A reader therefore sees the whole content or nothing, and a
crash leaves at most a temp file, which is never taken for an archive and is swept on the next open.

Ids are validated against the exact 64-hex pattern before any path is built, so nothing taken from
message content (a marker the model copied, a tool argument) can name a file outside the archive.

Content is text. It is encoded with ``surrogatepass`` so that any Python ``str`` (JSON can carry lone
surrogates) round-trips byte for byte.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NewType, Protocol

from ctxfold.compaction.archive.index import INDEX_FILE, ArchiveIndex
from ctxfold.errors import ArchiveError, IntegrityError

ArchiveId = NewType("ArchiveId", str)

ID_PATTERN = re.compile(r"[0-9a-f]{64}")
ARCHIVE_FILE_SUFFIX = ".txt"  # an archived output's file: its id and this
_TEMP_PREFIX = ".tmp-"
# A writer finishes one file in well under a second; a temp file older than this was left by a crash.
STALE_TEMP_AGE_S = 600.0
_ENCODING = "utf-8"
_ERRORS = "surrogatepass"

log = logging.getLogger("ctxfold.compaction.archive")


def encode_text(text: str) -> bytes:
    return text.encode(_ENCODING, _ERRORS)


def decode_text(data: bytes) -> str:
    return data.decode(_ENCODING, _ERRORS)


def content_id(text: str) -> ArchiveId:
    """The archive id of a content: the hex sha256 of its UTF-8 bytes."""
    return ArchiveId(hashlib.sha256(encode_text(text)).hexdigest())


def is_valid_id(value: object) -> bool:
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


def check_id(value: object) -> ArchiveId:
    """``value`` as an archive id; ValueError naming the value when it is not exactly 64 lowercase hex."""
    if not is_valid_id(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueError(f"archive id {shown} is not 64 lowercase hex characters (a sha256)")
    return ArchiveId(str(value))


class Backend(Protocol):
    """Where archive files live. Names are already-validated ``<sha256>.txt`` file names."""

    location: str  # printable location, for messages

    def exists(self, name: str) -> bool: ...

    def read_bytes(self, name: str) -> bytes:
        """Raises FileNotFoundError when absent."""
        ...

    def write_atomic(self, name: str, data: bytes) -> None:
        """Store ``data`` so that readers see all of it or nothing. Raises OSError on failure."""
        ...

    def names(self) -> Iterator[str]: ...


class MemoryBackend:
    """A dict in this process: for a compactor that keeps no session on disk, and for tests.

    Nothing survives the process, so it is only as lossless as the process lives.
    """

    def __init__(self) -> None:
        self.location = "<memory>"
        self._files: dict[str, bytes] = {}

    def exists(self, name: str) -> bool:
        return name in self._files

    def read_bytes(self, name: str) -> bytes:
        try:
            return self._files[name]
        except KeyError:
            raise FileNotFoundError(name) from None

    def write_atomic(self, name: str, data: bytes) -> None:
        self._files[name] = bytes(data)

    def names(self) -> Iterator[str]:
        return iter(list(self._files))


class LocalBackend:
    """A directory on a local (or POSIX-mounted) file system."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.location = str(self.root)
        self.sweep_stale_temps()

    def exists(self, name: str) -> bool:
        return os.path.isfile(self.root / name)

    def read_bytes(self, name: str) -> bytes:
        with open(self.root / name, "rb") as f:
            return f.read()

    def write_atomic(self, name: str, data: bytes) -> None:
        self._ensure_root()
        # mkstemp: O_EXCL, a random name, mode 0600; in the same directory so the rename is atomic.
        fd, tmp = _mkstemp(self.root)
        try:
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.root / name)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        # Make the rename itself durable: without this a power loss can forget the new name.
        _fsync_dir(self.root)

    def names(self) -> Iterator[str]:
        try:
            with os.scandir(self.root) as it:
                for entry in it:
                    yield entry.name
        except FileNotFoundError:
            return

    def sweep_stale_temps(self, older_than_s: float = STALE_TEMP_AGE_S) -> int:
        """Remove temp files left by a crashed writer; returns how many were removed."""
        removed = 0
        now = time.time()
        for name in list(self.names()):
            if not name.startswith(_TEMP_PREFIX):
                continue
            path = self.root / name
            try:
                if now - path.stat().st_mtime >= older_than_s:
                    path.unlink()
                    removed += 1
            except OSError:
                pass  # gone already, or not ours to remove: it is invisible either way
        return removed

    def _ensure_root(self) -> None:
        if self.root.is_dir() and not self.root.is_symlink():
            return
        make_private_dir(self.root)
        _fsync_dir(self.root.parent)


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Create ``path`` and its missing parents, each with mode 0700 (they hold a user's conversations;
    ``Path.mkdir`` gives parents the umask's default, 0755 as a rule). An existing ``path`` that is a
    symbolic link is refused (:func:`refuse_symlink`): what ctxfold writes goes where it was told."""
    missing: list[str] = []
    p = os.fspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p.rstrip(os.sep)) or "."
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass  # made meanwhile by another writer: checked below like any existing one
    refuse_symlink(path)


def refuse_symlink(path: str | os.PathLike[str]) -> None:
    """Raise OSError (ELOOP) when ``path`` is a symbolic link: a link planted in a data directory
    would send a write to a file of the link's choosing."""
    if os.path.islink(path):
        raise OSError(errno.ELOOP, "is a symbolic link; ctxfold does not write through links in its data "
                                   "directory: replace it with a real directory or file", os.fspath(path))


def _mkstemp(root: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=".part", dir=root)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecBackend:
    """Object storage (s3://, gs://, memory://, ...) through fsspec, imported only when used.

    One ``pipe_file`` is one object PUT, which object stores make visible whole or not at all, so no
    temp-and-rename dance is needed (and on S3 a rename would be a copy plus a delete).
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ArchiveError(
                f"archive location {url!r} needs fsspec: pip install 'ctxfold[remote]'"
            ) from e
        self.fs, root = url_to_fs(url, **storage_options)
        self.root = str(root).rstrip("/")
        self.location = url

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        with as_oserror():
            return bool(self.fs.exists(self._path(name)))

    def read_bytes(self, name: str) -> bytes:
        with as_oserror():
            return bytes(self.fs.cat_file(self._path(name)))

    def write_atomic(self, name: str, data: bytes) -> None:
        with as_oserror():
            self.fs.pipe_file(self._path(name), data)

    def names(self) -> Iterator[str]:
        with as_oserror():
            try:
                entries = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return
        for entry in entries:
            yield str(entry).rstrip("/").rsplit("/", 1)[-1]


@contextmanager
def as_oserror() -> Iterator[None]:
    """Storage clients raise their own errors (botocore, google.api_core); the store handles OSError."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        raise OSError(errno.EIO, f"{type(e).__name__}: {e}") from e


def open_backend(location: str | os.PathLike[str], **storage_options: Any) -> Backend:
    """A local directory for a path or ``file://`` URL, fsspec for any other URL."""
    text = os.fspath(location)
    if "://" not in text:
        return LocalBackend(text)
    if text.startswith("file://"):
        return LocalBackend(text[len("file://") :])
    return FsspecBackend(text, **storage_options)


class ArchiveStore:
    """The archive of one conversation.

    ``put`` raises :class:`ArchiveError` when the content cannot be stored; the compaction passes turn
    that into "left inline" and report it. The first write failure is logged once per store, so a full
    disk does not flood the log with one line per tool output.

    ``index_path``: where its search index is kept (:mod:`ctxfold.compaction.archive.index`); by
    default beside the files of a local directory, and for any other backend a temporary database of
    this process, rebuilt from the archive at its first search.

    Not thread-safe: one conversation is compacted by one task at a time (the search index is).
    """

    def __init__(self, location: str | os.PathLike[str] | Backend, *,
                 index_path: str | os.PathLike[str] | None = None, **storage_options: Any) -> None:
        if isinstance(location, (str, os.PathLike)):
            self.backend: Backend = open_backend(location, **storage_options)
        else:
            self.backend = location
        if index_path is None and isinstance(self.backend, LocalBackend):
            index_path = self.backend.root / INDEX_FILE
        self.index_path = index_path
        self._index: ArchiveIndex | None = None
        # Ids known to be stored: lets a pass over an already-compacted conversation skip the
        # per-marker stat (see passes.py). Only ever holds ids that were written or seen on disk.
        self._known: set[str] = set()
        self.write_error: ArchiveError | None = None  # the first write failure, if any
        self.write_failures = 0  # how many puts failed

    @property
    def location(self) -> str:
        return self.backend.location

    def __repr__(self) -> str:
        return f"ArchiveStore({self.location!r})"

    def exists(self, archive_id: str) -> bool:
        """Whether ``archive_id`` is stored here, as the backend says: a conversation's journal archive
        answers from what it wrote or read back and never asks where it commits
        (:class:`~ctxfold.compaction.journal.JournalArchive`); read with :meth:`get` to be sure. False
        (not an error) for a malformed id."""
        if not is_valid_id(archive_id):
            return False
        if archive_id in self._known:
            return True
        try:
            found = self.backend.exists(archive_id + ARCHIVE_FILE_SUFFIX)
        except OSError:
            return False
        if found:
            self._known.add(archive_id)
        return found

    def put(self, text: str) -> ArchiveId:
        """Store ``text`` (once) and return its id. Raises ArchiveError when it cannot be written."""
        data = encode_text(text)
        archive_id = ArchiveId(hashlib.sha256(data).hexdigest())
        if self.exists(archive_id):
            return archive_id
        try:
            self.backend.write_atomic(archive_id + ARCHIVE_FILE_SUFFIX, data)
        except (OSError, ValueError) as e:
            err = ArchiveError(f"cannot write archive {archive_id[:12]}... under {self.location}: {_describe(e)}")
            self.write_failures += 1
            if self.write_error is None:
                self.write_error = err
                log.warning("%s; tool outputs stay inline until the archive can be written", err)
            raise err from e
        self._known.add(archive_id)
        return archive_id

    def get(self, archive_id: str) -> str:
        """The stored text. KeyError for an unknown id, ValueError for a malformed one,
        IntegrityError when the file does not hash to its id, ArchiveError when it cannot be read."""
        aid = check_id(archive_id)
        try:
            data = self.backend.read_bytes(aid + ARCHIVE_FILE_SUFFIX)
        except FileNotFoundError:
            raise KeyError(f"no archive {aid} under {self.location}") from None
        except OSError as e:
            raise ArchiveError(f"cannot read archive {aid} under {self.location}: {_describe(e)}") from e
        if hashlib.sha256(data).hexdigest() != aid:
            raise IntegrityError(f"archive {aid} under {self.location} does not match its sha256: file is corrupt")
        self._known.add(aid)
        return decode_text(data)

    def read(self, archive_id: str, offset_chars: int = 0, limit_chars: int | None = None) -> str:
        """``get(archive_id)[offset_chars : offset_chars + limit_chars]``, offsets in characters."""
        text = self.get(archive_id)
        if offset_chars < 0:
            raise IndexError(f"offset {offset_chars} is negative")
        end = len(text) if limit_chars is None else offset_chars + limit_chars
        return text[offset_chars:end]

    @property
    def search_index(self) -> ArchiveIndex:
        """The archive's search index, opened at first use (no file is made before a search)."""
        if self._index is None:
            self._index = ArchiveIndex(self.index_path)
        return self._index

    def ids(self) -> list[ArchiveId]:
        """The stored ids, sorted. Temp files and foreign files are not ids."""
        out = []
        for name in self.backend.names():
            stem = name[: -len(ARCHIVE_FILE_SUFFIX)] if name.endswith(ARCHIVE_FILE_SUFFIX) else ""
            if is_valid_id(stem):
                out.append(ArchiveId(stem))
        return sorted(out)


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        return f"{name} ({e.strerror or e})"
    return str(e) or type(e).__name__
