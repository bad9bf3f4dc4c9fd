"""Load test of ``ctxfold serve``: latency the proxy adds when nothing fires, and no lost or mixed-up request.

Four processes on loopback: the scripted upstream (``python -m ctxfold.serve.testing``), the proxy
(``python -m ctxfold serve``), a bare pass-through proxy (``bench/passthrough.py``: the same aiohttp
stack forwarding bytes, nothing else: the cost of the hop itself), and this script, the load
generator. The same workload runs straight at the upstream (the baseline), through the pass-through
and through ctxfold, in alternating slices of ``--slice-s`` for ``--duration-s`` each:
``--conversations`` concurrent conversations, each a closed loop of requests that carry the whole
history so far; every request's last user message names its conversation and request number, the
upstream echoes it, and every answer is checked against what was sent. A sequential pass (one
request at a time) measures the added latency without queueing, a paced pass the same with 64
conversations that think between requests (each resumes its pause across slices: no bursts), and
a saturated pass the throughput limit.

Prints one JSON object: per phase and side, requests, errors, mismatches, median and p99 latency in
ms, the added median and p99 (minus direct), and each proxy's CPU time per request.

``--api responses`` runs the synthetic phases in OpenAI's Responses API (``/v1/responses``: the
history as ``input`` items, the system prompt as ``instructions``) on all three sides.

Run: ``PYTHONPATH=python python bench/bench_serve.py [--duration-s 3] [--conversations 64] [--stream]
[--fsync MODE] [--api chat|responses] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

import ctxfold
from ctxfold import fastjson
from synth import TRACES_DIR

REPO = Path(__file__).resolve().parent.parent
MAX_REQUESTS_PER_CONVERSATION = 40
# Large tool-like outputs in the synthetic conversations (--big-kb, --big-every): every BIG_EVERY-th
# request's user message carries BIG_KB kB of fresh text (log lines, paths, numbers: never seen before,
# so the proxy counts it cold). Set once from the command line.
BIG_KB = 0
BIG_EVERY = 10


def big_text(conv: int, req: int) -> str:
    rng = random.Random(conv * 1_000_003 + req)
    words = ["error", "warning", "src/app/models.py", "line", "assert", "def", "return", "0x7f3a", "None",
             "tests/test_api.py::test_create", "PASSED", "FAILED", "Traceback", "self", "value", "{", "}"]
    out, size = [], 0
    while size < BIG_KB * 1024:
        line = f"{rng.randrange(10**6):06d} " + " ".join(rng.choice(words) for _ in range(rng.randrange(4, 14)))
        line += f" {rng.random():.6f}\n"
        out.append(line)
        size += len(line)
    return "".join(out)
PHASES = ("sequential", "paced", "traces", "saturated")
API_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
# Replayed requests stop at this body size: about 75k tokens, well under the proxy's 128k window.
TRACE_BODY_LIMIT_BYTES = 300_000


def start(cmd: list[str], *, marker: str, stream: str = "stdout",
          extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server and wait for ``marker`` on its ``stream``. Its output goes to files (in the
    temporary directory, kept for a look after the run), as a deployment's goes to a collector that
    reads it all: a pipe nobody reads once the marker came would block its log writer, and a proxy
    whose log lines are dropped would be measured without the cost of writing them."""
    # The children run the ctxfold this script imports (installed, or the tree on PYTHONPATH).
    env = dict(os.environ, PYTHONPATH=str(Path(ctxfold.__file__).resolve().parent.parent), **(extra_env or {}))
    logs = Path(tempfile.mkdtemp(prefix="ctxfold-bench-serve-log-"))
    out, err = logs / "stdout.txt", logs / "stderr.txt"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=env)
    watched = out if stream == "stdout" else err
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        for line in watched.read_text(errors="replace").splitlines():
            if marker in line:
                return proc, line.split(marker, 1)[1].split()[0].rstrip(",")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{cmd[2:4]} did not start: {err.read_text(errors='replace')[-2000:]}")


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def new_state(conv: int, scripts: list[Script] | None = None, script: int = 0, api: str = "chat") -> dict[str, Any]:
    """A conversation: synthetic (short user questions, echoed answers) or, given ``scripts``, the
    replay of the real trace ``scripts[script % len(scripts)]``; ``api``: chat or responses (synthetic only)."""
    st: dict[str, Any] = {"conv": conv, "req": 0, "started": False, "wait_s": 0.0, "scripts": scripts,
                          "script": script, "api": api}
    if scripts is None:
        st["messages"] = [{"role": "system", "content": f"You are conversation {conv}. " + "Policy. " * 50}]
    return st


