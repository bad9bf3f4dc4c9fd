"""Anthropic messages: import and export.

A user message's ``tool_result`` blocks become role TOOL messages (one per block, in order, before
the rest of the message); ``thinking`` blocks become ``reasoning``; ``tool_use`` blocks become
tool calls whose arguments are the JSON of ``input``. Claude Code sessions reuse these converters.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from typing import Any

from ctxfold.chat.formats._common import (
    Reader,
    anthropic_usage,
    assign_ids,
    expect_dict,
    expect_list,
    expect_str,
    role_of,
    simple_content,
)
from ctxfold.chat.formats.openai import check_pairing
from ctxfold.chat.messages import Content, ContentPart, Conversation, Message, Role, ToolCall, ToolSpec, Usage
from ctxfold.errors import FormatError

NAME = "anthropic"
ROLES = {"user": Role.USER, "assistant": Role.ASSISTANT}
_MODELED = frozenset({"role", "content", "id", "usage"})


def _part(block: dict[str, Any]) -> ContentPart:
    kind = str(block.get("type", "text"))
    if kind == "text":
        text = expect_str(block.get("text"), "text block 'text'")
        return ContentPart(type="text", text=text, data={k: v for k, v in block.items() if k != "text"})
    return ContentPart(type=kind, data=block)


def _result_content(raw: Any) -> Content:
    if raw is None or isinstance(raw, str):
        return raw or ""
    blocks = expect_list(raw, "tool_result 'content'")
    return simple_content([_part(expect_dict(b, f"tool_result 'content'[{k}]")) for k, b in enumerate(blocks)])


def tool_call_from_block(b: dict[str, Any]) -> ToolCall:
    cid = expect_str(b.get("id"), "tool_use 'id'")
    name = expect_str(b.get("name"), "tool_use 'name'")
    inp = b.get("input", {})
    rest = {k: v for k, v in b.items() if k not in ("type", "id", "name", "input")}
    return ToolCall(id=cid, name=name, arguments=json.dumps(inp, ensure_ascii=False),
                    extra={"anthropic": rest} if rest else {})


def assistant_blocks(blocks: list[Any]) -> tuple[list[ContentPart], list[str], list[ToolCall], dict[str, Any]]:
    """Text parts, reasoning texts, tool calls and kept extras of assistant content blocks."""
    parts: list[ContentPart] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    extra: dict[str, Any] = {}
    for k, raw in enumerate(blocks):
        b = expect_dict(raw, f"'content'[{k}]")
        kind = b.get("type")
        if kind == "thinking":
            reasoning.append(expect_str(b.get("thinking"), f"'content'[{k}].thinking"))
            if "signature" in b:
                extra.setdefault("signatures", []).append(b["signature"])
        elif kind == "tool_use":
            calls.append(tool_call_from_block(b))
        elif kind == "tool_result":
            raise FormatError(f"'content'[{k}] is a tool_result block in an assistant message; "
                              "expected tool results in user messages")
        elif kind == "redacted_thinking":
            extra.setdefault("redacted_thinking", []).append(b)
        else:
            parts.append(_part(b))
    return parts, reasoning, calls, extra


def messages_from_anthropic(raw: Any, mid: str) -> list[Message]:
    """One Anthropic message dict -> one message, or several (tool results split out)."""
    d = expect_dict(raw, "message")
    role = role_of(d.get("role"), ROLES)
    mid = d["id"] if isinstance(d.get("id"), str) else mid
    content = d.get("content")
    rest = {k: v for k, v in d.items() if k not in _MODELED}
    if rest.pop("ctxfold_role", None) == "system" and role is Role.USER:
        role = Role.SYSTEM  # written by dump(): a system message inside the conversation
    usage = anthropic_usage(d.get("usage"))
    if isinstance(content, str) or role is Role.SYSTEM:
        if not isinstance(content, str):
            content = simple_content([_part(expect_dict(b, "'content' block")) for b in expect_list(content, "'content'")])
        return [Message(role=role, content=content, id=mid, usage=usage,
                        extra={"anthropic": rest} if rest else {})]
    blocks = expect_list(content, "'content'")
    if role is Role.ASSISTANT:
        parts, reasoning, calls, ex = assistant_blocks(blocks)
        ex.update(rest)
        return [Message(role=role, content=simple_content(parts), id=mid, tool_calls=tuple(calls),
                        reasoning="\n".join(reasoning) if reasoning else None, usage=usage,
                        extra={"anthropic": ex} if ex else {})]
    results: list[Message] = []
    others: list[ContentPart] = []
    for k, rb in enumerate(blocks):
        b = expect_dict(rb, f"'content'[{k}]")
        if b.get("type") == "tool_result":
            use_id = expect_str(b.get("tool_use_id"), f"'content'[{k}].tool_use_id")
            brest = {x: v for x, v in b.items() if x not in ("type", "tool_use_id", "content", "is_error", "id")}
            results.append(Message(role=Role.TOOL, content=_result_content(b.get("content")),
                                   id=b["id"] if isinstance(b.get("id"), str) else "",
                                   tool_call_id=use_id, is_error=bool(b.get("is_error", False)),
                                   extra={"anthropic": brest} if brest else {}))
        elif b.get("type") in ("tool_use", "thinking"):
            raise FormatError(f"'content'[{k}] is a {b.get('type')} block in a user message; "
                              "expected it in assistant messages")
        else:
            others.append(_part(b))
    if len(results) == 1 and not others and not results[0].id:
        results[0] = replace(results[0], id=mid, extra={"anthropic": {**rest, **results[0].extra.get(
            "anthropic", {})}} if rest else results[0].extra)
    else:
        results = [r if r.id else replace(r, id=f"{mid}#{k}" if mid else "") for k, r in enumerate(results)]
    out = results
    if others or not results:
        out.append(Message(role=Role.USER, content=simple_content(others), id=mid if not results else
                           (f"{mid}#text" if mid else ""), usage=usage, extra={"anthropic": rest} if rest else {}))
    return out


def _system(raw: Any) -> tuple[str | None, Any]:
    if raw is None or isinstance(raw, str):
        return raw, None
    blocks = expect_list(raw, "'system'")
    texts = [expect_str(expect_dict(b, "'system' block").get("text"), "'system' block text") for b in blocks]
    return "\n".join(texts), blocks


def tool_spec(raw: Any, k: int) -> ToolSpec:
    """Tool definition ``k`` of a Messages API request (``name``, ``description``, ``input_schema``)."""
    d = expect_dict(raw, f"'tools'[{k}]")
    name = expect_str(d.get("name"), f"'tools'[{k}].name")
    rest = {x: v for x, v in d.items() if x not in ("name", "description", "input_schema")}
    schema = d.get("input_schema") or {}
    return ToolSpec(name=name, description=str(d.get("description") or ""),
                    parameters=schema if isinstance(schema, dict) else {},
                    extra={"anthropic": rest} if rest else {})


def load_document(value: Any, reader: Reader, conv_id: str) -> list[Conversation]:
    """``{"system", "tools", "messages"}`` or a bare list of messages."""
    if isinstance(value, list):
        value = {"messages": value}
    d = expect_dict(value, "document")
    items = expect_list(d.get("messages"), "'messages'")
    system, system_blocks = _system(d.get("system"))
    messages: list[Message] = []
    locations: list[str] = []
    for i, raw in enumerate(items):
        loc = f"message {i}"
        got = reader.guard(loc, partial(messages_from_anthropic, raw, f"m{i}"))
        for m in got or []:
            messages.append(m)
            locations.append(loc)
    messages = check_pairing(messages, locations, reader)
    tools = tuple(t for t in (reader.guard(f"tools[{k}]", partial(tool_spec, t, k))
                              for k, t in enumerate(expect_list(d.get("tools") or [], "'tools'"))) if t is not None)
    rest = {k: v for k, v in d.items() if k not in ("messages", "system", "tools", "id")}
    if system_blocks is not None:
        rest["system"] = system_blocks
    cid = d["id"] if isinstance(d.get("id"), str) else conv_id
    return [Conversation(messages=assign_ids(messages, "m"), id=cid, system=system, tools=tools,
                         source_format=NAME, source=reader.source, meta={"anthropic": rest} if rest else {})]


# ---------------------------------------------------------------- export


def usage_to_anthropic(u: Usage) -> dict[str, Any]:
    if "input_tokens" in u.extra:
        return dict(u.extra)
    cached = u.cached_prompt_tokens or 0
    out: dict[str, Any] = {
        "input_tokens": None if u.prompt_tokens is None else u.prompt_tokens - cached,
        "output_tokens": u.completion_tokens,
    }
    if u.cached_prompt_tokens is not None:
        out["cache_read_input_tokens"] = u.cached_prompt_tokens
    return out


def _blocks(content: Content) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out = []
    for p in content:
        d = dict(p.data)
        d.setdefault("type", p.type)
        if p.text is not None:
            d["text"] = p.text
        out.append(d)
    return out


def _input(c: ToolCall) -> Any:
    parsed = c.parsed_arguments()
    # Anthropic takes an object; arguments that are not one (a raw command string) are wrapped so
    # nothing is lost, under a key no tool schema uses.
    return parsed if isinstance(parsed, dict) else {"_raw_arguments": c.arguments}


def _assistant(m: Message, api: bool) -> dict[str, Any]:
    ex = m.extra.get("anthropic", {})
    blocks: list[dict[str, Any]] = []
    if m.reasoning is not None:
        sigs = ex.get("signatures") or []
        b: dict[str, Any] = {"type": "thinking", "thinking": m.reasoning}
        if len(sigs) == 1:
            b["signature"] = sigs[0]
        blocks.append(b)
    if not api:
        blocks.extend(ex.get("redacted_thinking", []))
    blocks.extend(_blocks(m.content))
    for c in m.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c),
                       **({} if api else c.extra.get("anthropic", {}))})
    return {"role": "assistant", "content": blocks}


def _result_block(m: Message, api: bool) -> dict[str, Any]:
    b: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.tool_call_id,
                         "content": m.content if isinstance(m.content, str) else _blocks(m.content)}
    if m.is_error:
        b["is_error"] = True
    return b


def dump(conv: Conversation, *, api: bool = False) -> dict[str, Any]:
    """``{"system", "tools", "messages"}``, the request shape of the Messages API.

    ``api=True`` merges consecutive tool results into one user message and writes nothing the API
    rejects. ``api=False`` (a trace file) writes one message per model message, with ids, usage and
    kept fields, so that an import gives the same model back.
    """
    out_msgs: list[dict[str, Any]] = []
    for m in conv.messages:
        if m.role is Role.TOOL:
            block = _result_block(m, api)
            prev = out_msgs[-1] if out_msgs else None
            if api and prev is not None and prev["role"] == "user" and prev.get("_results"):
                prev["content"].append(block)
                continue
            d: dict[str, Any] = {"role": "user", "content": [block]}
            if api:
                d["_results"] = True
        elif m.role is Role.ASSISTANT:
            d = _assistant(m, api)
        elif m.role is Role.SYSTEM:
            # A system message inside the conversation (not the leading prompt): the Messages API has
            # no such role, so it travels as a user message that says what it is.
            d = {"role": "user", "content": _blocks(m.content) if not isinstance(m.content, str) else m.content}
            if not api:
                d["ctxfold_role"] = "system"
        else:
            d = {"role": "user", "content": m.content if isinstance(m.content, str) else _blocks(m.content)}
        if not api:
            if m.id:
                d["id"] = m.id
            if m.usage is not None:
                d["usage"] = usage_to_anthropic(m.usage)
            for k, v in m.extra.get("anthropic", {}).items():
                if m.role is Role.TOOL:
                    d["content"][0][k] = v
                elif k not in ("signatures", "redacted_thinking"):
                    d[k] = v
        out_msgs.append(d)
    for d in out_msgs:
        d.pop("_results", None)
    out: dict[str, Any] = {}
    meta = conv.meta.get("anthropic", {}) if not api else {}
    if conv.system is not None:
        out["system"] = meta.get("system", conv.system)
    if conv.tools:
        out["tools"] = [{"name": t.name, "description": t.description, "input_schema": dict(t.parameters),
                         **({} if api else t.extra.get("anthropic", {}))} for t in conv.tools]
    out["messages"] = out_msgs
    if not api:
        out.update({k: v for k, v in meta.items() if k != "system"})
    return out
