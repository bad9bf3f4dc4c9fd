"""A real agent through the proxy, the long run: mini-swe-agent (its own text-based config; the run set up as
tests/helpers/mini_swe_agent_run.py says) on a small task of its own, through ``ctxfold serve
--summarizer upstream`` to ``python -m llama_cpp.server`` (Gemma 3 270M, n_ctx 4096), then the same agent
straight to the engine (the control). What tests/serve/test_e2e_mini_swe_agent.py runs, longer, with
every figure kept (and its note on why this agent's conversations get no model-written summary).

Per model call: ctxfold's count of the prompt it sent (``X-Ctxfold-Prompt-Tokens``) beside the engine's
``usage.prompt_tokens``, the compactions (``X-Ctxfold-Compactions``), the seconds. Then whether ``ctxfold restore`` gives back the agent's conversation, and where
the control was refused.

    python bench/bench_mini_swe_agent.py [--steps 40] [--out mini_swe_agent.json]

Figures from one run on whatever machine runs it; docs/engines.md has one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # the launchers, relay and agent run the test uses

from helpers.gemma_gguf import gemma_gguf_path
from helpers.llama_server import start_llama_server, stop
from helpers.mini_swe_agent_run import AgentRun, run_agent
from helpers.proxy_helpers import metric
from serve.test_e2e_mini_swe_agent import restored_messages, start_proxy


def calls_summary(run: AgentRun, seconds: float) -> dict[str, Any]:
    compared = [c for c in run.calls if c.reported is not None and c.predicted is not None]
    return {
        "calls": len(run.calls), "exit_status": run.exit_status, "error": str(run.error or "")[:300],
        "compared": len(compared), "equal": sum(c.predicted == c.reported for c in compared),
        "max_prompt_tokens": max((c.reported or 0 for c in run.calls), default=0),
        "compactions": sum(c.compactions for c in run.calls),
        "compaction_steps": [c.step for c in run.calls if c.compactions],
        "cut_at_max_tokens": sum(c.finish_reason == "length" for c in run.calls),
        "seconds_median": statistics.median(c.seconds for c in run.calls) if run.calls else None,
        "wall_seconds": seconds,
    }


def show(label: str) -> Any:
    return lambda c: print(f"{label} step {c.step:3d} ctxfold {c.predicted} engine {c.reported} "
                           f"compactions {c.compactions} {c.finish_reason} {c.seconds:.1f} s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--summary-tokens", type=int, default=48)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2, help="threads that evaluate prompts")
    p.add_argument("--decode-threads", type=int, default=1, help="threads that generate")
    p.add_argument("--no-control", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    gguf = gemma_gguf_path()
    result: dict[str, Any] = {"settings": {"steps": args.steps, "max_tokens": args.max_tokens,
                                           "summary_tokens": args.summary_tokens, "n_ctx": args.n_ctx}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        engine, engine_url = start_llama_server(gguf, tmp / "engine.log", n_ctx=args.n_ctx, threads=args.threads,
                                                  decode_threads=args.decode_threads)
        try:
            (tmp / "work").mkdir()
            t0 = time.perf_counter()
            proxy, base = start_proxy(engine_url, gguf, tmp, n_ctx=args.n_ctx, max_tokens=args.max_tokens,
                                      summary_tokens=args.summary_tokens)
            try:
                run = run_agent(base + "/v1", tmp / "work", steps=args.steps, max_tokens=args.max_tokens,
                                on_call=show("proxied"))
                with urllib.request.urlopen(base + "/metrics", timeout=10) as m:
                    metrics = m.read().decode()
            finally:
                stop(proxy)
            proxied = result["proxied"] = calls_summary(run, time.perf_counter() - t0)
            proxied["engine_checks_agree"] = metric(metrics, "ctxfold_engine_checks_total", result="agree")
            proxied["compactions_by_kind"] = [line for line in metrics.splitlines()
                                              if line.startswith("ctxfold_compactions_total")]
            proxied["restored_exactly"] = restored_messages(tmp / "data") == run.sent_history()
            proxied["per_call"] = [asdict(c) for c in run.calls]
            if not args.no_control:
                (tmp / "control").mkdir()
                t0 = time.perf_counter()
                control = run_agent(engine_url, tmp / "control", steps=args.steps, max_tokens=args.max_tokens,
                                    on_call=show("control"))
                result["control"] = calls_summary(control, time.perf_counter() - t0)
                result["control"]["refused_at_step"] = len(control.calls) + 1 if control.error else None
        finally:
            stop(engine)
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "per_call"} if isinstance(v, dict) else v)
                      for k, v in result.items()}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
