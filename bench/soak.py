"""Soak test of ``ctxfold serve``: careless clients, a faulty upstream and a killed proxy, together.

Three processes on loopback: the scripted upstream (``python -m ctxfold.serve.testing``: slow at
random, 500s, 429s, streams cut part-way; every answer the echo of the last user message followed
by a digest of the whole history it received), the proxy (``python -m ctxfold serve``, with low
``--max-loaded-sessions`` and ``--max-connections`` so that both bounds are reached), and this
script, the load generator: ``--conversations`` conversations across ``--tenants`` tenants
(distinct ``Authorization`` headers; conversation k of every tenant opens with the same system
prompt and first message, and a quarter name themselves with the same ``X-Ctxfold-Session``
values in every tenant), each a closed loop of requests carrying the whole history, streaming or
not, with a pause between turns (with ``--max-turns``, a conversation that reaches that many turns
ends and a new one, with an opening of its own, takes its place). At random, a turn

- re-sends a request already answered (a retry, "regenerate"),
- sends the same request twice at once (a duplicate),
- or reads the first bytes of a stream and disconnects;

and every failed request (a 500, a 429, a cut stream, a 503 for too many connections, the proxy
down) is sent again until it is answered. Halfway, the proxy is killed with SIGKILL and started
again on the same port and data directory; no conversation ends before it is back.

Checked, each a line in ``problems`` when it fails:
- no request lost: every conversation reaches its last turn before ``--deadline-s``;
- no answer from another conversation's or tenant's state: every answer is the echo of the
  request's own last message and the digest of exactly the history the conversation sent;
- bounds: the proxy's open file descriptors (sampled from /proc) stay within its base plus two per
  allowed connection (the client's and the upstream's) plus one per loaded session; its resident
  memory stays within its size at startup plus ``--rss-allowance-mb``; ``sessions_loaded`` in
  /health stays within ``--max-loaded-sessions``;
- every restore exact: after the run, each conversation's key directory (found through the data
  directory's layout: ``tenants/<HMAC of the header>/sessions/<key>/``) holds one session, and its
  restore is the messages the generator sent and received, in order (``ctxfold restore`` run on a
  sample of them, the rest through the same code in this process).

Prints one JSON object (counts, samples, ``problems``); exits 1 when there is a problem.

Run: ``PYTHONPATH=python python bench/soak.py [--duration-s 60] [--conversations 64] [--tenants 8]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp

import ctxfold

REPO = Path(__file__).resolve().parent.parent
FD_SLACK = 24  # descriptors beyond the computed bound: the event loop's, a health probe, a summary's


def child_env() -> dict[str, str]:
    """The children run the ctxfold this script imports (installed, or the tree on PYTHONPATH)."""
    return dict(os.environ, PYTHONPATH=str(Path(ctxfold.__file__).resolve().parent.parent))


def wait_for_line(proc: subprocess.Popen[str], marker: str, pipe_name: str, timeout_s: float = 60.0) -> str:
    pipe = proc.stdout if pipe_name == "stdout" else proc.stderr
    assert pipe is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = pipe.readline()
        if not line:
            break
        if marker in line:
            return line.split(marker, 1)[1].split()[0].rstrip(",")
    proc.kill()
    raise RuntimeError(f"{proc.args!r} did not start: {pipe.read()}")


def drain(proc: subprocess.Popen[str], pipe_name: str, into: list[str]) -> threading.Thread:
    """Read a child's pipe to its end (so the child never blocks on a full pipe), keeping the last lines."""
    pipe = proc.stdout if pipe_name == "stdout" else proc.stderr
    assert pipe is not None

    def run() -> None:
        for line in pipe:
            into.append(line.rstrip())
            del into[:-200]

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def history_digest(messages: list[dict[str, Any]]) -> str:
    from ctxfold.serve.testing import history_digest as digest

    return digest(messages)


@dataclass
class Conversation:
    """One conversation as its client sees it."""

    tenant: int
    index: int  # within the tenant: conversation k opens alike in every tenant
    stream: bool
    session_header: str | None
    messages: list[dict[str, Any]]
    turns_done: int = 0
    finished: bool = False
    generation: int = 0  # with --max-turns: the conversations this slot ended before this one
    # Ended (--max-turns) before the proxy was killed: the kill may have come between its last answer
    # and the proxy's recording of it, and no later request carries that answer again.
    ended_before_kill: bool = False

    @property
    def name(self) -> str:
        return f"t{self.tenant}c{self.index}" + (f"g{self.generation}" if self.generation else "")

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Authorization": f"Bearer sk-soak-tenant-{self.tenant}"}
        if self.session_header is not None:
            h["X-Ctxfold-Session"] = self.session_header
        return h


