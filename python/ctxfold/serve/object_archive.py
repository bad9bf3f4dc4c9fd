"""Archives in object storage shared by replicas (``--archive-url``): where a conversation's archived
outputs live instead of among the session store's blobs.

The compaction core never writes there itself: an archive pass puts each output into the session's
journal, and the proxy writes the request's batch here when it commits it, from its event loop; a
recall's reads are fetched the same way before the reader runs
(:class:`~ctxfold.compaction.store.buffer.BufferedArchive`). Each storage call runs in a worker thread,
since fsspec's clients block.

The places are those of every earlier version: ``<url>/tenants/<tenant>/<key>`` for a tenant's
conversations of one key (they share one archive), ``<url>/<key>/<nnnn>`` for an anonymous conversation
(its own: see :meth:`ctxfold.serve.sessions.SessionStore.archive_dir`). Files are ``<sha256>.txt``, as
in a local archive directory.
"""

from __future__ import annotations

import asyncio
import functools

from ctxfold.compaction.archive.store import Backend, as_oserror, open_backend
from ctxfold.compaction.journal import ARCHIVE_BLOB_PREFIX
from ctxfold.compaction.store.base import BLOB_NAME_PATTERN
from ctxfold.errors import ArchiveError


def archive_prefix(key: str, session_id: str) -> str:
    """The place of a session's archive under the URL, from its key (``sessions/<key>`` for the anonymous
    tenant, ``tenants/<tenant>/sessions/<key>`` for a tenant) and its id (``<key>/<nnnn>``)."""
    parts = key.split("/")
    return f"{parts[1]}/{session_id.rsplit('/', 1)[-1]}" if parts[0] == "sessions" else f"tenants/{parts[1]}/{parts[3]}"


class ObjectArchives:
    """Archived outputs under one fsspec URL (s3://, gs://, memory://, a path). Blob names are the
    store's (``archive/<sha256>.txt``); OSError (FileNotFoundError for a missing one) when storage fails,
    whatever its client raised. The URL is checked when this is made: ArchiveError when it cannot name
    storage (its package missing, its scheme unknown), said once at startup rather than on every request."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        try:
            open_backend(self.url)
        except ArchiveError:
            raise  # fsspec missing: it says how to install it
        except OSError:
            pass  # storage that fails now is handled at each call, as it is later
        except Exception as e:  # noqa: BLE001 - fsspec says an unknown scheme or a bad URL its own way
            raise ArchiveError(f"archive URL {url!r}: {type(e).__name__}: {e}") from None

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one per proxy; a backend per conversation recently used
    def _backend(self, prefix: str) -> Backend:
        with as_oserror():
            return open_backend(f"{self.url}/{prefix}")

    async def get(self, prefix: str, name: str) -> bytes:
        return await asyncio.to_thread(self._backend(prefix).read_bytes, _file(name))

    async def put(self, prefix: str, name: str, data: bytes) -> None:
        await asyncio.to_thread(self._backend(prefix).write_atomic, _file(name), data)

    async def names(self, prefix: str) -> list[str]:
        """The blob names stored under ``prefix`` (files that are not archived outputs left out)."""
        files = await asyncio.to_thread(lambda: list(self._backend(prefix).names()))
        return sorted(n for n in (ARCHIVE_BLOB_PREFIX + f for f in files) if BLOB_NAME_PATTERN.fullmatch(n))


def _file(name: str) -> str:
    if not name.startswith(ARCHIVE_BLOB_PREFIX):
        raise ValueError(f"{name!r} is not an archived output's blob")
    return name[len(ARCHIVE_BLOB_PREFIX):]
