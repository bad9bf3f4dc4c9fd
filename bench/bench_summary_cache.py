"""Does the summary request ride the engine's cache? ``ctxfold serve --summarizer upstream`` in front of
``python -m llama_cpp.server`` (Gemma 3 270M, n_ctx 4096), the ``openai`` client replaying a shared trace as
a chat-only client (it keeps the model's answers in its history) until compactions have asked the model
for a summary.

Between the proxy and the engine a relay (tests/helpers/recording_relay.py) keeps each request's body and
the engine's own log lines for it: llama-cpp-python's ``N prefix-match hit, remaining M prompt tokens to
eval`` (the tokens served from its cache and those evaluated) and llama.cpp's ``prompt eval time``. Per
summary request: those figures as the proxy sent it (after the conversation's last request, whose KV the
engine holds), beside ctxfold's own figures for it (the proxy's log line, ``summary request P (C
cached)``), and the same body sent again cold (after a one-line request, so the engine's cache holds only
the chat format's opening).

    python bench/bench_summary_cache.py [--turns 40] [--summary-tokens 48] [--out summary_cache.json]

Figures from one run on whatever machine runs it; docs/engines.md and docs/cost.md have one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # the launchers, relay and replay client the tests use

from ctxfold.chat.formats import load
from ctxfold.serve.testing import BackgroundServer
from helpers.gemma_gguf import gemma_gguf_path
from helpers.llama_server import chat_only_turns, replay, start_llama_server, stop
from helpers.recording_relay import EngineFigures, RecordingRelay, send_cold
from serve.test_e2e_mini_swe_agent import start_proxy
from synth import TRACES_DIR

TRACE = ("openhands/multi_swe_bench_output.jsonl", 2)  # the longest conversation of the e2e bench
# The proxy's log line of an applied summary: ctxfold's own figures for its summary request.
PREDICTED = re.compile(r"summary request (\d+) \((\d+) cached\) \+ (\d+) out")


def figures(f: EngineFigures) -> dict[str, Any]:
    return {"prompt_tokens": f.prompt_tokens, "cached_tokens": f.cached_tokens, "evaluated_tokens": f.evaluated_tokens,
            "cached_share": f.cached_share, "prompt_eval_ms": f.prompt_eval_ms}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--turn-chars", type=int, default=800)
    p.add_argument("--max-tokens", type=int, default=8, help="each answer of the conversation")
    p.add_argument("--summary-tokens", type=int, default=48, help="the summary's cap (summary.max_tokens)")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2, help="threads that evaluate prompts")
    p.add_argument("--decode-threads", type=int, default=1, help="threads that generate")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    gguf = gemma_gguf_path()
    name, index = TRACE
    turns = chat_only_turns(load(TRACES_DIR / name)[index], max_chars=args.turn_chars)[: args.turns]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        log = tmp / "engine.log"
        engine, engine_url = start_llama_server(gguf, log, n_ctx=args.n_ctx, threads=args.threads,
                                                decode_threads=args.decode_threads)
        origin = engine_url.removesuffix("/v1")
        relay = RecordingRelay(origin, log)
        try:
            t0 = time.perf_counter()
            with BackgroundServer(relay.app()) as relayed:
                proxy, base = start_proxy(relayed.url + "/v1", gguf, tmp, n_ctx=args.n_ctx, max_tokens=args.max_tokens,
                                          summary_tokens=args.summary_tokens)
                try:
                    rows = replay(base + "/v1", [turns], max_tokens=args.max_tokens, on_turn=lambda r: print(
                        f"turn {r.turn:3d} {r.status:8s} ctxfold {r.predicted} engine {r.reported} "
                        f"compactions {r.compactions} {r.seconds:.1f} s", flush=True))
                finally:
                    stop(proxy)
            proxied_s = time.perf_counter() - t0
            predicted = PREDICTED.findall((tmp / "proxy.log").read_text(errors="replace"))
            warm = [r for r in relay.relayed if r.is_summary]
            cold = [send_cold(origin, log, r.body) for r in warm]
        finally:
            stop(engine)

    summaries = []
    for i, (w, c) in enumerate(zip(warm, cold, strict=True)):
        row: dict[str, Any] = {"warm": figures(w.engine), "cold": figures(c)}
        if i < len(predicted):
            row["ctxfold"] = {"prompt_tokens": int(predicted[i][0]), "cached_tokens": int(predicted[i][1]),
                              "output_tokens": int(predicted[i][2])}
        summaries.append(row)
        print(f"summary request {i + 1}: warm {row['warm']}; cold {row['cold']}; ctxfold {row.get('ctxfold')}",
              flush=True)
    warm_prompt = sum(w.engine.prompt_tokens or 0 for w in warm)
    result = {
        "trace": f"{name}#{index}", "turns": len(turns), "answered": sum(r.status == "ok" for r in rows),
        "compared": sum(r.reported is not None for r in rows),
        "equal": sum(r.reported is not None and r.reported == r.predicted for r in rows),
        "compactions": sum(r.compactions for r in rows), "summary_requests": len(warm),
        "warm_cached_share": sum(w.engine.cached_tokens for w in warm) / warm_prompt if warm_prompt else None,
        "summaries": summaries, "proxied_seconds": proxied_s,
        "settings": {"n_ctx": args.n_ctx, "max_tokens": args.max_tokens, "summary_tokens": args.summary_tokens,
                     "turn_chars": args.turn_chars},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "summaries"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
