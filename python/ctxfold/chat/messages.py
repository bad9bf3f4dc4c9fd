"""The conversation model every part of ctxfold works on.

One :class:`Conversation` holds the system prompt, the tool definitions and a list of
:class:`Message`. Messages are immutable: a compaction pass builds new ones with
:func:`dataclasses.replace`, so a view can be kept while another is built from it.

Format-specific fields that the model has no place for are kept in ``extra`` so that an import
followed by an export of the same format is lossless.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of an assistant message."""

    id: str  # pairs the call with its result (OpenAI tool_call_id, Anthropic tool_use_id)
    name: str  # the tool's name
    arguments: str  # the arguments as recorded (normally a JSON object), kept verbatim for byte-exact export
    extra: Mapping[str, Any] = field(default_factory=dict)  # format-specific fields (type, index, ...)

    def parsed_arguments(self) -> Any:
        """The arguments parsed as JSON, or the raw string when they are not JSON."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a multi-part content: text, or something opaque (an image) kept for export."""

    type: str  # "text" for text parts; anything else is opaque to ctxfold
    text: str | None = None  # the text of a text part
    data: Mapping[str, Any] = field(default_factory=dict)  # the rest of the part, verbatim


@dataclass(frozen=True, slots=True)
class Usage:
    """Provider-reported token usage of the model call that produced a message."""

    prompt_tokens: int | None = None  # tokens of the request, as the provider counted them
    completion_tokens: int | None = None  # tokens of the answer
    cached_prompt_tokens: int | None = None  # prompt tokens served from the provider's prefix cache
    extra: Mapping[str, Any] = field(default_factory=dict)  # the raw usage record


Content = str | tuple[ContentPart, ...]


@dataclass(frozen=True, slots=True)
class Message:
    """One message. Tool results are role TOOL with ``tool_call_id`` set, whatever the source format."""

    role: Role
    content: Content = ""  # text, or parts when the source had several
    id: str = ""  # stable id: from the trace where it has one, else assigned by the importer
    tool_calls: tuple[ToolCall, ...] = ()  # calls made by an assistant message
    tool_call_id: str | None = None  # on a tool result: the id of the call it answers
    name: str | None = None  # tool name on a result; speaker name where the format has one
    reasoning: str | None = None  # thinking / reasoning content, kept apart from the answer
    queued: bool = False  # a user message typed while a turn was running (not a new turn)
    resume: bool = False  # a synthetic continue instruction written by a compaction (hidden from users)
    is_error: bool = False  # a tool result that reports an error
    summary: bool = False  # a compaction summary written by ctxfold (another agent's: is_imported_summary)
    usage: Usage | None = None  # provider usage of the call that produced this message
    extra: Mapping[str, Any] = field(default_factory=dict)  # format-specific fields, for lossless export

    @property
    def text(self) -> str:
        """The text of the content: the string itself, or the text parts joined by newlines."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if p.text is not None)

    @property
    def is_user_turn(self) -> bool:
        """A real user turn: a user message that is not a queued insert, a resume message, a summary
        ctxfold wrote (``summary``), or feedback an agent wrote in the user role (:func:`is_agent_feedback`). Another
        agent's compaction summary (:attr:`is_summary`) does start a turn: the conversation goes on from it."""
        if self.role is not Role.USER or self.queued or self.resume or self.summary:
            return False
        return not is_agent_feedback(self)

    @property
    def is_summary(self) -> bool:
        """A compaction summary: ctxfold's own, or one another agent wrote that was imported as a user
        message (:func:`is_imported_summary`). Either is carried into later summaries as durable state."""
        return self.summary or is_imported_summary(self)

    @property
    def is_tool_result(self) -> bool:
        return self.role is Role.TOOL

    def num_chars(self) -> int:
        """Characters of content, reasoning and tool-call arguments: the size the archive rules use."""
        n = len(self.text) + len(self.reasoning or "")
        return n + sum(len(c.name) + len(c.arguments) for c in self.tool_calls)


# The extra key of a summary message ctxfold wrote: its summary text without the frame.
CTXFOLD_SUMMARY_KEY = "ctxfold_summary"

# The extra key an importer sets on a user message its format flags as another agent's compaction
# summary (Claude Code's isCompactSummary).
IMPORTED_SUMMARY_KEY = "imported_summary"

# How other agents open the compaction summary they carry into a continued session as a user message.
# Matched at the start of the message's first text, so a user who quotes one later is not misread.
IMPORTED_SUMMARY_OPENINGS: tuple[str, ...] = (
    "This session is being continued from a previous conversation",  # Claude Code
    "Another language model started to solve this problem and produced a summary",  # Codex
)

# How agents open the messages they write in the user role about the model's last answer (a malformed
# tool call, a timeout): feedback inside a turn, not a new request from the user.
AGENT_FEEDBACK_OPENINGS: tuple[str, ...] = (
    "Tool call error:",  # mini-swe-agent 1.x/2.x format error
    "Please always provide EXACTLY ONE action in triple backticks",  # mini-swe-agent 0.x format error
    "The last command <command>",  # mini-swe-agent: a command that timed out
    "Your last command ran successfully and did not produce any output",  # SWE-agent without tool calls
)


def _opening(m: Message) -> str:
    """The start of a message's first text, without building the joined text of a many-part message."""
    c = m.content
    if isinstance(c, str):
        return c[:200].lstrip()
    for p in c:
        if p.text:
            return p.text[:200].lstrip()
    return ""


def is_imported_summary(m: Message) -> bool:
    """Whether ``m`` is a user message carrying another agent's own compaction summary."""
    if m.role is not Role.USER or m.summary:
        return False
    return bool(m.extra.get(IMPORTED_SUMMARY_KEY)) or _opening(m).startswith(IMPORTED_SUMMARY_OPENINGS)


def is_agent_feedback(m: Message) -> bool:
    """Whether ``m`` is a message an agent wrote in the user role about the model's last answer."""
    return m.role is Role.USER and _opening(m).startswith(AGENT_FEEDBACK_OPENINGS)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool definition offered to the model, in the neutral (OpenAI function) shape."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)  # JSON schema of the arguments
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Conversation:
    """A conversation: system prompt, tool definitions and messages, with where it came from."""

    messages: list[Message]
    id: str = ""  # stable id of the conversation (session id, task id, file stem)
    system: str | None = None  # the system prompt; ``None`` when the trace has none
    tools: tuple[ToolSpec, ...] = ()
    source_format: str = ""  # the importer that read it ("openai", "claude_code", ...)
    source: str = ""  # where it was read from (a path, a path plus an index)
    meta: dict[str, Any] = field(default_factory=dict)  # format-specific conversation fields

    def __len__(self) -> int:
        return len(self.messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)

    def tool_pairs(self) -> int:
        """Tool results whose call appears earlier in the conversation."""
        seen: set[str] = set()
        pairs = 0
        for m in self.messages:
            seen.update(c.id for c in m.tool_calls)
            if m.role is Role.TOOL and m.tool_call_id in seen:
                pairs += 1
        return pairs


def as_parts(values: Sequence[Mapping[str, Any]]) -> tuple[ContentPart, ...]:
    """Neutral parts from OpenAI/Anthropic-style part dicts (``{"type": "text", "text": ...}``)."""
    parts = []
    for v in values:
        kind = str(v.get("type", "text"))
        text = v.get("text") if kind in ("text", "input_text", "output_text") else None
        rest = {k: x for k, x in v.items() if not (k == "text" and text is not None)}
        parts.append(ContentPart(type=kind, text=text if isinstance(text, str) else None, data=rest))
    return tuple(parts)
