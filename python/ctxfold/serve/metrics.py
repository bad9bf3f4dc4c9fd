"""The proxy's metrics, through the Prometheus client library (prometheus_client).

One process: a registry of the :class:`ProxyMetrics` object's own (several proxies in one process, as
the tests run them, keep their figures apart). ``--workers N``: the library's multiprocess mode. The
pool's parent points ``PROMETHEUS_MULTIPROC_DIR`` at an empty directory before any worker imports the
library (:func:`use_multiprocess_dir`); each worker writes its figures to files there, and ``GET
/metrics``, whichever worker the kernel hands it to, sums them all. The gauges say how (``livesum``:
the live workers' values added; ``mostrecent``: the last one set).

The objects below keep the small surface the proxy and its tests use (``inc``, ``set``, ``observe``,
``get``, ``values``); the library does the counting, the locking and the exposition format.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from ctxfold.serve.logs import dropped_lines

if TYPE_CHECKING:
    from ctxfold.compaction.cost import CompactionCost, PriceTable

# Summary generation takes from tens of milliseconds (extractive) to minutes (a model on a slow GPU).
SUMMARY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# What the proxy adds before a request leaves for the upstream: well under a millisecond when nothing fires.
OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 10.0)
# Tenants given a label of their own in the request and response counters, the first seen first; the
# rest share "other". A label per credential would grow the metrics without bound (every series is
# kept, scraped and stored for ever), so the set is capped (per worker, under --workers).
MAX_TENANT_LABELS = 32
TENANT_LABEL_CHARS = 12  # of the tenant's name (an HMAC, so its prefix tells nothing of the credential)
ANONYMOUS_LABEL = "anonymous"
OTHER_LABEL = "other"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def mark_worker_dead(pid: int) -> None:
    """A worker of the pool exited: its live gauges stop counting (its counters stay)."""
    if os.environ.get(MULTIPROC_ENV):
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


class _Metric:
    """One metric family and the sample that holds its value (``name`` for a gauge, ``name_total``
    for a counter, ``name_count`` for a histogram's number of observations)."""

    def __init__(self, metric: Any, sample: str, labels: Sequence[str]) -> None:
        self._metric = metric
        self._sample = sample
        self.label_names = tuple(labels)
        # Each label set's child, once looked up: the client library checks and locks on every lookup,
        # several times per request. The label sets are few (tenants are capped: TenantLabels).
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, labels: tuple[str, ...]) -> Any:
        if not labels:
            return self._metric
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._metric.labels(*labels)
        return child

    @property
    def values(self) -> dict[tuple[str, ...], float]:
        """This process's value of every label set seen."""
        return {tuple(sample.labels[n] for n in self.label_names): sample.value
                for family in self._metric.collect() for sample in family.samples if sample.name == self._sample}

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def values_total(self) -> float:
        """The sum over every label set."""
        return sum(self.values.values())


