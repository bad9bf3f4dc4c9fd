"""Lossless JSON form of the message model, for session logs and history dumps.

Unlike the OpenAI and Anthropic exporters (which write what those formats can hold), this form
keeps every field of :class:`~ctxfold.chat.messages.Message`, so ``decode(encode(m)) == m`` always.
Default values are left out to keep logs small.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxfold.chat.messages import ContentPart, Conversation, Message, Role, ToolCall, ToolSpec, Usage
from ctxfold.errors import FormatError

_FLAGS = ("queued", "resume", "is_error", "summary")


def encode_message(m: Message) -> dict[str, Any]:
    """A JSON-able dict holding every field of ``m``."""
    d: dict[str, Any] = {"role": m.role.value}
    if m.id:
        d["id"] = m.id
    if isinstance(m.content, str):
        d["content"] = m.content
    else:
        d["parts"] = [{"type": p.type, "text": p.text, "data": dict(p.data)} for p in m.content]
    if m.tool_calls:
        d["tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments, **({"extra": dict(c.extra)} if c.extra else {})}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    if m.reasoning is not None:
        d["reasoning"] = m.reasoning
    for flag in _FLAGS:
        if getattr(m, flag):
            d[flag] = True
    if m.usage is not None:
        u = m.usage
        # Counts the upstream did not give are left out like any default: a record with no null in it
        # is written without a walk for NaN (fastjson.dumps_record), and every answer has a usage.
        d["usage"] = {k: v for k, v in (("prompt_tokens", u.prompt_tokens), ("completion_tokens", u.completion_tokens),
                                        ("cached_prompt_tokens", u.cached_prompt_tokens)) if v is not None}
        if u.extra:
            d["usage"]["extra"] = dict(u.extra)
    if m.extra:
        d["extra"] = dict(m.extra)
    return d


def decode_message(d: Mapping[str, Any], *, where: str = "message") -> Message:
    """The inverse of :func:`encode_message`; raises FormatError naming ``where`` on a bad record."""
    try:
        role = Role(d["role"])
    except (KeyError, ValueError) as exc:
        raise FormatError(f"expected a role in {[r.value for r in Role]}, got {d.get('role')!r}",
                          location=where) from exc
    content: str | tuple[ContentPart, ...]
    if "parts" in d:
        content = tuple(ContentPart(type=p["type"], text=p.get("text"), data=p.get("data") or {}) for p in d["parts"])
    else:
        content = d.get("content", "")
        if not isinstance(content, str):
            raise FormatError(f"expected content to be a string, got {type(content).__name__}", location=where)
    usage = None
    if (u := d.get("usage")) is not None:
        usage = Usage(
            prompt_tokens=u.get("prompt_tokens"),
            completion_tokens=u.get("completion_tokens"),
            cached_prompt_tokens=u.get("cached_prompt_tokens"),
            extra=u.get("extra") or {},
        )
    return Message(
        role=role,
        content=content,
        id=d.get("id", ""),
        tool_calls=tuple(
            ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"], extra=c.get("extra") or {})
            for c in d.get("tool_calls", ())
        ),
        tool_call_id=d.get("tool_call_id"),
        name=d.get("name"),
        reasoning=d.get("reasoning"),
        usage=usage,
        extra=d.get("extra") or {},
        **{flag: bool(d.get(flag, False)) for flag in _FLAGS},
    )


def encode_conversation_header(conv: Conversation) -> dict[str, Any]:
    """Everything of a conversation but its messages."""
    return {
        "id": conv.id,
        "system": conv.system,
        "tools": [
            {"name": t.name, "description": t.description, "parameters": dict(t.parameters), "extra": dict(t.extra)}
            for t in conv.tools
        ],
        "source_format": conv.source_format,
        "source": conv.source,
        "meta": conv.meta,
    }


def decode_conversation_header(d: Mapping[str, Any], messages: list[Message]) -> Conversation:
    return Conversation(
        messages=messages,
        id=d.get("id", ""),
        system=d.get("system"),
        tools=tuple(
            ToolSpec(name=t["name"], description=t.get("description", ""), parameters=t.get("parameters") or {},
                     extra=t.get("extra") or {})
            for t in d.get("tools", ())
        ),
        source_format=d.get("source_format", ""),
        source=d.get("source", ""),
        meta=dict(d.get("meta") or {}),
    )
