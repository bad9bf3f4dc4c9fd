"""Server-sent events as OpenAI-compatible servers stream them, read incrementally. Neutral ground: the
proxy (:mod:`ctxfold.serve`) reads the upstream's streams with it, and the summarizer
(:mod:`ctxfold.compaction.summarize.openai`) reads its own; it needs nothing of either.
"""

from __future__ import annotations

import json
from typing import Any

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


def json_object(payload: str | None) -> dict[str, Any] | None:
    """An event's ``data:`` payload as a JSON object; None for no payload, bad JSON or another JSON
    value (an accumulator reads what it understands and relays the rest untouched)."""
    if payload is None:
        return None
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None
