"""Two and three proxy replicas on one Redis under load, the load generator in its own process.

Runs ``bench/bench_replicas.py`` (without its latency part): 64 conversations over 8 tenants, all at
once, each request sent to the next replica; no request lost, mixed up or warned about, every
session restored from Redis exactly as its client holds it under its own tenant, and compactions made
by one replica continued by every other.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.redis_server import REQUIRE_REDIS
from helpers.subprocess_env import ctxfold_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_64_conversations_round_robin_over_two_and_three_replicas() -> None:
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        if REQUIRE_REDIS:
            pytest.fail("redis-server is not on PATH (CTXFOLD_REQUIRE_REDIS is set, so this is a failure)")
        pytest.skip("redis-server is not on PATH (Debian: apt-get install redis-server)")
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_replicas.py"), "--replicas", "2", "3", "--conversations", "64",
         "--tenants", "8", "--turns", "8", "--latency-s", "0", "--time-limit-s", "60"],
        capture_output=True, text=True, env=ctxfold_env(), timeout=170, check=False)
    result = json.loads(out.stdout) if out.stdout.strip().startswith("{") else None
    assert result is not None, out.stderr[-3000:]
    for run in result["runs"]:
        assert run["errors"] == run["mismatches"] == run["warnings"] == 0, run["first_problems"]
        assert run["requests"] == 64 * 8  # nothing cut short by the time limit
        assert run["restore"] == {"sessions": 64, "conversations": 64, "tenants": 8, "exact": True}
        assert run["compacted_requests"] > 0 and all(run["compactions_by_replica"])
        assert run["num_missed"] == 0, run["missed"]
        assert all(run["continued_by_replica"]), run  # every replica continued compactions made elsewhere
    assert out.returncode == 0
