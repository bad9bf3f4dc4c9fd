"""Reading an OpenAI chat.completions event stream on the side, while its bytes pass through unchanged.

:class:`~ctxfold.wire.sse.SseReader` (the package's one SSE reader, shared with the summarizer) splits
the bytes into events as they arrive, whatever the chunking; :class:`AnswerAssembler` folds the chunks'
deltas into the one assistant message they stream (content, reasoning, tool calls, finish reason,
usage) so the proxy can record it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxfold import fastjson
from ctxfold.wire.sse import DONE, SseEventTooLarge, SseReader

__all__ = ["DONE", "AnswerAssembler", "SseEventTooLarge", "SseReader"]


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
