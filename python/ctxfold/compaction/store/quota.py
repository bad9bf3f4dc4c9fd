"""Per-account quotas and idle-session expiry in Redis: the scripts :class:`RedisStore` runs instead of
its plain ones when it has :class:`~ctxfold.compaction.store.base.StoreLimits`.

Keys, per account (the proxy's tenant; ``anonymous`` for requests without a credential)::

    <prefix>:acct:{<account>}:live    sorted set: the account's session ids, scored by when they expire (ms)
    <prefix>:acct:{<account>}:aux     sorted set: the ids living with them (archives), scored the same way
    <prefix>:acct:{<account>}:bytes   hash: id -> bytes written (records and blobs)
    <prefix>:acct:{<account>}:total   the account's bytes, all ids together
    <prefix>:accounts                 sorted set: accounts, scored by when their last id expires

Everything is counted and expired inside the scripts that write, so it is atomic across replicas: an
account's bound is checked and its new session registered in the same script that grants the session's
first lease (two replicas starting sessions at once cannot both pass the last place), and the bytes an
append writes are added in the script that writes them (events a replay skips are not counted twice).

Expiry is Redis's own: every grant of a lease sets the time to live of all the session's keys (its
stream, next seq, checkpoint, fence and blobs) and of its companions' blobs (its archive) at once, and
writes keep it; the account scores the ids with the same instant, from the server's clock
(``TIME``), so when Redis drops a session's keys its account drops it too: the next script on the
account (any grant) takes the expired ids out of its count, its bytes and the listing of sessions.
An account nobody uses any more is taken out whole by :meth:`RedisAccounting.sweep`, which each proxy
runs on a timer.

Bytes are what was written: a checkpoint, which folds events, is not subtracted, so the count is an upper
bound on the records Redis keeps (Redis's own overhead per key is not in it).

The scripts name the account's keys beside the session's, which sit in other cluster slots: like the
session listing, this needs one Redis (or Valkey) node, not a cluster.
"""

from __future__ import annotations

import logging
from typing import Any

from ctxfold.compaction.store.base import Lease, QuotaExceeded, StoreLimits

log = logging.getLogger("ctxfold.compaction.store")

# At most this many expired ids leave an account per script call, and accounts per sweep call: a
# script holds Redis for its whole run, so each call's work is bounded; the rest go next time.
PRUNE_BATCH = 512
SWEEP_ACCOUNTS = 64

# Shared by every script below. A = {live, aux, bytes, total, accounts}.
_LIB = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The ids whose time ran out leave the account (their bytes off its total) and the listing; Redis
-- dropped their keys at that same instant.
local function prune(A, index, now)
  local expired = 0
  for k = 1, 2 do
    local gone = redis.call('ZRANGEBYSCORE', A[k], '-inf', now, 'LIMIT', 0, PRUNE_BATCH)
    for _, id in ipairs(gone) do
      redis.call('DECRBY', A[4], tonumber(redis.call('HGET', A[3], id) or '0'))
      redis.call('HDEL', A[3], id)
      redis.call('ZREM', A[k], id)
      if k == 1 then
        redis.call('ZREM', index, id)
        expired = expired + 1
      end
    end
  end
  return expired
end
local function expiry(now, ttl)
  if ttl > 0 then return now + ttl end
  return '+inf'
end
-- The account lives as long as its last id: the sweep takes it out after that.
local function keep_account(A, account, now, ttl)
  if ttl > 0 then redis.call('ZADD', A[5], 'GT', now + ttl, account) end
end
local function count_bytes(A, id, n)
  if n > 0 then
    redis.call('HINCRBY', A[3], id, n)
    redis.call('INCRBY', A[4], n)
  end
end
""".replace("PRUNE_BATCH", str(PRUNE_BATCH))

# KEYS: lease, fence, next, stream, ckpt, blobs, A[1..5], index, then the companions' blobs.
# ARGV: owner, lease ms, session ttl ms (0: none), session id, account, new (1/0), max sessions,
# max bytes (0: none), then the companions' ids. Returns {token (0: held by another; -1: at the
# sessions bound; -2: at the bytes bound), ids expired, what the account holds of the bound refused}.
ACQUIRE = _LIB + """
local now, ttl = now_ms(), tonumber(ARGV[3])
local A = {KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]}
local expired = prune(A, KEYS[12], now)
local maxn, maxb = tonumber(ARGV[7]), tonumber(ARGV[8])
local used = tonumber(redis.call('GET', A[4]) or '0')
local known = redis.call('ZSCORE', A[1], ARGV[4])
local stored = known or redis.call('EXISTS', KEYS[3], KEYS[5]) > 0
local result
if maxb > 0 and used >= maxb then
  result = {-2, expired, used}
