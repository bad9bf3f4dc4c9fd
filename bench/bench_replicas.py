"""Proxy replicas sharing one Redis: no request lost or mixed up, restores exact, compactions seen by all,
and the latency a shared store adds per request when nothing fires.

Processes on loopback: a redis-server (AOF on, ``appendfsync always``), ``ctxfold serve --store
redis://...`` replicas, and this script, the load generator.

1. **Replicas** (2, then 3 proxy processes; the scripted upstream runs in this process so that what each
   replica sent upstream can be checked): ``--conversations`` conversations over ``--tenants`` tenants
   (the credential in ``Authorization``; conversations of different tenants open with the same system
   prompt and first message, so only the tenant keeps them apart), all at once, each a closed loop of
   ``--turns`` requests sent to the replicas round-robin (request k of conversation c to replica
   (c + k) mod n), within ``--time-limit-s``. Checked: every answer is its own request's (the upstream
   echoes the request's tag); no request answered with an error or a warning; every session restored
   from Redis is exactly one conversation as its client holds it, under its own tenant; compactions
   happen, and every replica sends on compacted views that another replica compacted (a request after
   one that went out compacted goes out compacted too, whichever replica serves it).
2. **Latency** with nothing firing (a 128k window), one request at a time, in alternating slices within
   one run: straight at the upstream (the baseline), through a bare pass-through proxy
   (``bench/passthrough.py``), through ``ctxfold serve`` on a local data directory, and through
   ``ctxfold serve --store`` on Redis with ``appendfsync always`` and with ``everysec``. Medians and p99
   in ms, and each side's added median and p99 (minus the baseline's).

Prints one JSON object. Run: ``PYTHONPATH=python python bench/bench_replicas.py [--replicas 2 3]
[--conversations 64] [--tenants 8] [--turns 10] [--latency-s 3]``. Needs redis-server on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench_serve import interleaved, start

FILLER = "lorem ipsum dolor sit amet " * 16  # ~110 tokens by chars4: a compaction every few turns at 2500
SUMMARY_MARK = "Goals: finish the user's task"  # the scripted upstream's summary
TENANT_KEY = "bench-replicas-tenant-key-0123456789"


class Redis:
    """A redis-server on a free loopback port, AOF on with the given fsync policy, no snapshots."""

    def __init__(self, folder: Path, appendfsync: str = "always") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("bench_replicas: redis-server is not on PATH (Debian: apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", appendfsync, "--dir", str(folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def commands(self) -> dict[str, int]:
        """Calls so far, by command (INFO commandstats; scripts count as evalsha)."""
        import redis

        client = redis.Redis(port=self.port)
        try:
            return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}
        finally:
            client.close()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def start_proxy(args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    return start([sys.executable, "-m", "ctxfold", "serve", "--port", "0", *args], marker="listening on ",
                 stream="stderr", extra_env={"CTXFOLD_TENANT_KEY": TENANT_KEY})


# -- 1. replicas ------------------------------------------------------------------------------------------

async def drive(urls: list[str], conversations: int, tenants: int, turns: int, time_limit_s: float
                ) -> dict[str, Any]:
    """Every conversation at once, each request of one to the next replica; what each got back."""
    out: dict[str, Any] = {"errors": [], "mismatches": [], "warnings": [], "requests": 0, "sent": {},
                           "transcripts": {}}
    stop_at = time.monotonic() + time_limit_s

    async def one(session: aiohttp.ClientSession, c: int) -> None:
        tenant = f"tenant-{c % tenants}"
        system = f"You are agent {c // tenants}."  # the same opening in every tenant
        messages: list[dict[str, Any]] = []
        for k in range(turns):
            if time.monotonic() > stop_at:
                break
            tag = f"conv={c} req={k}" if k else f"hello agent {c // tenants}"
            messages.append({"role": "user", "content": f"{tag} {FILLER}"})
            replica = (c + k) % len(urls)
            out["sent"][tag if k else f"{tag} {tenant}"] = (c, k, replica)
            body = {"model": "bench", "messages": [{"role": "system", "content": system}, *messages]}
            try:
                async with session.post(urls[replica] + "/v1/chat/completions", json=body,
                                        headers={"Authorization": f"Bearer {tenant}"}) as r:
                    raw = await r.read()
                    status = r.status
                    warnings = r.headers.getall("X-Ctxfold-Warning", [])
            except aiohttp.ClientError as e:
                out["errors"].append(f"{tag}: {e}")
                return
            out["requests"] += 1
            if status != 200:
                out["errors"].append(f"{tag}: HTTP {status} {raw[:200]!r}")
                return
            if warnings:
                out["warnings"].append(f"{tag}: {warnings}")
            text = json.loads(raw)["choices"][0]["message"]["content"]
            if not text.startswith(f"echo: {tag} "):
                out["mismatches"].append(f"sent {tag!r}, got {text[:60]!r}")
                return
            messages.append({"role": "assistant", "content": text})
        out["transcripts"][c] = (tenant, system, [(m["role"], m["content"]) for m in messages])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(one(session, c) for c in range(conversations)))
    return out


def compacted(body: dict[str, Any]) -> bool:
    return any(SUMMARY_MARK in str(m.get("content")) or "[ctxfold compacted" in str(m.get("content"))
               for m in body["messages"][:-1])


def handoffs(received: list[dict[str, Any]], sent: dict[str, tuple[int, int, int]], replicas: int) -> dict[str, Any]:
    """Per replica, requests that went out compacted right after the conversation's previous request
    (served by another replica) did; and requests that went out uncompacted after one that did not
    (a replica that missed another's compaction)."""
    state: dict[tuple[int, int], bool] = {}
    for body in received:
        last = str(body["messages"][-1].get("content"))
        if last.startswith("Internal context compaction"):
            continue
        tag = last.split(" lorem", 1)[0]
        if tag not in sent:  # a first request: only its tenant tells it apart, and nothing is compacted yet
            continue
        c, k, _ = sent[tag]
        state[(c, k)] = compacted(body)
    seen = [0] * replicas
    missed = []
    for (c, k), now in state.items():
        before = state.get((c, k - 1))
        if before:
            replica = sent[f"conv={c} req={k}"][2]
            if now:
                seen[replica] += 1
            else:
                missed.append(f"conv={c} req={k}")
    return {"compacted_requests": sum(state.values()), "continued_by_replica": seen, "missed": missed[:5],
            "num_missed": len(missed)}


async def stored_sessions(url: str) -> dict[str, Any]:
    from ctxfold.compaction.store import restore_async
    from ctxfold.compaction.store.redis_store import RedisStore

    store = RedisStore(url)
    try:
        out = {}
        for sid in await store.sessions():
            conv = await restore_async(store, sid)
            out[sid] = (conv.system, [(m.role.value, m.text) for m in conv.messages])
        return out
    finally:
        await store.close()


def restores(url: str, transcripts: dict[int, tuple[str, str, list[tuple[str, str]]]]) -> dict[str, Any]:
    """Every stored session restored, matched with the conversations as their clients hold them."""
    from ctxfold.serve.keys import tenant_of

    found = asyncio.run(stored_sessions(url))
    want: dict[str, list[tuple[str | None, list[tuple[str, str]]]]] = {}
    for tenant, system, messages in transcripts.values():
        scope = f"tenants/{tenant_of(TENANT_KEY.encode(), f'Bearer {tenant}')}"
        want.setdefault(scope, []).append((system, messages))
    got: dict[str, list[tuple[str | None, list[tuple[str, str]]]]] = {}
    for sid, restored in found.items():
        got.setdefault("/".join(sid.split("/")[:2]), []).append(restored)
    exact = all(sorted(got.get(scope, [])) == sorted(convs) for scope, convs in want.items()) and set(got) == set(want)
    return {"sessions": len(found), "conversations": len(transcripts), "tenants": len(want), "exact": exact}


def run_replicas(n: int, redis: Redis, db: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream

    up = ScriptedUpstream(keep_requests=1_000_000)
    with BackgroundServer(up.app()) as srv:
        procs = []
        # Replicas are checked on compactions they see of each other's: every due summary runs (the
        # minimum-gain rule, which may put one off while the next request fits, is off here).
        config = tmp / "compact.toml"
        config.write_text("[agent.compact.cost]\nmin_gain = false\n")
        try:
            for i in range(n):
                procs.append(start_proxy(
                    ["--upstream", srv.url + "/v1", "--store", redis.url(db), "--data-dir", str(tmp / f"r{n}-{i}"),
                     "--context-tokens", str(args.context_tokens), "--tokenizer", "chars4", "--template", "none",
                     "--fsync", "never", "--config", str(config)]))
            urls = [u for _, u in procs]
            t0 = time.monotonic()
            out = asyncio.run(drive(urls, args.conversations, args.tenants, args.turns, args.time_limit_s))
            elapsed = time.monotonic() - t0
            compactions = [_metric(u, "ctxfold_compactions_total{") for u in urls]
        finally:
            for p, _ in procs:
                p.terminate()
            for p, _ in procs:
                p.wait(30)
        received = list(up.received)
    return {
        "replicas": n, "requests": out["requests"], "seconds": round(elapsed, 2), "errors": len(out["errors"]),
        "mismatches": len(out["mismatches"]), "warnings": len(out["warnings"]),
        "first_problems": (out["errors"] + out["mismatches"] + out["warnings"])[:5],
        "compactions_by_replica": compactions, **handoffs(received, out["sent"], n),
        "restore": restores(redis.url(db), out["transcripts"]),
    }


def _metric(url: str, prefix: str) -> int:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(prefix))


# -- 2. latency ---------------------------------------------------------------------------------------------

def run_latency(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[Redis] = []
    try:
        up, up_url = start([sys.executable, "-m", "ctxfold.serve.testing", "--port", "0"], marker="listening on ")
        procs.append(up)
        bare, bare_url = start([sys.executable, str(Path(__file__).with_name("passthrough.py")), "--upstream", up_url],
                               marker="listening on ")
        procs.append(bare)
        common = ["--upstream", up_url, "--summarizer", "extractive", "--context-tokens", "131072"]
        local, local_url = start_proxy([*common, "--data-dir", str(tmp / "local")])
        procs.append(local)
        urls = {"direct": f"{up_url}/v1/chat/completions", "passthrough": f"{bare_url}/v1/chat/completions",
                "local": f"{local_url}/v1/chat/completions"}
        for policy in ("always", "everysec"):
            redis = Redis(tmp / f"redis-{policy}", policy)
            servers.append(redis)
            proxy, url = start_proxy([*common, "--data-dir", str(tmp / f"store-{policy}"), "--store",
                                      redis.url() + ("?durability=everysec" if policy == "everysec" else "")])
            procs.append(proxy)
            urls[f"redis_{policy}"] = f"{url}/v1/chat/completions"
        before = [r.commands() for r in servers]
        result = interleaved(urls, 1, args.latency_s, False, args.slice_s)
        for policy, r, calls0 in zip(("always", "everysec"), servers, before, strict=True):
            side = result[f"redis_{policy}"]
            n = max(1, side["requests"] + 4)  # and the warm-up requests
            side["redis_calls_per_request"] = {k: round((v - calls0.get(k, 0)) / n, 2)
                                               for k, v in sorted(r.commands().items()) if v > calls0.get(k, 0)}
        result["compactions"] = sum(_metric(u.removesuffix("/v1/chat/completions"), "ctxfold_compactions_total{")
                                    for k, u in urls.items() if k not in ("direct", "passthrough"))
        return result
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(10)
        for r in servers:
            r.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--replicas", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--context-tokens", type=int, default=2500)
    ap.add_argument("--time-limit-s", type=float, default=90.0, help="no new request after this (per run)")
    ap.add_argument("--latency-s", type=float, default=3.0, help="each side's time in the latency run (0: none)")
    ap.add_argument("--slice-s", type=float, default=0.5)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ctxfold-bench-replicas-"))
    result: dict[str, Any] = {"conversations": args.conversations, "tenants": args.tenants, "turns": args.turns}
    try:
        redis = Redis(tmp / "redis")
        try:
            result["runs"] = [run_replicas(n, redis, db, args, tmp) for db, n in enumerate(args.replicas)]
        finally:
            redis.stop()
        if args.latency_s > 0:
            result["latency"] = run_latency(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    ok = all(r["errors"] == r["mismatches"] == r["warnings"] == r["num_missed"] == 0 and r["restore"]["exact"]
             and r["compacted_requests"] > 0 and all(r["continued_by_replica"]) for r in result["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
