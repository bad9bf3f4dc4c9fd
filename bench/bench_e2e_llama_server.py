"""The proxy before a real server, the long run: ``ctxfold serve`` in front of ``python -m llama_cpp.server``
(Gemma 3 270M, n_ctx 4096), the ``openai`` client replaying shared traces as a chat-only client (the
user side of each turn capped at ``--turn-chars``; the model's own answers, ``--max-tokens`` each).

Per request: accepted or refused, ctxfold's count of the prompt it sent (``X-Ctxfold-Prompt-Tokens``)
beside the engine's ``usage.prompt_tokens``, the compactions it made (``X-Ctxfold-Compactions``), the KV
their plan keeps (``X-Ctxfold-Kv-Reused-Tokens``) beside the engine's own prefix-match hit (its log).
Then the control: the same client straight to the engine, each conversation until its first refusal.

    python bench/bench_e2e_llama_server.py [--turns 100] [--out e2e.json]

Figures from one run on whatever machine runs it; docs/engines.md has one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # the server launcher and replay client the test uses

from ctxfold.chat.formats import load
from helpers.gemma_gguf import gemma_gguf_path
from helpers.llama_server import (
    GEMMA_FORMAT_TEMPLATE,
    TurnResult,
    chat_only_turns,
    free_port,
    launch,
    replay,
    start_llama_server,
    stop,
)
from synth import TRACES_DIR

# Long conversations first: together over a hundred turns, several windows' worth each.
TRACES = (("openhands/multi_swe_bench_output.jsonl", 2), ("openhands/resolver_mock_output.jsonl", 1),
          ("swe_agent/crypto__katy.traj", 0),
          (("swe_agent/replay__marshmallow-code__marshmallow-1867__function_calling_replace_from_source__"
            "marshmallow-code__marshmallow-1867.traj"), 0),
          ("openhands/multi_swe_bench_output.jsonl", 0))


def conversations(turns: int, turn_chars: int) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    total = 0
    for name, index in TRACES:
        if total >= turns:
            break
        conv = load(TRACES_DIR / name)[index]
        t = chat_only_turns(conv, max_chars=turn_chars)[: turns - total]
        out.append((f"{name}#{index}", t))
        total += len(t)
    return out


def start_proxy(engine_url: str, gguf: Path, data_dir: Path, log: Path, args: argparse.Namespace
                ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ctxfold", "serve", "--upstream", engine_url, "--port", str(port),
           "--context-tokens", str(args.n_ctx), "--reply-reserve-tokens", str(4 * args.max_tokens),
           "--tokenizer", f"gguf:{gguf}", "--template", f"file:{GEMMA_FORMAT_TEMPLATE}",
           "--summarizer", args.summarizer, "--summary-timeout-s", str(args.summary_timeout_s),
           "--engine-check", "every", "--data-dir", str(data_dir)]
    base = f"http://127.0.0.1:{port}"
    return launch(cmd, log, base + "/health"), base


def summarize(rows: list[TurnResult], control: dict[str, Any], names: list[str]) -> dict[str, Any]:
    ok = [r for r in rows if r.status == "ok"]
    compared = [r for r in ok if r.reported is not None and r.predicted is not None]
    compaction_turns = [r for r in ok if r.compactions]
    # Turns between compactions, per conversation (the gaps between turns that compacted).
    gaps: list[int] = []
    for ci in range(len(names)):
        turns = [r.turn for r in ok if r.conversation == ci and r.compactions]
        gaps += [b - a for a, b in itertools.pairwise(turns)]
    steady = [r for r in ok if not r.compactions and r.predicted]
    return {
        "requests": len(rows), "answered": len(ok), "rejected": sum(r.status == "rejected" for r in rows),
        "errors": sum(r.status == "error" for r in rows),
        "compared": len(compared), "equal": sum(r.predicted == r.reported for r in compared),
        "max_abs_diff": max((abs((r.predicted or 0) - (r.reported or 0)) for r in compared), default=0),
        "streamed_without_usage": sum(r.stream and r.reported is None for r in ok),
        "compactions": sum(r.compactions for r in ok), "compaction_turns": len(compaction_turns),
        "turns_between_compactions_median": statistics.median(gaps) if gaps else None,
        "turns_between_compactions": gaps,
        "max_prompt_tokens": max((r.predicted or 0 for r in ok), default=0),
        "engine_reuse_share_steady": (sum(r.engine_reuse for r in steady) / sum(r.predicted or 0 for r in steady)
                                      if steady else None),
        "after_compaction": [{"conversation": names[r.conversation], "turn": r.turn, "prompt": r.predicted,
                              "planned_reuse": r.planned_reuse, "engine_reuse": r.engine_reuse}
                             for r in compaction_turns],
        "control": control,
        "seconds_median": statistics.median(r.seconds for r in ok) if ok else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--turn-chars", type=int, default=800)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stream-every", type=int, default=5, help="every Nth turn streamed (0: none)")
    p.add_argument("--summarizer", choices=("extractive", "upstream"), default="extractive")
    p.add_argument("--summary-timeout-s", type=float, default=30.0)
    p.add_argument("--no-control", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    gguf = gemma_gguf_path()
    convs = conversations(args.turns, args.turn_chars)
    names = [n for n, _ in convs]
    print(f"{sum(len(t) for _, t in convs)} turns in {len(convs)} conversations: "
          + ", ".join(f"{n} ({len(t)})" for n, t in convs), flush=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        engine_log = tmp / "engine.log"
        engine, engine_url = start_llama_server(gguf, engine_log, n_ctx=args.n_ctx, threads=args.threads)
        try:
            proxy, base = start_proxy(engine_url, gguf, tmp / "data", tmp / "proxy.log", args)
            t0 = time.perf_counter()
            try:
                rows = replay(base + "/v1", [t for _, t in convs], max_tokens=args.max_tokens, engine_log=engine_log,
                              stream_every=args.stream_every,
                              on_turn=lambda r: print(
                                  f"{names[r.conversation][:28]:28s} turn {r.turn:3d} {r.status:8s} "
                                  f"ctxfold {r.predicted} engine {r.reported} compactions {r.compactions} "
                                  f"planned reuse {r.planned_reuse} engine reuse {r.engine_reuse} "
                                  f"{r.seconds:.1f} s", flush=True))
                with urllib.request.urlopen(base + "/health", timeout=10) as h:
                    health = json.loads(h.read())
            finally:
                stop(proxy)
            proxied_s = time.perf_counter() - t0
            proxy_log = (tmp / "proxy.log").read_text(errors="replace")
            control: dict[str, Any] = {}
            if not args.no_control:
                for ci, (name, turns) in enumerate(convs):
                    if not any(r.compactions for r in rows if r.conversation == ci):
                        # It never outgrew the window through the proxy: the engine alone would not refuse it.
                        control[name] = {"refused_at_turn": None, "of": len(turns), "skipped": "no compaction"}
                        continue
                    c = replay(engine_url, [turns], max_tokens=args.max_tokens, stop_on_rejection=True)
                    last = c[-1]
                    control[name] = ({"refused_at_turn": last.turn, "of": len(turns), "error": last.error[:200]}
                                     if last.status != "ok" else {"refused_at_turn": None, "of": len(turns)})
                    print(f"control {name}: {control[name]}", flush=True)
        finally:
            stop(engine)
    result = summarize(rows, control, names)
    result.update({"n_ctx": args.n_ctx, "max_tokens": args.max_tokens, "turn_chars": args.turn_chars,
                   "summarizer": args.summarizer, "proxied_seconds": proxied_s, "engine_check": health["engine_check"],
                   "proxy_warnings": [line for line in proxy_log.splitlines() if "engine check" in line
                                      or "usage" in line or "fallback" in line][:10],
                   "rows": [asdict(r) for r in rows]})
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
