"""Every Claude Code conversation of the shared traces through ``ctxfold serve``'s ``/v1/messages``, as
Claude Code sends it, at a few windows.

    python bench/bench_claude_code.py [--ctx 4096,8192,16384] [--json build/bench/claude_code.json]

How each request is rebuilt and checked is tests/helpers/claude_code_replay.py's (the slow-tier test
tests/serve/test_serve_claude_code.py asserts on the same figures): the official ``anthropic`` SDK
streams each recorded turn's request through the proxy to a scripted upstream that answers with the
recorded turn and counts every prompt with the real DeepSeek V4 tokenizer. Per window: conversations,
requests sent, requests the upstream received, compaction passes (by kind), the largest prompt beside
the window, requests over it, orphaned tool results, sessions restored exactly by ``ctxfold restore``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.claude_code_replay import Figures, conversations, replay  # the test's replay: one definition
from synth import TRACES_DIR

WINDOWS = (4096, 8192, 16384)


def table(rows: Sequence[Figures]) -> str:
    head = ("| window | conversations | requests | upstream requests | compaction passes | max prompt "
            "| over window | orphans | restored exactly |")
    lines = [head, "|" + "---|" * 9]
    for f in rows:
        passes = ", ".join(f"{k} {n}" for k, n in sorted(f.passes.items())) or "0"
        lines.append(f"| {f.context_tokens:,} | {f.conversations} | {f.requests} | {f.upstream_requests} | "
                     f"{f.compactions} ({passes}) | {f.max_prompt_tokens:,} | {f.over_window} | {f.orphans} | "
                     f"{f.restored_exactly} of {f.conversations} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--traces", type=Path, default=TRACES_DIR)
    ap.add_argument("--ctx", default=",".join(map(str, WINDOWS)), help="windows in tokens, comma-separated")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    if not (args.traces / "claude_code_small").is_dir():
        print(f"bench_claude_code: no Claude Code traces under {args.traces} (pass --traces)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    convs = conversations(args.traces)
    rows = []
    for ctx in (int(x) for x in args.ctx.split(",")):
        with tempfile.TemporaryDirectory() as data_dir:
            rows.append(replay(convs, ctx, Path(data_dir)))
    print(table(rows))
    print(f"\n{time.perf_counter() - t0:.0f} s in all; longest conversation whole: "
          f"{rows[0].uncompacted_tokens:,} tokens", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    bad = [r for r in rows if r.mismatches or r.over_window or r.orphans or r.restored_exactly != r.conversations]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
