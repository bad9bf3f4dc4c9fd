"""How ``ctxfold serve`` runs: :class:`ProxyConfig`, checked once at construction (the CLI, tests and
embedders all build one; the CLI only converts its flags)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ctxfold.config import CompactConfig
from ctxfold.errors import ConfigError
from ctxfold.serve import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_ENGINE_CHECK_EVERY,
    DEFAULT_MAX_ANSWER_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LOADED_BYTES,
    DEFAULT_MAX_LOADED_CONVERSATIONS,
    DEFAULT_MAX_RECALL_CHARS,
    ENGINE_CHECK_MODES,
    FSYNC_MODES,
)
from ctxfold.store import DEFAULT_LEASE_MS, DEFAULT_SPOOL_MAX_BYTES, is_shared_url


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """How ``ctxfold serve`` runs."""

    upstream: str  # base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1
    data_dir: Path  # sessions, history dumps and (by default) archives live here
    compact: CompactConfig = field(default_factory=CompactConfig)  # context_tokens: the upstream's window
    archive_url: str | None = None  # fsspec URL for archives shared by replicas (s3://..., memory://...)
    # "upstream": the upstream model writes summaries; "config": the compact config's summarizer section;
    # "extractive": no model. Every one falls back to the extractive summary when it fails.
    summarizer: str = "upstream"
    summary_model: str | None = None  # model for summaries; None: the model of the conversation's request
    # The key summaries are sent with (summarizer "upstream"); None: the Authorization header of the client
    # request that triggered the compaction. Never shown (repr, health, logs).
    summary_api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    # The upstream's answers, bounded as the clients' requests are: a JSON answer (or an error body) past
    # max_answer_bytes is a 502, a stream past it or one event past max_event_bytes ends with an error
    # event. An unbounded answer would hold the proxy's memory for as long as the upstream sends.
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    connect_timeout_s: float = 10.0  # to open a connection upstream
    read_timeout_s: float = 600.0  # longest silence from the upstream (before the first byte or between chunks)
    max_recall_rounds: int = 4  # read_archive rounds answered by the proxy within one request
    # read_archive output the proxy adds to one request, all its calls and rounds together: each call
    # may ask for 100k characters, and a model that asks for hundreds at once would otherwise make the
    # next upstream request tens of megabytes. Past it, a call gets what is left and is told to go on later.
    max_recall_chars: int = DEFAULT_MAX_RECALL_CHARS
    # A client must send a request's head, and its body, within this; an idle kept-alive connection is
    # closed after it. Half-sent requests would otherwise hold a connection (and its memory) for an hour.
    client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S
    # Client connections open at once; more are answered 503 and closed. Each one in flight holds an
    # upstream connection too, and every loaded conversation an open log: all count against ulimit -n.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # Conversations kept loaded (compactor, open event log); the least recently used beyond are closed
    # and read back from the data directory when they return.
    max_loaded_conversations: int = DEFAULT_MAX_LOADED_CONVERSATIONS
    # Event-log bytes of the loaded sessions, all together: the memory they hold is about this.
    max_loaded_bytes: int = DEFAULT_MAX_LOADED_BYTES
    # The request header whose value names the tenant (hashed with the tenant key, never kept in clear).
    tenant_header: str = "Authorization"
    # The tenant HMAC key's file; None: $CTXFOLD_TENANT_KEY, else <data_dir>/tenant.key (made once).
    tenant_key_file: Path | None = None
    # A secret that /metrics and the details of /health ask for (the X-Ctxfold-Operator-Token header):
    # they show every tenant's labels and counts, the upstream and the spool. None: open to every
    # client that reaches the port (put the proxy where only operators reach its port, or set this).
    operator_token: str | None = field(default=None, repr=False)
    # fsync of the session logs. "compactions" (default): what the client cannot send again (compactions
    # and their summaries, archives) is fsynced; the session's start and its messages are written (a
    # killed proxy loses nothing) and become durable with the next fsync, since every request carries
    # the whole history anyway. "always": every event, a thread hop and a disk flush per message on
    # the request's path. "never": nothing (a crash of the machine may lose the last compactions).
    fsync: str = "compactions"
    tokenizer: str = "estimate:deepseek-v4"  # token counter spec (ctxfold.counting.load_counter)
    # Chat template the upstream renders requests with (ctxfold.templates preset), None: message text only.
    # The template's control tokens also bound the accounting's work per append.
    template: str | None = "deepseek-v4"
    # The shared session store (redis://, rediss://, unix://, valkey://): every replica reads and writes
    # its sessions there (ctxfold.store); None: the data directory, one process's. Never shown with its
    # password (redact_url).
    store_url: str | None = field(default=None, repr=False)
    # The local spool keeping the shared store's writes that failed, until it is back (bytes, per process).
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    # How long a replica's lease on a session lasts without renewal: a replica that stalls longer loses
    # the session to the next one that asks (its later writes are refused by the fencing token).
    lease_ms: int = DEFAULT_LEASE_MS
    # Per tenant (serve.quota, docs/store.md "Quotas and expiry"): the sessions (a conversation and each
    # of its forks) and the bytes stored at once; a tenant at a bound gets its requests passed through
    # uncompacted, labelled, until some of its sessions expire. None: no bound (the default: one API
    # key shared by a whole team is one tenant, and no number suits every deployment).
    max_sessions_per_tenant: int | None = None
    max_tenant_bytes: int | None = None
    # A session untouched this long is deleted with its archive (Redis: key TTLs; the data directory: a
    # sweep). None: kept for ever (an embedder's default; the command line's is 7 days). Nothing the
    # client needs is lost: it sends its whole history, which a new session compacts again.
    session_ttl_s: float | None = None
    # Whether the engine sees what ctxfold counts (ctxfold.serve.engine_check): "sampled" (a probe at
    # startup, and one answer in engine_check_every compared when the proxy counted its request anyway),
    # "startup" (the probe only), "every" (every request counted and compared: tests and benchmarks), "off".
    # The command line's default is "sampled"; an embedder's is "off": the proxy sends nothing upstream
    # that its clients did not send unless asked to.
    engine_check: str = "off"
    engine_check_every: int = DEFAULT_ENGINE_CHECK_EVERY
    # Ask the upstream for usage in streamed answers (stream_options.include_usage) when the client did not,
    # so streams calibrate too; the usage event and the "usage": null of every chunk are kept from the client.
    # On by default on the command line (--no-stream-usage); off for an embedder unless set.
    stream_usage: bool = False

    def __post_init__(self) -> None:
        if self.fsync not in FSYNC_MODES:
            raise ConfigError(f"fsync: {self.fsync!r} is not one of {', '.join(FSYNC_MODES)}")
        if self.engine_check not in ENGINE_CHECK_MODES:
            raise ConfigError(f"engine_check: {self.engine_check!r} is not one of {', '.join(ENGINE_CHECK_MODES)}")
        if self.summarizer not in ("upstream", "config", "extractive"):
            raise ConfigError(f"summarizer: {self.summarizer!r} is not one of upstream, config, extractive")
        if not self.upstream.startswith(("http://", "https://")):
            raise ConfigError(f"upstream: {redact_url(self.upstream)!r} is not an http(s) URL; expected the base "
                              "URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
        try:
            port = urlsplit(self.upstream).port
        except ValueError:
            port = -1
        if port == -1 or not urlsplit(self.upstream).hostname:
            raise ConfigError(f"upstream: {redact_url(self.upstream)!r} has no host or a port outside 0-65535")
        # Every number the proxy is run with, checked here once: the CLI, tests and embedders all build one.
        if self.operator_token is not None and len(self.operator_token) < 16:
            raise ConfigError("operator token: at least 16 characters (it guards every tenant's figures)")
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", self.tenant_header):
            raise ConfigError(f"tenant_header: {self.tenant_header!r} is not an HTTP header name")
        if self.store_url is not None and not is_shared_url(self.store_url):
            raise ConfigError(f"store: {redact_url(self.store_url)!r} is not a redis://, rediss://, unix:// or "
                              "valkey:// URL; the local data directory is --data-dir (the default store)")
        for name, low in (("max_body_bytes", 1), ("max_answer_bytes", 1), ("max_event_bytes", 1),
                          ("spool_max_bytes", 1), ("lease_ms", 100),
                          ("max_loaded_conversations", 1), ("max_loaded_bytes", 1), ("max_recall_rounds", 0),
                          ("max_recall_chars", 1), ("max_connections", 1), ("engine_check_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name}: must be a whole number >= {low}, got {value!r}")
        for name in ("max_sessions_per_tenant", "max_tenant_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}: must be a whole number >= 1, or None for no bound, got {value!r}")
        self._check_ttl()
        for name in ("connect_timeout_s", "read_timeout_s", "client_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name}: must be a positive, finite number of seconds, got {value!r}")

    def _check_ttl(self) -> None:
        ttl = self.session_ttl_s
        if ttl is None:
            return
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl < math.inf:
            raise ConfigError(f"session_ttl_s: must be a finite number of seconds >= 1, or None to keep sessions, "
                              f"got {ttl!r}")
        # A session's keys must outlive any lease on it by far: a grant renews their time, a renewal does not.
        if self.store_url is not None and ttl * 1000 < 2 * self.lease_ms:
            raise ConfigError(f"session_ttl_s: {ttl:g} s is shorter than twice the store lease ({self.lease_ms} ms); "
                              "idle sessions must outlive any request working on them")

    @property
    def quotas_on(self) -> bool:
        """Whether anything per tenant is bounded or expires (the proxy then keeps accounts)."""
        return bool(self.max_sessions_per_tenant or self.max_tenant_bytes or self.session_ttl_s)

    @property
    def completions_url(self) -> str:
        base = self.upstream.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + "/chat/completions"

    @property
    def base_url(self) -> str:
        return self.completions_url.removesuffix("/chat/completions")

    def upstream_target(self, path_qs: str) -> str:
        """Where a request the proxy relays goes on the upstream's origin: ``/v1/...`` under the
        upstream's base path (``/v1/models`` -> ``/openai/v1/models`` for ``http://h/openai/v1``),
        any other path as it is."""
        if path_qs == "/v1" or path_qs.startswith(("/v1/", "/v1?")):
            return urlsplit(self.base_url).path + path_qs.removeprefix("/v1")
        return path_qs



def redact_url(url: str) -> str:
    """``url`` without the password of its user part (``http://user:***@host/v1``), for whatever a
    person or a log may read: health, errors, the startup line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))

