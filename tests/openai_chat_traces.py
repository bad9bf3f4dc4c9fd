"""A tiny loader for the OpenAI-chat-shaped trace sets (tau-bench, the DeepSeek mini-swe-agent runs,
SWE-agent histories), so summarizer tests can run on real conversations without the format importers."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ctxfold.messages import Conversation, Message, Role, ToolCall, as_parts


def _content(value: Any) -> str | tuple[Any, ...]:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return as_parts([v if isinstance(v, Mapping) else {"type": "text", "text": str(v)} for v in value])
    return str(value)


def message_from_openai(d: Mapping[str, Any], index: int) -> Message:
    role = Role(d["role"]) if d.get("role") in {r.value for r in Role} else Role.USER
    calls = tuple(
        ToolCall(id=str(c.get("id", "")), name=str(c["function"].get("name", "")),
                 arguments=str(c["function"].get("arguments", "")))
        for c in d.get("tool_calls") or () if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
    )
    return Message(
        role=role, content=_content(d.get("content")), id=str(index), tool_calls=calls,
        tool_call_id=d.get("tool_call_id"), name=d.get("name"),
        reasoning=d.get("reasoning_content") if isinstance(d.get("reasoning_content"), str) else None,
    )


def _conversation(raw: list[Mapping[str, Any]], source: str) -> Conversation:
    msgs = [message_from_openai(d, i) for i, d in enumerate(raw) if isinstance(d, Mapping) and "role" in d]
    system = None
    if msgs and msgs[0].role is Role.SYSTEM:
        system = msgs[0].text
        msgs = msgs[1:]
    return Conversation(messages=msgs, system=system, source=source, source_format="openai")


def openai_chat_conversations(traces_dir: Path) -> Iterator[Conversation]:
    """Every conversation of the OpenAI-chat-shaped sets."""
    for i, task in enumerate(json.loads((traces_dir / "tau_bench" / "gpt-4o-airline.json").read_text())):
        yield _conversation(task["traj"], f"tau_bench/gpt-4o-airline.json#{i}")
    for p in sorted((traces_dir / "deepseek_sample").glob("*/*.traj.json")):
        yield _conversation(json.loads(p.read_text())["messages"], str(p.relative_to(traces_dir)))
    for p in sorted((traces_dir / "swe_agent").glob("*.traj")):
        history = json.loads(p.read_text()).get("history") or []
        yield _conversation(history, str(p.relative_to(traces_dir)))
