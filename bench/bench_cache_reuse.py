"""What llama.cpp's own server keeps of its cache after a compaction, with and without ``--cache-reuse``,
and what reuse costs in the answers.

``ctxfold serve`` in front of ``llama-server`` (the C++ binary built by ``.ci/build-llama-server``; Gemma 3
270M, n_ctx 4096, one slot, ``--swa-full`` in both runs: a sliding-window cache cannot shift otherwise),
a chat-only client replaying a shared trace past the window several times over. Two runs send the same
requests: the first with ``--cache-reuse N`` (the engine shifts cached chunks of at least N tokens into place
past the common prefix) and the model's own answers, the second without it, replaying the first run's
requests word for word. The proxy compacts both alike (same requests, same counts, extractive summary).

Per request, from the engine's own answer: the prompt's tokens, those it took from its cache
(``usage.prompt_tokens_details.cached_tokens``) and those it evaluated (``timings.prompt_n``); the KV the
proxy's plan expected to survive the rewrite (``X-Ctxfold-Kv-Reused-Tokens``); and the quality cost of
reuse: how many of the greedy answer's tokens agree with the run without reuse, and the largest difference
of their log-probabilities where they agree.

    python bench/bench_cache_reuse.py [--turns 40] [--cache-reuse 256] [--out reuse.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # the launchers the tests use

from ctxfold.chat.formats import load
from helpers.gemma_gguf import gemma_gguf_path
from helpers.llama_server import GEMMA_FORMAT_TEMPLATE, chat_only_turns, free_port, launch, stop
from helpers.llama_server_native import start_native_server
from synth import TRACES_DIR

TRACE = ("openhands/multi_swe_bench_output.jsonl", 2)


@dataclass
class Answer:
    """One request's answer as the engine gave it (through the proxy)."""

    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0  # taken from the engine's cache
    evaluated_tokens: int = 0  # prefilled
    compactions: int = 0
    planned_reuse: int | None = None  # the KV the proxy's plan expected to survive its rewrite
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read()), r.headers


def ask(base: str, messages: list[dict[str, str]], turn: int, max_tokens: int) -> Answer:
    body, headers = post(base + "/v1/chat/completions", {
        "model": "gemma-3-270m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0,
        "logprobs": True, "top_logprobs": 1})
    usage = body["usage"]
    content = (body["choices"][0].get("logprobs") or {}).get("content") or []
    planned = headers.get("X-Ctxfold-Kv-Reused-Tokens")
    return Answer(turn, prompt_tokens=usage["prompt_tokens"],
                  cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                  evaluated_tokens=body.get("timings", {}).get("prompt_n", 0),
                  compactions=int(headers.get("X-Ctxfold-Compactions", "0")),
                  planned_reuse=int(planned) if planned is not None else None,
                  text=body["choices"][0]["message"].get("content") or "",
                  tokens=[c["token"] for c in content], logprobs=[c["logprob"] for c in content])


def start_proxy(engine_url: str, gguf: Path, tmp: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ctxfold", "serve", "--upstream", engine_url, "--port", str(port),
           "--context-tokens", str(args.n_ctx), "--reply-reserve-tokens", str(4 * args.max_tokens),
           "--tokenizer", f"gguf:{gguf}", "--template", f"file:{GEMMA_FORMAT_TEMPLATE}", "--summarizer", "extractive",
           "--data-dir", str(tmp / "data")]
    base = f"http://127.0.0.1:{port}"
    return launch(cmd, tmp / "proxy.log", base + "/health"), base


