"""OpenAI chat messages: import (a JSON array, JSONL, ``{"messages": [...]}``) and export.

Fields the model has no place for stay in ``extra["openai"]`` so that OpenAI -> model -> OpenAI
gives the same JSON back. Reasoning is DeepSeek's ``reasoning_content`` field; usage is read from
``usage`` or from mini-swe-agent's ``extra.response.usage`` (DeepSeek's own counts).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

from ctxfold.chat.formats._common import (
    Reader,
    assign_ids,
    expect_dict,
    expect_list,
    expect_str,
    openai_usage,
    role_of,
)
from ctxfold.chat.messages import (
    Content,
    ContentPart,
    Conversation,
    Message,
    Role,
    ToolCall,
    ToolSpec,
    Usage,
    as_parts,
)
from ctxfold.errors import FormatError

NAME = "openai"
ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT,
         "tool": Role.TOOL}
# Keys the model holds; everything else is kept verbatim in extra["openai"].
_MODELED = frozenset({"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content", "id", "usage"})


def _content(raw: Any) -> Content:
    if raw is None or isinstance(raw, str):
        return raw or ""
    items = expect_list(raw, "'content'")
    for k, item in enumerate(items):
        expect_dict(item, f"'content'[{k}]")
    return as_parts(items)


def _tool_call(raw: Any, k: int) -> ToolCall:
    d = expect_dict(raw, f"'tool_calls'[{k}]")
    fn = expect_dict(d.get("function"), f"'tool_calls'[{k}].function")
    name = expect_str(fn.get("name"), f"'tool_calls'[{k}].function.name")
    args = fn.get("arguments", "")
    extra: dict[str, Any] = {k2: v for k2, v in d.items() if k2 not in ("id", "function")}
    fn_extra = {k2: v for k2, v in fn.items() if k2 not in ("name", "arguments")}
    if fn_extra:
        extra["function"] = fn_extra
    if isinstance(args, dict):  # some loggers store the parsed object; keep that shape for export
        extra["arguments_object"] = True
        args = json.dumps(args, ensure_ascii=False)
    args = expect_str(args, f"'tool_calls'[{k}].function.arguments")
    cid = expect_str(d.get("id"), f"'tool_calls'[{k}].id", optional=True)
    return ToolCall(id=cid, name=name, arguments=args, extra={"openai": extra} if extra else {})


def _usage_in_extra(d: dict[str, Any]) -> Any:
    # mini-swe-agent keeps the provider response (with its usage) under the message's "extra".
    ex = d.get("extra")
    if isinstance(ex, dict) and isinstance(ex.get("response"), dict):
        return ex["response"].get("usage")
    return None


def message_from_openai(raw: Any, default_id: str = "", *, keep_id: bool = True) -> Message:
    """One OpenAI chat message dict -> :class:`Message` (raises FormatError without a location). Its
    id is the dict's ``id`` when it has one and ``keep_id``, else ``default_id``."""
    if type(raw) is dict and len(raw) == 2:  # role and text alone: most messages, and the proxy parses each
        role, content = raw.get("role"), raw.get("content")
        if type(role) is str and type(content) is str and role in _PLAIN_ROLES:
            return Message(role=_PLAIN_ROLES[role], content=content, id=default_id)
    d = expect_dict(raw, "message")
    role = role_of(d.get("role"), ROLES)
    content = _content(d.get("content"))
    calls_raw = d.get("tool_calls")
    calls = () if calls_raw is None else tuple(
        _tool_call(c, k) for k, c in enumerate(expect_list(calls_raw, "'tool_calls'"))
    )
    if calls and role is not Role.ASSISTANT:
        raise FormatError(f"a {d['role']!r} message has 'tool_calls'; expected them on assistant messages only")
    tool_call_id = None
    if role is Role.TOOL:
        if d.get("tool_call_id") is None:
            raise FormatError("tool message has no 'tool_call_id'; expected the id of the call it answers")
        tool_call_id = expect_str(d.get("tool_call_id"), "'tool_call_id'")
    reasoning = d.get("reasoning_content")
    if reasoning is not None:
        reasoning = expect_str(reasoning, "'reasoning_content'")
    extra = {k: v for k, v in d.items() if k not in _MODELED}
    # The exporter writes null content exactly when an assistant message has calls and no text;
    # record the other cases so the same JSON comes back.
    default_null = bool(calls) and content == ""
    if "content" not in d:
        extra["content"] = _MISSING
    elif (d["content"] is None) != default_null and content == "":
        extra["content"] = d["content"]
    if d["role"] == "developer":
        extra["role"] = "developer"
    raw_usage = d.get("usage")
    usage = openai_usage(raw_usage if raw_usage is not None else _usage_in_extra(d))
    name = d.get("name")
    mid = d.get("id")
    return Message(
        role=role,
        content=content,
        id=mid if keep_id and isinstance(mid, str) and mid else default_id,
        tool_calls=calls,
        tool_call_id=tool_call_id,
        name=name if isinstance(name, str) else None,
        reasoning=reasoning,
        usage=usage,
        extra={"openai": extra} if extra else {},
    )


