"""Per-tenant quotas and idle-session expiry for the proxy's sessions (docs/store.md, *Quotas and expiry*).

Two bounds per tenant: the sessions it keeps (a conversation and each of its forks) and the bytes they
hold; and an idle time after which a session is deleted with its archive. A tenant at a bound gets its
requests passed through uncompacted, with a warning header, a counted reason and a log line
(:class:`~ctxfold.compaction.store.QuotaExceeded`), until some of its sessions expire; other tenants are not
affected.

- With a shared store (Redis), the store keeps the accounts in the scripts that write
  (:mod:`ctxfold.compaction.store.quota`), atomic across replicas: :func:`store_limits` tells it whose each
  session is and which archive lives with it.
- In the data directory (one process), :class:`DiskQuota` keeps them in memory: read from the disk at
  startup, kept as sessions are made and written, measured again and swept of idle sessions on a timer
  (:func:`sweep_data_dir`) that never deletes a conversation with a request under way.

The layout is the proxy's (``serve.sessions``): ``sessions/<key>/<n>`` for the anonymous tenant,
``tenants/<tenant>/sessions/<key>/<n>`` for the others; a tenant's archive is its key's
(``<key>/archive``), an anonymous conversation's its own (``<key>/<n>/archive``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ctxfold.compaction.session import EVENTS_FILE
from ctxfold.compaction.store import QuotaExceeded, StoreLimits
from ctxfold.compaction.store.quota import bytes_refused, sessions_refused

log = logging.getLogger("ctxfold.serve")

ANONYMOUS_ACCOUNT = "anonymous"  # the store's account of requests without a credential (tenants are hex)
# How often the timer sweeps: a quarter of the idle time, within these (an expired session may live a
# sweep longer; sizes of archives and dumps on disk are measured again as often).
MIN_SWEEP_INTERVAL_S = 0.5
MAX_SWEEP_INTERVAL_S = 60.0


def tenant_of_id(session_id: str) -> str:
    """The tenant of a session id (or a key, or an archive's id): "" for the anonymous one."""
    parts = session_id.split("/", 2)
    return parts[1] if parts[0] == "tenants" and len(parts) > 1 else ""


def account_of(session_id: str) -> str:
    return tenant_of_id(session_id) or ANONYMOUS_ACCOUNT


def companions_of(session_id: str) -> tuple[str, ...]:
    """The archive whose keys live as long as the session's (as ``SessionStore._archive_id`` names it)."""
    if session_id.startswith("sessions/"):
        return (f"{session_id}/archive",)
    return (f"{session_id.rsplit('/', 1)[0]}/archive",)


def store_limits(*, max_sessions: int | None, max_bytes: int | None, ttl_s: float | None) -> StoreLimits:
    return StoreLimits(account_of, companions_of, session_ttl_ms=round((ttl_s or 0) * 1000),
                       max_sessions=max_sessions or 0, max_bytes=max_bytes or 0)


def sweep_interval_s(ttl_s: float | None) -> float:
    return min(MAX_SWEEP_INTERVAL_S, max(MIN_SWEEP_INTERVAL_S, (ttl_s or math.inf) / 4))


def refusal_reason(e: QuotaExceeded) -> str:
    """What the client's warning header and the log say of a refusal (one line, the setting named)."""
    if e.kind == "sessions":
        return (f"this tenant keeps {e.used} conversations, its bound (max_sessions_per_tenant {e.limit}); new "
                "ones are not stored until some expire")
    return (f"this tenant's stored conversations hold {e.used} bytes, at or over its bound (max_tenant_bytes "
            f"{e.limit}); nothing more is stored until some expire")


# A tenant over its bound sends request after request: one log line per tenant and bound this often at
# most, with the number of refusals since the last line (the metric counts every one).
REFUSAL_LOG_INTERVAL_S = 60.0
MAX_REFUSAL_LOG_TENANTS = 1024  # tenants remembered for it; past it the table starts afresh


class RefusalLog:
    """Logs a tenant's refusals at WARNING, the first at once and then one line per interval saying how
    many there were: a client that ignores the warning header must not flood the log."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # (tenant label, kind) -> (last line, since)

    def note(self, label: str, e: QuotaExceeded) -> None:
        now = self.clock()
        last, since = self._seen.get((label, e.kind), (-math.inf, 0))
        if now - last < self.interval_s:
            self._seen[(label, e.kind)] = (last, since + 1)
            return
        if len(self._seen) >= MAX_REFUSAL_LOG_TENANTS:
            self._seen.clear()
        self._seen[(label, e.kind)] = (now, 0)
        more = f" ({since} more refused since the last line)" if since else ""
        log.warning("request passed through uncompacted (tenant %s): %s%s", label, refusal_reason(e), more,
                    extra={"tenant": label, "quota": e.kind, "refused_since_last_line": since})


# What a walk of the data directory found: (sessions, tenant key archives), each rel -> (log bytes,
# other bytes, the log's mtime).
Found = tuple[dict[str, tuple[int, int, float]], dict[str, tuple[int, int, float]]]


@dataclass(slots=True)
class _Entry:
    """One session directory, or a tenant key's archive, as the accounts see it."""

    tenant: str
    log_bytes: int = 0  # the event log, as the proxy last measured it
    other_bytes: int = 0  # history dumps, archived outputs, markers: measured by the last sweep
    last_used_s: float = 0.0  # wall clock: a restart reads it back from the log's mtime

    @property
    def nbytes(self) -> int:
        return self.log_bytes + self.other_bytes


class DiskQuota:
    """The data directory's sessions per tenant: how many, how many bytes, when each was last used.
    Paths are relative to the data directory. The tables are the event loop's: the walk and the
    removals run in worker threads (:func:`walk`, :func:`remove`) and hand their results back."""

    def __init__(self, data_dir: Path, *, max_sessions: int | None = None, max_bytes: int | None = None,
                 ttl_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.data_dir = Path(data_dir)
        self.max_sessions = max_sessions or 0
        self.max_bytes = max_bytes or 0
        self.ttl_s = ttl_s or 0.0
        self.clock = clock
        self.sessions: dict[str, _Entry] = {}  # session dir -> entry
        self.archives: dict[str, _Entry] = {}  # a tenant key's archive dir -> entry (sessions: their own)
        self._num: dict[str, int] = {}  # tenant -> sessions
        self._bytes: dict[str, int] = {}  # tenant -> bytes
        self.num_expired = 0  # sessions deleted for idleness since start (metric)

    # -- the tables ---------------------------------------------------------------------------------
    def _rel(self, session_dir: Path | str) -> str:
        path = Path(session_dir)
        try:  # a data directory given relative (--data-dir data) makes relative session paths too
            return path.relative_to(self.data_dir).as_posix()
        except ValueError:
            return path.as_posix()

    def _put(self, table: dict[str, _Entry], rel: str, entry: _Entry | None) -> None:
        old = table.pop(rel, None)
        if old is not None:
            self._bytes[old.tenant] -= old.nbytes
            self._num[old.tenant] -= table is self.sessions
        if entry is not None:
            table[rel] = entry
            self._bytes[entry.tenant] = self._bytes.get(entry.tenant, 0) + entry.nbytes
            self._num[entry.tenant] = self._num.get(entry.tenant, 0) + (table is self.sessions)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(sessions, bytes) the tenant keeps."""
        return self._num.get(tenant, 0), self._bytes.get(tenant, 0)

    # -- the proxy's calls --------------------------------------------------------------------------
    def check(self, key: str) -> None:
        """QuotaExceeded when ``key``'s tenant keeps as many bytes as it may: nothing more is stored."""
        _, nbytes = self.usage(tenant_of_id(key))
        if self.max_bytes and nbytes >= self.max_bytes:
            raise bytes_refused(nbytes, self.max_bytes)

    def admit(self, session_dir: Path) -> None:
        """Count a session about to be made (a new conversation, a fork), or QuotaExceeded. Counted at
        once, before the directory is written: two requests making sessions at once see each other."""
        rel = self._rel(session_dir)
        tenant = tenant_of_id(rel)
        self.check(rel)
        num, _ = self.usage(tenant)
        if self.max_sessions and num >= self.max_sessions:
            raise sessions_refused(num, self.max_sessions)
        self._put(self.sessions, rel, _Entry(tenant, last_used_s=self.clock()))

    def note(self, session_dir: Path, log_bytes: int) -> None:
        """A request used the session; its log is ``log_bytes`` long."""
        rel = self._rel(session_dir)
        old = self.sessions.get(rel)
        tenant = tenant_of_id(rel)
        self._put(self.sessions, rel, _Entry(tenant, log_bytes, old.other_bytes if old else 0, self.clock()))

    def forget(self, session_dir: Path) -> None:
        self._put(self.sessions, self._rel(session_dir), None)

    def expired(self) -> dict[str, list[str]]:
        """The sessions idle past the time, by key."""
        if not self.ttl_s:
            return {}
        deadline = self.clock() - self.ttl_s
        out: dict[str, list[str]] = {}
        for rel, entry in self.sessions.items():
            if entry.last_used_s < deadline:
                out.setdefault(rel.rsplit("/", 1)[0], []).append(rel)
        return out

    def is_expired(self, rel: str) -> bool:
        entry = self.sessions.get(rel)
        return entry is not None and bool(self.ttl_s) and entry.last_used_s < self.clock() - self.ttl_s

    # -- what the disk says ----------------------------------------------------------------------
    def apply_scan(self, found: Found, began_s: float) -> None:
        """The sizes and mtimes :func:`walk` found (it began at ``began_s``). Entries it did not find
        leave the tables, unless counted since it began (a session being made)."""
        for table, seen in ((self.sessions, found[0]), (self.archives, found[1])):
            for rel, (log_bytes, other_bytes, mtime) in seen.items():
                old = table.get(rel)
                last = max(mtime, old.last_used_s) if old is not None else mtime
                self._put(table, rel, _Entry(tenant_of_id(rel), log_bytes, other_bytes, last))
            for rel in [r for r, e in table.items() if r not in seen and e.last_used_s < began_s]:
                self._put(table, rel, None)

    def scan(self) -> None:
        """:func:`walk` and :meth:`apply_scan` in this thread (at startup, before serving)."""
        began = self.clock()
        self.apply_scan(walk(self.data_dir), began)

    def apply_removal(self, key: str, removed: list[str]) -> None:
        """Sessions :func:`remove` deleted; the key's archive with them once none is left."""
        for rel in removed:
            self._put(self.sessions, rel, None)
        if not any(r.rsplit("/", 1)[0] == key for r in self.sessions):
            self._put(self.archives, f"{key}/archive", None)
        self.num_expired += len(removed)



def remove(data_dir: Path, key: str, rels: list[str], whole_key: bool) -> list[str]:
    """Delete the session directories ``rels`` (and, ``whole_key``, the key's directory with its
    archive); returns the ones deleted. Blocks: a worker thread's."""
    removed = []
    for rel in rels:
        try:
            shutil.rmtree(data_dir / rel)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot delete the expired session %s: %s", rel, e)
            continue
        removed.append(rel)
    if whole_key and len(removed) == len(rels):
        shutil.rmtree(data_dir / key, ignore_errors=True)
    return removed


def walk(data_dir: Path) -> Found:
    """Every session directory and tenant key archive under ``data_dir``: rel -> (log bytes, other
    bytes, the log's mtime). Links are not followed (the proxy never writes through one)."""
    sessions: dict[str, tuple[int, int, float]] = {}
    archives: dict[str, tuple[int, int, float]] = {}
    roots = [data_dir / "sessions"]
    tenants = data_dir / "tenants"
    if tenants.is_dir() and not tenants.is_symlink():
        roots += [t / "sessions" for t in _dirs(tenants)]
    for root in roots:
        for key_dir in _dirs(root):
            for child in _dirs(key_dir):
                rel = child.relative_to(data_dir).as_posix()
                if child.name == "archive":
                    archives[rel] = (0, _size(child), 0.0)
                    continue
                try:
                    st = os.stat(child / EVENTS_FILE, follow_symlinks=False)
                except OSError:
                    continue  # no log: a session whose creation never completed, not one
                sessions[rel] = (st.st_size, _size(child) - st.st_size, st.st_mtime)
    return sessions, archives


def _dirs(folder: Path) -> list[Path]:
    try:
        with os.scandir(folder) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _size(folder: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            try:
                total += os.stat(os.path.join(dirpath, name), follow_symlinks=False).st_size
            except OSError:
                continue
    return total


async def sweep_data_dir(quota: DiskQuota, lock: Callable[[str], asyncio.Lock],
                         unload: Callable[[str], None]) -> int:
    """Measure the data directory again and delete the sessions idle past the time; returns how many.
    A key whose lock is held (a request under way, an answer being recorded) is left for the next
    sweep; the others are deleted under their lock, unloaded first, so no request reads them meanwhile."""
    began = quota.clock()
    quota.apply_scan(await asyncio.to_thread(walk, quota.data_dir), began)
    removed = 0
    for key, rels in quota.expired().items():
        key_lock = lock(key)
        if key_lock.locked():
            continue
        async with key_lock:
            rels = [r for r in rels if quota.is_expired(r)]  # a request may have come while we waited
            if not rels:
                continue
            unload(key)
            whole_key = all(r in rels for r in quota.sessions if r.rsplit("/", 1)[0] == key)
            gone = await asyncio.to_thread(remove, quota.data_dir, key, rels, whole_key)
            quota.apply_removal(key, gone)
        n = len(gone)
        if n:
            removed += n
            log.info("%d idle session(s) expired and deleted (tenant %s)", n,
                     tenant_of_id(key)[:12] or ANONYMOUS_ACCOUNT, extra={"expired_sessions": n})
    return removed