@dataclass(frozen=True)
class Script:
    """A recorded conversation as an agent sent it: for each assistant answer, the history before it."""

    name: str
    messages: list[dict[str, Any]]  # system first
    tools: list[dict[str, Any]]
    answers: list[int]  # indexes of the assistant messages, in order


def trace_scripts(max_body_bytes: int) -> list[Script]:
    """Every conversation of the real traces (TRACES_DIR), each request cut off where its body would
    pass ``max_body_bytes``: well under the proxy's window, so nothing fires."""
    from ctxfold.chat.formats import load
    from ctxfold.chat.formats.openai import dump

    scripts = []
    for path in sorted(TRACES_DIR.rglob("*")):
        if path.suffix not in (".json", ".jsonl", ".traj") or not path.is_file():
            continue
        for conv in load(path):
            d = dump(conv, api=True)
            msgs = d["messages"]
            if not msgs or msgs[0]["role"] != "system":
                msgs.insert(0, {"role": "system", "content": ""})
            answers, size = [], 0
            for i, m in enumerate(msgs):
                size += len(json.dumps(m, ensure_ascii=False).encode())
                if size > max_body_bytes:
                    break
                if m["role"] == "assistant" and i > 1:
                    answers.append(i)
            if answers:
                scripts.append(Script(f"{path.name}/{conv.id}", msgs, d.get("tools", []), answers))
    return scripts


def next_request(st: dict[str, Any], stream: bool) -> tuple[str, dict[str, Any], tuple[str, tuple[str, ...]] | str]:
    """The conversation's next request: (tag, body, what the answer must be). Synthetic: the answer
    starts with the echo of the tag. Replay: the recorded answer's text and tool-call ids."""
    scripts: list[Script] | None = st["scripts"]
    if scripts is None:
        if st["req"] == MAX_REQUESTS_PER_CONVERSATION:  # start over: agent conversations are tens of turns
            st.update(new_state(st["conv"] + 1_000_000, api=st["api"]), started=True)
        tag = f"conv={st['conv']} req={st['req']}"
        question = f"{tag} please answer briefly about item {st['req']}"
        if BIG_KB and st["req"] % BIG_EVERY == BIG_EVERY - 1:
            question += "\n" + big_text(st["conv"], st["req"])
        st["messages"].append({"role": "user", "content": question})
        if st["api"] == "responses":
            body = {"model": "bench", "instructions": st["messages"][0]["content"], "input": st["messages"][1:],
                    "stream": stream}
            return tag, body, f"echo: {tag} "
        if st["api"] == "messages":
            body = {"model": "bench", "system": st["messages"][0]["content"], "messages": st["messages"][1:],
                    "max_tokens": 256, "stream": stream}
            return tag, body, f"echo: {tag} "
        return tag, {"model": "bench", "messages": st["messages"], "stream": stream}, f"echo: {tag} "
    script = scripts[st["script"] % len(scripts)]
    if st["req"] == len(script.answers):  # the recording is over: the next one, as a new conversation
        st.update(new_state(st["conv"] + 1_000_000, scripts, st["script"] + 1), started=True)
        script = scripts[st["script"] % len(scripts)]
    i = script.answers[st["req"]]
    tag = f"conv={st['conv']} {script.name} answer {st['req']}"
    # A system prompt of its own: replays of one recording are different conversations to the proxy.
    messages = [{"role": "system", "content": f"[conversation {st['conv']}] {script.messages[0]['content']}"},
                *script.messages[1:i]]
    recorded = script.messages[i]
    answer = {"role": "assistant", "content": recorded.get("content")}
    if recorded.get("tool_calls"):
        answer["tool_calls"] = recorded["tool_calls"]
    body = {"model": "bench", "messages": messages, "stream": stream, "x_replay_answer": answer}
    if script.tools:
        body["tools"] = script.tools
    expect = (_text(recorded.get("content")), tuple(c["id"] for c in recorded.get("tool_calls") or []))
    return tag, body, expect


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def answer_of(raw: bytes, stream: bool, api: str = "chat") -> tuple[str, tuple[str, ...]]:
    """The text and tool-call ids of a chat completion (or a response, or a message), JSON or event stream."""
    if api == "messages":
        if not stream:
            blocks = json.loads(raw)["content"]
            return ("".join(b.get("text", "") for b in blocks if b["type"] == "text"),
                    tuple(b["id"] for b in blocks if b["type"] == "tool_use"))
        events = [json.loads(line.split("data: ", 1)[1]) for line in raw.decode().split("\n\n") if "data: {" in line]
        return "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"), ()
    if api == "responses":
        if not stream:
            items = json.loads(raw)["output"]
            return ("".join(p.get("text", "") for i in items if i["type"] == "message" for p in i["content"]),
                    tuple(i["call_id"] for i in items if i["type"] == "function_call"))
        events = [json.loads(line.split("data: ", 1)[1]) for line in raw.decode().split("\n\n") if "data: {" in line]
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"), ()
    if not stream:
        message = json.loads(raw)["choices"][0]["message"]
        return _text(message.get("content")), tuple(c["id"] for c in message.get("tool_calls") or [])
    text, ids = [], []
    for line in raw.decode().split("\n\n"):
        if line.startswith("data: {"):
            delta = ((json.loads(line[6:])["choices"] or [{}])[0]).get("delta", {})
            text.append(delta.get("content") or "")
            ids += [c["id"] for c in delta.get("tool_calls") or [] if c.get("id")]
    return "".join(text), tuple(ids)


