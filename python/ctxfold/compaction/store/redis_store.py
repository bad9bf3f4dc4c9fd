"""Sessions in Redis or Valkey, through redis-py's asyncio client (``pip install 'ctxfold[redis]'``).

Keys, per session (the ``{...}`` hash tag keeps one session's keys in one cluster slot, so its scripts
may touch them all)::

    <prefix>:{<session id>}:ev      a Stream: one entry per event, id 0-<seq+1>, field "e" = the record
    <prefix>:{<session id>}:next    the next seq the stream expects
    <prefix>:{<session id>}:ckpt    the checkpoint: {"through": seq, "events": [records]}
    <prefix>:{<session id>}:fence   the last fencing token granted (INCR)
    <prefix>:{<session id>}:lease   "<owner>|<token>", SET NX PX <ttl>
    <prefix>:{<session id>}:blobs   a Hash: blob name -> bytes (unless blobs=<fsspec URL>)
    <prefix>:sessions               a sorted Set of the session ids, all scored 0: listed by prefix (a
                                    conversation key's sessions) with ZRANGE BYLEX, in O(log n + found)

Every write of a lease holder runs as one Lua script that first compares the holder's token with the
session's fence and refuses the write when a later token was granted: a holder that stalled past its
lease cannot write once another took over (when nobody did, its token is still the latest and the
write is safe). One XADD per event; the stream is trimmed (XTRIM MINID) only by the checkpoint script,
after the checkpoint that covers the trimmed events is set, in the same script.

Stream ids are the events' own seqs, so a batch replayed after a lost reply skips what is already
there, and a batch that would leave a hole is refused.

Durability: Redis acknowledges a write before it reaches disk unless its append-only file says
otherwise. The store expects AOF (``appendonly yes``) with ``appendfsync always`` by default: every
acknowledged write is on disk before the reply, so neither a crash of Redis nor of its machine loses
one. ``durability=everysec`` accepts ``appendfsync everysec``: a crash of the Redis process still loses
nothing (the write reached the kernel before the reply), a crash of the machine or a power loss loses
up to about the last two seconds of acknowledged writes. Without AOF, a restart loses everything since
the last RDB snapshot. The setting is read at the first connection (CONFIG GET, where the server allows
it) and one warning line is logged when it is weaker than expected. Replication is asynchronous in
Redis 7.0: a failover to a replica can lose the writes it had not yet received.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ctxfold import fastjson
from ctxfold.compaction.eventlog import (
    Record,
    check_event,
    decode_event,
    encode_event,
    event_seq,
    fold_events,
)
from ctxfold.compaction.journal import Batch
from ctxfold.compaction.store.base import (
    BLOB_NAME_PATTERN,
    DEFAULT_LEASE_MS,
    Lease,
    LeaseLost,
    StoredSession,
    StoreLimits,
    StoreUnavailable,
    batch_seqs_contiguous,
    check_blob_name,
    check_session_id,
    refuse_to_fold,
)
from ctxfold.compaction.store.quota import RedisAccounting

log = logging.getLogger("ctxfold.compaction.store")

T = TypeVar("T")

DURABILITY_LEVELS = ("always", "everysec")
DEFAULT_DURABILITY = "always"
DEFAULT_PREFIX = "ctxfold"
DEFAULT_SOCKET_TIMEOUT_S = 5.0
DEFAULT_CONNECT_TIMEOUT_S = 2.0
# Session ids a client remembers having listed in the index (each listed once); past it, it starts over.
MAX_LISTED_IDS = 65_536

# KEYS: lease, fence. ARGV: owner, ttl ms. The lease is taken with SET NX PX, and only then is the
# fence incremented, so every grant, and only a grant, gets a token greater than all before it.
_ACQUIRE = """
local t = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if not redis.call('SET', KEYS[1], ARGV[1] .. '|' .. t, 'NX', 'PX', ARGV[2]) then return false end
return redis.call('INCR', KEYS[2])
"""
# KEYS: lease. ARGV: "<owner>|<token>", ttl ms.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: fence, next, stream, lease. ARGV: token, "<owner>|<token>" to release the lease after the
# write ("": keep it), then (seq, record) pairs, contiguous. Returns events written.
_APPEND = """
local fence = tonumber(redis.call('GET', KEYS[1]) or '0')
if fence > tonumber(ARGV[1]) then return redis.error_reply('FENCED ' .. fence) end
local nxt = tonumber(redis.call('GET', KEYS[2]) or '0')
if #ARGV > 2 and tonumber(ARGV[3]) > nxt then return redis.error_reply('GAP ' .. nxt) end
local written = 0
for i = 3, #ARGV, 2 do
  local seq = tonumber(ARGV[i])
  if seq == nxt then
    redis.call('XADD', KEYS[3], '0-' .. (seq + 1), 'e', ARGV[i + 1])
    nxt = nxt + 1
    written = written + 1
  end
