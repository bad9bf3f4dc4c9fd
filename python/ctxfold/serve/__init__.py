"""``ctxfold serve``: an OpenAI-compatible proxy that keeps every conversation inside the window.

- :mod:`ctxfold.serve.app`: the aiohttp server (:class:`ProxyConfig`, :class:`ProxyApp`, :func:`serve`).
- :mod:`ctxfold.serve.sessions`: which stored conversation a request continues.
- :mod:`ctxfold.serve.sse`: reading an event stream on the side while it passes through.
- :mod:`ctxfold.serve.metrics`: Prometheus text metrics.
- :mod:`ctxfold.serve.testing`: a scripted upstream for tests and benchmarks.
"""

from __future__ import annotations

from ctxfold.serve.app import BadRequest, ProxyApp, ProxyConfig, parse_request, serve
from ctxfold.serve.sessions import SESSION_HEADER, ProxySession, SessionStore, fingerprint, session_key

__all__ = [
    "SESSION_HEADER",
    "BadRequest",
    "ProxyApp",
    "ProxyConfig",
    "ProxySession",
    "SessionStore",
    "fingerprint",
    "parse_request",
    "serve",
    "session_key",
]
