"""Reading an OpenAI chat.completions event stream on the side, while its bytes pass through unchanged.

:class:`SseReader` splits the bytes into events (``data:`` payloads) as they arrive, whatever the
chunking (the package's one SSE reader: the summarizer reads its streams with it too; it needs
nothing of the proxy's dependencies); :class:`AnswerAssembler` folds the chunks' deltas into the one assistant message they
stream (content, reasoning, tool calls, finish reason, usage) so the proxy can record it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxfold import fastjson

DONE = "[DONE]"


class SseEventTooLarge(ValueError):
    """An event (its lines so far) is larger than the reader's bound: a stream no client should be held
    for, whose bytes would otherwise pile up in memory until it ends."""


class SseReader:
    """Incremental parser: feed bytes, get each complete event as (its raw bytes, its ``data`` payload).

    The raw bytes of the events, in order, followed by :meth:`rest`, are exactly the bytes fed, so a
    proxy can forward event by event without changing a byte. The payload is None for an event without
    ``data`` lines (a comment, a keep-alive).

    Linear in the bytes fed, however they are chunked: each chunk is searched for line ends once, and a
    line that spans chunks is joined once, when it ends. ``max_event_bytes``: an event (the lines read of
    it, the unfinished one included) larger than this raises :class:`SseEventTooLarge`.
    """

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self.max_event_bytes = max_event_bytes
        self._partial: list[bytes] = []  # the pieces of a line that has not ended yet
        self._event_nbytes = 0  # bytes of the event being read: its complete lines and the partial one
        self._raw: list[bytes] = []  # complete lines of the event being read
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[bytes, str | None]]:
        out: list[tuple[bytes, str | None]] = []
        start = 0
        self._event_nbytes += len(chunk)  # an over-count where events end in the chunk: reset at each end
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            piece = chunk[start : nl + 1]
            start = nl + 1
            if self._partial:
                self._partial.append(piece)
                line = b"".join(self._partial)
                self._partial = []
            else:
                line = piece
            self._line(line, out)
            if not self._raw:  # an event ended: what is left of the chunk is the next one's
                self._event_nbytes = len(chunk) - start
        if start < len(chunk):
            self._partial.append(chunk[start:])
        if self.max_event_bytes is not None and self._event_nbytes > self.max_event_bytes:
            raise SseEventTooLarge(f"an event of over {self.max_event_bytes:,} bytes")
        return out

    def _line(self, line: bytes, out: list[tuple[bytes, str | None]]) -> None:
        self._raw.append(line)
        body = line.rstrip(b"\r\n")
        if not body:  # a blank line ends the event
            out.append((b"".join(self._raw), "\n".join(self._data) if self._data else None))
            self._raw, self._data = [], []
        elif body.startswith(b"data:"):
            value = body[5:]
            self._data.append((value[1:] if value.startswith(b" ") else value).decode("utf-8", "replace"))
        # comments (":") and other fields (event:, id:, retry:) carry nothing the proxy needs

    def rest(self) -> bytes:
        """Bytes fed that no complete event holds yet (an unterminated last event)."""
        return b"".join(self._raw) + b"".join(self._partial)


@dataclass(slots=True)
class _CallDelta:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class AnswerAssembler:
    """The assistant message a stream carries, built from its chunks (choice 0)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _CallDelta] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # the [DONE] sentinel arrived
    chunks: int = 0

    def add(self, payload: str | None) -> dict[str, Any] | None:
        """Fold one event's payload in; returns the parsed chunk (None for [DONE] and non-JSON)."""
        if payload is None:
            return None
        if payload.strip() == DONE:
            self.done = True
            return None
        try:
            chunk = fastjson.loads(payload)
        except ValueError:
            return None  # not ours to judge: the bytes went to the client as they were
        if not isinstance(chunk, dict):
            return None
        self.chunks += 1
        self._fold(chunk)
        return chunk

    def _fold(self, chunk: dict[str, Any]) -> None:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        if isinstance(delta.get("reasoning_content"), str):
            self.reasoning.append(delta["reasoning_content"])
        for k, tc in enumerate(delta.get("tool_calls") or []):
            if not isinstance(tc, dict):
                continue
            index = tc.get("index", k)
            slot = self.calls.setdefault(index if isinstance(index, int) else k, _CallDelta())
            if isinstance(tc.get("id"), str):
                slot.id = tc["id"]
            fn = tc.get("function")
            if isinstance(fn, dict):
                if isinstance(fn.get("name"), str):
                    slot.name += fn["name"]
                if isinstance(fn.get("arguments"), str):
                    slot.arguments.append(fn["arguments"])

    @property
    def has_text(self) -> bool:
        return any(self.content) or any(self.reasoning)

    def call_names(self) -> list[str]:
        return [c.name for _, c in sorted(self.calls.items())]

    def message(self) -> dict[str, Any]:
        """The assembled message in the non-streaming ``choices[0].message`` shape."""
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                for _, c in sorted(self.calls.items())
            ]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg
