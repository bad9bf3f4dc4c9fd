"""Shared fixtures: where the real traces live, and the traces the project generates itself.

The real traces are read from ``../shared/traces`` beside the repository (CI lays it there), or from
``$CTXFOLD_TRACES``. They are never copied into the project. Without them, the tests that need them
skip (a fresh clone passes); with ``CTXFOLD_REQUIRE_TRACES=1`` (CI) a missing folder fails them
instead, so a run that should have read them cannot pass quietly. The ``traces_dir`` fixture is the
one place that decides: tests take it rather than reading the path themselves.

``synthetic_traces`` writes a small folder of generated traces in every format the importers read
(tests/synthetic_traces.py), so the same behaviour is tested on a fresh clone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

import synthetic_traces as synthetic
from ctxfold.serve import ProxyApp
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from proxy_helpers import start_proxy

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = Path(os.environ.get("CTXFOLD_TRACES", REPO_ROOT.parent / "shared" / "traces"))
REQUIRE_TRACES = os.environ.get("CTXFOLD_REQUIRE_TRACES", "") not in ("", "0")

# CI (.ci/run sets CTXFOLD_HYPOTHESIS_PROFILE=ci) checks a fixed set of examples for each property: a red
# run then means the change broke something, not that a new draw found an old gap. Local runs keep
# drawing new examples, and Hypothesis replays any that failed (.hypothesis/) until they pass.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("CTXFOLD_HYPOTHESIS_PROFILE", "default"))

WHERE_TO_GET_THEM = (
    "the real agent traces are not part of the project; put them in ../shared/traces beside the clone or "
    "point CTXFOLD_TRACES at them (README.md, 'Tests', names each set's public source)"
)


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The real traces folder; skips the test when it is absent (fails with CTXFOLD_REQUIRE_TRACES=1)."""
    if not TRACES_DIR.is_dir():
        message = f"real traces not found at {TRACES_DIR}: {WHERE_TO_GET_THEM}"
        if REQUIRE_TRACES:
            pytest.fail(f"{message} (CTXFOLD_REQUIRE_TRACES is set, so this is a failure)", pytrace=False)
        pytest.skip(message)
    return TRACES_DIR


@pytest.fixture(scope="session")
def _synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Path, synthetic.Expected]]:
    root = tmp_path_factory.mktemp("synthetic_traces")
    return root, synthetic.write_all(root)


@pytest.fixture(scope="session")
def synthetic_traces_dir(_synthetic: tuple[Path, dict[Path, synthetic.Expected]]) -> Path:
    """The folder of the generated traces, laid out like the real one: ``<format>/<files>``."""
    return _synthetic[0]


@pytest.fixture(scope="session")
def synthetic_traces(_synthetic: tuple[Path, dict[Path, synthetic.Expected]]) -> dict[Path, synthetic.Expected]:
    """The generated trace files (tests/synthetic_traces.py), each with what its importer must read."""
    return _synthetic[1]


# -- the proxy's tests: the scripted upstream and a proxy in front of it, on loopback ------------------------

@pytest.fixture()
def upstream() -> Iterator[tuple[ScriptedUpstream, str]]:
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as srv:
        yield up, srv.url


@pytest.fixture()
def proxy(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> Iterator[tuple[ProxyApp, str]]:
    p, srv = start_proxy(upstream[1], tmp_path / "data")
    try:
        yield p, srv.url
    finally:
        srv.close()


# -- a real redis-server on loopback, for the session store's tests ---------------------------------------
# Debian's redis-server (CI installs it: .ci/run). Each test gets a server of its own in its own
# directory, so a test may stop, kill and restart it. Without the binary the tests skip, unless
# CTXFOLD_REQUIRE_REDIS=1 (CI), where a missing server fails them.

import shutil  # this section's own imports, kept with it (merges stay local)
import socket
import subprocess
import time

REQUIRE_REDIS = os.environ.get("CTXFOLD_REQUIRE_REDIS", "") not in ("", "0")


class RedisServer:
    """One redis-server process on 127.0.0.1: AOF on, fsynced on every write, no RDB snapshots."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary = binary
        self.dir = folder
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> None:
        """Start it (again: the same port and directory, so it reads its append-only file back)."""
        if extra:
            self.extra = extra
        if not self.port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - the process writes it until stopped
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.dir), *self.extra],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{(self.dir / 'server.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(64).startswith(b"+PONG"):  # not -LOADING: the AOF is read back
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within 20 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last write; what it acknowledged must be in its append-only file."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.proc = None


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for the test; skips without the binary (fails with CTXFOLD_REQUIRE_REDIS=1)."""
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not on PATH (Debian: apt-get install redis-server)"
        if REQUIRE_REDIS:
            pytest.fail(f"{message} (CTXFOLD_REQUIRE_REDIS is set, so this is a failure)", pytrace=False)
        pytest.skip(message)
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(binary, folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()
