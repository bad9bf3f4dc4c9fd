"""``python -m llama_cpp.server`` for the end-to-end tests and bench, started on a free loopback port.

Run as a script, this module is ``llama_cpp.server``'s own ``__main__`` with one setting its command
line lacks: llama.cpp's repacked CPU weight layouts (AMX) off unless ``CTXFOLD_LLAMA_EXTRA_BUFFERS=1``
(see tests/helpers/gemma_gguf.py: on a host that reports AMX without letting a process use it, the server dies
with SIGILL on its first request). Everything else is the server as a user runs it.

Also: the chat template that mirrors llama-cpp-python's ``gemma`` chat format (tests/data), and a
chat-only client's view of a trace (tool turns flattened into user and assistant text).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GEMMA_FORMAT_TEMPLATE = Path(__file__).parents[1] / "data" / "llama_cpp_python_gemma.jinja"
EXTRA_BUFFER_TYPES = os.environ.get("CTXFOLD_LLAMA_EXTRA_BUFFERS", "") not in ("", "0")
# llama-cpp-python's own line for a prompt that continues its cached tokens (verbose, its default).
PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode} before it was ready: "
                               f"{log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not ready within {timeout_s:g} s")


def start_llama_server(gguf: Path, log: Path, *, n_ctx: int = 4096, threads: int = 2,
                       chat_format: str = "gemma", decode_threads: int | None = None
                       ) -> tuple[subprocess.Popen[bytes], str]:
    """llama_cpp.server on a free loopback port; returns the process and its base URL (``.../v1``).
    Its stderr (the prefix-match lines) goes to ``log``. ``threads`` evaluate prompts, ``decode_threads``
    (default: as many) generate."""
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", str(gguf), "--n_ctx", str(n_ctx),
           "--chat_format", chat_format, "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(decode_threads or threads), "--n_threads_batch", str(threads), "--seed", "0"]
    base = f"http://127.0.0.1:{port}"
    return launch(cmd, log, base + "/v1/models"), base + "/v1"


def launch(cmd: list[str], log: Path, ready_url: str, *, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    """``cmd`` started with its output in ``log``, once ``ready_url`` answers (within 120 s; else it is
    killed and the error names the log)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        wait_ready(ready_url, proc, 120.0, log)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def prefix_hits(log: Path, start: int = 0) -> tuple[list[int], int]:
    """The engine's prefix-match hits (tokens served from its cache) logged since byte ``start``, and
    the log's size now. A request that reused nothing logs no line."""
    data = log.read_bytes()
    return [int(m.group(1)) for m in PREFIX_HIT.finditer(data[start:].decode(errors="replace"))], len(data)


def text_of(m: Any) -> str:
    return str(getattr(m, "text", "") or "")


def chat_only_turns(conversation: Any, *, max_chars: int) -> list[str]:
    """A trace as a chat-only client replays it: the user's side of each turn (the system prompt in front
    of the first, tool results and user messages between two assistant answers joined, each capped at
    ``max_chars``), contents stripped. The assistant side is the model's own answer."""
    from ctxfold.chat.messages import Role

    turns: list[str] = []
    pending: list[str] = []
    if conversation.system:
        pending.append(conversation.system)
    for m in conversation.messages:
        if m.role is Role.ASSISTANT:
            if pending:
                turns.append("\n\n".join(pending)[:max_chars].strip() or "(empty)")
                pending = []
            continue
        body = text_of(m)
        pending.append(f"Tool result:\n{body}" if m.role is Role.TOOL else body)
    if pending:
        turns.append("\n\n".join(pending)[:max_chars].strip() or "(empty)")
    return turns


