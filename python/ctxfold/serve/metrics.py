"""Prometheus text-format metrics of the proxy (exposition format 0.0.4), without a client library.

The proxy runs one event loop, so updates need no lock; the figures are read by ``GET /metrics``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Summary generation takes from tens of milliseconds (extractive) to minutes (a model on a slow GPU).
SUMMARY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# What the proxy adds before a request leaves for the upstream: well under a millisecond when nothing fires.
OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 10.0)
# Tenants given a label of their own in the request and response counters, the first seen first; the
# rest share "other". A label per credential would grow the metrics without bound (every series is
# kept, scraped and stored for ever), so the set is capped.
MAX_TENANT_LABELS = 32
TENANT_LABEL_CHARS = 12  # of the tenant's name (an HMAC, so its prefix tells nothing of the credential)
ANONYMOUS_LABEL = "anonymous"
OTHER_LABEL = "other"


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Counter:
    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def values_total(self) -> float:
        """The sum over every label set."""
        return sum(self.values.values())

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if not self.values and not self.label_names:
            out.append(f"{self.name} 0")
        for labels, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self.label_names, labels)} {v:g}")
        return out


class Gauge(Counter):
    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = value

    def render(self) -> list[str]:
        return [line.replace(" counter", " gauge") if line.startswith("# TYPE") else line for line in super().render()]


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help = help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            out.append(f'{self.name}_bucket{{le="{bound:g}"}} {running}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {self.sum:.9g}")
        out.append(f"{self.name}_count {self.count}")
        return out


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
        self.requests = Counter("ctxfold_requests_total", "Chat completion requests received, by tenant (the first "
                                f"{MAX_TENANT_LABELS} seen; the rest as other).", ["stream", "tenant"])
        self.responses = Counter("ctxfold_responses_total", "Chat completion responses sent, by HTTP status and "
                                 "tenant.", ["status", "tenant"])
        self.bad_requests = Counter("ctxfold_bad_requests_total", "Requests refused, or passed through "
                                    "uncompacted (storage_error, store_unavailable, template_refused, internal_error), by reason.",
                                    ["reason"])
        self.upstream_errors = Counter(
            "ctxfold_upstream_errors_total", "Upstream failures: connect, timeout, status, cut_stream.", ["kind"])
        self.compactions = Counter("ctxfold_compactions_total", "Compaction passes applied.", ["kind", "trigger"])
        self.compaction_failures = Counter(
            "ctxfold_compaction_failures_total", "Compaction passes that were not applied.", ["kind", "trigger"])
        self.summary_fallbacks = Counter(
            "ctxfold_summary_fallbacks_total", "Summaries written by the extractive fallback after a failure, by "
            "why the summarizer failed (its reason without the details).", ("reason",))
        self.tokens_saved = Counter("ctxfold_tokens_saved_total", "Tokens removed from requests by compaction.")
        self.sessions_quarantined = Gauge("ctxfold_sessions_quarantined",
                                          "Sessions set aside since start because their event log could not be read.")
        self.sessions_forked = Gauge("ctxfold_sessions_forked",
                                     "Sessions forked from another since start (a history edited or answered anew).")
        self.recall_calls = Counter("ctxfold_recall_calls_total", "read_archive calls answered by the proxy.")
        self.spool_batches = Gauge("ctxfold_store_spool_batches",
                                   "Session writes waiting in the local spool for the shared store to come back.")
        self.spool_refused = Gauge(
            "ctxfold_store_spool_refused_batches", "Spooled session writes the shared store refused on replay since "
            "start (another replica took the session over): kept as .refused files in the spool directory.")
        self.spool_set_aside = Gauge(
            "ctxfold_store_spool_unreadable_files", "Spool files that could not be read at startup, set aside as .corrupt.")
        self.sessions = Gauge("ctxfold_sessions", "Sessions held in memory.")
        self.engine_checks = Counter(
            "ctxfold_engine_checks_total", "Answers whose usage.prompt_tokens was compared with ctxfold's count of "
            "the prompt sent (--engine-check), by whether they agree.", ("result",))
        self.engine_prompt_tokens_diff = Gauge(
            "ctxfold_engine_prompt_tokens_diff", "The engine's prompt tokens minus ctxfold's count, last compared.")
        self.engine_divergences = Counter(
            "ctxfold_engine_divergences_total", "What the startup probe found the engine does otherwise than "
            "ctxfold counts: template, tokenizer, system_dropped, tool_dropped, tool_refused, ...", ("kind",))
        self.summary_seconds = Histogram(
            "ctxfold_summary_seconds", "Wall time of summary generation.", SUMMARY_BUCKETS_S)
        self.overhead_seconds = Histogram(
            "ctxfold_proxy_overhead_seconds",
            "Time from a request's arrival to its forwarding upstream (parsing, matching, compaction).",
            OVERHEAD_BUCKETS_S)

    def render(self) -> str:
        lines: list[str] = []
        for m in (self.requests, self.responses, self.bad_requests, self.upstream_errors, self.compactions,
                  self.compaction_failures, self.summary_fallbacks, self.tokens_saved, self.recall_calls,
                  self.sessions, self.sessions_quarantined, self.sessions_forked, self.spool_batches,
                  self.spool_refused, self.spool_set_aside,
                  self.engine_checks, self.engine_prompt_tokens_diff, self.engine_divergences,
                  self.summary_seconds, self.overhead_seconds):
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
