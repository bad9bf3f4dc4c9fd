"""The replay of every shared trace counted two ways, side by side: the default counter (exact where
installed) against the estimate, at 4k to 128k.

    python bench/replay_counters.py [--traces DIR] [--windows 4096,8192,...] [--jobs N]

For each window and counter: conversations, model requests, compactions (summaries), tokens summarized
and archived, requests over the window as verified with the DeepSeek V4 tokenizer, orphans and restores
that were not exact. The rows are printed as a Markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

COUNTERS = {"exact (default)": "auto:deepseek-v4", "estimate": "estimate:deepseek-v4"}


def traces(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if p.suffix in (".json", ".jsonl", ".traj") and "licen" not in p.name.lower())


def replay(files: list[str], window: int, tokenizer: str, jobs: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "replay.json"
        cmd = [sys.executable, "-m", "ctxfold", "replay", *files, "--ctx", str(window), "--tokenizer", tokenizer,
               "--verify-with", "deepseek-v4", "--json", str(out), "--quiet", "--lenient", "--jobs", str(jobs)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if not out.exists():
            raise SystemExit(f"replay failed ({proc.returncode}): {proc.stderr[-2000:]}")
        doc = json.loads(out.read_text())
    convs = doc["conversations"]
    summaries = sum(1 for c in convs for e in c["events"] if e["kind"] == "summary" and e["applied"])
    return {
        "conversations": len(convs),
        "requests": sum(c["requests"] for c in convs),
        "summaries": summaries,
        "tokens_summarized": sum(c["tokens_summarized"] for c in convs),
        "tokens_archived": sum(c["tokens_archived"] for c in convs),
        "over_window_verified": sum(c["overflows_verified"] or 0 for c in convs),
        "orphans": sum(c["orphans"] for c in convs),
        "restores_not_exact": sum(1 for c in convs if c["restore_exact"] is False),
        "exit_code": proc.returncode,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "traces")
    ap.add_argument("--windows", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    files = traces(args.traces)
    rows: list[dict[str, object]] = []
    print("| window | counter | conversations | requests | summaries | tokens summarized | tokens archived | "
          "over the window (verified) | orphans | restores not exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for window in (int(w) for w in args.windows.split(",")):
        for label, spec in COUNTERS.items():
            r = replay(files, window, spec, args.jobs)
            rows.append({"window": window, "counter": label, **r})
            print(f"| {window // 1024}k | {label} | {r['conversations']} | {r['requests']} | {r['summaries']} | "
                  f"{r['tokens_summarized']:,} | {r['tokens_archived']:,} | {r['over_window_verified']} | "
                  f"{r['orphans']} | {r['restores_not_exact']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
