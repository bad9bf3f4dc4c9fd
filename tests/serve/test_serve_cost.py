"""What each compaction costs, in the proxy's metrics and log lines (ctxfold.compaction.cost, docs/cost.md):
a proxy run as ``ctxfold serve`` with prices compacts a conversation, and /metrics and the JSON log carry the
same figures; the minimum-gain rule's waits are counted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.compaction.config import CompactConfig
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from helpers.cli_helpers import run_main
from helpers.proxy_helpers import metric, post, start_proxy
from helpers.subprocess_env import ctxfold_env

FILLER = "lorem ipsum dolor sit amet " * 40
PRICES = "input=3,cached=0.3,write=3.75,output=15"


def converse(url: str, turns: int, filler: str = FILLER) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for k in range(turns):
        messages.append({"role": "user", "content": f"question {k} {filler}"})
        resp = post(url, {"model": "m", "messages": messages})
        assert resp.status_code == 200, resp.text
        messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})


def test_a_summary_leaves_its_cost_in_the_metrics_and_the_log_line(tmp_path: Path) -> None:
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as upstream:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ctxfold", "serve", "--upstream", upstream.url + "/v1", "--port", "0",
             "--data-dir", str(tmp_path / "data"), "--context-tokens", "2048", "--template", "none",
             "--tokenizer", "chars4", "--summarizer", "upstream", "--engine-check", "off", "--no-fsync",
             "--log-format", "json", "--price", PRICES],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ctxfold_env())
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"listening on (\S+),", line)
        assert m is not None, line + proc.stderr.read()[-2000:]
        url = m.group(1)
        try:
            converse(url, 10)
            text = httpx.get(url + "/metrics", timeout=30).text
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
    records = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    costs = [r["cost"] for r in records if r["message"].startswith("compaction: summary") and "cost" in r]
    assert costs, "a summary must have been applied, and its log line carry the cost"
    asked = [c for c in costs if c["summary_model_call"]]
    assert asked and all(c["summary_prompt_tokens"] > 0 and c["summary_output_tokens"] > 0 for c in asked)
    assert all(c["money"]["currency"] == "USD" for c in costs)
    line_text = next(r["message"] for r in records if r["message"].startswith("compaction: summary"))
    assert "saving" in line_text and "USD" in line_text
    # /metrics sums what the log lines say, figure by figure.

    def total(key: str) -> float:
        return float(sum(c[key] for c in costs))

    for sample, labels, key in [
        ("ctxfold_compaction_cache_read_tokens_total", {"request": "before"}, "before_cached_tokens"),
        ("ctxfold_compaction_cache_read_tokens_total", {"request": "after"}, "after_cached_tokens"),
        ("ctxfold_compaction_cache_write_tokens_total", {"request": "before"}, "before_written_tokens"),
        ("ctxfold_compaction_cache_write_tokens_total", {"request": "after"}, "after_written_tokens"),
        ("ctxfold_summary_request_tokens_total", {"part": "prompt"}, "summary_prompt_tokens"),
        ("ctxfold_summary_request_tokens_total", {"part": "cached"}, "summary_cached_tokens"),
        ("ctxfold_summary_request_tokens_total", {"part": "output"}, "summary_output_tokens"),
        ("ctxfold_compaction_cache_tokens_written_total", {}, "cache_tokens_written"),
        ("ctxfold_compaction_saving_tokens_total", {}, "saving_tokens"),
    ]:
        assert metric(text, sample, **labels) == total(key), (sample, labels)
    assert total("summary_prompt_tokens") > 0 and total("after_written_tokens") > 0
    for part in ("before_request", "after_request", "summary_request", "saving"):
        got = metric(text, "ctxfold_compaction_cost_total", currency="USD", part=part)
        assert got == pytest.approx(sum(c["money"][part] for c in costs), abs=1e-5), part
    invalidated = sum(c["money"]["invalidated"] for c in costs)
    assert invalidated == pytest.approx(sum(c["money"]["after_request"] + c["money"]["summary_request"]
                                            - c["money"]["before_request"] for c in costs), abs=1e-5)
    assert metric(text, "ctxfold_compaction_cost_total", currency="USD", part="summary_request") > 0


def test_without_prices_the_cost_is_in_tokens_only(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    app, srv = start_proxy(upstream[1], tmp_path / "data", compact=CompactConfig(context_tokens=2048),
                           tokenizer="chars4", template=None)
    try:
        converse(srv.url, 10)
    finally:
        srv.close()
    m = app.metrics
    assert m.compactions.get("summary", "soft") + m.compactions.get("summary", "major") >= 1
    assert m.cache_write_tokens.get("after") > 0 and m.saving_tokens.values_total() >= 0
    assert m.compaction_cost.values == {}  # relative weights are not money


def test_the_minimum_gain_rules_waits_are_counted(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    # A horizon of one request saves nothing: the rule puts off every automatic summary it may, while
    # the next request fits (small turns in a larger window leave it room to).
    compact = CompactConfig.from_mapping({"context_tokens": 8192, "cost": {"horizon_requests": 1}})
    app, srv = start_proxy(upstream[1], tmp_path / "data", compact=compact, tokenizer="chars4", template=None)
    try:
        converse(srv.url, 40, filler=FILLER[:400])
        text = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.close()
    waits = sum(s.compactor.min_gain_waits for s in app.sessions.loaded())
    assert waits > 0
    assert metric(text, "ctxfold_min_gain_waits_total") == waits


def test_a_bad_price_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "serve", "--upstream", "http://127.0.0.1:9/v1", "--price", "input=3,cachd=0.3")
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert "--price" in last and "unknown price 'cachd'" in last