@dataclass
class Stats:
    requests: int = 0
    answered: int = 0
    retried: dict[str, int] = field(default_factory=dict)  # why a request was sent again
    resends: int = 0  # answered requests sent again on purpose
    duplicates: int = 0  # requests sent twice at once
    disconnects: int = 0  # streams the client left mid-way
    compacted_answers: int = 0  # answers to a compacted history (with --context-tokens)
    # Conversations ended before the kill whose restore lacks their last answer (see Conversation).
    unrecorded_last_answers: int = 0
    problems: list[str] = field(default_factory=list)

    def retry(self, why: str) -> None:
        self.retried[why] = self.retried.get(why, 0) + 1

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


class Proxy:
    """``ctxfold serve`` as a subprocess on a fixed port, which can be killed and started again."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.log: list[str] = []
        self.pids: list[int] = []
        self.at_start: dict[int, tuple[int, int]] = {}  # pid -> (descriptors, resident bytes) once it listens

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=child_env())
        self.url = wait_for_line(self.proc, "listening on ", "stderr")
        self.pids.append(self.proc.pid)
        self.at_start[self.proc.pid] = (fd_count(self.proc.pid) or 0, rss_bytes(self.proc.pid) or 0)
        drain(self.proc, "stderr", self.log)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def answer_text(raw: bytes, stream: bool) -> str | None:
    """The answer's content, or None when it is not a whole answer (a cut stream, an error event)."""
    if not stream:
        try:
            return str(json.loads(raw)["choices"][0]["message"]["content"])
        except (ValueError, KeyError, IndexError, TypeError):
            return None
    text: list[str] = []
    done = False
    for event in raw.decode("utf-8", "replace").split("\n\n"):
        if event == "data: [DONE]":
            done = True
        elif event.startswith("data: {"):
            chunk = json.loads(event[6:])
            if "error" in chunk:
                return None
            text.append(((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content") or "")
    return "".join(text) if done else None


class Generator:
    def __init__(self, args: argparse.Namespace, proxy: Proxy, stats: Stats) -> None:
        self.args = args
        self.proxy = proxy
        self.stats = stats
        self.restarted = asyncio.Event()
        self.convs = [self.opening(t, k, 0) for t in range(args.tenants) for k in range(args.conversations // args.tenants)]
        self.ended: list[Conversation] = []  # conversations that reached --max-turns (their slot went on anew)

    @staticmethod
    def opening(tenant: int, k: int, generation: int) -> Conversation:
        # Every tenant's conversation k opens with the same system prompt and first message, and the
        # same session header: only the credential tells them apart.
        again = f" (task {generation + 1})" if generation else ""
        system = f"You are soak agent {k}{again}. Keep answers short. " + "Policy line. " * 20
        header = f"soak-conversation-{k}" + (f"-{generation}" if generation else "") if k % 4 == 3 else None
        return Conversation(tenant, k, stream=(k % 2 == 0), session_header=header, generation=generation,
                            messages=[{"role": "system", "content": system}])

    async def send(self, session: aiohttp.ClientSession, conv: Conversation, messages: list[dict[str, Any]],
                   *, disconnect: bool = False) -> str | None:
        """One attempt: the answer's text, or None (failed; the reason counted). With ``disconnect``,
        the client reads the first bytes of the answer and leaves."""
        body = {"model": "soak", "messages": messages, "stream": conv.stream}
        self.stats.requests += 1
        try:
            async with session.post(f"{self.proxy.url}/v1/chat/completions", data=json.dumps(body),
                                    headers=conv.headers()) as r:
                if disconnect:
                    await r.content.readany()
                    r.close()  # the connection goes, mid-answer
                    self.stats.disconnects += 1
                    return None
                raw = await r.read()
                if r.status != 200:
                    self.stats.retry(f"HTTP {r.status}")
                    if r.status not in (429, 500, 502, 503, 504):
                        self.stats.problem(f"{conv.name}: unexpected HTTP {r.status}: {raw[:300]!r}")
                    return None
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            self.stats.retry(type(e).__name__)
            return None
        text = answer_text(raw, conv.stream)
        if text is None:
            self.stats.retry("stream cut")
        return text

    def check(self, conv: Conversation, messages: list[dict[str, Any]], text: str) -> None:
        want = f"echo: {messages[-1]['content']} [seen {len(messages)} messages {history_digest(messages)}]"
        compacted = (f"echo: {messages[-1]['content']} [seen ", "echo: [ctxfold] ")
        if text != want and self.args.context_tokens and text.startswith(compacted):
            # Compacted: the upstream saw a summary and the tail, not the history the client sent (and
            # after a compaction under way, the proxy's notice as the last message).
            self.stats.compacted_answers += 1
            return
        if text != want:
            self.stats.problem(f"{conv.name} turn {conv.turns_done}: answer {text[:160]!r}, expected {want[:160]!r}")

    async def ask(self, session: aiohttp.ClientSession, conv: Conversation, messages: list[dict[str, Any]],
                  deadline: float) -> str | None:
        """Send until answered (every failure is retried, as an OpenAI client does), or None at the deadline."""
        backoff_s = 0.02
        while time.monotonic() < deadline:
            text = await self.send(session, conv, messages)
            if text is not None:
                self.stats.answered += 1
                self.check(conv, messages, text)
                return text
            await asyncio.sleep(backoff_s)
            backoff_s = min(1.0, backoff_s * 2)
        return None

    async def run_conversation(self, session: aiohttp.ClientSession, slot: int, deadline: float,
                               end_at: float) -> None:
        conv = self.convs[slot]
        rng = random.Random(self.args.seed * 1000 + conv.tenant * 100 + conv.index)
        await asyncio.sleep(rng.uniform(0, self.args.think_s))
        while True:
            last = conv.turns_done >= self.args.min_turns and time.monotonic() >= end_at
            if last:  # no conversation ends before the proxy was killed and is back
                await self.restarted.wait()
            r = conv.turns_done
            words = "opening" if r == 0 else f"{conv.name} turn {r}"
            content = f"task {conv.index}: {words}, answer briefly"
            messages = [*conv.messages, {"role": "user", "content": content}]
            action = rng.random()
            if action < self.args.disconnect_rate and conv.stream:
                await self.send(session, conv, messages, disconnect=True)
                await asyncio.sleep(rng.uniform(0, 0.05))
            if action > 1 - self.args.duplicate_rate:
                self.stats.duplicates += 1
                texts = await asyncio.gather(*(self.ask(session, conv, messages, deadline) for _ in range(2)))
                text = texts[0] if texts[0] is not None else texts[1]
                if texts[0] is None or texts[1] is None:
                    text = None
            else:
                text = await self.ask(session, conv, messages, deadline)
            if text is None:
                self.stats.problem(f"{conv.name}: turn {r} not answered before the deadline (request lost)")
                return
            if self.args.resend_rate > rng.random():  # the client asks again for an answer it has
                self.stats.resends += 1
                if await self.ask(session, conv, messages, deadline) is None:
                    self.stats.problem(f"{conv.name}: re-sent turn {r} not answered before the deadline")
                    return
            conv.messages = [*messages, {"role": "assistant", "content": text}]
            conv.turns_done += 1
            if last:
                conv.finished = True
                return
            if self.args.max_turns and conv.turns_done >= self.args.max_turns:
                # The task is done; the agent starts another: a new conversation in this slot (as real
                # sessions end, so the proxy's memory can reach a plateau).
                conv.finished = True
                conv.ended_before_kill = not self.restarted.is_set()
                self.ended.append(conv)
                conv = self.convs[slot] = self.opening(conv.tenant, conv.index, conv.generation + 1)
            await asyncio.sleep(rng.uniform(0.5, 1.5) * self.args.think_s)

    async def kill_and_restart(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.proxy.kill)
        await asyncio.sleep(0.3)  # requests meanwhile find the port closed: refused, retried
        await loop.run_in_executor(None, self.proxy.start)
        self.restarted.set()

    async def run(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.args.deadline_s
        end_at = t0 + self.args.duration_s
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(self.kill_and_restart(t0 + self.args.duration_s / 2),
                                 *(self.run_conversation(session, k, deadline, end_at) for k in range(len(self.convs))))


class Sampler:
    """The proxy's open descriptors, resident memory and loaded sessions, every ``interval_s``."""

    def __init__(self, proxy: Proxy, interval_s: float) -> None:
        self.proxy = proxy
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            proc = self.proxy.proc
            if proc is None or proc.poll() is not None:
                continue
            fds, rss = fd_count(proc.pid), rss_bytes(proc.pid)
            loaded = None
            with contextlib.suppress(OSError, ValueError), \
                    urllib.request.urlopen(f"{self.proxy.url}/health", timeout=5) as r:
                loaded = json.loads(r.read())["sessions_loaded"]
            if fds is not None and rss is not None:
                self.samples.append({"t": time.monotonic(), "pid": proc.pid, "fds": fds, "rss": rss,
                                     "sessions_loaded": loaded})

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def tenant_dir(data_dir: Path, tenant: int) -> Path:
    key = (data_dir / "tenant.key").read_bytes()
    credential = f"Bearer sk-soak-tenant-{tenant}"
    return data_dir / "tenants" / hmac.digest(key, credential.encode(), "sha256").hex()[:32]


def key_dir(data_dir: Path, conv: Conversation) -> Path:
    """Where the proxy keeps a conversation (docs/serve.md, *Data directory*)."""
    from ctxfold.serve.keys import fingerprint_wire, session_key

    first = conv.messages[1]
    key = session_key(conv.session_header, conv.messages[0]["content"], fingerprint_wire(first))
    return tenant_dir(data_dir, conv.tenant) / "sessions" / key


def restored(session_dir: Path, cli: bool) -> list[dict[str, Any]]:
    if cli:
        out = subprocess.run([sys.executable, "-m", "ctxfold", "restore", str(session_dir), "-o", "-", "--strict"],
                             capture_output=True, text=True, env=child_env(), timeout=120, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"ctxfold restore {session_dir}: exit {out.returncode}: {out.stderr.strip()[-300:]}")
        return list(json.loads(out.stdout)["messages"])
    from ctxfold.chat.formats import dumps
    from ctxfold.compaction.session import Session

    return list(json.loads(dumps(Session(session_dir).restore(), "openai"))["messages"])


def check_restores(data_dir: Path, convs: list[Conversation], stats: Stats, cli_sample: int,
                   forks_allowed: bool) -> tuple[int, int]:
    """Restores checked, and forks found. Without compaction, a conversation has one session, and its
    restore is what the client sent and received. With it, the answers to a duplicate or a re-sent
    request may differ (one was asked before a compaction, one after); the client keeps one and the
    proxy recorded the other, so the client's next request forks the session (docs/serve.md, *Forks*):
    then one of the key's sessions restores to the client's history."""
    checked = forks = 0
    try:
        (data_dir / "tenant.key").read_bytes()
    except OSError as e:
        stats.problem(f"no tenant key in the data directory ({e}): no tenant directory can be found")
        return 0, 0
    for n, conv in enumerate(convs):
        if len(conv.messages) < 2:  # not one turn answered (reported lost): nothing the proxy must hold
            continue
        kdir = key_dir(data_dir, conv)
        sessions = sorted(d for d in kdir.iterdir() if (d / "events.jsonl").is_file()) if kdir.is_dir() else []
        forks += max(0, len(sessions) - 1)
        if not sessions or (len(sessions) > 1 and not forks_allowed):
            stats.problem(f"{conv.name}: {len(sessions)} sessions in {kdir.relative_to(data_dir)} (expected one)")
            if not sessions:
                continue
        want_pairs = [(m["role"], m["content"]) for m in conv.messages]
        # The proxy records an answer after the client has it; its next request would bring it again.
        lacks_last_answer = want_pairs[:-1] if conv.ended_before_kill else None
        mismatches = []
        for session_dir in reversed(sessions):  # a fork is newer than its parent
            try:
                got = restored(session_dir, cli=n < cli_sample)
            except Exception as e:  # noqa: BLE001 - reported as a problem of the run
                mismatches.append(f"restore of {session_dir.name} failed: {e}")
                continue
            got_pairs = [(m.get("role"), m.get("content")) for m in got]
            if got_pairs == want_pairs:
                mismatches = []
                break
            if got_pairs == lacks_last_answer:  # killed between the answer and its recording
                stats.unrecorded_last_answers += 1
                mismatches = []
                break
            first_diff = next((i for i, (a, b) in enumerate(zip(got_pairs, want_pairs, strict=False)) if a != b),
                              min(len(got_pairs), len(want_pairs)))
            mismatches.append(f"restore of {session_dir.name} has {len(got)} messages, the client "
                              f"{len(conv.messages)}; first difference at {first_diff}: "
                              f"{got_pairs[first_diff:first_diff + 1]} vs {want_pairs[first_diff:first_diff + 1]}")
        for m in mismatches:
            stats.problem(f"{conv.name}: {m}")
        checked += 1
    # Nothing of a tenant in another's directory: every session directory is some conversation's own.
    known = {key_dir(data_dir, c) for c in convs}
    for kdir in (data_dir / "tenants").glob("*/sessions/*"):
        if kdir not in known:
            stats.problem(f"a key directory no conversation of its tenant owns: {kdir.relative_to(data_dir)}")
    return checked, forks


def bounds(samples: list[dict[str, Any]], at_start: dict[int, tuple[int, int]], args: argparse.Namespace,
           stats: Stats) -> dict[str, Any]:
    """Each proxy process's peak descriptors and memory, against its bound from its size once it listened.

    Descriptors: one per client connection and one per upstream connection (each client connection
    has at most one request in flight, and the upstream pool keeps no more idle connections than
    were ever busy at once), one event log per loaded session. Loaded sessions: the bound, plus
    the sessions of the conversations with a request under way (one per connection at most), which
    cannot be closed under it; checked exactly once the load is over."""
    report: dict[str, Any] = {}
    for pid in dict.fromkeys(s["pid"] for s in samples):
        mine = [s for s in samples if s["pid"] == pid]
        base_fds, base_rss = at_start[pid]
        fd_bound = base_fds + 2 * args.max_connections + args.max_loaded_sessions + FD_SLACK
        rss_bound = base_rss + args.rss_allowance_mb * 2**20
        peak_fds, peak_rss = max(s["fds"] for s in mine), max(s["rss"] for s in mine)
        third = max(1, len(mine) // 3)
        loaded = [s["sessions_loaded"] for s in mine if s["sessions_loaded"] is not None]
        report[str(pid)] = {"samples": len(mine), "fds_first": base_fds, "fds_peak": peak_fds, "fds_bound": fd_bound,
                            "rss_first_mb": round(base_rss / 2**20, 1), "rss_peak_mb": round(peak_rss / 2**20, 1),
                            "rss_bound_mb": round(rss_bound / 2**20, 1),
                            "rss_median_first_third_mb": round(sorted(s["rss"] for s in mine[:third])[third // 2]
                                                               / 2**20, 1),
                            "rss_median_last_third_mb": round(sorted(s["rss"] for s in mine[-third:])[third // 2]
                                                              / 2**20, 1),
                            "sessions_loaded_peak": max(loaded, default=None),
                            # (seconds since the run began, MiB), every tenth sample: growth shows as a slope
                            "rss_mb_series": [(round(s["t"] - samples[0]["t"], 1), round(s["rss"] / 2**20, 1))
                                              for s in mine[::10]]}
        if peak_fds > fd_bound:
            stats.problem(f"proxy {pid}: {peak_fds} open descriptors, over the bound {fd_bound}")
        if peak_rss > rss_bound:
            stats.problem(f"proxy {pid}: resident {peak_rss / 2**20:.0f} MiB, over the bound "
                          f"{rss_bound / 2**20:.0f} MiB")
        if loaded and max(loaded) > args.max_loaded_sessions + args.max_connections:
            stats.problem(f"proxy {pid}: {max(loaded)} sessions loaded, over --max-loaded-sessions "
                          f"{args.max_loaded_sessions} plus one per connection ({args.max_connections})")
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    up_cmd = [sys.executable, "-m", "ctxfold.serve.testing", "--port", "0", "--echo-digest",
              "--delay-max-s", str(args.upstream_delay_max_s), "--fail-rate", str(args.fail_rate),
              "--rate-limit-rate", str(args.rate_limit_rate), "--cut-rate", str(args.cut_rate),
              "--seed", str(args.seed)]
    up = subprocess.Popen(up_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    up_log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ctxfold-soak-") as tmp:
        data_dir = args.keep_data if args.keep_data is not None else Path(tmp) / "data"
        proxy: Proxy | None = None
        try:
            up_url = wait_for_line(up, "listening on ", "stdout")
            drain(up, "stderr", up_log)
            proxy = Proxy([sys.executable, "-m", "ctxfold", "serve", "--upstream", f"{up_url}/v1",
                           "--port", str(free_port()), "--data-dir", str(data_dir), "--summarizer", "extractive",
                           "--max-loaded-sessions", str(args.max_loaded_sessions),
                           "--max-connections", str(args.max_connections),
                           "--max-loaded-bytes", str(args.max_loaded_bytes), "--client-timeout-s", "10",
                           "--read-timeout-s", "30",
                           *(["--context-tokens", str(args.context_tokens), "--reply-reserve-tokens", "256"]
                             if args.context_tokens else [])])
            proxy.start()
            stats = Stats()
            gen = Generator(args, proxy, stats)
            t0 = time.monotonic()
            with Sampler(proxy, args.sample_s) as sampler:
                asyncio.run(gen.run())
            elapsed = time.monotonic() - t0
            with urllib.request.urlopen(f"{proxy.url}/health", timeout=10) as r:
                quiet_loaded = json.loads(r.read())["sessions_loaded"]
            if quiet_loaded > args.max_loaded_sessions:
                stats.problem(f"{quiet_loaded} sessions loaded once the load is over, over --max-loaded-sessions "
                              f"{args.max_loaded_sessions}")
            lost = [c.name for c in gen.convs if not c.finished]
            if lost:
                stats.problem(f"{len(lost)} conversations did not reach their end: {lost[:10]}")
            report_bounds = bounds(sampler.samples, proxy.at_start, args, stats)
            proxy.stop()
            checked, forks = check_restores(data_dir, gen.ended + gen.convs, stats, args.cli_restores,
                                            forks_allowed=bool(args.context_tokens))
        finally:
            if proxy is not None:
                proxy.stop()
            up.terminate()
            up.wait(10)
    result = {
        "conversations": len(gen.convs), "tenants": args.tenants, "seconds": round(elapsed, 1),
        "turns": sum(c.turns_done for c in gen.ended + gen.convs), "conversations_ended": len(gen.ended),
        "requests_sent": stats.requests,
        "answered": stats.answered, "retried": stats.retried, "resends": stats.resends,
        "duplicates": stats.duplicates, "compacted_answers": stats.compacted_answers, "disconnects": stats.disconnects, "restores_checked": checked, "forks": forks,
        "unrecorded_last_answers": stats.unrecorded_last_answers,
        "sessions_loaded_after": quiet_loaded,
        "proxy_pids": proxy.pids, "bounds": report_bounds, "problems": stats.problems,
        "load_average": os.getloadavg(),
    }
    if stats.problems:
        result["proxy_log_tail"] = proxy.log[-20:]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=60.0,
                    help="conversations start their last turn after this (default 60); the kill is at half")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="a turn not answered by then is lost (default: 3 x duration + 60)")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--min-turns", type=int, default=4, help="turns each conversation has at least (default 4)")
    ap.add_argument("--max-turns", type=int, default=0,
                    help="a conversation that reaches this many turns ends and a new one starts in its place "
                         "(default 0: conversations go on for the whole run)")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean pause between a conversation's turns")
    ap.add_argument("--resend-rate", type=float, default=0.1)
    ap.add_argument("--duplicate-rate", type=float, default=0.1)
    ap.add_argument("--disconnect-rate", type=float, default=0.1, help="of streaming turns")
    ap.add_argument("--fail-rate", type=float, default=0.05, help="upstream 500s")
    ap.add_argument("--rate-limit-rate", type=float, default=0.05, help="upstream 429s")
    ap.add_argument("--cut-rate", type=float, default=0.05, help="upstream streams cut")
    ap.add_argument("--upstream-delay-max-s", type=float, default=0.05)
    ap.add_argument("--max-loaded-sessions", type=int, default=16)
    ap.add_argument("--max-connections", type=int, default=24)
    ap.add_argument("--max-loaded-bytes", type=int, default=1 << 20)
    ap.add_argument("--context-tokens", type=int, default=0,
                    help="the proxy's window: small, compactions fire (answers then checked by their echo alone)")
    ap.add_argument("--rss-allowance-mb", type=float, default=64.0,
                    help="resident memory a proxy may add to its size at its first sample (default 64)")
    ap.add_argument("--sample-s", type=float, default=0.25)
    ap.add_argument("--cli-restores", type=int, default=4, help="restores checked through the ctxfold restore command")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep-data", type=Path, metavar="DIR", help="the proxy's data directory (kept; default: a "
                    "temporary one)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the result there")
    args = ap.parse_args(argv)
    if args.conversations % args.tenants:
        ap.error("--conversations must be a multiple of --tenants")
    if args.max_turns and args.max_turns <= args.min_turns:
        ap.error(f"--max-turns must be above --min-turns ({args.min_turns}): else every conversation starts anew "
                 "before it may take its last turn, and the run never ends")
    if not args.deadline_s:
        args.deadline_s = 3 * args.duration_s + 60
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n", encoding="utf-8")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
