"""Redis memory with and without per-tenant quotas and expiry: the case of the issue (one anonymous client
opening 150 conversations of about 28 kB each), then another tenant's conversation.

    PYTHONPATH=python python bench/quota_memory.py [--conversations 150] [--max-sessions 20]

Starts its own redis-server (AOF off: memory is measured, not durability) and the scripted upstream, and
runs the proxy in this process four ways: no bound (the old behaviour), ``max_sessions_per_tenant``,
``max_tenant_bytes`` and ``session_ttl_s`` (after the conversations, waits until they expired). Prints what
Redis's keys take before and after, the sessions stored and the requests refused.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ctxfold.compaction.config import CompactConfig
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from helpers.proxy_helpers import start_proxy

TEXT = "the tool printed this line of output, and more of the same " * 20  # ~1.2 kB a message


def redis_server(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def keys_memory(url: str) -> int:
    """What Redis's keys take, added up key by key (``MEMORY USAGE ... SAMPLES 0``, exact). Not
    ``used_memory``: that moves by hundreds of kB with the run's connections and the Lua VM's garbage
    (more script calls when requests are refused), whatever is stored."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return sum(int(client.memory_usage(k, samples=0) or 0) for k in client.scan_iter("*"))
    finally:
        client.close()


def conversation(url: str, k: int, key: str | None, turns: int = 10) -> tuple[int, int]:
    """One conversation of ``turns`` requests; returns (requests refused for a quota, requests)."""
    messages: list[dict[str, Any]] = []
    refused = 0
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {k} turn {t}: {TEXT}"})
        resp = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages},
                          headers=headers, timeout=60)
        resp.raise_for_status()
        refused += any("bound" in w for w in resp.headers.get_list("X-Ctxfold-Warning"))
        messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
    return refused, turns


def run(name: str, upstream: str, conversations: int, folder: Path, **kw: Any) -> None:
    proc, url = redis_server(folder)
    try:
        before = keys_memory(url)
        _app, srv = start_proxy(upstream, folder / f"data-{name}", store_url=url, lease_ms=1000,
                               compact=CompactConfig(context_tokens=None), **kw)
        try:
            refused = requests = 0
            for k in range(conversations):
                r, n = conversation(srv.url, k, None)
                refused, requests = refused + r, requests + n
            other = conversation(srv.url, 0, "another-tenant")
            after = keys_memory(url)
            import redis

            client = redis.Redis.from_url(url)
            stored = sum(1 for _ in client.scan_iter("*:next"))
            line = (f"{name:>22}: {conversations} conversations, {requests} requests, {refused} refused; "
                    f"{stored} sessions in Redis; keys' memory {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB "
                    f"(+{(after - before) / 1e6:.2f}); the other tenant refused {other[0]} of {other[1]}")
            ttl = kw.get("session_ttl_s")
            if ttl:
                deadline = time.monotonic() + 10 * ttl + 30
                while any(True for _ in client.scan_iter("*:next")) and time.monotonic() < deadline:
                    time.sleep(0.2)
                time.sleep(2 * max(0.5, ttl / 4))  # a sweep after the last expiry
                line += f"; after expiry {keys_memory(url) / 1e6:.2f} MB, keys left {client.dbsize()}"
            client.close()
            print(line, flush=True)
        finally:
            srv.close()
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=150)
    p.add_argument("--max-sessions", type=int, default=20)
    p.add_argument("--ttl-s", type=float, default=5.0)
    args = p.parse_args()
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as srv, tempfile.TemporaryDirectory() as tmp:
        upstream = srv.url + "/v1"
        run("no bound", upstream, args.conversations, Path(tmp))
        run(f"max {args.max_sessions} sessions", upstream, args.conversations, Path(tmp),
            max_sessions_per_tenant=args.max_sessions)
        run(f"max {args.max_sessions * 28} kB", upstream, args.conversations, Path(tmp),
            max_tenant_bytes=args.max_sessions * 28_000)
        run(f"ttl {args.ttl_s:g} s", upstream, args.conversations, Path(tmp), session_ttl_s=args.ttl_s)


if __name__ == "__main__":
    main()
