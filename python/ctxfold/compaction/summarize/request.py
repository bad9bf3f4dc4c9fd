"""The summary request: transcript[:BOTTOM] as it stands plus one internal user message.

The request is a suffix of what the model already saw (same system prompt, same tools, same messages), so an
engine's KV cache or a server's prefix cache reuses everything before the one added message (ds4 step 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ctxfold.chat.messages import CTXFOLD_SUMMARY_KEY, Conversation, Message, Role, ToolSpec

# The contract, after ds4's compaction prompt: durable task state only, no invented facts, no tool calls. It says "stop" twice because
# the summarizer runs inside a live agent transcript where "next step" usually means "call the next tool":
# during compaction that step must be recorded, not executed (ds4 COMPACT.md).
SUMMARY_CONTRACT = """\
Internal context compaction request. This is not a user request.

Write a compact summary of the conversation above that preserves durable task state only:
- the user's goals, constraints and preferences;
- files inspected or edited (exact paths);
- commands run and their important results (exit codes, key output lines);
- decisions made, approaches rejected and why, known bugs;
- the current state and the next steps, including the step in progress;
- bulky data that can be reloaded, described with the exact path, line range or command to fetch it again.

Do not invent facts. Do not narrate generically. Do not reproduce raw file contents unless a conclusion \
rests on them. After the summary, stop. Do not continue the user task, do not call tools, and do not output \
thinking tags or tool-call markup. Output only the summary."""

MID_TURN_ADDENDUM = """
The task is in progress: be exact about the step in flight, the last tool result and the next action."""

# The frame around a summary in a rebuilt view (ctxfold.compaction.compactor.frame_summary). A summary that holds
# either line is rejected (postprocess.garbage_reason) and a frame is never put inside a frame.
FRAME_OPEN = "[ctxfold compacted the earlier conversation. Durable task-state summary follows.]"
FRAME_CLOSE = "[End of summary. The recent conversation continues verbatim below.]"

INTERNAL_KEY = "ctxfold_internal"  # Message.extra key marking the contract message (never shown to users)
# Message.extra key of a summary message: the summary's own text, without the frame around it, so a
# later compaction carries the summary forward instead of quoting frames inside frames.
SUMMARY_TEXT_KEY = CTXFOLD_SUMMARY_KEY


@dataclass(frozen=True, slots=True)
class SummaryRequest:
    """One summary request.

    ``messages`` is the transcript up to BOTTOM followed by the contract message; ``system`` and ``tools``
    are the conversation's own, unchanged, so the rendered request shares the conversation's prefix.
    """

    messages: tuple[Message, ...]  # transcript[:BOTTOM] + the contract message (last)
    system: str | None  # the conversation's system prompt
    tools: tuple[ToolSpec, ...]  # the conversation's tool definitions
    reason: str  # why compaction runs ("soft limit before user turn", "manual", ...)
    max_tokens: int  # min(cap_tokens, room_tokens): the answer is cut here
    cap_tokens: int  # summary.max_tokens
    room_tokens: int | None  # tokens left in the window after the request, None if unknown

    @property
    def bottom(self) -> int:
        """Messages of the transcript in the request (BOTTOM)."""
        return len(self.messages) - 1

    @property
    def transcript(self) -> tuple[Message, ...]:
        return self.messages[:-1]

    @property
    def limit_reason(self) -> Literal["token_cap", "room"]:
        """The cut reason when the answer reaches ``max_tokens``: "room" if the room is the binding limit."""
        if self.room_tokens is not None and self.room_tokens < self.cap_tokens:
            return "room"
        return "token_cap"

    def to_openai(self, *, include_tools: bool = True) -> dict[str, Any]:
        """The request as an OpenAI chat.completions body (without model, stream and sampling fields)."""
        body: dict[str, Any] = {"messages": to_openai_messages(self.messages, system=self.system)}
        if include_tools and self.tools:
            body["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": dict(t.parameters) or {"type": "object"}}}
                for t in self.tools
            ]
            # The definitions stay for the cache; the model may not call them.
            body["tool_choice"] = "none"
        return body


def contract_text(reason: str, *, mid_turn: bool = False) -> str:
    """The text of the internal user message: the contract, the mid-turn addendum, and the reason."""
    text = SUMMARY_CONTRACT + (MID_TURN_ADDENDUM if mid_turn else "")
    return f"{text}\n\nCompaction reason: {reason}\n"


def build_summary_request(
    conversation: Conversation | Sequence[Message],
    bottom: int | None = None,
    *,
    reason: str = "manual",
    cap_tokens: int = 4096,
    room_tokens: int | None = None,
    mid_turn: bool = False,
    system: str | None = None,
    tools: Sequence[ToolSpec] = (),
) -> SummaryRequest:
    """Build the summary request for ``conversation.messages[:bottom]`` (all messages when bottom is None).

    ``room_tokens`` is what the window leaves after the request (the caller counts it with its tokenizer);
    the answer is capped at ``min(cap_tokens, room_tokens)``. A plain message list takes ``system`` and
    ``tools`` from the keyword arguments.
    """
    if isinstance(conversation, Conversation):
        messages: Sequence[Message] = conversation.messages
        system = conversation.system
        tools = conversation.tools
    else:
        messages = conversation
    n = len(messages)
    if bottom is None:
        bottom = n
    if not 0 <= bottom <= n:
        raise IndexError(f"bottom {bottom} is outside the conversation (0..{n} messages)")
    if cap_tokens < 1:
        raise ValueError(f"cap_tokens must be >= 1, got {cap_tokens}")
    if room_tokens is not None and room_tokens < 0:
        raise ValueError(f"room_tokens must be >= 0 (or None when unknown), got {room_tokens}")
    contract = Message(
        role=Role.USER, content=contract_text(reason, mid_turn=mid_turn), id="ctxfold-summary-request",
        extra={INTERNAL_KEY: True},
    )
    max_tokens = cap_tokens if room_tokens is None else min(cap_tokens, room_tokens)
    return SummaryRequest(
        messages=(*messages[:bottom], contract), system=system, tools=tuple(tools), reason=reason,
        max_tokens=max_tokens, cap_tokens=cap_tokens, room_tokens=room_tokens,
    )


# ------------------------------------------------------------------------------------------------------
# OpenAI chat rendering. Only what a summary request needs: reasoning is left out (servers ignore or reject
# it in input), and the request is made valid where BOTTOM cut a tool round in half.

PENDING_RESULT = "(no result yet: the call was still running when the conversation was compacted)"


def _content(m: Message) -> Any:
    if isinstance(m.content, str):
        return m.content
    parts: list[dict[str, Any]] = []
    for p in m.content:
        if p.text is not None:
            parts.append({"type": "text", "text": p.text})
        else:
            parts.append(dict(p.data) or {"type": p.type})
    return parts


def to_openai_messages(messages: Sequence[Message], *, system: str | None = None) -> list[dict[str, Any]]:
    """OpenAI chat messages for ``messages``.

    Two repairs keep strict servers (OpenAI itself) from rejecting a request cut at BOTTOM: an assistant's tool
    calls without results get a placeholder result (the hard trigger compacts while a result is waiting), and
    a tool result whose call is not in the list becomes a user message that names the tool.
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    open_calls: list[str] = []  # ids of the last assistant's calls still waiting for results

    def close_open_calls() -> None:
        for call_id in open_calls:
            out.append({"role": "tool", "tool_call_id": call_id, "content": PENDING_RESULT})
        open_calls.clear()

    for m in messages:
        if m.role is Role.TOOL:
            if m.tool_call_id is not None and m.tool_call_id in open_calls:
                open_calls.remove(m.tool_call_id)
                out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": _content(m)})
            else:
                close_open_calls()
                label = f"Tool result ({m.name})" if m.name else "Tool result"
                out.append({"role": "user", "content": f"{label}:\n{m.text}"})
            continue
        close_open_calls()
        if m.role is Role.SYSTEM:
            out.append({"role": "system", "content": _content(m)})
        elif m.role is Role.USER:
            out.append({"role": "user", "content": _content(m)})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": _content(m) if m.text or m.content else ""}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in m.tool_calls
                ]
                open_calls.extend(c.id for c in m.tool_calls)
                if not msg["content"]:
                    msg["content"] = None
            out.append(msg)
    close_open_calls()
    return out


def render_plain(messages: Sequence[Message], *, max_chars_per_message: int | None = None) -> str:
    """A plain-text transcript (for chunked summaries, where each chunk goes in one user message)."""
    lines: list[str] = []
    for m in messages:
        text = m.text
        if max_chars_per_message is not None and len(text) > max_chars_per_message:
            half = max_chars_per_message // 2
            text = f"{text[:half]}\n[... {len(text) - 2 * half} chars omitted ...]\n{text[-half:]}"
        if m.role is Role.TOOL:
            head = f"[tool result{' ' + m.name if m.name else ''}{' (error)' if m.is_error else ''}]"
        elif m.is_summary:
            head = "[earlier summary]"
        else:
            head = f"[{m.role.value}]"
        lines.append(f"{head} {text}".rstrip())
        for c in m.tool_calls:
            args = c.arguments
            if max_chars_per_message is not None and len(args) > max_chars_per_message:
                args = args[:max_chars_per_message] + " ..."
            lines.append(f"[tool call {c.name}] {args}")
    return "\n".join(lines)
