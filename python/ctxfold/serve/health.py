"""What the proxy tells its operator: ``GET /health`` (ok or degraded, and why: the data directory, the
session store, the upstream) and ``GET /metrics`` (Prometheus), both behind the operator token when one is
set (a load balancer's check gets the status alone)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ctxfold.serve.config import ProxyConfig, redact_url
from ctxfold.serve.engine_check import EngineCheck
from ctxfold.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ctxfold.serve.metrics import ProxyMetrics
from ctxfold.serve.request import OPERATOR_HEADER, error_response
from ctxfold.serve.sessions import SessionStore
from ctxfold.serve.upstream import UpstreamClient

log = logging.getLogger("ctxfold.serve")

# /health asks whether the upstream can be reached at most this often.
UPSTREAM_PROBE_INTERVAL_S = 5.0


class Operations:
    """The operator's routes of one proxy."""

    def __init__(self, config: ProxyConfig, sessions: SessionStore, metrics: ProxyMetrics, engine_check: EngineCheck,
                 client: Callable[[], UpstreamClient]) -> None:
        self.config = config
        self.sessions = sessions
        self.proxy_metrics = metrics
        self.engine_check = engine_check
        self._client = client
        self._upstream_probed: tuple[float, str | None] = (-math.inf, None)  # (when, why unreachable)
        self._health_problem: str | None = None  # what /health said last (None: ok), to log its changes

    def _operator(self, request: web.Request) -> bool:
        """Whether ``request`` may read the operator's figures (``operator_token``, when one is set)."""
        token = self.config.operator_token
        given = request.headers.get(OPERATOR_HEADER, "")
        return token is None or hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())

    async def health(self, request: web.Request) -> web.Response:
        problem = await asyncio.to_thread(self.sessions.storage_problem)
        if problem is None:
            problem = await self.sessions.store_problem()
        if problem is None:
            problem = await self._upstream_problem()
        report: dict[str, Any] = {"status": "ok" if problem is None else "degraded",
                                  "upstream": redact_url(self.config.completions_url),
                                  "sessions_loaded": self.sessions.num_sessions,
                                  "engine_check": self.engine_check.report.as_dict()}
        if problem is not None:  # requests still pass through, uncompacted: the reason is the operator's to fix
            report["reason"] = problem
        if not self._operator(request):  # a load balancer's check: the status alone, no details
            report = {"status": report["status"]}
        if problem != self._health_problem:  # said once per change, not once per probe
            if problem is not None:
                log.warning("health: degraded: %s", problem, extra={"health": "degraded", "reason": problem})
            else:
                log.info("health: ok again", extra={"health": "ok"})
            self._health_problem = problem
        spool = self.sessions.spool
        if spool is not None:  # refused and unreadable batches are the operator's to look at, not an outage
            report["spool"] = {"pending_batches": spool.num_pending, "refused_batches": spool.num_refused,
                               "unreadable_files": [str(p) for p in spool.set_aside]}
        return web.json_response(report, status=200 if problem is None else 503)

    async def _upstream_problem(self) -> str | None:
        """Why the upstream cannot be reached, asked at most every UPSTREAM_PROBE_INTERVAL_S (a health
        check every second must not cost a connection every second)."""
        now = time.monotonic()
        if now - self._upstream_probed[0] >= UPSTREAM_PROBE_INTERVAL_S:
            why = await self._client().unreachable()
            if why is not None and self._upstream_probed[1] is None:
                log.warning("the upstream %s cannot be reached: %s", redact_url(self.config.completions_url), why)
            self._upstream_probed = (now, why)
        why = self._upstream_probed[1]
        return None if why is None else f"the upstream {redact_url(self.config.completions_url)} cannot be reached: {why}"

    async def metrics(self, request: web.Request) -> web.Response:
        if not self._operator(request):
            return error_response(404, f"no such path without the {OPERATOR_HEADER} header",
                                  code="not_found")
        self.proxy_metrics.note_state(self.sessions)
        return web.Response(body=self.proxy_metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE,
                                                                 "X-Content-Type-Options": "nosniff"})