def run(gguf: Path, args: argparse.Namespace, *, cache_reuse_tokens: int, turns: list[str],
        requests: list[list[dict[str, str]]] | None) -> tuple[list[Answer], list[list[dict[str, str]]]]:
    """One run: the client's requests (built from the model's answers, or ``requests`` replayed) and the answers."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        engine, engine_url = start_native_server(gguf, tmp / "engine.log", n_ctx=args.n_ctx, threads=args.threads,
                                                 template_file=GEMMA_FORMAT_TEMPLATE,
                                                 cache_reuse_tokens=cache_reuse_tokens, swa_full=True)
        try:
            proxy, base = start_proxy(engine_url, gguf, tmp, args)
            try:
                answers: list[Answer] = []
                sent: list[list[dict[str, str]]] = []
                history: list[dict[str, str]] = []
                for i, text in enumerate(turns, 1):
                    messages = requests[i - 1] if requests is not None else [*history, {"role": "user", "content": text}]
                    a = ask(base, messages, i, args.max_tokens)
                    answers.append(a)
                    sent.append(messages)
                    history = [*messages, {"role": "assistant", "content": a.text}]
                    print(f"reuse {cache_reuse_tokens:4d} turn {i:3d} prompt {a.prompt_tokens:5d} cached {a.cached_tokens:5d} "
                          f"evaluated {a.evaluated_tokens:5d} compactions {a.compactions} plan {a.planned_reuse}",
                          flush=True)
            finally:
                stop(proxy)
        finally:
            stop(engine)
    return answers, sent


def agreement(a: Answer, b: Answer) -> tuple[int, float]:
    """Answer tokens that agree from the start, and the largest log-probability difference among them."""
    n = 0
    for x, y in zip(a.tokens, b.tokens, strict=False):
        if x != y:
            break
        n += 1
    return n, max((abs(a.logprobs[i] - b.logprobs[i]) for i in range(n)), default=0.0)


def report(reuse: list[Answer], cold: list[Answer], cache_reuse_tokens: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for a, b in zip(reuse, cold, strict=True):
        agree, worst = agreement(a, b)
        rows.append({"turn": a.turn, "compactions": a.compactions, "prompt_tokens": a.prompt_tokens,
                     "planned_reuse": a.planned_reuse, "reuse_cached": a.cached_tokens,
                     "reuse_evaluated": a.evaluated_tokens, "cold_cached": b.cached_tokens,
                     "cold_evaluated": b.evaluated_tokens, "answer_tokens": len(b.tokens), "agree_tokens": agree,
                     "max_logprob_diff": round(worst, 4), "same_requests": a.prompt_tokens == b.prompt_tokens})
    after = [r for r in rows if r["compactions"]]
    steady = [r for r in rows if not r["compactions"] and r["turn"] > 1]

    def share(rs: list[dict[str, Any]], key: str) -> float | None:
        total = sum(r["prompt_tokens"] for r in rs)
        return round(sum(r[key] for r in rs) / total, 4) if total else None

    return {
        "cache_reuse_tokens": cache_reuse_tokens, "requests": len(rows), "compactions": len(after),
        "after_compaction": after,
        "cached_share_after_compaction": {"reuse": share(after, "reuse_cached"), "cold": share(after, "cold_cached")},
        "cached_share_steady": {"reuse": share(steady, "reuse_cached"), "cold": share(steady, "cold_cached")},
        "answers_identical": sum(r["agree_tokens"] == r["answer_tokens"] for r in rows),
        "answers_identical_after_compaction": sum(r["agree_tokens"] == r["answer_tokens"] for r in after),
        "max_logprob_diff_median": statistics.median(r["max_logprob_diff"] for r in rows) if rows else None,
        "plan_vs_cold_cached": [(r["planned_reuse"], r["cold_cached"]) for r in after],
        "all": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--turn-chars", type=int, default=1200)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-reuse", type=int, default=256, help="llama-server's --cache-reuse in the first run")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    gguf = gemma_gguf_path()
    name, index = TRACE
    turns = chat_only_turns(load(TRACES_DIR / name)[index], max_chars=args.turn_chars)[: args.turns]
    reuse, sent = run(gguf, args, cache_reuse_tokens=args.cache_reuse, turns=turns, requests=None)
    cold, _ = run(gguf, args, cache_reuse_tokens=0, turns=turns, requests=sent)
    out = report(reuse, cold, args.cache_reuse)
    out["trace"] = f"{name}#{index}"
    summary = {k: v for k, v in out.items() if k != "all"}
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
