"""The proxy before a real server: ``ctxfold serve`` in front of ``python -m llama_cpp.server`` serving
Gemma 3 270M at n_ctx 4096, driven by the ``openai`` client replaying a shared trace as a chat-only client
(tool turns flattened into user text; the model's own answers, a few tokens each).

- Through the proxy: no request is refused as too long, compactions happen, and ctxfold's count of every
  prompt it sends (``--engine-check every``: the ``X-Ctxfold-Prompt-Tokens`` header) equals the engine's
  ``usage.prompt_tokens``, with the engine's tokenizer (``--tokenizer gguf:PATH``) and its chat format
  written as a template (tests/data/llama_cpp_python_gemma.jinja: llama-cpp-python's ``gemma`` format).
- The control: the same client straight to the engine is refused at some turn (printed).
- The startup probe agrees with that template and names the divergence with Gemma 3's own (the engine's
  ``gemma`` format drops system messages; Gemma 3's template folds them into the first turn).

Needs llama-cpp-python (the ``llama`` extra), the Gemma GGUF wheels and ``openai`` (the ``test`` extra),
and the shared traces; skips saying which is missing (CI with ``CTXFOLD_REQUIRE_LLAMA=1``: fails).
A few minutes on 2 cores: the engine's prefill is most of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat.formats import load
from helpers.gemma_gguf import _missing, gemma_gguf_path, require_llama_cpp
from helpers.llama_server import (
    GEMMA_FORMAT_TEMPLATE,
    TurnResult,
    chat_only_turns,
    free_port,
    launch,
    replay,
    start_llama_server,
    stop,
)
from helpers.proxy_helpers import metric
from helpers.subprocess_env import ctxfold_env

N_CTX = 4096
MAX_TOKENS = 8
TURN_CHARS = 1200  # the user side of a turn, capped: about 300 tokens
TURNS = 13  # about three windows' worth: the control is refused around turn 10, the proxy compacts
TRACE = ("openhands", "multi_swe_bench_output.jsonl")

pytestmark = pytest.mark.e2e  # real engine and proxy processes: minutes (the llama extras)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    require_llama_cpp()
    try:
        import openai  # noqa: F401
    except ImportError:
        _missing("the openai package is not installed: pip install '.[test]'")
    try:
        import uvicorn  # noqa: F401  (what llama_cpp.server runs on: its [server] extra)
    except ImportError:
        _missing("llama_cpp.server's packages are not installed: pip install '.[llama-server]'")
    gguf = gemma_gguf_path()
    log = tmp_path_factory.mktemp("engine") / "llama_server.log"
    proc, url = start_llama_server(gguf, log, n_ctx=N_CTX)
    try:
        yield url, log, gguf
    finally:
        stop(proc)


def start_proxy(engine_url: str, gguf: Path, template: str, data_dir: Path, log: Path
                ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ctxfold", "serve", "--upstream", engine_url, "--port", str(port),
           "--context-tokens", str(N_CTX), "--reply-reserve-tokens", str(4 * MAX_TOKENS),
           "--tokenizer", f"gguf:{gguf}", "--template", template, "--summarizer", "extractive",
           "--engine-check", "every", "--data-dir", str(data_dir)]
    base = f"http://127.0.0.1:{port}"
    return launch(cmd, log, base + "/health", env=ctxfold_env()), base


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def probe_report(base: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """The startup probe's report once it is done."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report: dict[str, Any] = get_json(base + "/health")["engine_check"]
        if report["state"] != "pending":
            return report
        time.sleep(0.5)
    raise AssertionError("the engine check did not finish")


def trace_turns(traces_dir: Path) -> list[str]:
    conversation = load(traces_dir.joinpath(*TRACE))[0]
    return chat_only_turns(conversation, max_chars=TURN_CHARS)[:TURNS]


def test_proxy_before_llama_server_counts_what_the_engine_sees(engine: tuple[str, Path, Path], traces_dir: Path,
                                                                 tmp_path: Path) -> None:
    engine_url, engine_log, gguf = engine
    turns = trace_turns(traces_dir)
    assert len(turns) == TURNS

    # The control first: the same client straight to the engine is refused once the history outgrows it.
    control = replay(engine_url, [turns], max_tokens=MAX_TOKENS, stop_on_rejection=True)
    assert control[-1].status == "rejected", [(r.turn, r.status, r.error) for r in control]
    assert "context" in control[-1].error
    print(f"control: refused at turn {control[-1].turn} of {len(turns)}: {control[-1].error[:160]}")

    proxy, base = start_proxy(engine_url, gguf, f"file:{GEMMA_FORMAT_TEMPLATE}", tmp_path / "data",
                              tmp_path / "proxy.log")
    try:
        report = probe_report(base)
        proxied = replay(base + "/v1", [turns], max_tokens=MAX_TOKENS, engine_log=engine_log, stream_every=4)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
    finally:
        stop(proxy)
    proxy_log = (tmp_path / "proxy.log").read_text()
    for r in proxied:
        print(f"turn {r.turn:2d} {'stream' if r.stream else 'json  '} predicted {r.predicted} engine {r.reported} "
              f"compactions {r.compactions} planned reuse {r.planned_reuse} engine reuse {r.engine_reuse} "
              f"{r.seconds:.1f} s")

    assert [r.status for r in proxied] == ["ok"] * len(turns), [(r.turn, r.error) for r in proxied if r.error]
    assert control[-1].turn < len(turns)  # the proxy went past the turn the engine refused alone
    answered: list[TurnResult] = [r for r in proxied if not r.stream]
    assert answered and all(r.reported is not None for r in answered)
    assert [r.predicted for r in answered] == [r.reported for r in answered]
    assert sum(r.compactions for r in proxied) >= 1
    assert all(r.predicted is not None and r.predicted + MAX_TOKENS <= N_CTX for r in proxied)
    # Every answer with usage was compared, and agreed; the probe agreed too (the engine's format drops
    # system and tool messages, and the template mirrors it: said, but not a divergence of the counts).
    assert metric(metrics, "ctxfold_engine_checks_total", result="agree") == len(answered)
    assert 'result="differ"' not in metrics
    assert report["state"] == "agree", report
    assert any("drops system messages" in f for f in report["findings"])
    # llama-cpp-python sends no usage in streams even when asked: said once.
    assert proxy_log.count("sends no usage in streamed answers") == 1


def test_engine_check_names_a_template_the_engine_does_not_use(engine: tuple[str, Path, Path],
                                                               tmp_path: Path) -> None:
    """Gemma 3's own template beside an engine running llama-cpp-python's ``gemma`` format: the probe
    says the engine drops system messages, in one warning line, and counts it."""
    engine_url, _, gguf = engine
    proxy, base = start_proxy(engine_url, gguf, "gemma-3", tmp_path / "data", tmp_path / "proxy.log")
    try:
        report = probe_report(base)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
    finally:
        stop(proxy)
    assert report["state"] == "differ", report
    assert report["figures"]["system"]["engine"] == report["figures"]["user"]["engine"]
    assert report["figures"]["system"]["ctxfold"] > report["figures"]["user"]["ctxfold"]
    assert metric(metrics, "ctxfold_engine_divergences_total", kind="system_dropped") == 1
    warnings = [line for line in (tmp_path / "proxy.log").read_text().splitlines() if "engine check" in line]
    assert len(warnings) == 1 and "drops system messages" in warnings[0], warnings
