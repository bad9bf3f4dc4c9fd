"""``ctxfold serve --workers N``: N processes accepting on one socket, stopped together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from helpers.subprocess_env import ctxfold_env

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc/self/task").is_dir(),
                                reason="worker processes are forked, and found through /proc (Linux)")

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ctxfold.cli.serve import serve_workers
    from ctxfold.serve.app import ProxyConfig

    config = ProxyConfig(upstream=sys.argv[3], data_dir=Path(sys.argv[1]), summarizer="extractive",
                         fsync="never")
    sys.exit(serve_workers(config, "127.0.0.1", 0, int(sys.argv[2]), ready=lambda url: print(url, flush=True)))
""")


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return sorted(int(p) for p in text.split())


@contextmanager
def pool(tmp_path: Path, workers: int, upstream_url: str | None = None
         ) -> Iterator[tuple[subprocess.Popen[str], str, list[int]]]:
    # By default an upstream that accepts connections (and is never sent a request): /health asks
    # whether it can be reached, and these tests ask /health whether each worker serves.
    upstream = socket.create_server(("127.0.0.1", 0))
    upstream_url = upstream_url or f"http://127.0.0.1:{upstream.getsockname()[1]}/v1"
    with upstream, subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "data"), str(workers), upstream_url],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=ctxfold_env()) as proc:
        pids: list[int] = []
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().split()[0]
            assert url.startswith("http://127.0.0.1:"), url
            # The pool says it listens before it forks (connections queue on the socket): wait for the workers.
            deadline = time.monotonic() + 30
            while len(pids := children(proc.pid)) < workers and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(pids) == workers
            yield proc, url, pids
        finally:
            # Whatever a failed test left running: only processes still ours (the pool's parent, and the
            # workers it has not reaped), so no pid that may have been reused meanwhile.
            if proc.poll() is None:
                for pid in children(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                proc.kill()


def healthy(url: str, n: int) -> bool:
    """``n`` requests, each on a connection of its own (so the kernel picks a worker for each)."""
    for _ in range(n):
        if httpx.get(url + "/health", timeout=5).status_code != 200:
            return False
    return True


@pytest.mark.slow
def test_every_worker_accepts_on_the_shared_socket_and_sigterm_stops_them_all(tmp_path: Path) -> None:
    with pool(tmp_path, 2) as (proc, url, pids):
        assert healthy(url, 4)
        # Each worker alone serves: the other one is stopped (SIGSTOP), the socket's queue is the same.
        for stopped in pids:
            os.kill(stopped, signal.SIGSTOP)
            try:
                assert healthy(url, 6)
            finally:
                os.kill(stopped, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
        assert proc.returncode == 0
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.slow
def test_metrics_count_every_request_of_every_worker(tmp_path: Path) -> None:
    """Each worker counts its own; /metrics, whichever worker answers it, gives the pool's total."""
    from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
    from helpers.proxy_helpers import chat, metric, post

    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as upstream, pool(tmp_path, 3, upstream.url + "/v1") as (proc, url, pids):
        answered_by: set[str] = set()
        for k in range(30):  # each on a connection of its own: the kernel spreads them over the workers
            resp = post(url, chat(("user", f"question {k}")))
            assert resp.status_code == 200
            answered_by.add(resp.json()["id"])
        assert len(answered_by) == 30
        for _ in range(6):  # any worker may answer the scrape: every one must give the total
            text = httpx.get(url + "/metrics", timeout=10).text
            assert metric(text, "ctxfold_requests_total", stream="false", tenant="anonymous") == 30, text
            assert metric(text, "ctxfold_responses_total", status="200", tenant="anonymous") == 30
            assert metric(text, "ctxfold_proxy_overhead_seconds_count") == 30
            assert metric(text, "ctxfold_sessions") == 30  # each worker's loaded sessions, added
        # Each worker that counted has its own file of figures: more than one, or nothing was summed.
        counted = {f.stem.rsplit("_", 1)[1] for f in (tmp_path / "data" / "metrics").glob("counter_*.db")}
        assert counted <= {str(p) for p in pids} and len(counted) >= 2, counted
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)


@pytest.mark.slow
def test_a_worker_that_dies_stops_the_pool_with_an_error(tmp_path: Path) -> None:
    with pool(tmp_path, 3) as (proc, _url, pids):
        os.kill(pids[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 1 and f"worker {pids[0]} exited" in err
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() for p in pids[1:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(Path(f"/proc/{p}").exists() for p in pids[1:])


def test_more_than_one_worker_without_a_shared_store_is_refused(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ctxfold", "serve", "--upstream", "http://127.0.0.1:9/v1",
                          "--workers", "2", "--data-dir", str(tmp_path / "d")],
                         check=False, capture_output=True, text=True, env=ctxfold_env(), timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "--workers 2" in out.stderr and "shared session store" in out.stderr