class Counter(_Metric):
    def __init__(self, registry: CollectorRegistry, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        base = name.removesuffix("_total")
        super().__init__(prometheus_client.Counter(base, help_text, labels, registry=registry), f"{base}_total",
                         labels)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self._child(labels).inc(amount)


class Gauge(_Metric):
    def __init__(self, registry: CollectorRegistry, name: str, help_text: str, labels: Sequence[str] = (),
                 *, across_workers: Literal["livesum", "mostrecent"] = "livesum") -> None:
        super().__init__(prometheus_client.Gauge(name, help_text, labels, registry=registry,
                                                 multiprocess_mode=across_workers), name, labels)

    def set(self, value: float, *labels: str) -> None:
        self._child(labels).set(value)


class Histogram(_Metric):
    def __init__(self, registry: CollectorRegistry, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(prometheus_client.Histogram(name, help_text, buckets=buckets, registry=registry),
                         f"{name}_count", ())

    def observe(self, value: float) -> None:
        self._metric.observe(value)

    @property
    def count(self) -> int:
        return int(self.get())


class TenantLabels:
    """The ``tenant`` label of a tenant: the first :data:`TENANT_LABEL_CHARS` characters of its name for
    the first ``max_labels`` tenants seen since the start, ``"other"`` for the rest, ``"anonymous"``
    for requests without a credential."""

    def __init__(self, max_labels: int = MAX_TENANT_LABELS) -> None:
        self.max_labels = max_labels
        self._labels: dict[str, str] = {}

    def label(self, tenant: str | None) -> str:
        if tenant is None:
            return OTHER_LABEL
        if not tenant:
            return ANONYMOUS_LABEL
        known = self._labels.get(tenant)
        if known is not None:
            return known
        if len(self._labels) >= self.max_labels:
            return OTHER_LABEL
        known = self._labels[tenant] = tenant[:TENANT_LABEL_CHARS]
        return known


class ProxyMetrics:
    """Everything ``GET /metrics`` reports."""

    def __init__(self) -> None:
        self.tenants = TenantLabels()
        r = self.registry = CollectorRegistry()
        # Under --workers each worker sets its state gauges after every request (a scrape reaches one
        # worker, and sums the files of all); alone, the scrape sets them, and requests need not.
        self.per_request_state = bool(os.environ.get(MULTIPROC_ENV))
        self.requests = Counter(r, "ctxfold_requests_total", "Chat completion requests received, by tenant (the first "
                                f"{MAX_TENANT_LABELS} seen; the rest as other).", ["stream", "tenant"])
        self.responses = Counter(r, "ctxfold_responses_total", "Chat completion responses sent, by HTTP status and "
                                 "tenant.", ["status", "tenant"])
        self.bad_requests = Counter(r, "ctxfold_bad_requests_total", "Requests refused, or passed through "
                                    "uncompacted (storage_error, store_unavailable, tenant_quota, template_refused, internal_error), by reason.",
                                    ["reason"])
        self.answers_unstored = Counter(
            r, "ctxfold_answers_unstored_total", "Answers the session store refused after the client had them "
            "(with their request's messages); the conversation's next request stores them.")
        self.upstream_errors = Counter(
            r, "ctxfold_upstream_errors_total", "Upstream failures: connect, timeout, status, cut_stream.", ["kind"])
        self.compactions = Counter(r, "ctxfold_compactions_total", "Compaction passes applied.", ["kind", "trigger"])
        self.compaction_failures = Counter(
            r, "ctxfold_compaction_failures_total", "Compaction passes that were not applied.", ["kind", "trigger"])
        self.summary_fallbacks = Counter(
            r, "ctxfold_summary_fallbacks_total", "Summaries written by the extractive fallback after a failure, by "
            "why the summarizer failed (its reason without the details).", ("reason",))
        self.tokens_saved = Counter(r, "ctxfold_tokens_saved_total", "Tokens removed from requests by compaction.")
        # What the compactions cost (ctxfold.compaction.cost, docs/cost.md), summed over every applied summary.
        self.cache_read_tokens = Counter(
            r, "ctxfold_compaction_cache_read_tokens_total", "Prompt tokens the request after each summary reads "
            "from a prefix cache: without the rewrite (request=before) and with it (after), as the cost model "
            "expects.", ("request",))
        self.cache_write_tokens = Counter(
            r, "ctxfold_compaction_cache_write_tokens_total", "Prompt tokens the request after each summary "
            "prefills (writes to the cache): without the rewrite (request=before) and with it (after).", ("request",))
        self.summary_request_tokens = Counter(
            r, "ctxfold_summary_request_tokens_total", "The summary requests' tokens: part=prompt, cached (of the "
            "prompt, the prefix shared with the conversation's last request), output.", ("part",))
        self.cache_tokens_written = Counter(
            r, "ctxfold_compaction_cache_tokens_written_total", "Prompt tokens the compactions made someone prefill "
            "that would not have been otherwise: the rewrite's prefill beyond the next request's own, and the "
            "summary requests' uncached prompts.")
        self.saving_tokens = Counter(
            r, "ctxfold_compaction_saving_tokens_total", "Cached prompt tokens the compactions are expected to "
            "save over their horizons (the later requests read the smaller view).")
        self.compaction_cost = Counter(
            r, "ctxfold_compaction_cost_total", "The compactions' cost in money, with --prices: part=before_request "
            "and after_request (the next request without and with the rewrite), summary_request, saving (expected "
            "over the horizon). Invalidated = after_request + summary_request - before_request; net = saving - "
            "invalidated.", ("currency", "part"))
        self.min_gain_waits = Counter(
            r, "ctxfold_min_gain_waits_total", "Automatic summaries the minimum-gain rule put off: their expected "
            "saving was below what they would invalidate, and the next request still fit.")
        self.sessions_quarantined = Gauge(r, "ctxfold_sessions_quarantined",
                                          "Sessions set aside since start because their event log could not be read.")
        self.sessions_forked = Gauge(r, "ctxfold_sessions_forked",
                                     "Sessions forked from another since start (a history edited or answered anew).")
        self.recall_calls = Counter(r, "ctxfold_recall_calls_total", "read_archive calls answered by the proxy.")
        self.spool_batches = Gauge(r, "ctxfold_store_spool_batches",
                                   "Session writes waiting in the local spool for the shared store to come back.")
        self.spool_refused = Gauge(
            r, "ctxfold_store_spool_refused_batches", "Spooled session writes the shared store refused on replay since "
            "start (another replica took the session over): kept as .refused files in the spool directory.")
        self.spool_set_aside = Gauge(
            r, "ctxfold_store_spool_unreadable_files", "Spool files that could not be read at startup, set aside as .corrupt.")
        self.sessions = Gauge(r, "ctxfold_sessions", "Sessions held in memory.")
        self.quota_refusals = Counter(
            r, "ctxfold_quota_refusals_total", "Requests passed through uncompacted, nothing stored, because their "
            "tenant was at a bound (kind: sessions or bytes), by tenant.", ("kind", "tenant"))
        self.sessions_expired = Gauge(
            r, "ctxfold_sessions_expired", "Sessions deleted since start, with their archives, because they were idle "
            "longer than --session-ttl-s (with --store: those this process found expired).")
        self.log_lines_dropped = Gauge(
            r, "ctxfold_log_lines_dropped", "Log lines dropped since start because stderr did not take them in time.")
        self.engine_checks = Counter(
            r, "ctxfold_engine_checks_total", "Answers whose usage.prompt_tokens was compared with ctxfold's count of "
            "the prompt sent (--engine-check), by whether they agree.", ("result",))
        self.engine_prompt_tokens_diff = Gauge(
            r, "ctxfold_engine_prompt_tokens_diff", "The engine's prompt tokens minus ctxfold's count, last compared.",
            across_workers="mostrecent")
        self.engine_divergences = Counter(
            r, "ctxfold_engine_divergences_total", "What the startup probe found the engine does otherwise than "
            "ctxfold counts: template, tokenizer, system_dropped, tool_dropped, tool_refused, ...", ("kind",))
        self.summary_seconds = Histogram(
            r, "ctxfold_summary_seconds", "Wall time of summary generation.", SUMMARY_BUCKETS_S)
        self.overhead_seconds = Histogram(
            r, "ctxfold_proxy_overhead_seconds",
            "Time from a request's arrival to its forwarding upstream (parsing, matching, compaction).",
            OVERHEAD_BUCKETS_S)

    def note_cost(self, cost: CompactionCost, prices: PriceTable | None) -> None:
        """One applied summary's cost figures; in money too with ``prices``."""
        self.cache_read_tokens.inc("before", amount=cost.before.cached_tokens)
        self.cache_read_tokens.inc("after", amount=cost.after.cached_tokens)
        self.cache_write_tokens.inc("before", amount=cost.before.written_tokens)
        self.cache_write_tokens.inc("after", amount=cost.after.written_tokens)
        self.summary_request_tokens.inc("prompt", amount=cost.summary_prompt_tokens)
        self.summary_request_tokens.inc("cached", amount=cost.summary_cached_tokens)
        self.summary_request_tokens.inc("output", amount=cost.summary_output_tokens)
        self.cache_tokens_written.inc(amount=cost.cache_tokens_written)
        self.saving_tokens.inc(amount=cost.saving_tokens)
        if prices is not None:
            # Each part is a price of tokens, never negative, so each is a counter; what a compaction
            # invalidates (which may be negative) is their difference.
            for part, value in (("before_request", cost.before.price(prices)),
                                ("after_request", cost.after.price(prices)),
                                ("summary_request", cost.summary_price(prices)), ("saving", cost.saving(prices))):
                self.compaction_cost.inc(prices.currency, part, amount=value)

    def note_state(self, sessions: Any) -> None:
        """The gauges that follow the sessions' state (``sessions``: the proxy's SessionStore), set before
        each scrape and, under --workers, after each request (see ``per_request_state``)."""
        self.sessions.set(sessions.num_sessions)
        self.log_lines_dropped.set(dropped_lines())
        self.sessions_quarantined.set(sessions.num_quarantined)
        self.sessions_forked.set(sessions.num_forks)
        quota = sessions.quota
        store = sessions.store
        self.sessions_expired.set(quota.num_expired if quota is not None
                                  else getattr(getattr(store, "inner", store), "num_expired", 0))
        spool = sessions.spool
        if spool is not None:
            self.spool_batches.set(spool.num_pending)
            self.spool_refused.set(spool.num_refused)
            self.spool_set_aside.set(len(spool.set_aside))

    def render(self) -> bytes:
        """The exposition text: this process's figures, or with --workers every worker's, summed."""
        if os.environ.get(MULTIPROC_ENV):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        return generate_latest(self.registry)