async def conversation(session: aiohttp.ClientSession, url: str, st: dict[str, Any], stop_at: float, stream: bool,
                       out: dict[str, Any], think_s: float = 0.0) -> None:
    """Drive one conversation until ``stop_at``; its state carries over to the next slice."""
    rng = random.Random(st["conv"] * 7919 + st["req"])

    async def pause(wait_s: float) -> bool:
        """Wait, unless the slice ends first: then the rest of the wait opens the conversation's next
        slice. Starting every conversation at once at each slice would measure a burst of N requests."""
        if time.monotonic() + wait_s >= stop_at:
            st["wait_s"] = time.monotonic() + wait_s - stop_at
            return False
        await asyncio.sleep(wait_s)
        return True

    if think_s and not await pause(st["wait_s"] if st["started"] else rng.uniform(0, think_s)):
        st["started"] = True
        return
    st["started"] = True
    while time.monotonic() < stop_at:
        tag, body, expect = next_request(st, stream)
        # Compact UTF-8 JSON, as httpx (the OpenAI SDK's client) sends it; orjson writes it, so the load
        # generator takes less of the machine the servers it measures run on.
        data = fastjson.dumps(body, fast=True)
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
                raw = await r.read()
                status = r.status
        except aiohttp.ClientError as e:
            out["errors"].append(f"{tag}: {e}")
            return
        dt = time.perf_counter() - t0
        if status != 200:
            out["errors"].append(f"{tag}: HTTP {status} {raw[:200]!r}")
            return
        text, ids = answer_of(raw, stream, st["api"])
        if isinstance(expect, str) and not text.startswith(expect):
            out["mismatches"].append(f"sent {tag!r}, got {text[:60]!r}")
        elif isinstance(expect, tuple) and (text, ids) != expect:
            out["mismatches"].append(f"sent {tag!r}, got {text[:60]!r} {ids}")
        out["latencies"].append(dt)
        out["body_bytes"].append(len(data))
        if st["scripts"] is None:
            st["messages"].append({"role": "assistant", "content": text})  # a message item too, in responses
        st["req"] += 1
        if think_s and not await pause(rng.uniform(0.5, 1.5) * think_s):  # the agent works between model calls
            return


async def phase(url: str, states: list[dict[str, Any]], duration_s: float, stream: bool, out: dict[str, Any],
                think_s: float = 0.0) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:
        stop_at = time.monotonic() + duration_s
        await asyncio.gather(*(conversation(s, url, st, stop_at, stream, out, think_s) for st in states))