elseif ARGV[6] == '1' and not known and maxn > 0 and redis.call('ZCARD', A[1]) >= maxn then
  result = {-1, expired, redis.call('ZCARD', A[1])}
else
  local t = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
  if not redis.call('SET', KEYS[1], ARGV[1] .. '|' .. t, 'NX', 'PX', ARGV[2]) then
    result = {0, expired, 0}
  else
    result = {redis.call('INCR', KEYS[2]), expired, 0}
    -- A listed id whose keys are gone (it expired after the listing was read) is not a session again.
    if ARGV[6] == '1' or stored then
      redis.call('ZADD', A[1], expiry(now, ttl), ARGV[4])
      if ttl > 0 then
        for i = 3, 6 do redis.call('PEXPIRE', KEYS[i], ttl) end
        for i = 13, #KEYS do redis.call('PEXPIRE', KEYS[i], ttl) end
        for i = 9, #ARGV do redis.call('ZADD', A[2], 'XX', now + ttl, ARGV[i]) end
      end
    end
    if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
  end
end
keep_account(A, ARGV[5], now, ttl)
return result
"""

# KEYS: fence, next, stream, lease, ckpt, blobs, A[1..5]. ARGV: token, "<owner>|<token>" to release
# ("": keep), session ttl ms, session id, account, then (seq, record) pairs. As the plain append
# (redis_store._APPEND), plus: the bytes of the records written are counted, the keys' time renewed.
APPEND = _LIB + """
local fence = tonumber(redis.call('GET', KEYS[1]) or '0')
if fence > tonumber(ARGV[1]) then return redis.error_reply('FENCED ' .. fence) end
local nxt = tonumber(redis.call('GET', KEYS[2]) or '0')
if #ARGV > 5 and tonumber(ARGV[6]) > nxt then return redis.error_reply('GAP ' .. nxt) end
local written, nbytes = 0, 0
for i = 6, #ARGV, 2 do
  local seq = tonumber(ARGV[i])
  if seq == nxt then
    redis.call('XADD', KEYS[3], '0-' .. (seq + 1), 'e', ARGV[i + 1])
    nxt = nxt + 1
    written = written + 1
    nbytes = nbytes + #ARGV[i + 1]
  end
end
redis.call('SET', KEYS[2], nxt)
if ARGV[2] ~= '' and redis.call('GET', KEYS[4]) == ARGV[2] then redis.call('DEL', KEYS[4]) end
local now, ttl = now_ms(), tonumber(ARGV[3])
local A = {KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]}
redis.call('ZADD', A[1], expiry(now, ttl), ARGV[4])
count_bytes(A, ARGV[4], nbytes)
if ttl > 0 then
  for _, i in ipairs({1, 2, 3, 5, 6}) do redis.call('PEXPIRE', KEYS[i], ttl) end
end
keep_account(A, ARGV[5], now, ttl)
return written
"""

# KEYS: blobs, A[1..5]. ARGV: session ttl ms, id, account, "s" (a session's own blobs) or "a" (a
# companion's: an archive), then (name, bytes) pairs. A blob's name is its content's digest: one
# already there is the same bytes, neither written nor counted again.
PUT_BLOBS = _LIB + """
local added = 0
for i = 5, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then added = added + #ARGV[i + 1] end
end
local now, ttl = now_ms(), tonumber(ARGV[1])
local A = {KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]}
if ARGV[4] == 'a' then
  redis.call('ZADD', A[2], 'GT', expiry(now, ttl), ARGV[2])
else
  redis.call('ZADD', A[1], expiry(now, ttl), ARGV[2])
end
count_bytes(A, ARGV[2], added)
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
keep_account(A, ARGV[3], now, ttl)
return added
"""

# KEYS: accounts, index. ARGV: key prefix. Accounts whose every id expired: their ids leave the
# listing and their keys go. Returns the number of sessions taken out.
SWEEP = _LIB + """
local done = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms(), 'LIMIT', 0, SWEEP_ACCOUNTS)
local expired = 0
for _, account in ipairs(done) do
  local base = ARGV[1] .. ':acct:{' .. account .. '}:'
  for _, id in ipairs(redis.call('ZRANGE', base .. 'live', 0, -1)) do
    redis.call('ZREM', KEYS[2], id)
    expired = expired + 1
  end
  redis.call('DEL', base .. 'live', base .. 'aux', base .. 'bytes', base .. 'total')
  redis.call('ZREM', KEYS[1], account)
