"""64 concurrent conversations through the proxy, the load generator in its own process.

Runs ``bench/bench_serve.py`` briefly: no request lost or answered with another conversation's
answer, and the added latency (median, p99) printed beside the direct call to the upstream and a bare
pass-through proxy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.subprocess_env import ctxfold_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_64_concurrent_conversations_no_lost_or_mixed_requests() -> None:
    env = ctxfold_env()
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_serve.py"), "--conversations", "64", "--duration-s", "0.5",
         "--slice-s", "0.25"],
        capture_output=True, text=True, env=env, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    for phase in ("sequential", "paced", "saturated"):
        for side in ("direct", "passthrough", "ctxfold"):
            r = result[phase][side]
            assert r["errors"] == 0 and r["mismatches"] == 0, r["first_problems"]
            assert r["requests"] > 0
    assert result["paced"]["ctxfold"]["requests"] >= 64  # every conversation got through at least once
    print("\nserve latency (ms)   direct median/p99   passthrough added   ctxfold added median/p99")
    for phase in ("sequential", "paced", "saturated"):
        r = result[phase]
        d, b, c = r["direct"], r["passthrough"], r["ctxfold"]
        print(f"{phase:<18}  {d['median_ms']:8.2f} {d['p99_ms']:8.2f}   {b['added_median_ms']:8.2f} "
              f"{b['added_p99_ms']:8.2f}   {c['added_median_ms']:8.2f} {c['added_p99_ms']:8.2f}   "
              f"(ctxfold CPU {c['cpu_ms_per_request']:.2f} ms/request)")
    print(f"ctxfold's own overhead before forwarding: {result['proxy_overhead']}")
