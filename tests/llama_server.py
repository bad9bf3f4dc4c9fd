"""``python -m llama_cpp.server`` for the end-to-end tests and bench, started on a free loopback port.

Run as a script, this module is ``llama_cpp.server``'s own ``__main__`` with one setting its command
line lacks: llama.cpp's repacked CPU weight layouts (AMX) off unless ``CTXFOLD_LLAMA_EXTRA_BUFFERS=1``
(see tests/gemma_gguf.py: on a host that reports AMX without letting a process use it, the server dies
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
from pathlib import Path
from typing import Any

GEMMA_FORMAT_TEMPLATE = Path(__file__).parent / "data" / "llama_cpp_python_gemma.jinja"
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
                       chat_format: str = "gemma") -> tuple[subprocess.Popen[bytes], str]:
    """llama_cpp.server on a free loopback port; returns the process and its base URL (``.../v1``).
    Its stderr (the prefix-match lines) goes to ``log``."""
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", str(gguf), "--n_ctx", str(n_ctx),
           "--chat_format", chat_format, "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--seed", "0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + "/v1/models", proc, 120.0, log)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, base + "/v1"


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
    from ctxfold.messages import Role

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
