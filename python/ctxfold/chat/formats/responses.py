"""OpenAI Responses items (``input`` and ``output`` of ``/v1/responses``) as ctxfold messages, and back.

A list of items becomes units, each one :class:`~ctxfold.chat.messages.Message` made from a run of
consecutive items:
- a ``message`` of role user: a user message; of role system or developer: a system message (the
  role kept in ``extra``);
- a ``function_call_output`` or ``custom_tool_call_output``: a tool result (its call's ``call_id``);
- every other item (assistant ``message``, ``reasoning``, ``function_call``, ``custom_tool_call``,
  and item types ctxfold does not know: ``web_search_call``, ``local_shell_call`` with its output, ...)
  joins the run of assistant items it is in: one assistant message whose text is the run's
  ``output_text``, whose tool calls are its function and custom tool calls, and whose reasoning is
  its reasoning summaries and texts (with the JSON of the items ctxfold does not know, so they are
  counted).

So a unit is always whole items, a ``reasoning`` item belongs to the same unit as the calls and text
it precedes, and a call's output is its own unit, paired by ``call_id`` as chat completions' tool
results are. The caller keeps each unit's items as the client sent them (``units_of`` returns them);
:func:`written_items` is the form of a message ctxfold wrote (a summary, an archive marker), which
carries no ``reasoning`` item (its encrypted content cannot be written again) and no item ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ctxfold.chat.messages import Content, ContentPart, Message, Role, ToolCall, Usage
from ctxfold.errors import FormatError

# A call item's type -> the field holding its arguments.
CALL_TYPES = {"function_call": "arguments", "custom_tool_call": "input"}
OUTPUT_TYPES = frozenset({"function_call_output", "custom_tool_call_output"})
# OpenAI's own compaction items: encrypted, opaque to ctxfold, never dropped or edited.
COMPACTION_TYPES = frozenset({"compaction", "compaction_summary"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
KIND_KEY = "responses_type"  # extra key: the item type a tool call or result came as (when not a function's)
ROLE_KEY = "responses_role"  # extra key: system or developer, on a system message


def item_type(item: dict[str, Any]) -> str:
    """An item's type: ``message`` when it has a role and no type (the easy input message)."""
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    return kind if isinstance(kind, str) else ""


def _content(raw: Any, where: str) -> Content:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise FormatError(f"{where}: 'content' must be a string or an array of parts, got {type(raw).__name__}")
    out = []
    for k, part in enumerate(raw):
        if not isinstance(part, dict):
            raise FormatError(f"{where}: content[{k}] must be an object, got {type(part).__name__}")
        text = part.get("text")
        if part.get("type") in TEXT_PARTS:
            if not isinstance(text, str):
                raise FormatError(f"{where}: content[{k}].text must be a string, got {type(text).__name__}")
            out.append(ContentPart(type="text", text=text))
        else:
            out.append(ContentPart(type=str(part.get("type", "")), data=part))
    return tuple(out)


def _texts(content: Content) -> list[str]:
    return [content] if isinstance(content, str) else [p.text for p in content if p.text is not None]


def _str_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise FormatError(f"{where}: '{name}' must be a string, got {type(value).__name__}")
    return value


def _assistant(run: list[dict[str, Any]], mid: str, where: str) -> Message:
    """One run of assistant-side items as one assistant message."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for k, item in enumerate(run):
        kind = item_type(item)
        at = f"{where}+{k}"
        if kind == "message":
            texts.extend(_texts(_content(item.get("content", ""), at)))
        elif kind in CALL_TYPES:
            args = item.get(CALL_TYPES[kind], "")
            calls.append(ToolCall(id=_str_field(item, "call_id", at), name=_str_field(item, "name", at),
                                  arguments=args if isinstance(args, str) else json.dumps(args),
                                  extra={} if kind == "function_call" else {KIND_KEY: kind}))
        elif kind == "reasoning":
            for field in ("summary", "content"):
                parts = item.get(field)
                if isinstance(parts, list):
                    reasoning.extend(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:  # not ctxfold's to read: counted by its JSON
            reasoning.append(json.dumps(item, ensure_ascii=False))
    return Message(role=Role.ASSISTANT, content="\n".join(texts), id=mid, tool_calls=tuple(calls),
                   reasoning="\n".join(reasoning) if reasoning else None)


def _single(item: dict[str, Any], mid: str, where: str) -> Message:
    """A user, system or developer message, or a call's output, as one message."""
    kind = item_type(item)
    if kind in OUTPUT_TYPES:
        output = item.get("output", "")
        return Message(role=Role.TOOL, content=_content(output, where), id=mid,
                       tool_call_id=_str_field(item, "call_id", where),
                       extra={} if kind == "function_call_output" else {KIND_KEY: kind})
    role = item.get("role")
    content = _content(item.get("content", ""), where)
    if role == "user":
        return Message(role=Role.USER, content=content, id=mid)
    return Message(role=Role.SYSTEM, content=content, id=mid, extra={ROLE_KEY: role})