end
redis.call('SET', KEYS[2], nxt)
if ARGV[2] ~= '' and redis.call('GET', KEYS[4]) == ARGV[2] then redis.call('DEL', KEYS[4]) end
return written
"""
# KEYS: fence, next, stream, ckpt. ARGV: token, through seq, checkpoint bytes.
_CHECKPOINT = """
local fence = tonumber(redis.call('GET', KEYS[1]) or '0')
if fence > tonumber(ARGV[1]) then return redis.error_reply('FENCED ' .. fence) end
local through = tonumber(ARGV[2])
if through >= tonumber(redis.call('GET', KEYS[2]) or '0') then return redis.error_reply('GAP checkpoint') end
redis.call('SET', KEYS[4], ARGV[3])
-- With idle-session expiry the checkpoint goes when the session's other keys go (the fence's time to live).
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[4], ttl) end
redis.call('XTRIM', KEYS[3], 'MINID', '0-' .. (through + 2))
return through
"""


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """The redis-py URL and ctxfold's own options (prefix, durability, blobs) taken out of its query."""
    parts = urlsplit(url)
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme, parts.scheme)
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k in ("prefix", "durability", "blobs"):
            ours[k] = v
        else:
            theirs.append((k, v))
    return urlunsplit((scheme, parts.netloc, parts.path, urlencode(theirs), parts.fragment)), ours