@dataclass
class TurnResult:
    """One request of a replay, as the client saw it (and the engine's log line for it)."""

    conversation: int
    turn: int  # 1-based, within its conversation
    status: str  # "ok", "rejected" (the prompt did not fit the engine's window), "error"
    stream: bool = False
    predicted: int | None = None  # X-Ctxfold-Prompt-Tokens: ctxfold's count of the prompt it sent
    reported: int | None = None  # the engine's usage.prompt_tokens
    compactions: int = 0  # X-Ctxfold-Compactions
    planned_reuse: int | None = None  # X-Ctxfold-Kv-Reused-Tokens: the KV the compaction's plan keeps
    engine_reuse: int = 0  # the engine's prefix-match hit (tokens it did not evaluate again)
    seconds: float = 0.0
    error: str = ""


def replay(base_url: str, conversations: list[list[str]], *, max_tokens: int, engine_log: Path | None = None,
           stream_every: int = 0, stop_on_rejection: bool = False, on_turn: Any = None) -> list[TurnResult]:
    """Drive ``conversations`` (the user side of each turn) through ``base_url`` with the ``openai`` client,
    as a chat-only client does: each answer (the model's own, ``max_tokens`` at most, greedy) goes into the
    history the next request carries. Every ``stream_every``-th turn is streamed (0: none). A conversation
    whose request is refused as too long for the window is left there when ``stop_on_rejection``."""
    import openai

    from helpers.sdk_clients import openai_client

    client = openai_client(base_url, api_key="unused", timeout=900.0)
    out: list[TurnResult] = []
    log_pos = engine_log.stat().st_size if engine_log is not None else 0
    for ci, turns in enumerate(conversations):
        history: list[dict[str, Any]] = []
        for ti, text in enumerate(turns, 1):
            history.append({"role": "user", "content": text})
            stream = stream_every > 0 and ti % stream_every == 0
            r = TurnResult(ci, ti, "ok", stream=stream)
            t0 = time.perf_counter()
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="gemma-3-270m", messages=history, max_tokens=max_tokens, temperature=0.0,
                    seed=0, stream=stream)  # type: ignore[call-overload]
                h = raw.headers
                r.predicted = int(h["x-ctxfold-prompt-tokens"]) if "x-ctxfold-prompt-tokens" in h else None
                r.compactions = int(h.get("x-ctxfold-compactions", "0"))
                if "x-ctxfold-kv-reused-tokens" in h:
                    r.planned_reuse = int(h["x-ctxfold-kv-reused-tokens"])
                parsed = raw.parse()
                if stream:
                    parts: list[str] = []
                    for chunk in parsed:
                        if chunk.usage is not None:
                            r.reported = chunk.usage.prompt_tokens
                        for choice in chunk.choices:
                            parts.append(choice.delta.content or "")
                    answer = "".join(parts)
                else:
                    answer = parsed.choices[0].message.content or ""
                    r.reported = parsed.usage.prompt_tokens if parsed.usage is not None else None
                history.append({"role": "assistant", "content": answer})
            except openai.BadRequestError as e:
                text_of_error = str(e)
                r.status = "rejected" if ("context" in text_of_error and "length" in text_of_error) else "error"
                r.error = text_of_error[:300]
                history.pop()
            except openai.APIError as e:
                r.status, r.error = "error", str(e)[:300]
                history.pop()
            r.seconds = time.perf_counter() - t0
            if engine_log is not None:
                hits, log_pos = prefix_hits(engine_log, log_pos)
                r.engine_reuse = hits[-1] if hits else 0
            out.append(r)
            if on_turn is not None:
                on_turn(r)
            if r.status != "ok" and stop_on_rejection:
                break
    return out


if __name__ == "__main__":
    import llama_cpp.llama_cpp as lib  # the module llama_cpp.Llama reads its defaults from
    from llama_cpp.server.__main__ import main

    if not EXTRA_BUFFER_TYPES:
        default_params = lib.llama_model_default_params

        def params_without_repacking() -> Any:
            params = default_params()
            params.use_extra_bufts = False
            return params

        lib.llama_model_default_params = params_without_repacking
    main()
