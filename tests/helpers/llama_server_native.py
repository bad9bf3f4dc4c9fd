"""llama.cpp's own ``llama-server`` (the C++ binary, not ``python -m llama_cpp.server``) for the end-to-end
tests and bench, and the official SDKs driving each of its dialects.

The binary is built by ``.ci/build-llama-server`` from the llama.cpp source inside llama-cpp-python's
sdist and found through ``CTXFOLD_LLAMA_SERVER`` (else ``llama-server`` on the PATH). It serves
``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` over one chat template, so one engine
checks the proxy's count in each dialect against the engine's own usage.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers.gemma_gguf import _missing
from helpers.llama_server import free_port, launch
from helpers.sdk_clients import anthropic_client, openai_client

MODEL = "gemma-3-270m"
DIALECTS = ("chat", "responses", "messages")


def llama_server_binary() -> Path:
    """The ``llama-server`` binary, or a skip (a failure with ``CTXFOLD_REQUIRE_LLAMA=1``) saying how to build it."""
    named = os.environ.get("CTXFOLD_LLAMA_SERVER") or shutil.which("llama-server")
    if not named or not os.access(named, os.X_OK):
        _missing("llama.cpp's own llama-server is not built: run .ci/build-llama-server and set "
                 "CTXFOLD_LLAMA_SERVER to the path it prints")
    return Path(str(named))


def start_native_server(gguf: Path, log: Path, *, n_ctx: int, template_file: Path, threads: int = 2,
                        cache_reuse_tokens: int = 0, swa_full: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """``llama-server`` on a free loopback port with one slot of ``n_ctx`` tokens (its default splits the
    window among several) and ``template_file`` as its chat template; returns the process and ``.../v1``.
    ``cache_reuse_tokens``: the smallest cached chunk it shifts into place past the common prefix
    (``--cache-reuse``; 0: the common prefix alone). ``swa_full``: a full-size cache for the sliding-window
    layers, without which a sliding-window model cannot shift its cache."""
    port = free_port()
    cmd = [str(llama_server_binary()), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--ctx-size", str(n_ctx), "--parallel", "1", "--threads", str(threads), "--jinja",
           "--chat-template-file", str(template_file), "--no-webui", "--metrics",
           "--cache-reuse", str(cache_reuse_tokens)]
    if swa_full:
        cmd.append("--swa-full")
    base = f"http://127.0.0.1:{port}"
    return launch(cmd, log, base + "/health"), base + "/v1"


@dataclass
class Turn:
    """One request as the SDK client saw it."""

    dialect: str
    turn: int  # 1-based
    stream: bool
    status: str = "ok"  # "ok", "rejected" (too long for the window), "error"
    predicted: int | None = None  # X-Ctxfold-Prompt-Tokens: the proxy's count of what it sent
    reported: int | None = None  # the engine's whole prompt, from the dialect's usage
    compactions: int = 0  # X-Ctxfold-Compactions
    seconds: float = 0.0
    error: str = ""
    answer: str = field(default="", repr=False)


def _headers(turn: Turn, headers: Any) -> None:
    if "x-ctxfold-prompt-tokens" in headers:
        turn.predicted = int(headers["x-ctxfold-prompt-tokens"])
    turn.compactions = int(headers.get("x-ctxfold-compactions", "0"))


def _chat(client: Any, history: list[tuple[str, str]], turn: Turn, max_tokens: int) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": r, "content": t} for r, t in history], max_tokens=max_tokens,
        temperature=0.0, seed=0, stream=turn.stream,
        **({"stream_options": {"include_usage": True}} if turn.stream else {}))
    _headers(turn, raw.headers)
    parsed = raw.parse()
    if not turn.stream:
        turn.answer = parsed.choices[0].message.content or ""
        turn.reported = parsed.usage.prompt_tokens if parsed.usage is not None else None
        return
    parts: list[str] = []
    for chunk in parsed:
        if chunk.usage is not None:
            turn.reported = chunk.usage.prompt_tokens
        parts.extend(c.delta.content or "" for c in chunk.choices)
    turn.answer = "".join(parts)


def _responses(client: Any, history: list[tuple[str, str]], turn: Turn, max_tokens: int) -> None:
    raw = client.responses.with_raw_response.create(
        # Each item typed, as Codex and the Agents SDK send them: llama-server refuses an untyped one.
        model=MODEL, input=[{"type": "message", "role": r, "content": t} for r, t in history], max_output_tokens=max_tokens,
        temperature=0.0, stream=turn.stream)
    _headers(turn, raw.headers)
    parsed = raw.parse()
    if not turn.stream:
        turn.answer = parsed.output_text
        turn.reported = parsed.usage.input_tokens if parsed.usage is not None else None
        return
    parts: list[str] = []
    for event in parsed:
        if event.type == "response.output_text.delta":
            parts.append(event.delta)
        elif event.type == "response.completed" and event.response.usage is not None:
            turn.reported = event.response.usage.input_tokens
    turn.answer = "".join(parts)


def _anthropic_prompt(usage: Any) -> int | None:
    """The whole prompt of an Anthropic usage: what was read from the cache, written to it and neither."""
    if usage is None or usage.input_tokens is None:
        return None
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0))


def _messages(client: Any, history: list[tuple[str, str]], turn: Turn, max_tokens: int) -> None:
    raw = client.messages.with_raw_response.create(
        # Greedy, in the request body: this SDK's create() has no temperature argument any more.
        model=MODEL, messages=[{"role": r, "content": t} for r, t in history], max_tokens=max_tokens,
        extra_body={"temperature": 0.0}, stream=turn.stream)
    _headers(turn, raw.headers)
    parsed = raw.parse()
    if not turn.stream:
        turn.answer = "".join(b.text for b in parsed.content if b.type == "text")
        turn.reported = _anthropic_prompt(parsed.usage)
        return
    parts: list[str] = []
    for event in parsed:
        if event.type == "message_start":
            turn.reported = _anthropic_prompt(event.message.usage)
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            parts.append(event.delta.text)
    turn.answer = "".join(parts)


_SEND = {"chat": _chat, "responses": _responses, "messages": _messages}


def converse(base_url: str, dialect: str, user_turns: list[str], *, max_tokens: int, stream_every: int = 0,
             stop_on_rejection: bool = False) -> list[Turn]:
    """Drive ``user_turns`` through ``base_url`` (``.../v1``) in ``dialect`` with its official SDK, as a
    chat-only client: each answer (the model's own, ``max_tokens`` at most, greedy) goes into the history
    the next request carries. Every ``stream_every``-th turn is streamed (0: none)."""
    import anthropic
    import openai

    if dialect == "messages":
        client = anthropic_client(base_url.removesuffix("/v1"), timeout=900.0)
        refused: tuple[type[Exception], ...] = (anthropic.BadRequestError,)
        failed: tuple[type[Exception], ...] = (anthropic.APIError,)
    else:
        client = openai_client(base_url, timeout=900.0)
        refused, failed = (openai.BadRequestError,), (openai.APIError,)
    history: list[tuple[str, str]] = []
    out: list[Turn] = []
    for i, text in enumerate(user_turns, 1):
        turn = Turn(dialect, i, stream=stream_every > 0 and i % stream_every == 0)
        history.append(("user", text))
        t0 = time.perf_counter()
        try:
            _SEND[dialect](client, history, turn, max_tokens)
            history.append(("assistant", turn.answer))
        except refused as e:
            words = str(e)
            turn.status = "rejected" if "context" in words or "exceed" in words else "error"
            turn.error = words[:300]
            history.pop()
        except failed as e:
            turn.status, turn.error = "error", str(e)[:300]
            history.pop()
        turn.seconds = time.perf_counter() - t0
        out.append(turn)
        if turn.status != "ok" and stop_on_rejection:
            break
    return out