def summary(out: dict[str, Any]) -> dict[str, Any]:
    lat = out["latencies"]
    return {
        "requests": len(lat), "errors": len(out["errors"]), "mismatches": len(out["mismatches"]),
        "median_ms": statistics.median(lat) * 1e3 if lat else None, "p99_ms": percentile(lat, 0.99) * 1e3,
        "median_body_kb": statistics.median(out["body_bytes"]) / 1e3 if out["body_bytes"] else None,
        "first_problems": (out["errors"] + out["mismatches"])[:5],
    }


def interleaved(urls: dict[str, str], conversations: int, duration_s: float, stream: bool, slice_s: float,
                think_s: float = 0.0, first_conv: int = 0, scripts: list[Script] | None = None,
                api: str = "chat") -> dict[str, Any]:
    """The same load against each of ``urls`` (name -> URL; the first is the baseline) in alternating
    slices, so all see the same machine (other processes come and go); each side's conversations carry
    on from slice to slice. Adds to each later side its median and p99 minus the baseline's."""
    sides = []
    for k, (name, url) in enumerate(urls.items()):
        out: dict[str, Any] = {"latencies": [], "errors": [], "mismatches": [], "body_bytes": []}
        sides.append((name, url, out, [new_state(first_conv + k * 100_000 + c, scripts, c, api)
                                       for c in range(conversations)]))
        if k:  # a first request through each proxy: connections to the upstream are open before timing
            warm = [new_state(9_000_000 + first_conv + k * 100_000 + c, api=api) for c in range(min(conversations, 4))]
            asyncio.run(phase(url, warm, 0.2, stream, {"latencies": [], "errors": [], "mismatches": [],
                                                       "body_bytes": []}))
    elapsed = 0.0
    while elapsed < duration_s:
        for _, url, out, states in sides:
            asyncio.run(phase(url, states, slice_s, stream, out, think_s))
        elapsed += slice_s
    result: dict[str, Any] = {}
    base: dict[str, Any] | None = None
    for name, _, out, _ in sides:
        s = result[name] = summary(out)
        if base is None:
            base = s
        elif s["median_ms"] is not None and base["median_ms"] is not None:
            s["added_median_ms"] = s["median_ms"] - base["median_ms"]
            s["added_p99_ms"] = s["p99_ms"] - base["p99_ms"]
    return result


