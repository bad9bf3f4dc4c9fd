"""A minimal reader for the OpenAI-chat trace sets (tau_bench, deepseek_sample).

Only what the archive tests need: role, content, tool calls, tool_call_id, name, reasoning. Kept
small on purpose; the full importers live in ctxfold.formats.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ctxfold.messages import Message, Role, ToolCall


def _message(i: int, d: dict[str, Any]) -> Message:
    calls = tuple(
        ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in d.get("tool_calls") or ()
    )
    return Message(
        role=Role(d["role"]),
        content=d.get("content") or "",
        id=f"m{i}",
        tool_calls=calls,
        tool_call_id=d.get("tool_call_id"),
        name=d.get("name"),
        reasoning=d.get("reasoning_content"),
    )


def load_openai_chat_sets(traces_dir: Path) -> Iterator[tuple[str, str, list[Message]]]:
    """(set name, conversation name, messages) for every conversation of the two sets."""
    tau = traces_dir / "tau_bench" / "gpt-4o-airline.json"
    for k, item in enumerate(json.loads(tau.read_text(encoding="utf-8"))):
        yield "tau_bench", f"{item['task_id']}.{item['trial']}#{k}", [_message(i, d) for i, d in enumerate(item["traj"])]
    for path in sorted((traces_dir / "deepseek_sample").glob("*/*.traj.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        yield "deepseek_sample", f"{path.parent.name}/{path.name}", [
            _message(i, d) for i, d in enumerate(data["messages"])
        ]
