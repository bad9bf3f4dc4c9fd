"""What the engine sees against what ctxfold counts, over the scripted upstream: the startup probe, the
comparison of answers' figures, the proxy's own headers, and usage asked for in streams (and kept from a
client that did not ask). The same against llama_cpp.server: tests/serve/test_e2e_llama_server.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.compaction.config import CompactConfig
from ctxfold.serve import ProxyApp
from ctxfold.serve.forward import strip_null_usage, with_stream_usage
from ctxfold.serve.sse import AnswerAssembler, SseReader
from ctxfold.serve.testing import ScriptedUpstream
from helpers.proxy_helpers import chat, metric, post, settle, start_proxy


def probe_report(app: ProxyApp, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while app.engine_check.report.state == "pending":
        assert time.monotonic() < deadline, "the startup probe did not finish"
        time.sleep(0.02)
    return app.engine_check.report.as_dict()


def test_null_usage_is_removed_from_an_event_and_nothing_else() -> None:
    event = b'data: {"id":"c","choices":[{"delta":{"content":"a \\"usage\\":null,"}}],"usage":null}\n\n'
    assert strip_null_usage(event) == b'data: {"id":"c","choices":[{"delta":{"content":"a \\"usage\\":null,"}}]}\n\n'
    assert strip_null_usage(b'data: {"usage": null, "id": "c"}\n\n') == b'data: {"id": "c"}\n\n'
    kept = b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n'
    assert strip_null_usage(kept) == kept


def test_stream_options_are_added_only_where_the_client_asked_for_none() -> None:
    assert with_stream_usage({"stream": True})["stream_options"] == {"include_usage": True}  # type: ignore[index]
    asked = with_stream_usage({"stream_options": {"continuous_usage_stats": False}})
    assert asked is not None and asked["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert with_stream_usage({"stream_options": {"include_usage": True}}) is None
    assert with_stream_usage({"stream_options": "odd"}) is None  # the upstream judges that as it is


def stream(url: str, body: dict[str, Any]) -> bytes:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return b"".join(r.iter_raw())


def test_a_stream_asks_for_usage_and_the_client_that_did_not_ask_gets_none(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, url = upstream
    app, srv = start_proxy(url, tmp_path / "data", stream_usage=True, engine_check="every",
                           compact=CompactConfig(context_tokens=20_000, reply_reserve_tokens=50))
    try:
        probe_report(app)
        got = stream(srv.url, chat(("user", "stream me an answer " * 30), stream=True))
        sent = up.sent[-1]
        assert up.received[-1]["stream_options"] == {"include_usage": True}
        usage_events = [e for e in sent.split(b"\n\n") if b'"usage"' in e]
        assert len(usage_events) == 1  # the scripted upstream sent it
        assert got == sent.replace(usage_events[0] + b"\n\n", b"")  # the client has everything else, unchanged
        reader, answer = SseReader(), AnswerAssembler()
        for _, data in reader.feed(got):
            answer.add(data)
        assert answer.done and answer.usage is None
        # A client that asks gets it, and the bytes as they came.
        got = stream(srv.url, chat(("user", "again " * 30), stream=True, stream_options={"include_usage": True}))
        assert got == up.sent[-1] and b'"usage"' in got
        settle(app)
        # The usage the client never saw was compared and calibrated the conversation all the same (the
        # scripted upstream counts otherwise than ctxfold: the factor moved).
        assert app.metrics.engine_checks.values_total() == 2
        assert all(s.calibration != 1.0 for s in app.sessions.loaded())
    finally:
        srv.close()


def test_without_stream_usage_the_stream_is_left_alone(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, url = upstream
    _, srv = start_proxy(url, tmp_path / "data")
    try:
        got = stream(srv.url, chat(("user", "stream me an answer " * 5), stream=True))
        assert "stream_options" not in up.received[-1]
        assert got == up.sent[-1]
    finally:
        srv.close()


def test_startup_probe_reports_a_template_the_upstream_does_not_use(upstream: tuple[ScriptedUpstream, str],
                                                                    tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The scripted upstream counts its own way (not DeepSeek V4's template): the probe says so once,
    counts it, shows it in /health; its requests are the only ones sent (max_tokens 1)."""
    up, url = upstream
    app, srv = start_proxy(url, tmp_path / "data", engine_check="startup")
    try:
        report = probe_report(app)
        health = httpx.get(f"{srv.url}/health", timeout=10).json()
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        srv.close()
    assert report["state"] == "differ" and health["engine_check"] == report
    assert any("template differs" in f for f in report["findings"]), report
    assert metric(metrics, "ctxfold_engine_divergences_total", kind="template") == 1
    probes = list(up.received)
    assert len(probes) == 4 and all(p["max_tokens"] == 1 for p in probes)
    assert any(p["messages"][0]["role"] == "system" for p in probes)
    assert any(m["role"] == "tool" for p in probes for m in p["messages"])
    assert len([r for r in caplog.records if "engine check" in r.getMessage()]) == 1


