"""A real agent end to end: mini-swe-agent (from PyPI, its own text-based config) working on a small task of
its own through ``ctxfold serve`` to ``python -m llama_cpp.server`` serving Gemma 3 270M at n_ctx 4096, the
summaries written by that model (``--summarizer upstream``).

Gemma 3 270M will not solve the task: most answers are cut at the token cap or malformed, and the agent
answers each with its format-error message and goes on (tests/helpers/mini_swe_agent_run.py says what
is configured for that). So the history grows every step and outgrows the window:

- through the proxy, every one of the run's steps is answered, none over the window, and ctxfold's count
  of every prompt it sent (``X-Ctxfold-Prompt-Tokens``, ``--engine-check every``) equals the engine's
  ``usage.prompt_tokens``, counted with the model's own GGUF tokenizer (``--tokenizer gguf:PATH``) and the
  engine's chat format (the GGUF carries no chat template, so ``--template gguf:PATH`` has nothing to
  read: tests/data/llama_cpp_python_gemma.jinja is the ``gemma`` format the engine renders);
- ``ctxfold restore`` gives back the conversation of the agent's last request, message for message;
- the control, the same agent straight to the engine, is refused once its history outgrows the window
  (litellm's ``ContextWindowExceededError``: llama_cpp.server's "maximum context length").

Needs llama-cpp-python's server (the ``llama-server`` extra), mini-swe-agent (the ``agent`` extra) and the
Gemma GGUF wheels (the ``test`` extra); skips saying which is missing (fails with CTXFOLD_REQUIRE_LLAMA=1).
About ten minutes on 2 loaded cores.

What the run shows besides: mini-swe-agent v2 keeps a malformed answer out of its history (only the
format-error message goes in), so its requests carry no assistant message at all and each one forks the
proxy's conversation. ctxfold takes the model to have seen a conversation up to its latest answer, so
here nothing counts as seen, the soft trigger finds "nothing to summarize", and the model is never asked
for a summary: the window guard keeps every request inside the window (its archive pass folds the long
task message into an archive marker). docs/engines.md says more.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.gemma_gguf import _missing, gemma_gguf_path, require_llama_cpp
from helpers.llama_server import GEMMA_FORMAT_TEMPLATE, free_port, launch, start_llama_server, stop
from helpers.mini_swe_agent_run import AgentRun, require_mini_swe_agent, run_agent
from helpers.proxy_helpers import metric
from helpers.subprocess_env import ctxfold_env

N_CTX = 4096
MAX_TOKENS = 16  # per answer: most are cut here (the agent drops them from its history either way)
SUMMARY_TOKENS = 48  # the summary's cap: Gemma 270M decodes a few tokens a second on a loaded CPU
# One thread generates: on 2 cores shared with other work, two decoding threads waited on each other
# (0.5 tokens/s where one thread made 5); prompts are still evaluated on two.
DECODE_THREADS = 1
STEPS = 32

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # real engine, proxy and agent: half an hour


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    require_llama_cpp()
    require_mini_swe_agent()
    try:
        import uvicorn  # noqa: F401  (what llama_cpp.server runs on: its [server] extra)
    except ImportError:
        _missing("llama_cpp.server's packages are not installed: pip install '.[llama-server]'")
    gguf = gemma_gguf_path()
    log = tmp_path_factory.mktemp("engine") / "llama_server.log"
    proc, url = start_llama_server(gguf, log, n_ctx=N_CTX, decode_threads=DECODE_THREADS)
    try:
        yield url, log, gguf
    finally:
        stop(proc)


def start_proxy(upstream_url: str, gguf: Path, tmp: Path, *, n_ctx: int = N_CTX, max_tokens: int = MAX_TOKENS,
                summary_tokens: int = SUMMARY_TOKENS) -> tuple[subprocess.Popen[bytes], str]:
    """``ctxfold serve`` as the run uses it, once its startup probe is done (the probe's requests would
    otherwise come between the agent's and take the engine's cache)."""
    config = tmp / "compact.yaml"
    config.write_text(f"agent:\n  compact:\n    summary:\n      max_tokens: {summary_tokens}\n"
                      f"      min_room_tokens: {summary_tokens}\n")
    port = free_port()
    cmd = [sys.executable, "-m", "ctxfold", "serve", "--upstream", upstream_url, "--port", str(port),
           "--context-tokens", str(n_ctx), "--reply-reserve-tokens", str(2 * max_tokens),
           "--tokenizer", f"gguf:{gguf}", "--template", f"file:{GEMMA_FORMAT_TEMPLATE}",
           "--summarizer", "upstream", "--summary-timeout-s", "900", "--config", str(config),
           "--engine-check", "every", "--data-dir", str(tmp / "data")]
    base = f"http://127.0.0.1:{port}"
    proc = launch(cmd, tmp / "proxy.log", base + "/health", env=ctxfold_env())
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            if json.loads(r.read())["engine_check"]["state"] != "pending":
                return proc, base
        time.sleep(0.5)
    stop(proc)
    raise AssertionError("the engine check did not finish")


def restored_messages(data_dir: Path) -> list[dict[str, str]]:
    """``ctxfold restore`` of the proxy's newest session, run as a user runs it: role and content of each
    message, the system prompt first. mini-swe-agent leaves each malformed answer out of its history, so
    each request forks the conversation (the proxy's lineage: ``sessions/ID/0000``, ``0001``, ...)."""
    sessions = sorted(p for p in data_dir.glob("tenants/*/sessions/*/*") if (p / "events.jsonl").is_file())
    assert sessions, f"no session under {data_dir}"
    out = subprocess.run([sys.executable, "-m", "ctxfold", "restore", str(sessions[-1]), "-o", "-"],
                         capture_output=True, text=True, env=ctxfold_env(), check=True)
    doc = json.loads(out.stdout)
    system = [{"role": "system", "content": doc["system"]}] if doc.get("system") else []
    return system + [{"role": m["role"], "content": m.get("content") or ""} for m in doc["messages"]]


def print_run(label: str, run: AgentRun) -> None:
    for c in run.calls:
        print(f"{label} step {c.step:2d} ctxfold {c.predicted} engine {c.reported} compactions {c.compactions} "
              f"{c.finish_reason} {c.seconds:.1f} s")
    print(f"{label}: {len(run.calls)} calls, ended {run.exit_status}: {str(run.error or '')[:200]}")


def test_mini_swe_agent_through_the_proxy_outlasts_the_window(engine: tuple[str, Path, Path],
                                                               tmp_path: Path) -> None:
    engine_url, _, gguf = engine
    import litellm

    (tmp_path / "work").mkdir()
    proxy, base = start_proxy(engine_url, gguf, tmp_path)
    try:
        run = run_agent(base + "/v1", tmp_path / "work", steps=STEPS, max_tokens=MAX_TOKENS)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
    finally:
        stop(proxy)
    print_run("proxied", run)
    print(f"compactions by kind: {[line for line in metrics.splitlines() if line.startswith('ctxfold_compactions_total')]}")

    # Every step answered, and the agent stopped at its limit.
    assert run.error is None and run.exit_status == "LimitsExceeded", (run.exit_status, run.error)
    assert len(run.calls) == STEPS
    # ctxfold's count of each prompt equals the engine's, and none was over the window.
    assert all(c.reported is not None for c in run.calls)
    assert [c.predicted for c in run.calls] == [c.reported for c in run.calls]
    assert max(c.reported or 0 for c in run.calls) + MAX_TOKENS <= N_CTX
    assert sum(c.compactions for c in run.calls) >= 1
    assert metric(metrics, "ctxfold_engine_checks_total", result="agree") == STEPS
    assert 'result="differ"' not in metrics
    # The session holds the whole conversation of the agent's last request, through every compaction.
    assert restored_messages(tmp_path / "data") == run.sent_history()

    # The control: straight to the engine, the agent is refused once its history outgrows the window.
    (tmp_path / "control").mkdir()
    control = run_agent(engine_url, tmp_path / "control", steps=STEPS, max_tokens=MAX_TOKENS)
    print_run("control", control)
    assert isinstance(control.error, litellm.exceptions.ContextWindowExceededError), control.exit_status
    assert "context" in str(control.error)
    assert len(control.calls) < STEPS  # the proxy went past the step the engine refused alone
