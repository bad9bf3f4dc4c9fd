"""What a session needs from durable storage, whatever keeps it.

A store holds, per session (an id such as ``<key digest>/0003``):

- its **events**, one record per event, in ``seq`` order (:mod:`ctxfold.compaction.eventlog`): appended, read
  back in order for resume and restore;
- a **checkpoint**: the fold of the events so far (header, originals, last view, state), after which the
  events it covers are trimmed;
- **blobs**: history dumps and archived tool outputs, by a relative name (``history/<file>.jsonl``,
  ``archive/<sha256>.txt``). Blob names carry their content's digest, so a blob written twice, or by a
  writer that lost its lease, is the same bytes or a name nothing refers to: blobs need no fencing, and
  a batch writes its blobs before the events that name them (write-ahead, as the local log does);
- a **lease** per session: held by one writer at a time for ``ttl_ms``, renewed while it works, and
  carrying a **fencing token** that grows with every grant. Every event write names the token it holds
  and the store refuses it (:class:`LeaseLost`) once a later token was granted, so a writer that stalled
  past its lease (a long pause, SIGSTOP) cannot write after another took over.

Every method is a coroutine: the proxy calls them on its event loop. The compactor is synchronous and
may run in a worker thread; it writes to a :class:`ctxfold.compaction.store.buffer.BufferedLog`, whose batch the
proxy commits with one :meth:`Store.append` before it answers (see that module for why).

Errors: :class:`StoreUnavailable` when the store cannot be reached or fails part way (the caller passes
the request through uncompacted, with a warning header); :class:`LeaseLost` when a write is refused by its
fencing token (the caller drops its in-memory session and loads it again); ``FormatError`` for a record
that cannot be read.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NewType, Protocol

from ctxfold.compaction.eventlog import Event, Record
from ctxfold.compaction.journal import Batch
from ctxfold.errors import CtxfoldError, FormatError

# A session's id in a store (the proxy's: ``<key>/<nnnn>``), not to be mixed up with the key it is under
# (serve.keys.ConversationKey), its tenant (TenantId) or an archived output's id (ArchiveId).
SessionId = NewType("SessionId", str)

# A session id: path-like segments of safe characters (the proxy's are its data directory's relative
# paths, ``tenants/<tenant>/sessions/<key>/<n>``: five). The local store makes directories of them and
# Redis puts them inside key names, so nothing else may appear (no "..", no separators of other kinds).
_SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}"
SESSION_ID_PATTERN = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT}){{0,4}}")
# Blob names: a history dump or an archived output, each named by (a prefix of) its content digest.
BLOB_NAME_PATTERN = re.compile(r"(?:history/[0-9]{6}-[0-9a-f]{16}\.jsonl|archive/[0-9a-f]{64}\.txt)")

DEFAULT_LEASE_MS = 30_000
# When a local store fsyncs its event logs (LocalStore): every batch, only batches beyond messages, never.
FSYNC_MODES = ("always", "compactions", "never")


class StoreError(CtxfoldError):
    """A session store could not do what was asked."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, or failed part way through a request: nothing after the failure is
    known to be written. The proxy passes the request through uncompacted and says so in a header."""


class SpoolFull(StoreUnavailable):
    """The store is unavailable and the local spool that keeps unwritten batches is at its bound."""


class NoSuchSession(StoreError):
    """The store holds no session by that id."""


class LeaseLost(StoreError):
    """A write was refused: another writer was granted the session's lease after this one (a later
    fencing token), or the lease is held by another writer. The session must be loaded again."""


class QuotaExceeded(StoreError):
    """A session's account (the proxy's tenant) is at its bound: a new session would pass the number of
    sessions it may keep, or it keeps as many bytes as it may already. Nothing was written and no lease
    taken; the proxy passes the request through uncompacted and says why."""

    def __init__(self, message: str, *, kind: str, used: int, limit: int) -> None:
        super().__init__(message)
        self.kind = kind  # "sessions" or "bytes": which bound
        self.used = used  # what the account holds (sessions, or bytes) when refused
        self.limit = limit


def _no_companions(session_id: str) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """Bounds a shared store keeps per account, and when idle sessions go (see docs/store.md, *Quotas
    and expiry*). Every bound 0: none. The store cannot tell whose a session is from its id alone (the
    ids are the proxy's), so the proxy says: ``account_of`` (its tenant), ``companions_of`` (the ids
    whose keys live and die with the session: its archive)."""

    account_of: Callable[[str], str]  # session id -> the account it counts against
    companions_of: Callable[[str], tuple[str, ...]] = _no_companions
    session_ttl_ms: int = 0  # a session untouched this long is deleted with its companions; 0: kept
    max_sessions: int = 0  # sessions an account keeps at once; 0: no bound
    max_bytes: int = 0  # bytes written (records and blobs) an account keeps at once; 0: no bound

    def __post_init__(self) -> None:
        for name in ("session_ttl_ms", "max_sessions", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be a whole number >= 0, got {value!r}")

    @property
    def active(self) -> bool:
        """Whether anything is bounded or expires: else the store keeps no accounts at all."""
        return bool(self.session_ttl_ms or self.max_sessions or self.max_bytes)


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or SESSION_ID_PATTERN.fullmatch(session_id) is None or ".." in session_id:
        raise ValueError(f"session id {session_id!r}: expected up to 5 '/'-separated names of letters, digits, "
                         "'.', '_' and '-'")
    return session_id


def check_blob_name(name: str) -> str:
    if not isinstance(name, str) or BLOB_NAME_PATTERN.fullmatch(name) is None:
        raise ValueError(f"blob name {name!r}: expected history/NNNNNN-<16 hex>.jsonl or archive/<sha256>.txt")
    return name


@dataclass(frozen=True, slots=True)
class Lease:
    """The right to write one session, until ``ttl_ms`` after the last grant or renewal."""

    session_id: str
    token: int  # the fencing token: greater than every token granted before for this session
    owner: str  # who holds it (host:pid:random), for messages and for release
    ttl_ms: int  # how long a grant or renewal lasts


@dataclass(slots=True)
class StoredSession:
    """A session as read back: the checkpoint's records followed by the events after it, in ``seq``
    order, and the records that could not be read, each after the event it followed (what
    :func:`ctxfold.compaction.eventlog.load_events` takes, through :meth:`records`)."""

    session_id: str
    events: list[Event] = field(default_factory=list)
    checkpoint_seq: int = -1  # the last seq the checkpoint covers; -1: none yet
    # (how many of ``events`` came before it, the record): what a store read but could not decode.
    unreadable: list[tuple[int, Record]] = field(default_factory=list)

    @property
    def next_seq(self) -> int:
        return int(self.events[-1]["seq"]) + 1 if self.events else 0

    def records(self) -> list[Record]:
        """Every record in the order read, the unreadable ones among them, each named by its seq."""
        out: list[Record] = []
        pending = iter(self.unreadable)
        bad = next(pending, None)
        for k, event in enumerate(self.events):
            while bad is not None and bad[0] <= k:
                out.append(bad[1])
                bad = next(pending, None)
            out.append(Record(f"seq {event.get('seq')}", event))
        out += [bad[1]] if bad is not None else []
        out += [r for _, r in pending]
        return out


class Store(Protocol):
    """A session store. See the module docstring for the contract."""

    url: str  # printable location (no password)
    shared: bool  # several processes may use it at once (the local directory: one process only)

    async def exists(self, session_id: str) -> bool: ...

    async def sessions(self, prefix: str = "") -> list[str]:
        """The ids of the stored sessions that start with ``prefix``, sorted."""
        ...

    async def read(self, session_id: str) -> StoredSession:
        """The checkpoint and every event after it, in order, read at one instant. An unknown session
        reads as no events."""
        ...

    async def append(self, lease: Lease, batch: Batch, *, release: bool = False) -> None:
        """Write ``batch``'s blobs, then its events, in order, one record per event. Events whose seq is
        already stored are skipped (a batch replayed from the spool after a lost reply writes nothing
        twice); a seq past the next one expected is refused (ValueError: a gap). LeaseLost when a later
        token was granted. ``release``: give the lease up once written, in the same call (the last
        write of a request: one round trip, and one fsync of the store, fewer)."""
        ...

    async def checkpoint(self, lease: Lease) -> int:
        """Fold the stored events into the checkpoint and trim the events it covers; returns the last
        seq it covers (-1 when there is nothing)."""
        ...

    async def put_blob(self, session_id: str, name: str, data: bytes) -> None: ...

    async def get_blob(self, session_id: str, name: str) -> bytes:
        """FileNotFoundError when absent."""
        ...

    async def blob_names(self, session_id: str) -> list[str]:
        """The names of the session's blobs (``archive/<sha256>.txt``, ``history/...``), sorted: what the
        search index of an archive is kept in step with (:mod:`ctxfold.compaction.archive.index`)."""
        ...

    async def acquire(self, session_id: str, *, owner: str, ttl_ms: int = DEFAULT_LEASE_MS,
                      new: bool = False) -> Lease | None:
        """The session's lease with a new fencing token, or None while another holder's lease runs.
        With :class:`StoreLimits`: QuotaExceeded when the session's account is over its bytes, or
        (``new``: the caller starts a session under this id) at its number of sessions."""
        ...

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease by its ttl; False when it expired and someone else holds it (or nobody does
        and it must be acquired again)."""
        ...

    async def release(self, lease: Lease) -> None:
        """Give the lease up now, if still held by ``lease`` (the next acquirer gets a later token)."""
        ...

    async def quarantine(self, session_id: str, reason: str) -> None:
        """The session's log cannot be read: keep it (restore salvages what it can) but list it no more,
        where the store can say so (a local directory: a ``QUARANTINED`` file with ``reason``)."""
        ...

    async def close(self) -> None: ...


def batch_seqs_contiguous(events: Sequence[Event]) -> None:
    """ValueError unless the events' seqs are contiguous and increasing."""
    for a, b in itertools.pairwise(events):
        if int(b["seq"]) != int(a["seq"]) + 1:
            raise ValueError(f"batch events are not contiguous: seq {a['seq']} then {b['seq']}")


def refuse_to_fold(stored: StoredSession, where: str) -> None:
    """FormatError when ``stored`` holds records that cannot be read: a checkpoint would trim them, and
    with them what a salvage could still name."""
    if stored.unreadable:
        record = stored.unreadable[0][1]
        raise FormatError(f"no checkpoint of a session with unreadable records ({record.why})",
                          source=f"{where} {stored.session_id}", location=record.location)