def test_an_upstream_that_cannot_be_reached_leaves_the_probe_unavailable(tmp_path: Path) -> None:
    app, srv = start_proxy("http://127.0.0.1:9/v1", tmp_path / "data", engine_check="startup",
                           connect_timeout_s=1.0)
    try:
        report = probe_report(app)
    finally:
        srv.close()
    assert report["state"] == "unavailable" and report["findings"]


def test_every_answer_is_compared_with_the_count_of_its_request(upstream: tuple[ScriptedUpstream, str],
                                                                tmp_path: Path) -> None:
    """``every``: each request counted before it leaves (the X-Ctxfold-Prompt-Tokens header), each
    answer's usage compared. The scripted upstream counts otherwise, so they differ: said once."""
    up, url = upstream
    app, srv = start_proxy(url, tmp_path / "data", engine_check="every",
                           compact=CompactConfig(context_tokens=100_000))
    try:
        probe_report(app)
        turns: list[tuple[str, str]] = []
        for i in range(3):
            turns.append(("user", f"question {i} " * 20))
            r = post(srv.url, chat(*turns))
            assert r.status_code == 200
            assert int(r.headers["X-Ctxfold-Prompt-Tokens"]) > 0
            assert r.headers["X-Ctxfold-Compactions"] == "0"
            assert r.json()["usage"]["prompt_tokens"] == up.prompt_tokens_seen[-1]
            turns.append(("assistant", r.json()["choices"][0]["message"]["content"]))
            settle(app)
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        srv.close()
    assert metric(metrics, "ctxfold_engine_checks_total", result="differ") == 3
    assert "ctxfold_engine_prompt_tokens_diff" in metrics


def test_sampled_compares_one_answer_in_n(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    _, url = upstream
    app, srv = start_proxy(url, tmp_path / "data", engine_check="sampled", engine_check_every=2)
    try:
        probe_report(app)
        assert not app.engine_check.counts_every_request
        checked = [app.engine_check.due() for _ in range(6)]
    finally:
        srv.close()
    assert checked == [True, False, True, False, True, False]


def test_the_cli_turns_the_check_and_stream_usage_on(tmp_path: Path) -> None:
    from ctxfold.cli import build_parser
    from ctxfold.cli.serve import build_config

    args = build_parser().parse_args(["serve", "--upstream", "http://127.0.0.1:1/v1", "--data-dir",
                                      str(tmp_path / "d"), "--summary-timeout-s", "7.5"])
    cfg = build_config(args)
    assert cfg.engine_check == "sampled" and cfg.stream_usage and cfg.compact.summary.timeout_s == 7.5
    args = build_parser().parse_args(["serve", "--upstream", "http://127.0.0.1:1/v1", "--data-dir",
                                      str(tmp_path / "d"), "--engine-check", "off", "--no-stream-usage"])
    cfg = build_config(args)
    assert cfg.engine_check == "off" and not cfg.stream_usage


def test_a_summary_past_its_budget_is_the_extractive_one_and_says_why(upstream: tuple[ScriptedUpstream, str],
                                                                      tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """``--summary-timeout-s``: the model's summary is given that long; the request then goes on with the
    extractive summary, and the log and the fallback metric name the timeout."""
    from dataclasses import replace

    from ctxfold.serve import ProxyConfig
    from helpers.proxy_helpers import serve_in_background

    up, url = upstream
    up.summary_delay_s = 30.0
    compact = CompactConfig(context_tokens=4096)
    compact = replace(compact, summary=replace(compact.summary, timeout_s=0.5))
    app = ProxyApp(ProxyConfig(upstream=url, data_dir=tmp_path / "data", compact=compact, summarizer="upstream",
                               fsync="never"))
    srv = serve_in_background(app).__enter__()
    try:
        turns: list[tuple[str, str]] = []
        slowest_s = 0.0
        for k in range(40):
            turns.append(("user", f"question {k}: " + "tell me more about the build " * 40))
            t0 = time.monotonic()
            r = post(srv.url, chat(*turns), timeout=20)
            slowest_s = max(slowest_s, time.monotonic() - t0)
            assert r.status_code == 200
            turns.append(("assistant", r.json()["choices"][0]["message"]["content"]))
            if app.metrics.summary_fallbacks.values:
                break
        else:
            raise AssertionError("no summary was asked for")
    finally:
        srv.close()
    assert app.metrics.summary_fallbacks.values == {("timeout after 0.5 s",): 1}
    assert slowest_s < 10.0  # the budget, not the model's 30 s
    assert any("extractive fallback" in r.getMessage() and "timeout after 0.5 s" in r.getMessage()
               for r in caplog.records)