end
return expired
""".replace("SWEEP_ACCOUNTS", str(SWEEP_ACCOUNTS))


def sessions_refused(used: int, limit: int) -> QuotaExceeded:
    return QuotaExceeded(f"the account keeps {used} sessions, its bound ({limit})", kind="sessions", used=used,
                         limit=limit)


def bytes_refused(used: int, limit: int) -> QuotaExceeded:
    return QuotaExceeded(f"the account's sessions hold {used} bytes, at or over its bound ({limit})", kind="bytes",
                         used=used, limit=limit)


class RedisAccounting:
    """The accounts of one :class:`~ctxfold.compaction.store.redis_store.RedisStore` (its client, key prefix and
    limits): the keys and arguments of the scripts above, and what their answers mean."""

    def __init__(self, client: Any, prefix: str, limits: StoreLimits) -> None:
        self.prefix = prefix
        self.limits = limits
        self.acquire_script = client.register_script(ACQUIRE)
        self.append_script = client.register_script(APPEND)
        self.put_blobs_script = client.register_script(PUT_BLOBS)
        self.sweep_script = client.register_script(SWEEP)
        self.num_expired = 0  # sessions this process found expired (and took out of their accounts)

    def account_keys(self, session_id: str) -> tuple[str, list[str]]:
        """(the account's name, its keys: live, aux, bytes, total, the registry of accounts)."""
        account = self.limits.account_of(session_id)
        base = f"{self.prefix}:acct:{{{account}}}"
        return account, [f"{base}:live", f"{base}:aux", f"{base}:bytes", f"{base}:total", f"{self.prefix}:accounts"]

    def acquire_args(self, session_keys: list[str], blobs_key: Any, session_id: str, owner: str, ttl_ms: int,
                     new: bool) -> tuple[list[str], list[Any]]:
        """``session_keys``: lease, fence, next, stream, ckpt, blobs; ``blobs_key``: id -> a blobs key."""
        account, a_keys = self.account_keys(session_id)
        companions = list(self.limits.companions_of(session_id))
        keys = [*session_keys, *a_keys, f"{self.prefix}:sessions", *(blobs_key(c) for c in companions)]
        limits = self.limits
        args: list[Any] = [owner, ttl_ms, limits.session_ttl_ms, session_id, account, int(new), limits.max_sessions,
                           limits.max_bytes, *companions]
        return keys, args

    def granted(self, reply: Any, session_id: str, owner: str, ttl_ms: int) -> Lease | None:
        """The acquire script's answer as a lease, None (held by another) or QuotaExceeded."""
        token, expired, used = (int(x) for x in reply)
        if expired:
            self.note_expired(expired, self.limits.account_of(session_id))
        if token == -1:
            raise sessions_refused(used, self.limits.max_sessions)
        if token == -2:
            raise bytes_refused(used, self.limits.max_bytes)
        return Lease(session_id, token, owner, ttl_ms) if token > 0 else None

    def append_args(self, session_keys: list[str], session_id: str) -> tuple[list[str], list[Any]]:
        """``session_keys``: fence, next, stream, lease, ckpt, blobs; the caller adds its own arguments
        (token, release) before and the records after."""
        account, a_keys = self.account_keys(session_id)
        return [*session_keys, *a_keys], [self.limits.session_ttl_ms, session_id, account]

    def put_blobs_args(self, blobs_key: str, session_id: str, blobs: list[tuple[str, bytes]], *,
                       companion: bool) -> tuple[list[str], list[Any]]:
        account, a_keys = self.account_keys(session_id)
        args: list[Any] = [self.limits.session_ttl_ms, session_id, account, "a" if companion else "s"]
        for name, data in blobs:
            args += [name, data]
        return [blobs_key, *a_keys], args

    def sweep_args(self) -> tuple[list[str], list[Any]]:
        return [f"{self.prefix}:accounts", f"{self.prefix}:sessions"], [self.prefix]

    def note_expired(self, n: int, account: str | None) -> None:
        self.num_expired += n
        # The account's name is the proxy's tenant (a keyed hash): its first characters, as the metrics label it.
        log.info("%d idle session(s) expired and deleted (%s)", n,
                 f"account {account[:12]}" if account is not None else "accounts nobody used since",
                 extra={"expired_sessions": n})
