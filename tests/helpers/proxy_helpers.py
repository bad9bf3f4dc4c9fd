"""What the proxy's tests share: a proxy on loopback in front of the scripted upstream, and a client.

The fixtures built on these (``upstream``, ``proxy``) live in conftest.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from ctxfold.compaction.config import CompactConfig
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.app import runner_options
from ctxfold.serve.testing import BackgroundServer


def start_proxy(upstream_url: str, data_dir: Path, **kw: Any) -> tuple[ProxyApp, BackgroundServer]:
    """A proxy with the extractive summarizer and no fsync (the window unknown unless ``compact=``)."""
    compact = kw.pop("compact", CompactConfig(context_tokens=None))
    cfg = ProxyConfig(upstream=upstream_url, data_dir=data_dir, compact=compact, summarizer="extractive",
                      fsync="never", **kw)
    proxy = ProxyApp(cfg)
    return proxy, serve_in_background(proxy).__enter__()


@contextmanager
def started_proxies(upstream_url: str, tmp_path: Path, n: int, **kw: Any) -> Iterator[list[tuple[ProxyApp, str]]]:
    """``n`` proxies in this process (each its own event loop and thread, and data directory
    ``tmp_path/app<i>``), with the same settings (``store_url=`` to share one store): (app, URL) each."""
    out: list[tuple[ProxyApp, str]] = []
    servers = []
    try:
        for i in range(n):
            app, srv = start_proxy(upstream_url, tmp_path / f"app{i}", **kw)
            servers.append(srv)
            out.append((app, srv.url))
        yield out
    finally:
        for srv in servers:
            srv.close()


def serve_in_background(proxy: ProxyApp) -> BackgroundServer:
    """The proxy on loopback, run as ``ctxfold serve`` runs it (its runner options: client timeouts,
    a handler cancelled when its client leaves)."""
    return BackgroundServer(proxy.app(), **runner_options(proxy.config))


def chat(*turns: tuple[str, str], system: str = "You are terse.", **extra: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in turns]
    return {"model": "m", "messages": msgs, **extra}


def post(url: str, body: Any, *, raw: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 30.0) -> httpx.Response:
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/chat/completions", content=data, timeout=timeout,
                      headers={"Content-Type": "application/json", **(headers or {})})


def metric(text: str, sample: str, **labels: str) -> float | None:
    """The value of ``sample`` (a series name, e.g. ``ctxfold_requests_total``) with exactly ``labels`` in
    a /metrics text, read with the Prometheus client's own parser; None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return float(s.value)
    return None


def settle(app: ProxyApp, timeout_s: float = 30.0) -> None:
    """Wait until the proxy has recorded the answers it sent. It records an answer after the client has
    it, still under the conversation's lock: a test that reads the data directory at once may be
    early, and a request sent before the answer is recorded continues the conversation without it (a
    branch of its own). The time limit is a safety net: the wait ends on the lock's release."""
    deadline = time.monotonic() + timeout_s
    while app.sessions.num_locked:
        assert time.monotonic() < deadline, "a conversation stayed locked"
        time.sleep(0.01)