def printable_url(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class RedisStore:
    """A :class:`ctxfold.compaction.store.base.Store` in Redis or Valkey (``redis://``, ``rediss://``, ``unix://``,
    ``valkey://``). URL options: ``prefix`` (key prefix, default ctxfold), ``durability`` (always or
    everysec: the weakest AOF fsync policy accepted without a warning), ``blobs`` (an fsspec URL for
    history dumps and archives instead of Redis), and redis-py's own (socket_timeout, ...). With
    ``limits``, per-account bounds and idle-session expiry (:mod:`ctxfold.compaction.store.quota`)."""

    shared = True

    def __init__(self, url: str, *, limits: StoreLimits | None = None) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise StoreUnavailable(f"store {printable_url(url)} needs redis-py: pip install 'ctxfold[redis]'") from e
        client_url, opts = _split_url(url)
        self.url = printable_url(url)
        self.prefix = opts.get("prefix", DEFAULT_PREFIX)
        self.durability = opts.get("durability", DEFAULT_DURABILITY)
        if self.durability not in DURABILITY_LEVELS:
            raise ValueError(f"store {self.url}: durability must be one of {', '.join(DURABILITY_LEVELS)}, "
                             f"got {self.durability!r}")
        self.blobs_url = opts.get("blobs") or None
        query = dict(parse_qsl(urlsplit(client_url).query))
        kwargs: dict[str, Any] = {}
        if "socket_timeout" not in query:
            kwargs["socket_timeout"] = DEFAULT_SOCKET_TIMEOUT_S
        if "socket_connect_timeout" not in query:
            kwargs["socket_connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
        # A failure is reported at once (the caller passes the request through and spools): retrying
        # here would hold the request for the retries' whole backoff.
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.client = aioredis.from_url(client_url, retry=Retry(NoBackoff(), 0), **kwargs)
        self._acquire = self.client.register_script(_ACQUIRE)
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)
        self._append = self.client.register_script(_APPEND)
        self._checkpoint = self.client.register_script(_CHECKPOINT)
        # Accounts only when something is bounded or expires: else the scripts and round trips of before.
        self.accounting = RedisAccounting(self.client, self.prefix, limits) if limits and limits.active else None
        self._checked = False
        self._listed: set[str] = set()  # session ids this client added to the index (once is enough)
        self.durability_warning: str | None = None  # the warning logged at the first connection, if any

    # -- keys -------------------------------------------------------------------------------------
    def _key(self, session_id: str, what: str) -> str:
        return f"{self.prefix}:{{{check_session_id(session_id)}}}:{what}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}:sessions"

    # -- calls ------------------------------------------------------------------------------------
    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis call; its failures as StoreUnavailable or LeaseLost (see the module docstring)."""
        from redis import exceptions as rex

        if not self._checked:
            await self._check_durability()
        try:
            return await fn()
        except rex.ResponseError as e:
            text = str(e)
            if text.startswith("FENCED"):
                raise LeaseLost(f"store {self.url}: {what} refused: the session's lease was granted to another "
                                f"writer (fencing token {text.split()[-1]})") from None
            if text.startswith("GAP"):
                raise ValueError(f"store {self.url}: {what} refused: events missing before it ({text})") from None
            raise StoreUnavailable(f"store {self.url}: {what} failed: {text}") from e
        except (TimeoutError, rex.ConnectionError, rex.TimeoutError, OSError) as e:
            raise StoreUnavailable(f"store {self.url}: {what} failed: {type(e).__name__}: {e}") from e
        except rex.RedisError as e:
            raise StoreUnavailable(f"store {self.url}: {what} failed: {type(e).__name__}: {e}") from e

    async def _check_durability(self) -> None:
        """Log one warning line when the server's persistence is weaker than ``durability``."""
        from redis import exceptions as rex

        try:
            appendonly = (await self.client.config_get("appendonly")).get("appendonly")
            appendfsync = (await self.client.config_get("appendfsync")).get("appendfsync")
        except rex.ResponseError:
            # Managed services often refuse CONFIG: nothing to check, the operator's documentation says.
            self._checked = True
            log.debug("store %s: CONFIG GET refused; persistence not checked", self.url)
            return
        except (TimeoutError, rex.RedisError, OSError) as e:
            raise StoreUnavailable(f"store {self.url}: unreachable: {type(e).__name__}: {e}") from e
        self._checked = True
        self.durability_warning = durability_problem(self.url, appendonly, appendfsync, self.durability)
        if self.durability_warning:
            log.warning("%s", self.durability_warning)

    # -- reading ----------------------------------------------------------------------------------
    async def exists(self, session_id: str) -> bool:
        n = await self._call("exists", lambda: self.client.exists(self._key(session_id, "next"),
                                                                  self._key(session_id, "ckpt")))
        return bool(n)

    async def sessions(self, prefix: str = "") -> list[str]:
        # Session ids are ASCII (check_session_id), so "\x7f" sorts after every id that starts with prefix.
        members = await self._call("listing sessions", lambda: self.client.zrangebylex(
            self._index, f"[{prefix}", f"({prefix}\x7f" if prefix else "+"))
        ids = (m.decode() if isinstance(m, bytes) else str(m) for m in members)
        return sorted(i for i in ids if i.startswith(prefix))

    async def read(self, session_id: str) -> StoredSession:
        ckpt_key, ev_key = self._key(session_id, "ckpt"), self._key(session_id, "ev")

        async def both() -> list[Any]:
            # MULTI/EXEC: the checkpoint and the stream as of one instant (a checkpoint between two
            # separate reads would trim events the first read did not see folded).
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.get(ckpt_key)
                pipe.xrange(ev_key, "-", "+")
                return list(await pipe.execute())

        raw_ckpt, entries = await self._call("reading the session", both)
        out = StoredSession(session_id)
        if raw_ckpt is not None:
            self._read_checkpoint(raw_ckpt, out)
        for entry_id, fields in entries:
            name = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            record = decode_event(fields.get(b"e", b""), location=f"stream entry {name}")
            if record.event is None:
                out.unreadable.append((len(out.events), record))
            elif event_seq(record.event) > out.checkpoint_seq:
                out.events.append(record.event)
        return out

    @staticmethod
    def _read_checkpoint(raw: bytes, out: StoredSession) -> None:
        """The checkpoint's records into ``out``; what cannot be read of it, as unreadable records (the
        events it covers are trimmed: a salvage gets the rest, with the gap named)."""
        try:
            ckpt = fastjson.loads(raw)
            through, events = ckpt["through"], ckpt["events"]
            if type(through) is not int or not isinstance(events, list):
                raise TypeError("expected a whole-number through and a list of events")
        except (ValueError, LookupError, TypeError, RecursionError) as e:
            out.unreadable.append((0, Record("checkpoint", None, f"not a checkpoint: {type(e).__name__}: {e}"[:300])))
            return
        out.checkpoint_seq = through
        for k, event in enumerate(events):
            record = check_event(event, location=f"checkpoint record {k + 1}")
            if record.event is None:
                out.unreadable.append((len(out.events), record))
            else:
                out.events.append(record.event)

    # -- writing ----------------------------------------------------------------------------------
    async def append(self, lease: Lease, batch: Batch, *, release: bool = False) -> None:
        sid = lease.session_id
        batch_seqs_contiguous(batch.events)
        if self.blobs_url is not None:
            for name, data in batch.blobs:
                await self.put_blob(sid, name, data)
        blobs = [] if self.blobs_url is not None else [(check_blob_name(n), d) for n, d in batch.blobs]
        acct = self.accounting
        if blobs or sid not in self._listed:
            # Blobs before the events that name them, so a separate round trip: a script in the same
            # pipeline would run even where an HSET failed (out of memory), naming a dump not stored.
            async def first() -> None:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.zadd(self._index, {sid: 0})  # listing only: harmless when the append then fails
                    if acct is not None and blobs:
                        keys, args = acct.put_blobs_args(self._key(sid, "blobs"), sid, blobs, companion=False)
                        await acct.put_blobs_script(keys=keys, args=args, client=pipe)
                    for name, data in blobs if acct is None else ():
                        pipe.hset(self._key(sid, "blobs"), name, data)
                    await pipe.execute()

            await self._call("writing blobs", first)
            if len(self._listed) >= MAX_LISTED_IDS:  # a bound, not a cache policy: listing again is harmless
                self._listed.clear()
            self._listed.add(sid)
        if not batch.events:
            if release:
                await self.release(lease)
            return
        args: list[Any] = [lease.token, f"{lease.owner}|{lease.token}" if release else ""]
        keys = [self._key(sid, "fence"), self._key(sid, "next"), self._key(sid, "ev"), self._key(sid, "lease")]
        script = self._append
        if acct is not None:
            keys, more = acct.append_args([*keys, self._key(sid, "ckpt"), self._key(sid, "blobs")], sid)
            args += more
            script = acct.append_script
        for e in batch.events:
            args += [event_seq(e), encode_event(e)]
        await self._call("appending events", lambda: script(keys=keys, args=args))

    async def checkpoint(self, lease: Lease) -> int:
        stored = await self.read(lease.session_id)
        refuse_to_fold(stored, self.url)
        if not stored.events or stored.next_seq - 1 == stored.checkpoint_seq:
            return stored.checkpoint_seq
        through = stored.next_seq - 1
        data = fastjson.dumps_record({"through": through, "events": fold_events(stored.events)})
        sid = lease.session_id
        keys = [self._key(sid, "fence"), self._key(sid, "next"), self._key(sid, "ev"), self._key(sid, "ckpt")]
        await self._call("writing a checkpoint", lambda: self._checkpoint(keys=keys, args=[lease.token, through, data]))
        return through

    async def put_blob(self, session_id: str, name: str, data: bytes) -> None:
        check_blob_name(name)
        if self.blobs_url is not None:
            backend = self._blob_backend(session_id)
            try:
                await asyncio.to_thread(backend.write_atomic, name.replace("/", "-"), data)
            except OSError as e:
                raise StoreUnavailable(f"store {self.url}: writing {name} to {self.blobs_url} failed: {e}") from e
            return
        acct = self.accounting
        if acct is not None:  # another's blobs (an archive): counted to the account, living with its sessions
            keys, args = acct.put_blobs_args(self._key(session_id, "blobs"), session_id, [(name, data)], companion=True)
            await self._call(f"writing {name}", lambda: acct.put_blobs_script(keys=keys, args=args))
            return
        await self._call(f"writing {name}", lambda: self.client.hset(self._key(session_id, "blobs"), name, data))

    async def get_blob(self, session_id: str, name: str) -> bytes:
        check_blob_name(name)
        if self.blobs_url is not None:
            backend = self._blob_backend(session_id)
            try:
                return await asyncio.to_thread(backend.read_bytes, name.replace("/", "-"))
            except FileNotFoundError:
                raise
            except OSError as e:
                raise StoreUnavailable(f"store {self.url}: reading {name} from {self.blobs_url} failed: {e}") from e
        data = await self._call(f"reading {name}", lambda: self.client.hget(self._key(session_id, "blobs"), name))
        if data is None:
            raise FileNotFoundError(f"{self.url} {session_id}: no {name}")
        return data if isinstance(data, bytes) else data.encode()

    async def blob_names(self, session_id: str) -> list[str]:
        if self.blobs_url is not None:
            backend = self._blob_backend(session_id)
            try:
                flat = await asyncio.to_thread(lambda: list(backend.names()))
            except OSError as e:
                raise StoreUnavailable(f"store {self.url}: listing {self.blobs_url} failed: {e}") from e
            names = [n.replace("-", "/", 1) for n in flat]  # put_blob wrote "archive/x" as "archive-x"
        else:
            keys = await self._call("listing blobs", lambda: self.client.hkeys(self._key(session_id, "blobs")))
            names = [k.decode() if isinstance(k, bytes) else str(k) for k in keys]
        return sorted(n for n in names if BLOB_NAME_PATTERN.fullmatch(n))

    def _blob_backend(self, session_id: str) -> Any:
        from ctxfold.compaction.archive.store import open_backend

        assert self.blobs_url is not None
        return open_backend(f"{self.blobs_url.rstrip('/')}/{check_session_id(session_id)}")

    # -- the lease --------------------------------------------------------------------------------
    async def acquire(self, session_id: str, *, owner: str, ttl_ms: int = DEFAULT_LEASE_MS,
                      new: bool = False) -> Lease | None:
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        keys = [self._key(session_id, "lease"), self._key(session_id, "fence")]
        acct = self.accounting
        if acct is not None:  # the grant also checks the account's bounds and renews the session's time
            keys, args = acct.acquire_args(
                [*keys, *(self._key(session_id, k) for k in ("next", "ev", "ckpt", "blobs"))],
                lambda i: self._key(i, "blobs"), session_id, owner, ttl_ms, new)
            reply = await self._call("taking the lease", lambda: acct.acquire_script(keys=keys, args=args))
            return acct.granted(reply, session_id, owner, ttl_ms)
        token = await self._call("taking the lease", lambda: self._acquire(keys=keys, args=[owner, ttl_ms]))
        if token is None:
            return None
        return Lease(session_id, int(token), owner, ttl_ms)

    async def renew(self, lease: Lease) -> bool:
        keys = [self._key(lease.session_id, "lease")]
        value = f"{lease.owner}|{lease.token}"
        return bool(await self._call("renewing the lease", lambda: self._renew(keys=keys, args=[value, lease.ttl_ms])))

    async def release(self, lease: Lease) -> None:
        keys = [self._key(lease.session_id, "lease")]
        value = f"{lease.owner}|{lease.token}"
        await self._call("releasing the lease", lambda: self._release(keys=keys, args=[value]))

    async def quarantine(self, session_id: str, reason: str) -> None:
        # Nothing written: each replica that finds the log unreadable sets it aside for itself (the
        # proxy remembers it), and a marker written beside it would be one more key to expire with it.
        check_session_id(session_id)

    async def sweep(self) -> int:
        """Take the accounts whose every session expired out of the store (their listing, their
        counters); returns the sessions taken out. Nothing without expiry. Each proxy runs it on a timer."""
        acct = self.accounting
        if acct is None or not acct.limits.session_ttl_ms:
            return 0
        keys, args = acct.sweep_args()
        n = int(await self._call("sweeping expired accounts", lambda: acct.sweep_script(keys=keys, args=args)))
        if n:
            acct.note_expired(n, None)
            self._listed.clear()  # ids out of the index now: a session made again under one is listed again
        return n

    @property
    def num_expired(self) -> int:
        """Sessions this process found expired since it started (see :mod:`ctxfold.compaction.store.quota`)."""
        return self.accounting.num_expired if self.accounting is not None else 0

    async def close(self) -> None:
        await self.client.aclose()


def durability_problem(url: str, appendonly: str | None, appendfsync: str | None, expected: str) -> str | None:
    """The one-line warning for a server whose persistence is weaker than ``expected``, else None."""
    if appendonly != "yes":
        return (f"store {url}: Redis runs without its append-only file (appendonly {appendonly}): a restart loses "
                "every session write since the last snapshot; set appendonly yes and appendfsync always")
    rank = {"always": 2, "everysec": 1, "no": 0}
    if rank.get(appendfsync or "no", 0) < rank[expected]:
        return (f"store {url}: Redis fsyncs its append-only file with appendfsync {appendfsync}, weaker than "
                f"{expected}: a crash of its machine can lose acknowledged session writes; set appendfsync "
                f"{expected} (or durability=everysec in the store URL to accept everysec)")
    return None
