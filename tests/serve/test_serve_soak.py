"""The proxy soaked: 64 conversations across 8 tenants, a faulty upstream, careless clients and a
SIGKILL, with the load generator in a process of its own (``bench/soak.py``, run briefly here; run
it longer from the command line: ``python bench/soak.py --duration-s 600``).

What is checked (each failure a line of the report's ``problems``): every conversation reaches its
end (a failed request is sent again until answered), every answer is the echo of its own request and
of exactly its own history as the upstream received it, the proxy's open descriptors, resident memory
and loaded sessions stay within the bounds its settings give (sampled over the run), and the restore
of every conversation's one session is the messages its client sent and received, in order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.subprocess_env import ctxfold_env

REPO = Path(__file__).resolve().parents[2]
DURATION_S = 40  # half before the kill, half after; about a minute in all on a loaded 2-core machine


@pytest.mark.slow
def test_soak_64_conversations_8_tenants_faults_and_a_sigkill(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    out = subprocess.run(
        # Each conversation ends after 12 turns and a new one takes its slot, as agents' tasks end.
        [sys.executable, str(REPO / "bench" / "soak.py"), "--duration-s", str(DURATION_S), "--max-turns", "12",
         "--json", str(report)],
        capture_output=True, text=True, env=ctxfold_env(), timeout=DURATION_S * 3 + 240, check=False)
    assert report.is_file(), out.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["problems"] == [], json.dumps(result, indent=1)[-4000:]
    assert out.returncode == 0, out.stderr[-3000:]
    # The run did what it is for: the faults fired, the proxy restarted, the bounds were reached.
    assert len(result["proxy_pids"]) == 2
    assert result["conversations"] == 64 and result["conversations_ended"] > 0
    assert result["restores_checked"] == 64 + result["conversations_ended"]
    retried = result["retried"]
    for why in ("HTTP 500", "HTTP 429", "stream cut"):
        assert retried.get(why, 0) > 0, retried
    assert result["resends"] > 0 and result["duplicates"] > 0 and result["disconnects"] > 0
    assert max(b["sessions_loaded_peak"] or 0 for b in result["bounds"].values()) >= 16  # eviction ran