# Roles whose messages need nothing but their text ("developer" is kept as written, "tool" answers a call).
_PLAIN_ROLES = {"system": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT}

# Marks a message that had no "content" key at all (as opposed to null or "").
_MISSING = {"__missing__": True}


def tool_spec(raw: Any, k: int) -> ToolSpec:
    """Tool definition ``k`` of a request, nested (chat completions) or flat (Responses API)."""
    d = expect_dict(raw, f"'tools'[{k}]")
    where = f"'tools'[{k}].function" if "function" in d else f"'tools'[{k}]"
    fn = expect_dict(d.get("function", d), where)
    name = expect_str(fn.get("name"), f"{where}.name")
    desc = fn.get("description") or ""
    params = fn.get("parameters") or {}
    rest = {k2: v for k2, v in d.items() if k2 not in ("function", "type")}
    fn_rest = {k2: v for k2, v in fn.items() if k2 not in ("name", "description", "parameters")}
    extra: dict[str, Any] = {}
    if rest or fn_rest or "function" not in d:
        extra = {"openai": {"rest": rest, "function": fn_rest, "flat": "function" not in d}}
    return ToolSpec(name=name, description=str(desc), parameters=params if isinstance(params, dict) else {},
                    extra=extra)


def check_pairing(messages: list[Message], locations: list[str], reader: Reader) -> list[Message]:
    """Formats whose API requires pairing: a result without an earlier call is an error (lenient: skipped)."""
    seen: set[str] = set()
    out: list[Message] = []
    for m, where in zip(messages, locations, strict=True):
        if m.role is Role.TOOL and m.tool_call_id not in seen:
            cid = m.tool_call_id

            def fail(cid: str | None = cid) -> None:
                raise FormatError(f"tool result for call {cid!r} has no earlier assistant message making that "
                                  "call; expected every result to answer a preceding tool call")

            reader.guard(where, fail)
            continue
        seen.update(c.id for c in m.tool_calls)
        out.append(m)
    return out


def conversation_from_messages(
    items: Sequence[Any],
    reader: Reader,
    *,
    where: str,
    conv_id: str,
    source_format: str = NAME,
    tools: Iterable[Any] = (),
    require_pairing: bool = True,
    meta: dict[str, Any] | None = None,
) -> Conversation:
    """Messages of one conversation; the leading system message becomes ``Conversation.system``."""
    messages: list[Message] = []
    locations: list[str] = []
    prefix = f"{where}, " if where else ""
    for i, raw in enumerate(items):
        loc = f"{prefix}message {i}"
        m = reader.guard(loc, partial(message_from_openai, raw, f"m{i}"))
        if m is not None:
            messages.append(m)
            locations.append(loc)
    if require_pairing:
        messages = check_pairing(messages, locations, reader)
    system = None
    first = messages[0] if messages else None
    # Only a plain leading system message becomes the prompt; one with an id or kept fields stays a
    # message so that nothing about it is lost.
    if first is not None and first.role is Role.SYSTEM and isinstance(first.content, str) \
            and not first.extra and first.id == "m0":
        system = first.content
        messages.pop(0)
    specs = tuple(
        s for s in (reader.guard(f"{prefix}tools[{k}]", partial(tool_spec, t, k))
                    for k, t in enumerate(tools)) if s is not None
    )
    return Conversation(messages=assign_ids(messages, "m"), id=conv_id, system=system, tools=specs,
                        source_format=source_format, source=reader.source, meta=dict(meta or {}))


