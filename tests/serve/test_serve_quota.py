"""Per-tenant quotas and idle-session expiry (``--max-sessions-per-tenant``, ``--max-tenant-bytes``,
``--session-ttl-s``; docs/store.md, *Quotas and expiry*), in the data directory and in a real Redis on
loopback.

A tenant at a bound gets its requests relayed uncompacted with a warning header, counted in
``ctxfold_quota_refusals_total`` and ``ctxfold_bad_requests_total{reason="tenant_quota"}``, nothing
stored; another tenant goes on compacting. Idle sessions are deleted with their archives (Redis: key
TTLs; the data directory: the sweep) and free their tenant's quota. Waits are on state (keys gone,
directories gone), with generous deadlines only as safety nets.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.store import LocalStore
from ctxfold.errors import ConfigError
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from helpers.proxy_helpers import metric, settle, started_proxies
from helpers.redis_server import RedisServer
from helpers.subprocess_env import ctxfold_env

WARNING_HEADER = "X-Ctxfold-Warning"
TENANT_KEY = "quota-test-tenant-key-0123456789"
FILLER = "lorem ipsum dolor sit amet " * 25  # ~170 tokens a message: a compaction every few turns at 3000
SUMMARY_MARK = "Goals: finish the user's task"  # the scripted upstream's summary text
DEADLINE_S = 30.0  # a safety net only: every wait below ends on the state it waits for


@pytest.fixture()
def upstream() -> Iterator[tuple[ScriptedUpstream, str]]:
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as srv:
        yield up, srv.url + "/v1"


@contextmanager
def proxies(tmp_path: Path, upstream_url: str, n: int = 1, **kw: Any) -> Iterator[list[tuple[ProxyApp, str]]]:
    """``n`` proxies in this process, each with its own loop and data directory (``store_url=`` to share one)."""
    key_file = tmp_path / "tenant.key"
    key_file.write_text(TENANT_KEY)
    compact = kw.pop("compact", CompactConfig(context_tokens=3000))
    with started_proxies(upstream_url, tmp_path, n, tenant_key_file=key_file, compact=compact, **kw) as out:
        yield out


def ask(url: str, messages: list[dict[str, Any]], key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages}, headers=headers,
                      timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def conversation(url: str, key: str | None, opening: str, turns: int = 1) -> list[httpx.Response]:
    """A conversation of ``turns`` requests, each answer kept in the history as a client keeps it."""
    messages: list[dict[str, Any]] = []
    out = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"{opening} turn {k} {FILLER}"})
        resp = ask(url, messages, key)
        messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
        out.append(resp)
    return out


def refused(resp: httpx.Response) -> bool:
    return any("not compacted" in w and "bound" in w for w in resp.headers.get_list(WARNING_HEADER))


def metrics_text(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"still waiting for {what} after {DEADLINE_S} s"
        time.sleep(0.05)


def session_dirs(data_dir: Path) -> list[Path]:
    return sorted(p.parent for p in data_dir.glob("**/events.jsonl"))


def tenant_dirs(data_dir: Path) -> dict[str, int]:
    """Session directories per tenant folder ("" for the anonymous tenant)."""
    out: dict[str, int] = {}
    for d in session_dirs(data_dir):
        rel = d.relative_to(data_dir).parts
        tenant = rel[1] if rel[0] == "tenants" else ""
        out[tenant] = out.get(tenant, 0) + 1
    return out


# -- Redis helpers -----------------------------------------------------------------------------------------

def redis_keys(redis: RedisServer) -> list[str]:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        return sorted(k.decode() for k in client.keys("*"))
    finally:
        client.close()


def stored_sessions(redis: RedisServer) -> dict[str, int]:
    """Sessions with data in Redis, per tenant ("" for the anonymous one)."""
    out: dict[str, int] = {}
    for k in redis_keys(redis):
        if k.endswith(":next"):
            sid = k.split("{", 1)[1].rsplit("}", 1)[0]
            tenant = sid.split("/")[1] if sid.startswith("tenants/") else ""
            out[tenant] = out.get(tenant, 0) + 1
    return out


# -- the sessions bound ------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["data_dir", "redis"])
def test_a_tenant_past_its_sessions_bound_is_relayed_uncompacted_and_another_is_not(
        where: str, tmp_path: Path, upstream: tuple[ScriptedUpstream, str], request: pytest.FixtureRequest) -> None:
    up, url = upstream
    kw: dict[str, Any] = {"max_sessions_per_tenant": 3}
    if where == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        kw.update(store_url=redis.url, lease_ms=2000)
    with proxies(tmp_path, url, 2 if where == "redis" else 1, **kw) as apps:
        # Tenant A opens 6 conversations, alternating between the replicas when there are two.
        results = [conversation(apps[k % len(apps)][1], "key-a", f"a{k}")[0] for k in range(6)]
        assert [refused(r) for r in results] == [False] * 3 + [True] * 3
        assert all(r.json()["choices"][0]["message"]["content"].startswith("echo: a") for r in results)
        warning = results[3].headers[WARNING_HEADER]
        assert "keeps 3 conversations" in warning and "max_sessions_per_tenant 3" in warning
        # Refused, the request went upstream as the client sent it.
        assert up.received[-1]["messages"][-1]["content"].startswith("a5 turn 0")
        # Tenant B is unaffected: stored, and compacted as its conversation grows.
        replies = conversation(apps[0][1], "key-b", "b", turns=12)
        assert not any(refused(r) for r in replies)
        assert any(int(r.headers["X-Ctxfold-Compactions"]) for r in replies)
        assert any(SUMMARY_MARK in str(b["messages"]) or "[ctxfold compacted" in str(b["messages"])
                   for b in list(up.received)[-6:])
        for app, _ in apps:
            settle(app)
        counts = stored_sessions(request.getfixturevalue("redis_server")) if where == "redis" else \
            tenant_dirs(tmp_path / "app0")
        assert sorted(counts.values()) == [1, 3]  # B's one, A's three
        # A's continuation of a stored conversation is still served (the bound is on new sessions).
        assert not refused(conversation(apps[0][1], "key-a", "a0")[0])
        refusals = sum(metric(metrics_text(u), "ctxfold_quota_refusals_total", kind="sessions",
                              tenant=app.metrics.tenants.label(app.sessions.key_for(
                                  {"Authorization": "Bearer key-a"}, None, [{"role": "user", "content": "x"}]
                              ).split("/")[1])) or 0 for app, u in apps)
        assert refusals == 3
        assert sum(metric(metrics_text(u), "ctxfold_bad_requests_total", reason="tenant_quota") or 0
                   for _, u in apps) == 3


def test_concurrent_new_sessions_never_pass_the_bound_across_two_clients(redis_server: RedisServer) -> None:
    """The bound is checked in the script that grants a session's first lease: two clients (as two
    replicas) starting 20 sessions of one tenant at once get exactly the bound between them."""
    from ctxfold.compaction.store import QuotaExceeded
    from ctxfold.compaction.store.redis_store import RedisStore
    from ctxfold.serve.quota import store_limits

    async def run() -> tuple[int, int]:
        limits = store_limits(max_sessions=5, max_bytes=None, ttl_s=None)
        stores = [RedisStore(redis_server.url, limits=limits) for _ in range(2)]

        async def one(k: int) -> bool:
            try:
                return await stores[k % 2].acquire(f"tenants/t1/sessions/k{k}/0000", owner="o", new=True) is not None
            except QuotaExceeded:
                return False

        granted = sum(await asyncio.gather(*(one(k) for k in range(20))))
        other = await stores[0].acquire("tenants/t2/sessions/k/0000", owner="o", new=True)
        for s in stores:
            await s.close()
        return granted, other is not None

    assert asyncio.run(run()) == (5, True)


# -- the bytes bound ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["data_dir", "redis"])
def test_a_tenant_at_its_bytes_bound_stores_nothing_more(
        where: str, tmp_path: Path, upstream: tuple[ScriptedUpstream, str], request: pytest.FixtureRequest) -> None:
    _, url = upstream
    kw: dict[str, Any] = {"max_tenant_bytes": 6000}
    if where == "redis":
        kw.update(store_url=request.getfixturevalue("redis_server").url, lease_ms=2000)
    with proxies(tmp_path, url, **kw) as apps:
        app, proxy_url = apps[0]
        # Each turn stores about 1.4 kB (a message of ~700 bytes and its answer, as records): the bound is
        # reached within a few turns, and from then on nothing more of the tenant is stored.
        replies = conversation(proxy_url, "key-a", "a", turns=8)
        flags = [refused(r) for r in replies]
        assert flags[0] is False and flags[-1] is True
        first = flags.index(True)
        assert all(flags[first:]), flags  # once at the bound, it stays there (nothing expires here)
        assert "bytes, at or over its bound (max_tenant_bytes 6000)" in replies[first].headers[WARNING_HEADER]
        assert not refused(conversation(proxy_url, "key-b", "b", turns=2)[-1])  # another tenant stores on
        assert not any(refused(r) for r in conversation(proxy_url, None, "anon", turns=2))
        settle(app)
        text = metrics_text(proxy_url)
        assert (metric(text, "ctxfold_bad_requests_total", reason="tenant_quota") or 0) == len(flags) - first


# -- idle expiry ---------------------------------------------------------------------------------------------

def test_idle_sessions_expire_from_the_data_directory_and_free_the_quota(
        tmp_path: Path, upstream: tuple[ScriptedUpstream, str]) -> None:
    _, url = upstream
    with proxies(tmp_path, url, max_sessions_per_tenant=1, session_ttl_s=1.0) as apps:
        app, proxy_url = apps[0]
        data = tmp_path / "app0"
        conversation(proxy_url, "key-a", "a", turns=2)
        assert refused(conversation(proxy_url, "key-a", "second")[0])  # at the bound
        settle(app)
        assert tenant_dirs(data) == {app.sessions.key_for({"Authorization": "Bearer key-a"}, None,
                                                          [{"role": "user", "content": "x"}]).split("/")[1]: 1}
        keep_b = conversation(proxy_url, "key-b", "b")  # noqa: F841 - tenant B's session expires too
        store = app.sessions.store
        assert isinstance(store, LocalStore) and store.num_remembered == 2
        wait_for("the idle sessions to be swept", lambda: not session_dirs(data))
        assert not list(data.glob("tenants/*/sessions/*"))  # key directories (archives) gone with them
        # The process forgets them too: a proxy that runs for months holds nothing of sessions long gone.
        wait_for("the store to forget the deleted sessions", lambda: store.num_remembered == 0)
        # The quota is free again: a new conversation of A is stored.
        assert not refused(conversation(proxy_url, "key-a", "third")[0])
        settle(app)
        assert len(session_dirs(data)) == 1 and store.num_remembered == 1
        assert (metric(metrics_text(proxy_url), "ctxfold_sessions_expired") or 0) >= 2


def test_a_session_in_use_outlives_its_idle_time_in_the_data_directory(
        tmp_path: Path, upstream: tuple[ScriptedUpstream, str]) -> None:
    """A conversation that goes on past the idle time is never swept: each request renews it."""
    _, url = upstream
    with proxies(tmp_path, url, session_ttl_s=1.0) as apps:
        app, proxy_url = apps[0]
        messages: list[dict[str, Any]] = []
        first_dir: list[Path] = []
        deadline = time.monotonic() + 3.0  # three idle times
        k = 0
        while time.monotonic() < deadline:
            messages.append({"role": "user", "content": f"turn {k}"})
            resp = ask(proxy_url, messages, "key-a")
            assert not resp.headers.get_list(WARNING_HEADER)
            messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
            settle(app)
            first_dir = first_dir or session_dirs(tmp_path / "app0")
            assert session_dirs(tmp_path / "app0") == first_dir  # the same session all along
            time.sleep(0.3)
            k += 1


def test_idle_sessions_expire_from_redis_with_their_archive_and_free_the_quota(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    _, url = upstream
    with proxies(tmp_path, url, 2, store_url=redis_server.url, lease_ms=500, session_ttl_s=1.5,
                 max_sessions_per_tenant=1) as apps:
        conversation(apps[0][1], "key-a", "a", turns=2)
        assert refused(conversation(apps[1][1], "key-a", "second")[0])  # the other replica counts it too
        conversation(apps[1][1], None, "anon")
        for app, _ in apps:
            settle(app)
        assert sorted(stored_sessions(redis_server).values()) == [1, 1]
        # Every key of a session (and the account's) goes: wait until only leases could be left.
        wait_for("Redis to expire the sessions", lambda: not stored_sessions(redis_server))
        # The quota is free again, on either replica.
        assert not refused(conversation(apps[1][1], "key-a", "third")[0])
        for app, _ in apps:
            settle(app)
        assert list(stored_sessions(redis_server).values()) == [1]
        # Once every session expired, the sweep takes the listing and the accounts out too.
        wait_for("the sweep to clear the store", lambda: not [
            k for k in redis_keys(redis_server) if not k.endswith(":lease")])
        expired = sum(metric(metrics_text(u), "ctxfold_sessions_expired") or 0 for _, u in apps)
        assert expired >= 3


def test_the_bytes_count_follows_expiry_in_redis(redis_server: RedisServer) -> None:
    """The account's bytes are the records and blobs written, once each (a replayed batch is not counted
    twice), and leave the account with the sessions that expire."""
    from ctxfold.compaction.store import Batch
    from ctxfold.compaction.store.redis_store import RedisStore
    from ctxfold.serve.quota import store_limits

    async def run() -> list[int]:
        import redis.asyncio as aioredis

        store = RedisStore(redis_server.url, limits=store_limits(max_sessions=None, max_bytes=10_000, ttl_s=1.0))
        client = aioredis.from_url(redis_server.url)
        total = "ctxfold:acct:{t1}:total"
        seen = []
        lease = await store.acquire("tenants/t1/sessions/k/0000", owner="o", new=True)
        assert lease is not None
        batch = Batch(blobs=(("history/000001-0123456789abcdef.jsonl", b"d" * 300),),
                      events=({"seq": 0, "type": "header", "conversation": {}},))
        await store.append(lease, batch)
        seen.append(int(await client.get(total)))
        await store.append(lease, batch)  # a replay: nothing new
        seen.append(int(await client.get(total)))
        await store.put_blob("tenants/t1/sessions/k/archive", "archive/" + "a" * 64 + ".txt", b"x" * 200)
        seen.append(int(await client.get(total)))
        await store.release(lease)
        while await client.exists("ctxfold:{tenants/t1/sessions/k/0000}:next"):
            await asyncio.sleep(0.05)
        assert not await client.exists("ctxfold:{tenants/t1/sessions/k/archive}:blobs")  # with its session
        again = await store.acquire("tenants/t1/sessions/k2/0000", owner="o", new=True)  # prunes the account
        assert again is not None
        seen.append(int(await client.get(total)))
        seen.append(store.num_expired)
        await client.aclose()
        await store.close()
        return seen

    first, replayed, with_archive, after, expired = asyncio.run(run())
    assert first > 300 and replayed == first and with_archive == first + 200
    assert (after, expired) == (0, 1)


# -- two processes sharing Redis -----------------------------------------------------------------------------

@contextmanager
def serve_processes(tmp_path: Path, redis: RedisServer, upstream: str, n: int,
                    *extra: str) -> Iterator[list[str]]:
    procs: list[subprocess.Popen[str]] = []
    urls = []
    env = ctxfold_env(CTXFOLD_TENANT_KEY=TENANT_KEY)
    try:
        for i in range(n):
            proc = subprocess.Popen(
                [sys.executable, "-m", "ctxfold", "serve", "--upstream", upstream, "--store", redis.url,
                 "--data-dir", str(tmp_path / f"replica{i}"), "--port", "0", "--template", "none",
                 "--tokenizer", "chars4", "--fsync", "never", *extra],
                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
            procs.append(proc)
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert "listening on " in line, line + proc.stderr.read()[-3000:]
            urls.append(line.split("listening on ", 1)[1].split(",", 1)[0])
        yield urls
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


@pytest.mark.slow
def test_two_proxy_processes_share_the_count_and_the_expiry(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    _, url = upstream
    with serve_processes(tmp_path, redis_server, url, 2, "--max-sessions-per-tenant", "4",
                         "--session-ttl-s", "3", "--store-lease-ms", "1000") as urls:
        flags = [refused(conversation(urls[k % 2], "key-a", f"a{k}")[0]) for k in range(8)]
        assert flags == [False] * 4 + [True] * 4
        assert not refused(conversation(urls[1], "key-b", "b")[0])
        wait_for("Redis to expire the sessions", lambda: not stored_sessions(redis_server))
        # Expired, they left the count: four more fit, on both processes, and no fifth.
        flags = [refused(conversation(urls[k % 2], "key-a", f"again{k}")[0]) for k in range(5)]
        assert flags == [False] * 4 + [True]


# -- settings ---------------------------------------------------------------------------------------------------

def test_settings_are_checked(tmp_path: Path) -> None:
    base: dict[str, Any] = {"upstream": "http://127.0.0.1:1/v1", "data_dir": tmp_path}
    for bad in ({"max_sessions_per_tenant": 0}, {"max_tenant_bytes": -1}, {"session_ttl_s": 0.5},
                {"session_ttl_s": float("inf")},
                {"session_ttl_s": 10, "store_url": "redis://127.0.0.1:1/0", "lease_ms": 30_000}):
        with pytest.raises(ConfigError):
            ProxyConfig(**base, **bad)
    assert not ProxyConfig(**base).quotas_on  # an embedder's default: nothing bounded, nothing expires
    assert ProxyConfig(**base, session_ttl_s=60).quotas_on


def test_the_command_line_expires_a_shared_stores_sessions_after_seven_days_and_keeps_the_data_directorys(
        tmp_path: Path) -> None:
    """Unless told: Redis's memory is the bound that matters, and a data directory (the operator's own disk,
    which ctxfold restore reads) is not emptied at the first start after an upgrade."""
    from ctxfold.cli import build_parser
    from ctxfold.cli.serve import build_config

    parser = build_parser()
    base = ["serve", "--upstream", "http://127.0.0.1:1/v1", "--data-dir", str(tmp_path)]
    config = build_config(parser.parse_args(base))
    assert config.session_ttl_s is None and config.max_sessions_per_tenant is None
    config = build_config(parser.parse_args([*base, "--store", "redis://127.0.0.1:1/0"]))
    assert config.session_ttl_s == 7 * 24 * 3600
    config = build_config(parser.parse_args([*base, "--store", "redis://127.0.0.1:1/0", "--session-ttl-s", "0"]))
    assert config.session_ttl_s is None
    args = parser.parse_args([*base, "--session-ttl-s", "3600", "--max-sessions-per-tenant", "10",
                              "--max-tenant-bytes", "1000000"])
    config = build_config(args)
    assert (config.session_ttl_s, config.max_sessions_per_tenant, config.max_tenant_bytes) == (3600, 10, 1_000_000)


def test_the_data_directory_accounts_hold_with_a_relative_data_dir() -> None:
    from ctxfold.compaction.store import QuotaExceeded
    from ctxfold.serve.quota import DiskQuota

    quota = DiskQuota(Path("data"), max_sessions=2, max_bytes=1000)
    quota.admit(Path("data/tenants/t1/sessions/k/0000"))
    quota.note(Path("data/tenants/t1/sessions/k/0000"), 400)
    quota.admit(Path("data/sessions/k/0000"))  # the anonymous tenant: a count of its own
    assert quota.usage("t1") == (1, 400) and quota.usage("") == (1, 0)
    quota.note(Path("data/tenants/t1/sessions/k/0000"), 1000)
    with pytest.raises(QuotaExceeded) as refused_bytes:
        quota.admit(Path("data/tenants/t1/sessions/k2/0000"))
    assert refused_bytes.value.kind == "bytes"
    quota.forget(Path("data/tenants/t1/sessions/k/0000"))
    assert quota.usage("t1") == (0, 0)


def test_refusals_are_logged_once_a_minute_per_tenant(caplog: pytest.LogCaptureFixture) -> None:
    from ctxfold.compaction.store import QuotaExceeded
    from ctxfold.serve.quota import RefusalLog

    now = [0.0]
    refusals = RefusalLog(interval_s=60, clock=lambda: now[0])
    e = QuotaExceeded("x", kind="sessions", used=3, limit=3)
    with caplog.at_level("WARNING", logger="ctxfold.serve"):
        for _ in range(100):
            refusals.note("aaaa", e)
        refusals.note("bbbb", e)
        now[0] = 61
        refusals.note("aaaa", e)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "(tenant aaaa)" in lines[0] and "(tenant bbbb)" in lines[1] and "(99 more refused" in lines[2]
