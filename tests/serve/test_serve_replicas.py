"""Proxy replicas sharing one Redis (``ctxfold serve --store redis://...``): any replica serves any request.

Real processes on loopback: a redis-server (the ``redis_server`` fixture: AOF, appendfsync always), the
scripted upstream (in this process, so a test sees what went upstream and can slow it down), and
``ctxfold serve`` processes. A conversation's requests alternate between replicas; what one replica
compacted, the next one continues from; tenants stay apart; restore from Redis gives back exactly what
the client sent and was answered. A replica paused (SIGSTOP) in the middle of a slow summary past its
lease loses the conversation to another, and its late write is refused by the fencing token; Redis
killed and restarted (AOF) loses nothing a client was answered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.cli_helpers import run_main
from helpers.proxy_helpers import metric, start_proxy, started_proxies
from helpers.redis_server import RedisServer
from helpers.subprocess_env import ctxfold_env

pytest.importorskip("redis")
pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="pauses processes with SIGSTOP (POSIX)")

from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.store import restore_from_store
from ctxfold.compaction.store.redis_store import RedisStore
from ctxfold.errors import ConfigError, FormatError
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream

WARNING_HEADER = "X-Ctxfold-Warning"
TENANT_KEY = "replica-test-tenant-key-0123456789"
FILLER = "lorem ipsum dolor sit amet " * 25  # ~170 tokens a message by chars4: a compaction every few turns
SUMMARY_MARK = "Goals: finish the user's task"  # the scripted upstream's summary text


@contextmanager
def replicas(tmp_path: Path, redis: RedisServer, upstream: str, n: int, *extra: str,
             lease_ms: int = 1000) -> Iterator[list[tuple[subprocess.Popen[str], str]]]:
    procs: list[tuple[subprocess.Popen[str], str]] = []
    env = ctxfold_env(CTXFOLD_TENANT_KEY=TENANT_KEY)
    try:
        for i in range(n):
            proc = subprocess.Popen(
                [sys.executable, "-m", "ctxfold", "serve", "--upstream", upstream, "--store", redis.url,
                 "--data-dir", str(tmp_path / f"replica{i}"), "--port", "0", "--context-tokens", "3000",
                 "--template", "none", "--tokenizer", "chars4", "--fsync", "never",
                 "--store-lease-ms", str(lease_ms), *extra],
                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert "listening on " in line, line + proc.stderr.read()[-3000:]
            procs.append((proc, line.split("listening on ", 1)[1].split(",", 1)[0]))
        yield procs
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc, _ in procs:
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


@pytest.fixture()
def upstream() -> Iterator[tuple[ScriptedUpstream, str]]:
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as srv:
        yield up, srv.url + "/v1"


def ask(url: str, messages: list[dict[str, Any]], key: str | None = None, timeout_s: float = 30) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages}, headers=headers,
                      timeout=timeout_s)


def ask_into(into: dict[str, httpx.Response], url: str, messages: list[dict[str, Any]]) -> None:
    """``ask`` from a thread of its own; a connection cut by a killed proxy leaves ``into`` empty."""
    try:
        into["a"] = ask(url, messages, timeout_s=60)
    except httpx.HTTPError:
        pass


def turn(url: str, messages: list[dict[str, Any]], text: str, key: str | None = None) -> httpx.Response:
    """One user turn: the message joins the history, the answer too (as the client keeps it)."""
    messages.append({"role": "user", "content": f"{text} {FILLER}"})
    resp = ask(url, messages, key)
    assert resp.status_code == 200, resp.text
    answer = resp.json()["choices"][0]["message"]
    assert answer["content"].startswith(f"echo: {text} ")  # its own answer: nothing mixed up
    messages.append({"role": "assistant", "content": answer["content"]})
    return resp


def stored(redis: RedisServer) -> dict[str, list[tuple[str, str]]]:
    """Every session in the store, restored: id -> (role, text) of each original message."""
    async def ids() -> list[str]:
        store = RedisStore(redis.url)
        try:
            return await store.sessions()
        finally:
            await store.close()

    out = {}
    for sid in asyncio.run(ids()):
        conv = restore_from_store(redis.url, sid)
        out[sid] = [(m.role.value, m.text) for m in conv.messages]
    return out


def as_pairs(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def has_summary(body: dict[str, Any]) -> bool:
    """Whether a request went out compacted: the upstream's summary, or the extractive one's mark."""
    return any(SUMMARY_MARK in str(m.get("content")) or "[ctxfold compacted" in str(m.get("content"))
               for m in body["messages"][:-1])


def test_round_robin_across_two_replicas_continues_each_others_compactions(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    with replicas(tmp_path, redis_server, url, 2) as procs:
        urls = [u for _, u in procs]
        messages: list[dict[str, Any]] = []
        summarized_by: list[int] = []
        for k in range(14):
            served = k % 2
            turn(urls[served], messages, f"turn {k}")
            sent = [b for b in up.received if not b["messages"][-1]["content"].startswith("Internal context")][-1]
            if has_summary(sent):
                summarized_by.append(served)
        # Compactions happened, and requests of both replicas went out with a summary: each continued
        # from the other's compacted view (a replica that had not read the store would send it all).
        assert 0 in summarized_by and 1 in summarized_by, summarized_by
        sent = [b for b in up.received if not b["messages"][-1]["content"].startswith("Internal context")]
        assert len(sent[-1]["messages"]) < len(messages)
        assert stored(redis_server) == {f"sessions/{sid}": as_pairs(messages) for sid in _ids(redis_server)}
        for _, u in procs:
            assert httpx.get(u + "/health", timeout=10).json()["status"] == "ok"


def _ids(redis: RedisServer) -> list[str]:
    async def ids() -> list[str]:
        store = RedisStore(redis.url)
        try:
            return [i.removeprefix("sessions/") for i in await store.sessions()]
        finally:
            await store.close()

    return asyncio.run(ids())


def test_tenants_stay_apart_through_every_replica(tmp_path: Path, redis_server: RedisServer,
                                                  upstream: tuple[ScriptedUpstream, str]) -> None:
    _up, url = upstream
    with replicas(tmp_path, redis_server, url, 2) as procs:
        urls = [u for _, u in procs]
        conversations: dict[str, list[dict[str, Any]]] = {"key-a": [], "key-b": []}
        for k in range(6):
            for n, (key, messages) in enumerate(conversations.items()):
                # The same opening in both tenants: only the credential tells them apart.
                turn(urls[(k + n) % 2], messages, f"turn {k} of {key if k else 'the same start'}", key=key)
        found = stored(redis_server)
        assert all(sid.startswith("tenants/") for sid in found)
        assert len(found) == 2 and len({sid.split("/")[1] for sid in found}) == 2
        assert sorted(found.values()) == sorted(as_pairs(m) for m in conversations.values())
        sid = next(iter(found))  # and `ctxfold restore --store` prints it
        out = subprocess.run([sys.executable, "-m", "ctxfold", "restore", "--store", redis_server.url, sid, "-o", "-"],
                             capture_output=True, text=True, env=ctxfold_env(), timeout=60, check=True)
        assert [(m["role"], m["content"]) for m in json.loads(out.stdout)["messages"]] == found[sid]


def into_a_slow_summary(up: ScriptedUpstream, url_a: str, url_b: str, messages: list[dict[str, Any]]
                        ) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """Turns through both replicas until the conversation is compacted once, then turns on A until one
    of its requests waits for a (slow) summary: that request's thread and where its answer goes."""
    k = 0
    while not any(has_summary(b) for b in up.received):
        turn(url_a if k % 2 else url_b, messages, f"turn {k}")
        k += 1
    before = len(up.summary_authorizations)
    up.summary_delay_s = 4.0
    for _ in range(12):
        messages.append({"role": "user", "content": f"turn {k} {FILLER}"})
        result: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=ask_into, args=(result, url_a, list(messages)))
        thread.start()
        deadline = time.monotonic() + 10
        while thread.is_alive() and len(up.summary_authorizations) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        if len(up.summary_authorizations) > before:
            return thread, result
        thread.join()
        assert result["a"].status_code == 200
        messages.append({"role": "assistant", "content": result["a"].json()["choices"][0]["message"]["content"]})
        k += 1
    pytest.fail("no compaction on replica A")


