"""LangChain pieces for the integration's tests and its side-by-side benchmark: chat models that call no
network (a scripted agent model, a deterministic summary model) and the comparison form of a message."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import Field

Turn = AIMessage | Callable[[list[BaseMessage]], AIMessage]


class ScriptedModel(BaseChatModel):
    """An agent's model that answers from a script: a message, or a function of what it was sent. Records
    every request (its messages, and the names of the tools bound for it)."""

    script: list[Any]
    seen: list[list[BaseMessage]] = Field(default_factory=list)
    bound: list[list[str]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        self.bound.append([getattr(t, "name", None) or t.get("function", {}).get("name") for t in tools])
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        self.seen.append(list(messages))
        turn = self.script[len(self.seen) - 1]
        answer = turn(list(messages)) if callable(turn) else turn
        return ChatResult(generations=[ChatGeneration(message=answer)])


class SummaryModel(BaseChatModel):
    """A deterministic summary writer: about ``words`` words drawn from a digest of the prompt, the same
    answer for the same prompt, whoever asks (LangChain's SummarizationMiddleware or ctxfold)."""

    words: int = 150
    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "summary-fake"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        self.calls += 1
        digest = hashlib.sha256("".join(m.text for m in messages).encode()).hexdigest()
        text = "Task state: " + " ".join(f"fact-{digest[i % 60:i % 60 + 4]}-{i}" for i in range(self.words))
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])


def shown(messages: Sequence[BaseMessage]) -> list[tuple[Any, ...]]:
    """What the model reads of each message: its type, text, calls and the call a result answers."""
    out = []
    for m in messages:
        calls = tuple((c["id"], c["name"], sorted(c["args"].items())) for c in getattr(m, "tool_calls", []))
        out.append((m.type, m.text, calls, m.tool_call_id if isinstance(m, ToolMessage) else None))
    return out
