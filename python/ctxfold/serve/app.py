"""The compacting proxy: an aiohttp server in front of any OpenAI-compatible chat.completions endpoint.

This module holds the routes, startup, health, metrics and the relay of every other path; a chat
completion goes through the modules below, each calling only those after it:

1. :mod:`~ctxfold.serve.request`: read the body within ``max_body_bytes`` and ``client_timeout_s``,
   decode and check it (400 in OpenAI's error shape, naming what and where);
2. :mod:`~ctxfold.serve.sessions`: find the conversation it continues (the key in
   :meth:`ProxyApp.completions`, the session in :meth:`ProxyApp._route_and_compact`: the only calls
   into it), under that conversation's lock;
3. :mod:`~ctxfold.serve.compaction`: append the new messages to its compactor, run the automatic
   passes and build the outgoing body from the compacted view (``read_archive`` offered once the
   conversation has archived outputs);
4. :mod:`~ctxfold.serve.forward`: send it upstream and the answer back, JSON or event stream, the
   upstream's bytes and headers unchanged, answering the model's ``read_archive`` calls itself
   (:mod:`~ctxfold.serve.recall`); an upstream that refuses the prompt as too long gets it again
   once, compacted to a lower window (:mod:`~ctxfold.serve.window`);
5. :mod:`~ctxfold.serve.record`: once the client has the answer, record it in the session and
   calibrate the conversation's token estimate with the upstream's ``usage``.

A client that leaves cancels its handler (:func:`runner_options`): the upstream call is closed at
once and the conversation's lock released. Steps 3 and 5 run to their end all the same
(:func:`uncancelled`): they keep what the client sent, and a compactor stopped half way through an
append would not match its log.

Errors: see :mod:`~ctxfold.serve.forward`. A failed summary never fails a request: the compactor falls
back to the extractive summary (logged, and counted by reason). Whatever happens upstream, the
client's messages are already in the session, so a retry continues the same conversation.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

from aiohttp import web

from ctxfold.compaction.store import QuotaExceeded, Spooled, Store, StoreError, open_store
from ctxfold.errors import ConfigError, NoFitError
from ctxfold.serve.anthropic import ANTHROPIC, count_tokens_body
from ctxfold.serve.compaction import CompactionStep, Outgoing, failure_kind
from ctxfold.serve.compactors import Compactors
from ctxfold.serve.config import ProxyConfig, redact_url
from ctxfold.serve.dialect import OPENAI, Dialect
from ctxfold.serve.engine_check import EngineCheck
from ctxfold.serve.forward import Forwarder, PromptTooLong
from ctxfold.serve.health import Operations
from ctxfold.serve.keys import (
    ANONYMOUS_TENANT,
    MAX_SESSION_KEY_CHARS,
    SESSION_HEADER,
    TENANT_KEY_ENV,
    TENANT_KEY_FILE,
    ConversationKey,
    load_tenant_key,
    tenant_of,
)
from ctxfold.serve.listener import BoundedListener, runner_options
from ctxfold.serve.metrics import ProxyMetrics
from ctxfold.serve.quota import (
    DiskQuota,
    RefusalLog,
    refusal_reason,
    store_limits,
    sweep_data_dir,
    sweep_interval_s,
)
from ctxfold.serve.record import prompt_tokens, record
from ctxfold.serve.relay import relay_body
from ctxfold.serve.request import (
    OWN_REQUEST_HEADERS,
    RELAY_DROPPED_HEADERS,
    BadRequest,
    ParsedRequest,
    check_one_credential,
    error_response,
    parse_request,
    read_body,
    relayed_headers,
)
from ctxfold.serve.responses import RESPONSES
from ctxfold.serve.routing import ProxySession
from ctxfold.serve.sessions import WARNING_HEADER, SessionStore, StoreCompactorFactory, is_storage_error
from ctxfold.serve.tasks import uncancelled
from ctxfold.serve.upstream import UpstreamClient
from ctxfold.tokens.templates.jinja import TemplateRenderError

# Re-exported: the names the proxy's users and tests have imported from here.
__all__ = ["BadRequest", "BoundedListener", "ProxyApp", "ProxyConfig", "failure_kind", "make_runner", "parse_request",
           "redact_url", "runner_options", "serve", "uncancelled"]

log = logging.getLogger("ctxfold.serve")
access_log = logging.getLogger("ctxfold.access")

T = TypeVar("T")
_COUNTED = web.RequestKey("ctxfold_response_counted", bool)  # the response was counted in the metrics
_TENANT = web.RequestKey("ctxfold_tenant_label", str)  # the request's tenant, as the metrics label it
_WARNINGS = web.RequestKey("ctxfold_warnings", list[str])  # what the proxy could not do for a request


def request_warnings(request: web.Request) -> list[str]:
    """The warnings of a request, sent back as ``X-Ctxfold-Warning`` headers."""
    warnings: list[str] = request.setdefault(_WARNINGS, [])
    return warnings


async def add_warning_headers(request: web.Request, response: web.StreamResponse) -> None:
    """An ``on_response_prepare`` hook: each warning of the request as one header (ASCII, one line)."""
    for text in request.get(_WARNINGS, ()):
        response.headers.add(WARNING_HEADER, " ".join(text.split()).encode("ascii", "replace").decode())


class ProxyApp:
    """The proxy's state: configuration, sessions, the upstream client and the metrics."""

    def __init__(self, config: ProxyConfig, *, make_compactor: StoreCompactorFactory | None = None,
                 worker: int | None = None) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        from ctxfold.tokens.counting import LoneSurrogatesCounted, load_counter
        from ctxfold.tokens.templates import get_template

        # One counter and template for every conversation: both are stateless and thread-safe.
        # Requests may carry lone surrogate escapes, forwarded as they came: counted, never refused.
        self.counter = LoneSurrogatesCounted(load_counter(config.tokenizer))
        self.template = get_template(config.template) if config.template is not None else None
        store: Store | None = None
        if config.store_url is not None:
            # Each process its own spool (a worker keeps its number across restarts, and with it its spool).
            spool = config.data_dir / "spool" / (f"worker-{worker}" if worker is not None else "main")
            limits = store_limits(max_sessions=config.max_sessions_per_tenant, max_bytes=config.max_tenant_bytes,
                                  ttl_s=config.session_ttl_s) if config.quotas_on else None
            store = open_store(config.store_url, spool_dir=spool, spool_max_bytes=config.spool_max_bytes,
                               limits=limits)
            if config.tenant_key_file is None and not os.environ.get(TENANT_KEY_ENV):
                log.warning("tenants are keyed with %s/%s: replicas on other machines must use the same key "
                            "(--tenant-key-file or %s), else their tenants differ and share no conversation",
                            config.data_dir, TENANT_KEY_FILE, TENANT_KEY_ENV)
        self.compactors = Compactors(config, self.counter, self.template, self._client)
        # One path: the Store interface, a LocalStore in the data directory unless a shared one is named.
        self.sessions = SessionStore(config.data_dir, make_compactor or self.compactors.for_store,
                                     max_loaded_sessions=config.max_loaded_conversations,
                                     max_loaded_bytes=config.max_loaded_bytes, tenant_header=config.tenant_header,
                                     tenant_key=self._tenant_key(), archive_url=config.archive_url,
                                     fsync=config.fsync, store=store, lease_ms=config.lease_ms,
                                     quota=self._disk_quota())
        self.compactors.sessions = self.sessions
        self._replayer: asyncio.Task[None] | None = None  # writes the spool back once the store is back
        self._sweeper: asyncio.Task[None] | None = None  # deletes idle sessions, measures the accounts again
        self._refusals = RefusalLog()
        self._upstream: UpstreamClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop serving: the store's reads are asked on it
        self.compaction = CompactionStep(config, self.metrics)
        self.forwarder = Forwarder(config, self.metrics, self._client)
        self.engine_check = EngineCheck(mode=config.engine_check, every=config.engine_check_every,
                                        counter=self.counter, template=self.template, metrics=self.metrics,
                                        client=self._client, completions_url=config.completions_url,
                                        model=config.summary_model, api_key=config.summary_api_key)
        self._engine_probe: asyncio.Task[Any] | None = None

    def _disk_quota(self) -> DiskQuota | None:
        """The data directory's per-tenant accounts, when something is bounded or expires (a shared
        store keeps its own: see open_store's limits)."""
        c = self.config
        if c.store_url is not None or not c.quotas_on:
            return None
        return DiskQuota(c.data_dir, max_sessions=c.max_sessions_per_tenant, max_bytes=c.max_tenant_bytes,
                         ttl_s=c.session_ttl_s)

    def _tenant_key(self) -> bytes | None:
        """The key file's secret, read at startup so a bad file stops the proxy with one line; None:
        the store reads the environment or the data directory's key when a credential first comes."""
        path = self.config.tenant_key_file
        if path is None:
            return None
        try:
            return load_tenant_key(self.config.data_dir, path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"tenant_key_file: cannot read a tenant key from {path}: {e}") from None

    # -- app -----------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        # client_max_size backs up the Content-Length check for chunked uploads (read in a stream).
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        operations = Operations(self.config, self.sessions, self.metrics, self.engine_check, self._client)
        app.router.add_get("/health", operations.health)
        app.router.add_get("/metrics", operations.metrics)
        # Everything else (/v1/models, /v1/embeddings, a vendor's own paths) goes to the upstream as it came.
        app.router.add_route("*", "/{path:.*}", self.relay)
        app.on_response_prepare.append(add_warning_headers)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    def _client(self) -> UpstreamClient:
        if self._upstream is None:  # not an assert: python -O must not turn this into an AttributeError
            raise RuntimeError("the proxy's upstream client is used before the app started")
        return self._upstream

    async def _startup(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()
        self._upstream = UpstreamClient(self.config.completions_url, connect_timeout_s=self.config.connect_timeout_s,
                                        read_timeout_s=self.config.read_timeout_s)
        if self.sessions.spool is not None:
            self._replayer = self._loop.create_task(self._replay_spool())
        if self.config.quotas_on:
            if self.sessions.quota is not None:  # the accounts as the disk has them, before the first request
                await asyncio.to_thread(self.sessions.quota.scan)
            self._sweeper = self._loop.create_task(self._sweep())
        if self.config.engine_check != "off":
            # In a task of its own: the proxy serves while the engine answers the probe.
            self._engine_probe = asyncio.create_task(self.engine_check.startup())

    async def _replay_spool(self) -> None:
        """Write the spooled batches back as soon as the store answers again, whether requests come or not."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.sessions.replay_spool()
            except Exception:
                log.exception("replaying the local spool failed")

    async def _sweep(self) -> None:
        """Delete idle sessions (and, in the data directory, measure the accounts again) on a timer, the
        first sweep at once: sessions that went idle while the proxy was down go at its start."""
        store = self.sessions.store
        sweep_store = getattr(getattr(store, "inner", store), "sweep", None)  # a RedisStore's, spooled or not
        while True:
            try:
                if self.sessions.quota is not None:
                    await sweep_data_dir(self.sessions.quota, self.sessions.lock, self._forget_key)
                elif sweep_store is not None:
                    await sweep_store()
            except Exception as e:  # noqa: BLE001 - a failed sweep is tried again; requests go on
                log.warning("sweeping idle sessions failed: %s", e)
            await asyncio.sleep(sweep_interval_s(self.config.session_ttl_s))

    def _forget_key(self, key: str) -> None:
        self.sessions.unload(key)
        self.compactors.models.pop(key, None)

    async def _cleanup(self, app: web.Application) -> None:
        if self._replayer is not None:
            self._replayer.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._engine_probe is not None and not self._engine_probe.done():
            self._engine_probe.cancel()
            try:
                await self._engine_probe
            except asyncio.CancelledError:
                pass
        if self._upstream is not None:
            await self._upstream.close()
        await asyncio.to_thread(self.sessions.close)
        await self.sessions.aclose()

    async def relay(self, request: web.Request) -> web.StreamResponse:
        """A request the proxy does not handle, to the upstream and back: method, path and query,
        body and end-to-end headers one way; status, headers and body, as they come, the other."""
        try:
            check_one_credential(request.headers, self.config)
            body = await read_body(request, self.config)
        except BadRequest as e:
            refused = error_response(e.status, e.message, code=e.code, param=e.param)
            refused.force_close()
            return refused
        headers = relayed_headers(request.headers.items(), RELAY_DROPPED_HEADERS)
        return await self._relay_body(request, self.config.upstream_target(request.raw_path), body, headers)

    async def _relay_body(self, request: web.Request, target: str, body: bytes,
                          headers: list[tuple[str, str]], dialect: Dialect = OPENAI) -> web.StreamResponse:
        return await relay_body(request, self._client(), target, body, headers,
                                partial(self.forwarder.upstream_failure, dialect=dialect))

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's ``/v1/messages/count_tokens``: counted here when the tokenizer is the model's own
        (an exact counter, the chat template in use), else relayed to the upstream."""
        if not self.counter.exact:
            return await self.relay(request)
        try:
            check_one_credential(request.headers, self.config)
            parsed = ANTHROPIC.parse(await read_body(request, self.config))
            return count_tokens_body(parsed, self.compactors.count_view)
        except BadRequest as e:
            return ANTHROPIC.error(e.status, e.message, code=e.code, param=e.param)
        except Exception as e:  # a bug costs this request, in the dialect's own error shape
            log.exception("internal error while counting a request's tokens")
            return ANTHROPIC.error(500, f"internal error in ctxfold serve ({type(e).__name__}: {e})",
                                   kind="server_error", code="internal_error")

    # -- a chat completion (or an Anthropic message, or a response) -----------------------------------------
    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self.completions(request, ANTHROPIC)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self.completions(request, RESPONSES)

    async def completions(self, request: web.Request, dialect: Dialect = OPENAI) -> web.StreamResponse:
        t0 = time.perf_counter()
        resp: web.StreamResponse | None = None
        try:
            resp = await self._completion(request, t0, dialect)
            return resp
        finally:  # one access line per request, whatever became of it (a client that left: 499)
            if access_log.isEnabledFor(logging.INFO):
                self._access_line(request, resp, t0)

    def _access_line(self, request: web.Request, resp: web.StreamResponse | None, t0: float) -> None:
        status = resp.status if resp is not None else 499
        headers = resp.headers if resp is not None else {}
        fields = {"status": status, "tenant": self._tenant_label(request), "ms": round(1e3 * (time.perf_counter() - t0), 2),
                  "prompt_tokens": int(headers.get("X-Ctxfold-Prompt-Tokens", "0")) or None,
                  "compactions": int(headers.get("X-Ctxfold-Compactions", "0")),
                  "warnings": len(request.get(_WARNINGS, ()))}
        access_log.info("%s %s %d tenant=%s prompt_tokens=%s compactions=%d warnings=%d %.1f ms", request.method,
                        request.path, status, fields["tenant"], fields["prompt_tokens"], fields["compactions"],
                        fields["warnings"], fields["ms"], extra=fields)

    async def _completion(self, request: web.Request, t0: float, dialect: Dialect) -> web.StreamResponse:
        try:
            check_one_credential(request.headers, self.config)
            raw = await read_body(request, self.config)
            parsed = dialect.parse(raw)
            if parsed.relay_reason is not None:  # its history is not in the request: nothing to compact
                self._count_request(request, parsed.stream, None)
                return self._counted(request, await self._pass_through(request, parsed, parsed.relay_reason,
                                                                       "upstream_state", expected=True))
            header_key = request.headers.get(SESSION_HEADER)
            if header_key is not None and not (0 < len(header_key) <= MAX_SESSION_KEY_CHARS):
                raise BadRequest(400, f"{SESSION_HEADER} must be 1 to {MAX_SESSION_KEY_CHARS} characters",
                                 code="invalid_session", param=SESSION_HEADER)
            parsed.authorization = request.headers.get("Authorization")  # for summaries this request triggers
            try:
                key = self.sessions.key_for(request.headers, parsed.system, parsed.messages)
                self._count_request(request, parsed.stream, key)
                model = parsed.body.get("model")
                if isinstance(model, str):
                    self.compactors.models.setdefault(key, model)
                async with self.sessions.lock(key):
                    try:
                        return await self._handle(request, parsed, key, t0)
                    finally:  # the conversation's leases: the next request may go to any replica
                        # Eager with a local store: its release never waits, so a client that left
                        # after its answer cancels nothing (no turn of the loop to deliver it in).
                        await uncancelled(self.sessions.finish(key), eager=not self.sessions.store.shared)
            except OSError as e:
                if not is_storage_error(e):
                    raise
                if _TENANT not in request:  # no key: the tenant key could not be read or written
                    self._count_request(request, parsed.stream, None)
                reason = self.sessions.note_storage_error(e)
                return self._counted(request, await self._pass_through(request, parsed, reason, "storage_error"))
            except QuotaExceeded as e:
                return self._counted(request, await self._over_quota(request, parsed, e))
            except StoreError as e:
                # Redis unreachable or failing, a write refused by its fencing token, a lease held too
                # long elsewhere: the client gets its answer, uncompacted; what was written waits in the
                # spool, and the client's next request carries the rest.
                reason = self.sessions.note_store_error(key, e)
                return self._counted(request, await self._pass_through(request, parsed, reason, "store_unavailable"))
            except TemplateRenderError as e:
                # The chat template refuses the conversation itself (a role it lacks, turns that do not
                # alternate): ctxfold cannot count it, so it cannot compact it; the upstream decides.
                reason = f"the chat template refuses this conversation, so it is not counted: {e}"
                return self._counted(request, await self._pass_through(request, parsed, reason, "template_refused"))
            finally:  # after the lock is released; also when the client left and the handler is cancelled
                for evicted in self.sessions.trim():
                    self.compactors.models.pop(evicted, None)
                if self.metrics.per_request_state:
                    self.metrics.note_state(self.sessions)
        except asyncio.CancelledError:
            if _COUNTED not in request:
                self.metrics.responses.inc("499", self._tenant_label(request))  # nginx's "client closed request"
            raise
        except NoFitError as e:
            # Said before the request, never after: nothing goes upstream (what the client sent is stored).
            self.metrics.bad_requests.inc("context_length_exceeded")
            self.metrics.responses.inc("400", self._tenant_label(request))
            return dialect.error(400, str(e), code="context_length_exceeded", param="messages")
        except BadRequest as e:
            self.metrics.bad_requests.inc(e.code)
            self.metrics.responses.inc(str(e.status), self._tenant_label(request))
            resp = dialect.error(e.status, e.message, code=e.code, param=e.param)
            if e.status in (408, 413):
                resp.force_close()  # the rest of the body is not read: the connection cannot be reused
            return resp
        except Exception as e:  # a bug must cost one request, not the server
            log.exception("internal error while handling a request")
            self.metrics.responses.inc("500", self._tenant_label(request))
            return dialect.error(500, f"internal error in ctxfold serve ({type(e).__name__}: {e}); retrying "
                                      "is safe: messages already stored are not stored twice", kind="server_error",
                                 code="internal_error")

    async def _pass_through(self, request: web.Request, parsed: ParsedRequest, reason: str,
                            label: str, *, expected: bool = False) -> web.StreamResponse:
        """The request as the client sent it, uncompacted, when its session cannot be written: the
        client gets an answer and a warning, and loses nothing (its next request carries the whole
        history, which is stored once the data directory, or the store, takes writes again).
        ``expected``: a request the proxy never compacts (logged at info, not as an error)."""
        self._note_pass_through(request, reason, label, level=logging.INFO if expected else logging.ERROR)
        headers = [*relayed_headers(request.headers.items(), OWN_REQUEST_HEADERS), ("Content-Type", "application/json")]
        return await self._relay_body(request, self._target(parsed), parsed.raw, headers, parsed.dialect or OPENAI)

    def _target(self, parsed: ParsedRequest) -> str:
        """Where the request goes on the upstream's origin: its API's path under the upstream's base."""
        return (parsed.dialect or OPENAI).upstream_target(urlsplit(self.config.base_url).path)

    async def _over_quota(self, request: web.Request, parsed: ParsedRequest, e: QuotaExceeded) -> web.StreamResponse:
        """A request of a tenant at its bound: relayed as the client sent it, nothing stored. Chosen over a
        429: the bound is on what the proxy keeps, not on what the tenant may ask the model (see
        docs/store.md). Labelled as every pass-through is, counted by bound and tenant, logged."""
        label = self._tenant_label(request)
        reason = refusal_reason(e)
        self.metrics.quota_refusals.inc(e.kind, label)
        self.metrics.bad_requests.inc("tenant_quota")
        self._refusals.note(label, e)
        request_warnings(request).append(f"not compacted: {reason}")
        headers = [*relayed_headers(request.headers.items(), OWN_REQUEST_HEADERS), ("Content-Type", "application/json")]
        return await self._relay_body(request, self._target(parsed), parsed.raw, headers, parsed.dialect or OPENAI)

    def _note_pass_through(self, request: web.Request, reason: str, label: str, *, level: int = logging.ERROR) -> None:
        """A request that goes (or went) upstream as the client sent it, its messages not stored: logged,
        counted, and said to the client in a warning header."""
        log.log(level, "request passed through uncompacted: %s", reason)
        self.metrics.bad_requests.inc(label)
        request_warnings(request).append(f"not compacted: {reason}")

    async def _handle(self, request: web.Request, parsed: ParsedRequest, key: ConversationKey, t0: float) -> web.StreamResponse:
        """Under the conversation's lock: route, compact, forward, record."""
        left = asyncio.Event()  # set when the client leaves: the summaries of this request stop
        # Eager without a shared store: the work then waits on worker threads alone (see uncancelled), and
        # a summary, whose client has timers of its own, only ever after one (CompactionStep.inline).
        eager = not self.sessions.store.shared
        out = await uncancelled(self._route_and_compact(parsed, key, request_warnings(request), left), left.set,
                                eager=eager)
        self.metrics.overhead_seconds.observe(time.perf_counter() - t0)
        headers = dict(relayed_headers(request.headers.items(), OWN_REQUEST_HEADERS))
        headers["Content-Type"] = "application/json"
        # The proxy reads the answer: it asks for it uncompressed (no Accept-Encoding would allow any coding).
        headers["Accept-Encoding"] = "identity"
        store = out.session.compactor.store
        dialect = parsed.dialect or OPENAI
        try:
            resp, answer = await self.forwarder.forward(request, store, out.body, out.payload, headers,
                                                        stream=parsed.stream, recall=out.recall, too_long_raises=True,
                                                        extra_headers=partial(self._own_headers, out),
                                                        dialect=dialect)
        except PromptTooLong as e:
            # The engine counts more than ctxfold does (or its window is smaller than --context-tokens):
            # compact to a lower window and ask once more; the client sees that one answer.
            self.metrics.upstream_errors.inc("context_length_exceeded")
            log.warning("the upstream refused a prompt as too long (%s); compacting further and retrying once", e)
            lowered = await uncancelled(self._lower(parsed, out, e.prompt_tokens, e.limit_tokens, left), left.set)
            if lowered is None:  # no window to aim lower at: the client gets the refusal
                refused = e.answer or dialect.error(400, str(e), code="context_length_exceeded", param="messages")
                return self._counted(request, refused)
            lowered.compactions += out.compactions
            out = lowered
            resp, answer = await self.forwarder.forward(request, store, out.body, out.payload, headers,
                                                        stream=parsed.stream, recall=out.recall,
                                                        too_long_raises=False, dialect=dialect,
                                                        extra_headers=partial(self._own_headers, out))
        self._counted(request, resp)
        if answer is not None:
            await uncancelled(record(self.config, out.session, answer, check=self.engine_check,
                                     commit=self._commit_answer), eager=eager)
        return resp

    def _own_headers(self, out: Outgoing) -> list[tuple[str, str]]:
        """The headers that tell the client what the proxy did: ctxfold's count of the request as it left
        (when it was counted: from about a fifth of the window on, or every request with --engine-check
        every), the compactions this request made and the KV their plan keeps."""
        own: list[tuple[str, str]] = [("X-Ctxfold-Compactions", str(out.compactions))]
        predicted = prompt_tokens(out.session.compactor, count=self.engine_check.counts_every_request)
        if predicted is not None:
            own.append(("X-Ctxfold-Prompt-Tokens", str(predicted)))
        if out.kv_reused_tokens is not None:
            own.append(("X-Ctxfold-Kv-Reused-Tokens", str(out.kv_reused_tokens)))
        return own

    async def _route_and_compact(self, parsed: ParsedRequest, key: ConversationKey, warnings: list[str],
                                 left: asyncio.Event) -> Outgoing:
        """The session the request continues (a new one when none), with its new messages stored and
        compacted: what goes upstream. Loading a key's sessions or building one may take a worker
        thread; run to its end even when the client leaves (see :func:`uncancelled`)."""
        session = await self.sessions.find(key, parsed.system, parsed.messages, warnings)
        out = await self.compaction.prepare(parsed, session, lambda conv: self.sessions.create(key, conv), left)
        # What the step compacted is stored (or spooled) before anything goes upstream (a summary is
        # costly to write again); messages alone go with the answer's commit (one write, after the answer).
        await self.sessions.commit(out.session, unless_only_appends=True)
        return out

    async def _commit_answer(self, session: ProxySession) -> None:
        """The request's last write to the store: its messages and the answer, and the lease. A refusal
        (not a spooled batch: that is written later) is counted and said on the conversation's next request."""
        try:
            await self.sessions.commit(session, release=True)
        except Spooled:
            raise
        except StoreError as e:
            self.metrics.answers_unstored.inc()
            self.sessions.note_unstored_answer(session, e)
            raise

    async def _lower(self, parsed: ParsedRequest, out: Outgoing, prompt_tokens: int | None,
                     limit_tokens: int | None, left: asyncio.Event) -> Outgoing | None:
        lowered = await self.compaction.lower(parsed, out, prompt_tokens, limit_tokens, left)
        await self.sessions.commit(out.session)
        return lowered

    def _count_request(self, request: web.Request, stream: bool, key: str | None) -> None:
        """Count a request under its tenant's label, taken from its store key (no second HMAC), else
        from its credential."""
        tenant = (key.split("/", 2)[1] if key.startswith("tenants/") else ANONYMOUS_TENANT) if key is not None \
            else self._tenant_of(request)
        label = request[_TENANT] = self.metrics.tenants.label(tenant)
        self.metrics.requests.inc("true" if stream else "false", label)

    def _tenant_label(self, request: web.Request) -> str:
        """The metrics label of a request's tenant (see :class:`~ctxfold.serve.metrics.TenantLabels`)."""
        label = request.get(_TENANT)
        return label if label is not None else self.metrics.tenants.label(self._tenant_of(request))

    def _tenant_of(self, request: web.Request) -> str | None:
        credential = request.headers.get(self.config.tenant_header)
        if not credential:
            return ANONYMOUS_TENANT
        try:
            return tenant_of(self.sessions.tenant_key(), credential)
        except (OSError, ValueError):  # no tenant key to be had: counted as "other"
            return None

    def _counted(self, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        """Count a response once it is decided (the client may leave during the recording after it)."""
        self.metrics.responses.inc(str(resp.status), self._tenant_label(request))
        request[_COUNTED] = True
        return resp


def make_runner(proxy: ProxyApp) -> web.AppRunner:
    """The proxy's aiohttp runner (:func:`runner_options`)."""
    return web.AppRunner(proxy.app(), **runner_options(proxy.config))


async def serve(config: ProxyConfig, host: str, port: int, *, ready: Callable[[str], None] | None = None,
                stop_on_signals: bool = False, sock: socket.socket | None = None, worker: int | None = None) -> None:
    """Run the proxy until cancelled (or SIGTERM/SIGINT with ``stop_on_signals``, from the main thread).
    ``ready`` gets the URL once the port accepts connections. Stopping closes the session logs. With
    ``sock`` (a bound socket), accept on it instead of binding ``host``:``port`` (``ctxfold serve
    --workers``: several processes accept on one socket)."""
    stop = asyncio.Event()
    if stop_on_signals:
        import signal

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    proxy = ProxyApp(config, worker=worker)
    runner = make_runner(proxy)
    await runner.setup()
    listener = BoundedListener(runner, max_connections=config.max_connections)
    try:
        bound = await listener.start(host, port, sock=sock)
        # What startup built (modules, tokenizer tables, the app) lives as long as the process: frozen,
        # a full collection does not scan it again. On the trace replay this cut the collector's
        # time per request by two fifths and its longest pauses from 43 to 16 ms.
        gc.collect()
        gc.freeze()
        if ready is not None:
            ready(f"http://{host}:{bound}")
        await stop.wait()
    finally:
        await listener.stop()
        await runner.cleanup()
