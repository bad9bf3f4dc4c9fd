"""A real redis-server on loopback for the session store's tests (the ``redis_server`` fixture of
tests/conftest.py): one process per test in its own directory, AOF on and fsynced on every write."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

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