def overhead_from_metrics(proxy_url: str) -> dict[str, Any]:
    """The proxy's own measure of the time from a request's arrival to its forwarding (histogram)."""
    import urllib.request

    text = urllib.request.urlopen(f"{proxy_url}/metrics", timeout=10).read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith("ctxfold_proxy_overhead_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), int(float(line.rsplit(" ", 1)[1]))))
    total = buckets[-1][1] if buckets else 0
    def quantile(q: float) -> float | None:
        for le, n in buckets:
            if total and n >= q * total:
                return le * 1e3
        return None
    return {"requests": total, "median_at_most_ms": quantile(0.5), "p99_at_most_ms": quantile(0.99)}


def compactions(proxy_url: str) -> int:
    """Compactions the proxy has applied so far (its metrics)."""
    import urllib.request

    text = urllib.request.urlopen(f"{proxy_url}/metrics", timeout=10).read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("ctxfold_compactions_total{"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace) -> dict[str, Any]:
    up, up_url = start([sys.executable, "-m", "ctxfold.serve.testing", "--port", "0"], marker="listening on ")
    data = tempfile.mkdtemp(prefix="ctxfold-bench-serve-")
    # A 128k window, as deployed: the trigger checks run on every request (and nothing fires: the
    # conversations stay far below it).
    cmd = [sys.executable, "-m", "ctxfold", "serve", "--upstream", up_url, "--port", "0", "--data-dir", data,
           "--summarizer", "extractive", "--context-tokens", "131072"]
    cmd += ["--fsync", args.fsync]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    procs = [up]
    try:
        proxy, proxy_url = start(cmd, marker="listening on ", stream="stderr")
        procs.append(proxy)
        bare, bare_url = start([sys.executable, str(Path(__file__).with_name("passthrough.py")), "--upstream",
                                up_url], marker="listening on ")
        procs.append(bare)
        path = API_PATHS[args.api]
        urls = {"direct": f"{up_url}{path}", "passthrough": f"{bare_url}{path}", "ctxfold": f"{proxy_url}{path}"}
        result: dict[str, Any] = {"conversations": args.conversations, "duration_s": args.duration_s,
                                  "think_ms": args.think_ms, "stream": args.stream, "fsync": args.fsync,
                                  "api": args.api, "event_loop": _event_loop_name(),
                                  "tokenizer": args.tokenizer or "the default", "big_kb": BIG_KB, "big_every": BIG_EVERY}
        # sequential: one request at a time. paced: the conversations each wait --think-ms between requests,
        # as agents do, so the servers are busy but not saturated. saturated: no wait at all, which on a
        # small machine measures queueing (throughput), not what the proxy adds to a request.
        # traces: paced, each conversation the replay of a real recorded one (tool calls, tool outputs,
        # bodies of tens to hundreds of KB), cut well under the window.
        # The traces are chat completions: replayed in that API only.
        scripts = trace_scripts(TRACE_BODY_LIMIT_BYTES) if TRACES_DIR.is_dir() and args.api == "chat" else None
        phases: list[tuple[str, int, float, list[Script] | None]] = [
            ("sequential", 1, 0.0, None), ("paced", args.conversations, args.think_ms / 1e3, None),
            ("traces", args.conversations, args.think_ms / 1e3, scripts), ("saturated", args.conversations, 0.0, None)]
        if scripts is None:
            result["traces"] = {"status": f"no traces at {TRACES_DIR}" if args.api == "chat"
                                else "the traces are replayed in chat completions only"}
            del phases[2]
        phases = [p for p in phases if p[0] in args.phases]
        for k, (name, n, think_s, workload) in enumerate(phases):
            cpu0 = {p.pid: cpu_seconds(p.pid) for p in (proxy, bare)}
            fired0 = compactions(proxy_url)
            result[name] = interleaved(urls, n, args.duration_s, args.stream, args.slice_s, think_s,
                                       first_conv=k * 10_000, scripts=workload, api=args.api)
            result[name]["compactions"] = compactions(proxy_url) - fired0  # "when nothing fires": 0
            # CPU each proxy spent per request it forwarded: its real cost, apart from waiting for a core.
            for side, p in (("ctxfold", proxy), ("passthrough", bare)):
                result[name][side]["cpu_ms_per_request"] = (cpu_seconds(p.pid) - cpu0[p.pid]) * 1e3 / max(
                    1, result[name][side]["requests"])
        result["proxy_overhead"] = overhead_from_metrics(proxy_url)
        return result
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(10)


def _event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=3.0, help="per phase, each side (default 3)")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--slice-s", type=float, default=0.5, help="direct and proxied load alternate in slices")
    ap.add_argument("--think-ms", type=float, default=200.0, help="wait between a conversation's requests (paced)")
    ap.add_argument("--stream", action="store_true", help="streaming requests")
    ap.add_argument("--fsync", choices=("compactions", "always", "never"), default="compactions",
                    help="the proxy's --fsync (default: compactions, its own default)")
    ap.add_argument("--phases", type=lambda v: v.split(","), default=list(PHASES), metavar="NAMES",
                    help=f"comma-separated, of {','.join(PHASES)} (default: all)")
    ap.add_argument("--api", choices=tuple(API_PATHS), default="chat",
                    help="the API the synthetic phases speak (default chat: /v1/chat/completions; responses, messages)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the result there")
    ap.add_argument("--tokenizer", metavar="SPEC", help="the proxy's --tokenizer (default: the proxy's default)")
    ap.add_argument("--big-kb", type=int, default=0, help="kB of fresh tool-like text in every --big-every-th request")
    ap.add_argument("--big-every", type=int, default=10)
    args = ap.parse_args(argv)
    if unknown := sorted(set(args.phases) - set(PHASES)):
        ap.error(f"--phases: no phase {', '.join(unknown)}; the phases are {', '.join(PHASES)}")
    global BIG_KB, BIG_EVERY
    BIG_KB, BIG_EVERY = args.big_kb, max(1, args.big_every)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
