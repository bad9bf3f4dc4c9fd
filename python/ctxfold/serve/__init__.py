"""``ctxfold serve``: an OpenAI-compatible proxy that keeps every conversation inside the window.

- :mod:`ctxfold.serve.app`: the aiohttp server (:class:`ProxyApp`, :func:`serve`), routes and relay.
- :mod:`ctxfold.serve.config`: :class:`ProxyConfig`, every setting checked once.
- :mod:`ctxfold.serve.request`: reading and checking a request; OpenAI-shaped errors.
- :mod:`ctxfold.serve.sessions`: which stored conversation a request continues.
- :mod:`ctxfold.serve.compaction`: a request's messages into its compactor, the outgoing body.
- :mod:`ctxfold.serve.forward`: forwarding and the answer back (JSON or SSE), with recall
  (:mod:`ctxfold.serve.recall`).
- :mod:`ctxfold.serve.record`: recording the answer; :mod:`ctxfold.serve.window`: calibration.
- :mod:`ctxfold.serve.summaries`: upstream summaries through the proxy's own client.
- :mod:`ctxfold.serve.upstream`: the HTTP/1.1 client the proxy asks its upstream with.
- :mod:`ctxfold.serve.sse`: folding a streamed answer into the message it carries (the SSE reader itself is :mod:`ctxfold.wire.sse`).
- :mod:`ctxfold.serve.metrics`: Prometheus text metrics.
- :mod:`ctxfold.serve.testing`: a scripted upstream for tests and benchmarks.

The proxy needs aiohttp and httptools (``pip install 'ctxfold[serve]'``); they are imported on first
use, so the rest of ctxfold (and ``ctxfold --help``) works without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

DEFAULT_MAX_BODY_BYTES = 32 << 20  # 32 MiB: a long agent history is a few MiB of JSON
# An answer is one assistant message: a very long one is a few hundred kB, a stream of it a few MB (each
# delta an event of its own, ~200 bytes of framing). 64 MiB and 8 MiB an event leave room for any model
# while bounding what one upstream can make the proxy hold.
DEFAULT_MAX_ANSWER_BYTES = 64 << 20
DEFAULT_MAX_EVENT_BYTES = 8 << 20
# Sessions kept in memory: each holds its compactor and, once written to, an open event log, so an
# unbounded set would run a long-lived proxy out of memory and file descriptors. The least recently
# used conversations beyond this are closed and read back from disk when they come back.
DEFAULT_MAX_LOADED_CONVERSATIONS = 512
# Event-log bytes of the loaded sessions (a loaded session holds its messages parsed, and the dicts they
# came in, sharing their text: about its log's size in memory, twice that while it is read). Past it,
# the least recently used conversations are closed.
DEFAULT_MAX_LOADED_BYTES = 256 << 20
FSYNC_MODES = ("compactions", "always", "never")  # ProxyConfig.fsync, the first is the default
# ProxyConfig.engine_check (ctxfold.serve.engine_check), the first is the default.
ENGINE_CHECK_MODES = ("sampled", "startup", "every", "off")
DEFAULT_ENGINE_CHECK_EVERY = 16  # answers per sampled comparison of prompt tokens
# read_archive output added to one request, all calls and rounds together: one full-size read (the
# tool's own cap per call), about 25k tokens.
DEFAULT_MAX_RECALL_CHARS = 100_000
# The command line's idle time before a session is deleted: long enough that a conversation paused over a
# weekend keeps its compactions, short enough that a client opening conversations without end does not
# grow the store for ever (docs/store.md, "Quotas and expiry").
DEFAULT_SESSION_TTL_S = 7 * 24 * 3600.0
# A request's head and body must arrive within this; idle kept-alive connections close after it.
DEFAULT_CLIENT_TIMEOUT_S = 60.0
# Client connections at once. With an upstream connection each and an open log per loaded conversation
# (512), this stays inside the usual 1024 file descriptors.
DEFAULT_MAX_CONNECTIONS = 200
PORT_RANGE = (0, 65535)

if TYPE_CHECKING:
    from ctxfold.serve.app import BadRequest, ProxyApp, ProxyConfig, parse_request, serve
    from ctxfold.serve.keys import SESSION_HEADER, fingerprint, session_key
    from ctxfold.serve.routing import ProxySession
    from ctxfold.serve.sessions import SessionStore

_LAZY = {
    "BadRequest": "app", "ProxyApp": "app", "ProxyConfig": "app", "parse_request": "app", "serve": "app",
    "SESSION_HEADER": "keys", "ProxySession": "routing", "SessionStore": "sessions",
    "fingerprint": "keys", "session_key": "keys",
}


def require_serve_extra() -> None:
    """Raise ModuleNotFoundError with the install line when a package of the proxy is missing."""
    for name in ("aiohttp", "httptools", "prometheus_client"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                f"ctxfold serve needs {name}, which is not installed; pip install 'ctxfold[serve]'") from None


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ctxfold.serve' has no attribute {name!r}")
    if module == "app":
        require_serve_extra()
    return getattr(importlib.import_module(f"ctxfold.serve.{module}"), name)


__all__ = [
    "DEFAULT_CLIENT_TIMEOUT_S",
    "DEFAULT_ENGINE_CHECK_EVERY",
    "DEFAULT_MAX_ANSWER_BYTES",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_LOADED_BYTES",
    "DEFAULT_MAX_LOADED_CONVERSATIONS",
    "DEFAULT_MAX_RECALL_CHARS",
    "DEFAULT_SESSION_TTL_S",
    "ENGINE_CHECK_MODES",
    "FSYNC_MODES",
    "PORT_RANGE",
    "SESSION_HEADER",
    "BadRequest",
    "ProxyApp",
    "ProxyConfig",
    "ProxySession",
    "SessionStore",
    "fingerprint",
    "parse_request",
    "require_serve_extra",
    "serve",
    "session_key",
]