@pytest.mark.slow
def test_a_replica_stalled_past_its_lease_loses_the_conversation_and_its_write_is_refused(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    with replicas(tmp_path, redis_server, url, 2, lease_ms=1000) as procs:
        (stalled, url_a), (_, url_b) = procs
        messages: list[dict[str, Any]] = []
        thread, result = into_a_slow_summary(up, url_a, url_b, messages)
        os.kill(stalled.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)  # past A's lease
            up.summary_delay_s = 0.0
            # The client gives up on A and sends the same request to B, which takes the conversation over.
            resp = ask(url_b, messages)
            assert resp.status_code == 200, resp.text
            assert not resp.headers.get_list("X-Ctxfold-Warning")
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        thread.join(60)
        late = result["a"]
        # A's summary came back after B's takeover: its write was refused by the fencing token, and its
        # client still got an answer (uncompacted), with a warning.
        assert late.status_code == 200
        warnings = " ".join(late.headers.get_list("X-Ctxfold-Warning"))
        assert "took this conversation over" in warnings and "fencing token" in warnings, warnings
        messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
        for n in range(3):  # the conversation goes on, through both
            turn(url_a if n % 2 == 0 else url_b, messages, f"after {n}")
        assert list(stored(redis_server).values()) == [as_pairs(messages)]


@pytest.mark.slow
def test_a_replica_killed_in_a_compaction_is_taken_over_after_its_lease(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    with replicas(tmp_path, redis_server, url, 3, lease_ms=1000) as procs:
        (killed, url_a), (_, url_b), (_, url_c) = procs
        messages: list[dict[str, Any]] = []
        thread, result = into_a_slow_summary(up, url_a, url_b, messages)
        killed.kill()
        killed.wait(20)
        thread.join(60)
        assert "a" not in result  # its client saw the connection go: no answer
        up.summary_delay_s = 0.0
        t0 = time.monotonic()
        resp = ask(url_b, messages)  # waits for the dead replica's lease to run out, then takes over
        assert resp.status_code == 200 and not resp.headers.get_list("X-Ctxfold-Warning"), resp.headers
        assert time.monotonic() - t0 < 5
        messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
        for n in range(3):
            turn(url_c if n % 2 == 0 else url_b, messages, f"after {n}")
        assert list(stored(redis_server).values()) == [as_pairs(messages)]


@pytest.mark.slow
def test_redis_killed_and_restarted_loses_nothing_acknowledged(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    # The default lease: a replica that could not release its lease while Redis was down must not wait
    # for it to run out (it is its own).
    with replicas(tmp_path, redis_server, url, 2, lease_ms=30_000) as procs:
        urls = [u for _, u in procs]
        messages: list[dict[str, Any]] = []
        for k in range(4):
            turn(urls[k % 2], messages, f"turn {k}")
        # Killed while an answer is on its way: the answer's write finds no store and goes to the spool.
        up.delay_s = 1.0
        killer = threading.Timer(0.5, redis_server.kill)
        killer.start()
        turn(urls[0], messages, "turn 4")
        killer.join()
        up.delay_s = 0.0
        # Without Redis: requests pass through uncompacted, with a warning, and /health says why.
        resp = turn(urls[1], messages, "turn 5")
        assert any("session store" in w for w in resp.headers.get_list("X-Ctxfold-Warning")), resp.headers
        health = httpx.get(urls[0] + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert metric(httpx.get(urls[0] + "/metrics", timeout=30).text, "ctxfold_store_spool_batches") == 1
        redis_server.start()  # reads its append-only file back
        deadline = time.monotonic() + 20
        while any(httpx.get(u + "/health", timeout=30).status_code != 200 for u in urls):
            assert time.monotonic() < deadline, httpx.get(urls[0] + "/health", timeout=30).text
            time.sleep(0.2)
        # The spooled answer of turn 4 reached the store before the next request needed it.
        assert next(iter(stored(redis_server).values()))[: len(messages) - 2] == as_pairs(messages)[:-2]
        for k in range(6, 10):
            t0 = time.monotonic()
            resp = turn(urls[k % 2], messages, f"turn {k}")
            assert not resp.headers.get_list("X-Ctxfold-Warning")
            assert time.monotonic() - t0 < 5, f"turn {k} waited for a lease"
        assert list(stored(redis_server).values()) == [as_pairs(messages)]


def _acl_xadd(redis: RedisServer, allow: bool) -> None:
    """A partial outage of the store: its user loses (or gets back) XADD, while leases are still granted."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=10) as c:
        c.sendall(f"ACL SETUSER default {'+' if allow else '-'}xadd\r\n".encode())
        assert c.recv(64).startswith(b"+OK")


def test_answers_spooled_in_a_partial_outage_are_not_lost_to_a_new_lease(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    """Stream appends refused while leases are granted: each answer goes to the spool, and the
    conversation's next request passes through (labelled) instead of taking a new lease, which would
    fence the spooled answers out when they are replayed."""
    _, url = upstream
    with replicas(tmp_path, redis_server, url, 1, lease_ms=30_000) as procs:
        (_, proxy), = procs
        messages: list[dict[str, Any]] = []
        for k in range(3):
            turn(proxy, messages, f"turn {k}")
        _acl_xadd(redis_server, allow=False)
        for k in range(3, 6):
            resp = turn(proxy, messages, f"turn {k}")
            if k > 3:  # the first one's answer went to the spool; the ones after it wait behind it
                assert any("spool" in w for w in resp.headers.get_list(WARNING_HEADER)), resp.headers
        _acl_xadd(redis_server, allow=True)
        deadline = time.monotonic() + 20
        while (health := httpx.get(proxy + "/health", timeout=30)).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.2)
        assert health.json()["spool"] == {"pending_batches": 0, "refused_batches": 0, "unreadable_files": []}
        for k in range(6, 9):
            resp = turn(proxy, messages, f"turn {k}")
            assert not resp.headers.get_list(WARNING_HEADER), resp.headers
        assert list(stored(redis_server).values()) == [as_pairs(messages)]
        assert metric(httpx.get(proxy + "/metrics", timeout=30).text, "ctxfold_store_spool_refused_batches") == 0
        spool = tmp_path / "replica0" / "spool" / "main"
        assert not [p.name for p in spool.iterdir()], "nothing refused, nothing left behind"


def test_workers_share_the_store(tmp_path: Path, redis_server: RedisServer,
                                 upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    env = ctxfold_env(CTXFOLD_TENANT_KEY=TENANT_KEY)
    with subprocess.Popen(
            [sys.executable, "-m", "ctxfold", "serve", "--upstream", url, "--store", redis_server.url, "--data-dir",
             str(tmp_path / "data"), "--port", "0", "--context-tokens", "3000", "--template", "none", "--tokenizer",
             "chars4", "--fsync", "never", "--workers", "3"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env) as proc:
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert "listening on " in line, line
            base = line.split("listening on ", 1)[1].split(" ", 1)[0].rstrip(",")
            messages: list[dict[str, Any]] = []
            for k in range(10):  # each request on a connection of its own: the kernel picks the worker
                turn(base, messages, f"turn {k}")
            assert any(has_summary(b) for b in up.received)
            assert list(stored(redis_server).values()) == [as_pairs(messages)]
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


# -- routing through the store, in-process replicas --------------------------------------------------------

@contextmanager
def two_apps(tmp_path: Path, redis: RedisServer, upstream_url: str,
             **kw: Any) -> Iterator[list[tuple[ProxyApp, str]]]:
    """Two proxies in this process (each its own event loop and thread), sharing one Redis."""
    with started_proxies(upstream_url, tmp_path, 2, store_url=redis.url, lease_ms=2000,
                         tenant_key_file=_key_file(tmp_path), **kw) as out:
        yield out


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenant.key"
    if not path.exists():
        path.write_text(TENANT_KEY)
    return path


def _settled(app: ProxyApp) -> None:
    deadline = time.monotonic() + 10
    while app.sessions.num_locked:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_edited_request_forks_through_the_store_on_another_replica(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    with two_apps(tmp_path, redis_server, url, compact=CompactConfig(context_tokens=3000)) as apps:
        messages: list[dict[str, Any]] = []
        for k in range(10):
            turn(apps[k % 2][1], messages, f"turn {k}")
            _settled(apps[k % 2][0])
        assert any(has_summary(b) for b in up.received)
        parent_sent = up.received[-1]["messages"]
        assert has_summary(up.received[-1])
        # The last user message edited, sent to the other replica: a fork at the common prefix.
        edited = [*messages[:-2], {"role": "user", "content": f"turn 9 (edited) {FILLER}"}]
        resp = ask(apps[0][1], edited)
        assert resp.status_code == 200, resp.text
        fork_sent = up.received[-1]["messages"]
        assert fork_sent[:-1] == parent_sent[:-1]  # the parent's compacted view, its summary included
        assert fork_sent[-1]["content"].startswith("turn 9 (edited)")
        _settled(apps[0][0])
        assert apps[0][0].sessions.num_forks == 1
        edited.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
        assert sorted(stored(redis_server).values()) == sorted([as_pairs(messages), as_pairs(edited)])
        # Each goes on, on either replica.
        turn(apps[1][1], edited, "after the fork")
        turn(apps[0][1], messages, "after the parent")
        assert sorted(stored(redis_server).values()) == sorted([as_pairs(messages), as_pairs(edited)])


def test_a_retry_on_another_replica_continues_the_session(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    with two_apps(tmp_path, redis_server, url) as apps:
        messages: list[dict[str, Any]] = []
        turn(apps[0][1], messages, "first")
        request = [*messages, {"role": "user", "content": "second"}]
        answer = ask(apps[1][1], request).json()["choices"][0]["message"]["content"]
        first_sent = up.received[-1]["messages"]
        for k in range(4):  # the same request again, on both replicas: nothing recorded twice
            _settled(apps[k % 2][0])
            resp = ask(apps[k % 2][1], request)
            assert resp.status_code == 200
            assert up.received[-1]["messages"] == first_sent
        messages = [*request, {"role": "assistant", "content": answer}]
        assert list(stored(redis_server).values()) == [as_pairs(messages)]


def test_a_corrupt_stored_session_is_set_aside_and_the_conversation_continues(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    import redis as redis_py

    _, url = upstream
    with two_apps(tmp_path, redis_server, url) as apps:
        messages: list[dict[str, Any]] = []
        turn(apps[0][1], messages, "first")
        (sid,) = stored(redis_server)
        client = redis_py.Redis.from_url(redis_server.url)
        try:  # a record no reader knows, after the good ones
            n = int(client.get(f"ctxfold:{{{sid}}}:next") or 0)
            client.xadd(f"ctxfold:{{{sid}}}:ev", {"e": b'{"seq": %d, "type": "bogus"}' % n}, id=f"0-{n + 1}")
            client.set(f"ctxfold:{{{sid}}}:next", n + 1)
        finally:
            client.close()
        resp = turn(apps[1][1], messages, "second")
        assert any("set aside" in w for w in resp.headers.get_list(WARNING_HEADER))
        assert apps[1][0].sessions.num_quarantined == 1
        turn(apps[0][1], messages, "third")
        turn(apps[1][1], messages, "fourth")
        sessions = stored_or_none(redis_server)
        assert sessions[sid] is None and [v for k, v in sessions.items() if k != sid] == [as_pairs(messages)]


def stored_or_none(redis: RedisServer) -> dict[str, list[tuple[str, str]] | None]:
    async def ids() -> list[str]:
        store = RedisStore(redis.url)
        try:
            return await store.sessions()
        finally:
            await store.close()

    out: dict[str, list[tuple[str, str]] | None] = {}
    for sid in asyncio.run(ids()):
        try:
            out[sid] = [(m.role.value, m.text) for m in restore_from_store(redis.url, sid).messages]
        except FormatError:
            out[sid] = None
    return out


def test_a_store_url_must_name_a_shared_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "serve", "--upstream", "http://127.0.0.1:1", "--store", str(tmp_path),
                            "--data-dir", str(tmp_path / "d"))
    assert code == 2
    assert "argument --store: " in err and "is not a redis://, rediss://, unix:// or valkey:// URL" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="store_url: .* is not a redis://"):
        ProxyConfig(upstream="http://127.0.0.1:9/v1", data_dir=tmp_path, store_url=str(tmp_path))
    with pytest.raises(ConfigError, match="lease_ms"):
        ProxyConfig(upstream="http://127.0.0.1:9/v1", data_dir=tmp_path, store_url="redis://127.0.0.1:1/0", lease_ms=5)


def test_an_unreachable_store_passes_requests_through_and_health_says_why(
        tmp_path: Path, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, srv = start_proxy(url, tmp_path / "data", store_url=f"redis://127.0.0.1:{port}/0?socket_connect_timeout=0.5",
                           tenant_key_file=_key_file(tmp_path))
    try:
        messages: list[dict[str, Any]] = []
        resp = turn(srv.url, messages, "first")
        assert any(w.startswith("not compacted: the session store failed") for w in resp.headers.get_list(WARNING_HEADER))
        assert up.received[-1]["messages"] == messages[:-1]  # the client's own request, as it sent it
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503 and "session store is unreachable" in health.json()["reason"]
        assert metric(httpx.get(srv.url + "/metrics").text, "ctxfold_bad_requests_total", reason="store_unavailable") == 1
    finally:
        srv.close()


def test_read_archive_is_answered_from_the_store_on_any_replica(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    with two_apps(tmp_path, redis_server, url) as apps:
        start = [{"role": "user", "content": "shared start"}]
        assert ask(apps[0][1], start).status_code == 200
        (sid,) = stored(redis_server)
        text = "archived by replica a\n" * 20
        aid = hashlib.sha256(text.encode()).hexdigest()

        async def put() -> None:  # what replica A's archive pass commits: a blob of the conversation's
            store = RedisStore(redis_server.url)  # archive (no credential: the conversation's own, not the key's)
            try:
                await store.put_blob(sid + "/archive", f"archive/{aid}.txt", text.encode())
            finally:
                await store.close()

        asyncio.run(put())
        call = {"id": "c9", "type": "function", "function": {"name": "read_archive", "arguments": json.dumps({"id": aid})}}
        answers = iter([{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "assistant", "content": "done"}])
        up.answer_for = lambda body: next(answers)  # type: ignore[method-assign]
        body = {"model": "m", "messages": [*start, {"role": "assistant", "content": "echo: shared start"},
                                           {"role": "user", "content": "recall it"}],
                "tools": [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]}
        resp = httpx.post(apps[1][1] + "/v1/chat/completions", json=body, timeout=30)
        assert resp.json()["choices"][0]["message"]["content"] == "done"
        assert up.received[-1]["messages"][-1]["content"].startswith(f"[read_archive id={aid} chars 0-440 of 440")


def test_an_output_archived_by_one_replica_is_recalled_through_the_other(
        tmp_path: Path, redis_server: RedisServer, upstream: tuple[ScriptedUpstream, str]) -> None:
    up, url = upstream
    compact = CompactConfig.from_mapping({"minor": {"keep_recent_user_turns": 1, "archive_threshold": 100}})
    big = "output line that is long enough to archive\n" * 50
    with two_apps(tmp_path, redis_server, url, compact=compact) as apps:
        (a, url_a), (_, url_b) = apps
        history: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        assert ask(url_a, history).status_code == 200
        history += [{"role": "assistant", "content": "echo: start"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "t0", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "t0", "content": big}]
        assert ask(url_b, history).status_code == 200
        history += [{"role": "assistant", "content": "echo: start"}, {"role": "user", "content": "next"}]
        assert ask(url_a, history).status_code == 200
        assert _compactions(a) == 1  # the archive pass, on replica A
        history += [{"role": "assistant", "content": "echo: next"}, {"role": "user", "content": "more"}]
        assert ask(url_b, history).status_code == 200
        marker = up.received[-1]["messages"][3]["content"]
        assert marker.startswith("[ctxfold archived")  # B continued A's compacted view
        aid = hashlib.sha256(big.encode()).hexdigest()
        assert aid in marker
        call = {"id": "c9", "type": "function", "function": {"name": "read_archive", "arguments": json.dumps({"id": aid})}}
        answers = iter([{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "assistant", "content": "done"}])
        up.answer_for = lambda body: next(answers)  # type: ignore[method-assign]
        history += [{"role": "assistant", "content": "echo: more"}, {"role": "user", "content": "recall it"}]
        assert ask(url_b, history).json()["choices"][0]["message"]["content"] == "done"
        assert big[:200] in up.received[-1]["messages"][-1]["content"]
        history.append({"role": "assistant", "content": "done"})
        restored = restore_from_store(redis_server.url, next(iter(stored_or_none(redis_server))))
        assert [m.text for m in restored.messages] == [m["content"] or "" for m in history]


def _compactions(app: ProxyApp) -> float:
    return sum(app.metrics.compactions.values.values())
