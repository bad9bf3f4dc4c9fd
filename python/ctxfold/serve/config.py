"""How ``ctxfold serve`` runs: :class:`ProxyConfig`, checked once at construction (the CLI, tests and
embedders all build one). Each field is the one place its setting is spelled: its check, and the flag of
``ctxfold serve`` that sets it (name, help, help group), are in its metadata (ctxfold.settings); the
command makes its flags from them and reads them back (ctxfold.cli._flags)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.cost import PriceTable, priced
from ctxfold.compaction.store import DEFAULT_LEASE_MS, DEFAULT_SPOOL_MAX_BYTES, is_shared_url
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
    DEFAULT_SESSION_TTL_S,
    ENGINE_CHECK_MODES,
    FSYNC_MODES,
)
from ctxfold.settings import REQUIRED, Check, setting, validate_fields
from ctxfold.tokens.counting import DEFAULT_TOKENIZER

SUMMARIZERS = ("upstream", "config", "extractive")  # ProxyConfig.summarizer
MIN_OPERATOR_TOKEN_CHARS = 16  # the token guards every tenant's figures: not a guessable word

# The sections of ``ctxfold serve --help`` the settings are listed in, in order (the command adds its
# own flags, listening and logging, to them).
LISTENING = "listening"
UPSTREAM = "upstream"
COMPACTION = "compaction"
SUMMARIES = "summaries"
CLIENTS = "clients"
STORAGE = "sessions and storage"
LOGGING = "logging"
HELP_GROUPS = (LISTENING, UPSTREAM, COMPACTION, SUMMARIES, CLIENTS, STORAGE, LOGGING)


def _upstream_url(url: str) -> str | None:
    if not url.startswith(("http://", "https://")):
        return (f"{redact_url(url)!r} is not an http(s) URL; expected the base URL of an OpenAI-compatible "
                "server, e.g. http://127.0.0.1:8000/v1")
    try:
        port = urlsplit(url).port
    except ValueError:
        port = -1
    if port == -1 or not urlsplit(url).hostname:
        return f"{redact_url(url)!r} has no host or a port outside 0-65535"
    return None


def _header_name(name: str) -> str | None:
    ok = re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name)  # RFC 9110 token characters
    return None if ok else f"{name!r} is not an HTTP header name"


def _operator_token(token: str) -> str | None:
    # The token itself is never in the message: it is a secret.
    if len(token) < MIN_OPERATOR_TOKEN_CHARS:
        return f"at least {MIN_OPERATOR_TOKEN_CHARS} characters (it guards every tenant's figures)"
    return None


def _store_url(url: str) -> str | None:
    if is_shared_url(url):
        return None
    return (f"{redact_url(url)!r} is not a redis://, rediss://, unix:// or valkey:// URL; the local data "
            "directory is --data-dir (the default store)")


_POSITIVE = Check(int, 1)
_SECONDS = Check(float, 0.0, lo_open=True, unit="seconds")  # finite and above 0
_TEXT = Check(str, optional=True)
_PATH = Check(Path)
_OPTIONAL_PATH = Check(Path, optional=True)
CLI_DATA_DIR = Path("ctxfold-data")  # where ``ctxfold serve`` keeps its data unless told


class _TtlByStore:
    """The command line's default of --session-ttl-s: 7 days with a shared store, none with the data
    directory (:func:`cli_session_ttl_s` resolves it once the store is known)."""

    def __repr__(self) -> str:
        return "604800 with --store, else 0"


TTL_BY_STORE = _TtlByStore()


def cli_session_ttl_s(value: object, store_url: str | None) -> float | None:
    """--session-ttl-s as given, or its default for the store in use."""
    if value is TTL_BY_STORE:
        return DEFAULT_SESSION_TTL_S if store_url is not None else None
    return value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """How ``ctxfold serve`` runs."""

    # Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1.
    upstream: str = setting(
        REQUIRED, Check(str, rule=_upstream_url), "--upstream", metavar="URL", group=UPSTREAM,
        help="the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    # Sessions, history dumps and (by default) archives live here. An embedder names it; the command
    # has a default, since a proxy started by hand needs somewhere to keep them.
    data_dir: Path = setting(
        REQUIRED, _PATH, "--data-dir", cli_default=CLI_DATA_DIR, group=STORAGE,
        help="sessions, history dumps and archives (default ./{default})")
    # context_tokens: the upstream's window.
    compact: CompactConfig = setting(
        check=Check(CompactConfig), default_factory=CompactConfig,
        via="--config, --context-tokens, --max-output-tokens, --reply-reserve-tokens, --summary-timeout-s")
    archive_url: str | None = setting(  # fsspec URL for archives shared by replicas (s3://..., memory://...)
        None, _TEXT, "--archive-url", metavar="URL", group=STORAGE,
        help="fsspec URL for archives shared by several proxy replicas (s3://bucket/prefix, ...)")
    # "upstream": the upstream model writes summaries; "config": the compact config's summarizer section;
    # "extractive": no model. Every one falls back to the extractive summary when it fails.
    summarizer: str = setting(
        "upstream", Check(str, choices=SUMMARIZERS), "--summarizer", group=SUMMARIES,
        help="who writes summaries: the upstream model (default), the summarizer section of --config, "
        "or no model (extractive); a failed summary always falls back to the extractive one")
    summary_model: str | None = setting(  # model for summaries; None: the model of the conversation's request
        None, _TEXT, "--summary-model", metavar="NAME", group=SUMMARIES,
        help="model for summaries (default: the request's model)")
    # The key summaries are sent with (summarizer "upstream"); None: the Authorization header of the client
    # request that triggered the compaction. Never shown (repr, health, logs), nor given on a command line.
    summary_api_key: str | None = setting(None, _TEXT, via="--summary-api-key-env", repr=False)
    max_body_bytes: int = setting(  # larger request bodies get 413
        DEFAULT_MAX_BODY_BYTES, _POSITIVE, "--max-body-bytes", metavar="N", group=CLIENTS,
        help="largest request body accepted, else 413 (default {default})")
    # The upstream's answers, bounded as the clients' requests are: a JSON answer (or an error body) past
    # max_answer_bytes is a 502, a stream past it or one event past max_event_bytes ends with an error
    # event. An unbounded answer would hold the proxy's memory for as long as the upstream sends.
    max_answer_bytes: int = setting(
        DEFAULT_MAX_ANSWER_BYTES, _POSITIVE, "--max-answer-bytes", metavar="N", group=UPSTREAM,
        help="largest upstream answer relayed: past it a JSON answer is a 502 and a stream ends with "
        "an error event (default {default})")
    max_event_bytes: int = setting(
        DEFAULT_MAX_EVENT_BYTES, _POSITIVE, "--max-event-bytes", metavar="N", group=UPSTREAM,
        help="largest event of an upstream stream: past it the stream ends with an error event (default {default})")
    connect_timeout_s: float = setting(  # to open a connection upstream
        10.0, _SECONDS, "--connect-timeout-s", metavar="S", group=UPSTREAM,
        help="to connect upstream (default {default})")
    read_timeout_s: float = setting(  # longest silence from the upstream (before the first byte or between chunks)
        600.0, _SECONDS, "--read-timeout-s", metavar="S", group=UPSTREAM,
        help="longest silence from the upstream before 504 or a cut stream (default {default})")
    max_recall_rounds: int = setting(  # read_archive rounds answered by the proxy within one request
        4, Check(int, 0), "--max-recall-rounds", metavar="N", group=COMPACTION,
        help="read_archive rounds the proxy answers within one request (default {default})")
    # read_archive output the proxy adds to one request, all its calls and rounds together: each call
    # may ask for 100k characters, and a model that asks for hundreds at once would otherwise make the
    # next upstream request tens of megabytes. Past it, a call gets what is left and is told to go on later.
    max_recall_chars: int = setting(
        DEFAULT_MAX_RECALL_CHARS, _POSITIVE, "--max-recall-chars", metavar="N", group=COMPACTION,
        help="archived text the proxy's read_archive answers add to one request, all calls together; "
        "beyond it the model is told to read on later (default {default})")
    # A client must send a request's head, and its body, within this; an idle kept-alive connection is
    # closed after it. Half-sent requests would otherwise hold a connection (and its memory) for an hour.
    client_timeout_s: float = setting(
        DEFAULT_CLIENT_TIMEOUT_S, _SECONDS, "--client-timeout-s", metavar="S", group=CLIENTS,
        help="a client must send a request's head, and then its body, within this (else the "
        "connection is closed, or 408); idle connections close after it (default {default})")
    # Client connections open at once; more are answered 503 and closed. Each one in flight holds an
    # upstream connection too, and every loaded conversation an open log: all count against ulimit -n.
    max_connections: int = setting(
        DEFAULT_MAX_CONNECTIONS, _POSITIVE, "--max-connections", metavar="N", group=CLIENTS,
        help="client connections open at once; more are answered 503 and closed (default "
        "{default}; each also holds an upstream connection: mind ulimit -n)")
    # Conversations kept loaded (compactor, open event log); the least recently used beyond are closed
    # and read back from the data directory when they return.
    max_loaded_conversations: int = setting(
        DEFAULT_MAX_LOADED_CONVERSATIONS, _POSITIVE, "--max-loaded-sessions", "--max-loaded-conversations",
        metavar="N", group=STORAGE,
        help="sessions kept in memory (each with at most one open file); the least recently used "
        "conversations beyond are closed and read back from --data-dir when they return (default {default})")
    # Event-log bytes of the loaded sessions, all together: the memory they hold is about this.
    max_loaded_bytes: int = setting(
        DEFAULT_MAX_LOADED_BYTES, _POSITIVE, "--max-loaded-bytes", metavar="N", group=STORAGE,
        help="event-log bytes of the loaded sessions, all together (the memory they hold is about this); "
        "beyond, the least recently used conversations are closed (default {default})")
    # The request header whose value names the tenant (hashed with the tenant key, never kept in clear).
    tenant_header: str = setting(
        "Authorization", Check(str, rule=_header_name), "--tenant-header", metavar="NAME", group=CLIENTS,
        help="the request header whose value names the client's tenant, kept only as a keyed hash "
        "(default {default}); requests without it share one anonymous tenant")
    # The tenant HMAC key's file; None: $CTXFOLD_TENANT_KEY, else <data_dir>/tenant.key (made once).
    tenant_key_file: Path | None = setting(
        None, _OPTIONAL_PATH, "--tenant-key-file", metavar="FILE", group=CLIENTS,
        help="the secret the tenant hash is keyed with (default: $CTXFOLD_TENANT_KEY, else "
        "<data-dir>/tenant.key, made once)")
    # A secret that /metrics and the details of /health ask for (the X-Ctxfold-Operator-Token header):
    # they show every tenant's labels and counts, the upstream and the spool. None: open to every
    # client that reaches the port (put the proxy where only operators reach its port, or set this).
    # The command reads it from an environment variable: a command line is visible to every local user.
    operator_token: str | None = setting(
        None, Check(str, optional=True, rule=_operator_token), via="--operator-token-env", repr=False)
    # fsync of the session logs. "compactions" (default): what the client cannot send again (compactions
    # and their summaries, archives) is fsynced; the session's start and its messages are written (a
    # killed proxy loses nothing) and become durable with the next fsync, since every request carries
    # the whole history anyway. "always": every event, a thread hop and a disk flush per message on
    # the request's path. "never": nothing (a crash of the machine may lose the last compactions).
    fsync: str = setting(
        "compactions", Check(str, choices=FSYNC_MODES), "--fsync", group=STORAGE,
        help="fsync of the session logs: compactions (default: compactions and archives; the messages "
        "are written, and the client resends them anyway), always (every message too: a disk flush on "
        "each request's path), never (a machine crash may lose the last compactions; a killed proxy "
        "loses nothing in any mode)")
    # Prices per million tokens (ctxfold.compaction.cost.PriceTable) the compactions' cost is reported in
    # (metrics, log lines) and the minimum-gain rule weighs with; given, they replace the cost section's
    # prices in ``compact``. None: the cost section's, relative weights unless it names a currency (and
    # then no money is reported: weights are not money).
    prices: PriceTable | None = setting(
        None, Check(PriceTable, optional=True, parse=PriceTable.read), "--prices", "--price",
        metavar="PRICES", group=COMPACTION,
        help="price each compaction's cost in money (metrics and log lines) and weigh the minimum-gain rule "
        "with: a JSON or TOML file (input, cached, write, output per million tokens, and currency) or the "
        "same inline, e.g. input=3,cached=0.3,write=3.75,output=15 (cached and write default to input, "
        "currency to USD). Default: the cost section of --config, in relative weights (tokens only)")
    tokenizer: str = setting(  # token counter spec (ctxfold.tokens.counting.load_counter)
        DEFAULT_TOKENIZER, Check(str), "--tokenizer", metavar="SPEC", group=COMPACTION,
        help="token counter for the upstream's model: deepseek-v4, qwen3, mistral, o200k_base, "
        "cl100k_base, a tokenizer.json or .model file, estimate:NAME (an upper bound), auto:NAME (exact "
        "when installed, else the estimate, with a warning), or chars4 (default: {default}; the "
        "upstream's usage figures calibrate it per conversation)")
    # Chat template the upstream renders requests with (ctxfold.tokens.templates preset), None: message text only.
    # The template's control tokens also bound the accounting's work per append.
    template: str | None = setting(
        "deepseek-v4", _TEXT, "--template", metavar="SPEC", null_text="none", group=COMPACTION,
        help="chat template the upstream renders requests with: deepseek-v3.2, deepseek-v4, chatml, "
        "mistral-v7, gemma-3, llama-3.1, llama-3.2, the model's own Jinja template (hf:PATH, "
        "gguf:PATH, file:PATH), or none for message text alone (default: {default})")
    # The shared session store (redis://, rediss://, unix://, valkey://): every replica reads and writes
    # its sessions there (ctxfold.compaction.store); None: the data directory, one process's. Never shown with its
    # password (redact_url).
    store_url: str | None = setting(
        None, Check(str, optional=True, rule=_store_url), "--store", metavar="URL", group=STORAGE, repr=False,
        help="a session store shared by several proxy processes or machines: redis://HOST:PORT/DB, "
        "rediss://, unix://, valkey:// (options: ?prefix=, durability=always|everysec, blobs=<fsspec "
        "URL>; see docs/store.md); default: --data-dir, for one process")
    # The local spool keeping the shared store's writes that failed, until it is back (bytes, per process).
    spool_max_bytes: int = setting(
        DEFAULT_SPOOL_MAX_BYTES, _POSITIVE, "--spool-max-bytes", metavar="N", group=STORAGE,
        help="with --store: the local spool (in --data-dir) that keeps session writes while the store "
        "is unreachable, per process (default {default})")
    # How long a replica's lease on a session lasts without renewal: a replica that stalls longer loses
    # the session to the next one that asks (its later writes are refused by the fencing token). Under
    # 100 ms a lease would lapse between a request's own writes.
    lease_ms: int = setting(
        DEFAULT_LEASE_MS, Check(int, 100), "--store-lease-ms", metavar="MS", group=STORAGE,
        help="with --store: how long a process's lease on a conversation lasts unrenewed; one that "
        "stalls longer loses it to another (default {default})")
    # Per tenant (serve.quota, docs/store.md "Quotas and expiry"): the sessions (a conversation and each
    # of its forks) and the bytes stored at once; a tenant at a bound gets its requests passed through
    # uncompacted, labelled, until some of its sessions expire. None: no bound (the default: one API
    # key shared by a whole team is one tenant, and no number suits every deployment).
    max_sessions_per_tenant: int | None = setting(
        None, Check(int, 1, optional=True), "--max-sessions-per-tenant", metavar="N", group=STORAGE,
        help="sessions (a conversation and each fork) a tenant keeps at once; past it, its new conversations "
        "pass through uncompacted, labelled, until some expire (default: no bound)")
    max_tenant_bytes: int | None = setting(
        None, Check(int, 1, optional=True), "--max-tenant-bytes", metavar="N", group=STORAGE,
        help="bytes a tenant's stored sessions hold at once (records, dumps, archives); at it, its requests "
        "pass through uncompacted, labelled, until some expire (default: no bound)")
    # A session untouched this long is deleted with its archive (Redis: key TTLs; the data directory: a
    # sweep). None: kept for ever. Nothing the client needs is lost (it sends its whole history, which a
    # new session compacts again), but `ctxfold restore` of an expired conversation is. The command line
    # expires a shared store's sessions after 7 days unless told otherwise (its memory is the bound that
    # matters) and keeps a data directory's (the operator's own disk, read by restore).
    session_ttl_s: float | None = setting(
        None, Check(float, 1.0, optional=True, unit="seconds"), "--session-ttl-s", metavar="S", group=STORAGE,
        cli_default=TTL_BY_STORE, null_text="0",
        help="a session untouched this long is deleted with its archive (the client's next request starts a new "
        "one from its history); 0 keeps sessions for ever (default: 604800, 7 days, with --store; 0 with the "
        "data directory)")
    # Whether the engine sees what ctxfold counts (ctxfold.serve.engine_check): "sampled" (a probe at
    # startup, and one answer in engine_check_every compared when the proxy counted its request anyway),
    # "startup" (the probe only), "every" (every request counted and compared: tests and benchmarks), "off".
    # The command line's default is "sampled"; an embedder's is "off": the proxy sends nothing upstream
    # that its clients did not send unless asked to.
    engine_check: str = setting(
        "off", Check(str, choices=ENGINE_CHECK_MODES), "--engine-check", cli_default=ENGINE_CHECK_MODES[0],
        group=UPSTREAM,
        help="whether the upstream sees what ctxfold counts: a probe at startup (tiny requests with "
        "a system and a tool message, max_tokens 1) and, with sampled (default), one answer in "
        "--engine-check-every compared when its request was counted anyway; every: each request "
        "counted and compared (for tests); startup: the probe only; off")
    engine_check_every: int = setting(
        DEFAULT_ENGINE_CHECK_EVERY, _POSITIVE, "--engine-check-every", metavar="N", group=UPSTREAM,
        help="answers per sampled comparison (default {default})")
    # Ask the upstream for usage in streamed answers (stream_options.include_usage) when the client did not,
    # so streams calibrate too; the usage event and the "usage": null of every chunk are kept from the client.
    # On by default on the command line (--no-stream-usage); off for an embedder unless set, for the
    # reason engine_check is.
    stream_usage: bool = setting(
        False, Check(bool), "--no-stream-usage", cli_default=True, group=UPSTREAM,
        help="do not ask the upstream for usage in streamed answers the client asked none for (by "
        "default the proxy asks, calibrates with it, and keeps it from the client)")

    def __post_init__(self) -> None:
        # Every setting the proxy is run with, checked here once: the CLI, tests and embedders all build one.
        validate_fields(self, "")
        if self.prices is not None:  # one cost section for the rule and the reports
            object.__setattr__(self, "compact", replace(self.compact, cost=priced(self.compact.cost, self.prices)))
        # A session's keys must outlive any lease on it by far: a grant renews their time, a renewal does not.
        ttl = self.session_ttl_s
        if ttl is not None and self.store_url is not None and ttl * 1000 < 2 * self.lease_ms:
            raise ConfigError(f"session_ttl_s: {ttl:g} s is shorter than twice the store lease ({self.lease_ms} ms); "
                              "idle sessions must outlive any request working on them")

    @property
    def money_prices(self) -> PriceTable | None:
        """The prices the compactions' cost is reported in, in money; None when they are relative weights."""
        table = PriceTable.from_config(self.compact.cost)
        return table if table.money else None

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