def is_single(item: dict[str, Any]) -> bool:
    """Whether an item is a unit of its own (a user, system or developer message, or a call's output)."""
    kind = item_type(item)
    return kind in OUTPUT_TYPES or (kind == "message" and item.get("role") in ("user", "system", "developer"))


def unit_groups(items: Sequence[dict[str, Any]], where: str = "input", *, first_item: int = 0
                ) -> list[tuple[list[dict[str, Any]], str]]:
    """The items of each unit of ``items``, as given, and where the unit starts (``where[index]``): a
    user, system or developer message or a call's output alone, the assistant's items between them
    together. FormatError names an item that is not an object."""
    groups: list[tuple[list[dict[str, Any]], str]] = []
    run: list[dict[str, Any]] = []
    run_start = 0
    for i, item in enumerate(items, first_item):
        if not isinstance(item, dict):
            raise FormatError(f"{where}[{i}] must be an object, got {type(item).__name__}")
        if is_single(item):
            if run:
                groups.append((run, f"{where}[{run_start}]"))
                run = []
            groups.append(([item], f"{where}[{i}]"))
        else:
            if not run:
                run_start = i
            run.append(item)
    if run:
        groups.append((run, f"{where}[{run_start}]"))
    return groups


def unit_message(items: list[dict[str, Any]], mid: str, where: str) -> Message:
    """The message of one unit (:func:`unit_groups`); FormatError names what is wrong, at ``where``."""
    if len(items) == 1 and is_single(items[0]):
        return _single(items[0], mid, where)
    return _assistant(items, mid, where)


def units_of(items: Sequence[dict[str, Any]], first_id: int = 0, where: str = "input", *, first_item: int = 0
             ) -> tuple[list[Message], list[list[dict[str, Any]]]]:
    """(the units of ``items``, the items of each unit as given). Ids ``m<first_id + unit>``; a
    FormatError names the item that is wrong (``where[first_item + index]``)."""
    groups = unit_groups(items, where, first_item=first_item)
    return [unit_message(g, f"m{first_id + k}", at) for k, (g, at) in enumerate(groups)], [g for g, _ in groups]


def written_items(m: Message) -> list[dict[str, Any]]:
    """A message ctxfold wrote (or rewrote) as items: no reasoning, no item ids."""
    text = m.text
    if m.role is Role.TOOL:
        return [{"type": m.extra.get(KIND_KEY, "function_call_output"), "call_id": m.tool_call_id, "output": text}]
    if m.role is not Role.ASSISTANT:
        role = "user" if m.role is Role.USER else m.extra.get(ROLE_KEY, "developer")
        return [{"type": "message", "role": role, "content": text}]
    out: list[dict[str, Any]] = [{"type": "message", "role": "assistant", "content": text}] if text else []
    for c in m.tool_calls:
        kind = c.extra.get(KIND_KEY, "function_call")
        out.append({"type": kind, "call_id": c.id, "name": c.name, CALL_TYPES.get(kind, "arguments"): c.arguments})
    return out


def usage_of(raw: Any) -> Usage | None:
    """A Responses ``usage`` object: ``input_tokens`` (the prompt, cached tokens included),
    ``input_tokens_details.cached_tokens``, ``output_tokens``."""
    if not isinstance(raw, dict):
        return None

    def whole(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    details = raw.get("input_tokens_details")
    cached = whole(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt_tokens=whole(raw.get("input_tokens")), completion_tokens=whole(raw.get("output_tokens")),
                 cached_prompt_tokens=cached, extra=raw)