def load_document(value: Any, reader: Reader, conv_id: str, jsonl_lines: Sequence[tuple[int, Any]] | None = None
                  ) -> list[Conversation]:
    """A list of messages, ``{"messages": [...], "tools": [...]}``, or JSONL of either."""
    if jsonl_lines is not None:
        if jsonl_lines and all(isinstance(v, dict) and "messages" in v for _, v in jsonl_lines):
            out = []
            for lineno, v in jsonl_lines:
                out.extend(load_document(v, reader, f"{conv_id}:{lineno}"))
            return out
        # JSONL of messages: one conversation; a message's location is its line.
        return [conversation_from_messages([v for _, v in jsonl_lines], reader, where="", conv_id=conv_id)]
    if isinstance(value, dict):
        msgs = expect_list(value.get("messages"), "'messages'")
        tools = value.get("tools") or []
        rest = {k: v for k, v in value.items() if k not in ("messages", "tools", "id")}
        cid = value["id"] if isinstance(value.get("id"), str) else conv_id
        return [conversation_from_messages(msgs, reader, where="", conv_id=cid, tools=expect_list(tools, "'tools'"),
                                           meta={"openai": rest} if rest else None)]
    return [conversation_from_messages(expect_list(value, "document"), reader, where="", conv_id=conv_id)]


# ---------------------------------------------------------------- export


def usage_to_openai(u: Usage) -> dict[str, Any]:
    if "prompt_tokens" in u.extra or "completion_tokens" in u.extra:
        return dict(u.extra)
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}
    if u.cached_prompt_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return out


def _parts_to_openai(content: Content) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    out = []
    for p in content:
        d = dict(p.data)
        d.setdefault("type", p.type)
        if p.text is not None:
            d["text"] = p.text
        out.append(d)
    return out


def tool_call_to_openai(c: ToolCall, *, api: bool) -> dict[str, Any]:
    ex = dict(c.extra.get("openai", {})) if not api else {}
    fn: dict[str, Any] = {"name": c.name, "arguments": c.arguments}
    if ex.pop("arguments_object", False):
        fn["arguments"] = c.parsed_arguments()
    fn.update(ex.pop("function", {}))
    out: dict[str, Any] = {"id": c.id, "type": "function", "function": fn}
    out.update(ex)
    return out


def message_to_openai(m: Message, *, api: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role.value}
    content: Any = _parts_to_openai(m.content)
    if m.tool_calls and content == "":
        content = None
    out["content"] = content
    if m.tool_calls:
        out["tool_calls"] = [tool_call_to_openai(c, api=api) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning is not None:
        out["reasoning_content"] = m.reasoning
    if api:
        return out
    ex = m.extra.get("openai", {})
    if m.id:
        out["id"] = m.id
    if m.usage is not None and _usage_in_extra(dict(ex)) is None:
        out["usage"] = usage_to_openai(m.usage)
    for k, v in ex.items():
        if k == "content" and v == _MISSING:
            out.pop("content", None)
        else:
            out[k] = v
    return out


def tool_spec_to_openai(t: ToolSpec) -> dict[str, Any]:
    ex = t.extra.get("openai", {})
    fn: dict[str, Any] = {"name": t.name, "description": t.description, "parameters": dict(t.parameters)}
    fn.update(ex.get("function", {}))
    if ex.get("flat"):
        return {**fn, **ex.get("rest", {})}
    return {"type": "function", "function": fn, **ex.get("rest", {})}


def dump(conv: Conversation, *, api: bool = False) -> dict[str, Any]:
    """``{"messages": [...], "tools": [...]}``, the request shape of chat completions.

    ``api=False`` (a trace file) also writes message ids, usage and the fields kept from the source;
    ``api=True`` writes only what the chat completions API accepts.
    """
    messages: list[dict[str, Any]] = []
    if conv.system is not None:
        messages.append({"role": "system", "content": conv.system})
    messages.extend(message_to_openai(m, api=api) for m in conv.messages)
    out: dict[str, Any] = {"messages": messages}
    if conv.tools:
        out["tools"] = [tool_spec_to_openai(t) for t in conv.tools]
    if not api:
        out.update(conv.meta.get("openai", {}))
    return out


def parts(*texts: str) -> tuple[ContentPart, ...]:
    """Text parts, for tests and callers building multi-part content."""
    return tuple(ContentPart(type="text", text=t, data={"type": "text"}) for t in texts)
