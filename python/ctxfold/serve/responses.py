"""OpenAI's Responses API (``POST /v1/responses``) as a :class:`~ctxfold.serve.dialect.Dialect`.

A stateless request (the client sends the whole ``input``) is compacted as chat completions are:
its items become units (:mod:`ctxfold.chat.formats.responses`: a call's output is a tool result,
paired by ``call_id``; a run of assistant items, its ``reasoning`` items included, is one assistant
message), ``instructions`` is the system prompt. The items up to the last of OpenAI's own
``compaction`` items (and the system or developer messages that open the input) are the request's
fixed head: counted with the system prompt, never compacted, sent first as the client sent them.
A unit the view shows as the client sent it goes out as its items, byte for byte in JSON (its
reasoning items, their ``encrypted_content``, item ids); a unit ctxfold wrote goes out without
reasoning and ids. So a reasoning item is kept verbatim or dropped whole with its unit.

A request whose history lives upstream (``previous_response_id``, ``conversation``, an
``item_reference`` item) cannot be compacted by ctxfold: it is relayed as it came and labelled
(:attr:`~ctxfold.serve.request.ParsedRequest.relay_reason`).

Answers: a JSON ``response`` object, or events (``response.created``, ``response.output_item.*``,
deltas, ``response.completed`` with the whole response and its usage), relayed byte for byte and read
on the side (:class:`ResponseAssembler`). With the recall tool offered, the events of ``read_archive``
call items and the closing events wait (:class:`RecallItemFilter`); after a recall round the next
round's ``response.created`` and ``response.in_progress`` are dropped, its items renumbered after
those the client has, its sequence numbers continued, and its closing event given the first round's
response id: the only events the proxy changes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from ctxfold.chat.formats.openai import message_to_openai
from ctxfold.chat.formats.responses import (
    CALL_TYPES,
    COMPACTION_TYPES,
    OUTPUT_TYPES,
    item_type,
    unit_groups,
    unit_message,
    units_of,
    usage_of,
    written_items,
)
from ctxfold.chat.messages import Message, Role, ToolCall, ToolSpec
from ctxfold.compaction.archive import RECALL_TOOLS
from ctxfold.compaction.archive.recall import recall_tools_openai
from ctxfold.errors import FormatError
from ctxfold.fastjson import dumps
from ctxfold.serve.dialect import Dialect, StreamFilter
from ctxfold.serve.memo import ConversionMemo
from ctxfold.serve.request import BadRequest, ParsedRequest, decode_object, error_response
from ctxfold.wire.sse import SseReader, json_object

log = logging.getLogger("ctxfold.serve")

# Each unit's message (without an id) and chat form, by the JSON of its items: see serve/memo.py.
_converted: ConversionMemo[tuple[Message, dict[str, Any]]] = ConversionMemo()

# Request fields that say the conversation's history is kept upstream, not sent by the client.
UPSTREAM_STATE = ("previous_response_id", "conversation")
_CLOSING = frozenset({"response.completed", "response.incomplete", "response.failed"})
_OPENING = frozenset({"response.created", "response.in_progress", "response.queued"})


@dataclass(slots=True)
class Sources:
    """The request's items as sent: the fixed head, and each unit's items."""

    head: list[dict[str, Any]] = field(default_factory=list)
    items_of: list[list[dict[str, Any]]] = field(default_factory=list)


def _bad(message: str, code: str = "invalid_type", param: str | None = None) -> BadRequest:
    return BadRequest(400, message, code=code, param=param)


def _input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    for name, kind in (("model", str), ("stream", bool), ("tools", list), ("instructions", str)):
        if name in body and body[name] is not None and not isinstance(body[name], kind):
            raise _bad(f"'{name}' must be a {kind.__name__}, got {type(body[name]).__name__}", param=name)
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _bad("'input' must be a string or a non-empty array of items", param="input")
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}] must be an object, got {type(item).__name__}", param=f"input[{i}]")
    return raw


def head_length(items: list[dict[str, Any]]) -> int:
    """How many leading items are the fixed head: the opening system and developer messages, and
    everything up to the last compaction item (with the call outputs right after it)."""
    n = 0
    while n < len(items) and item_type(items[n]) == "message" and items[n].get("role") in ("system", "developer"):
        n += 1
    last = max((i for i, item in enumerate(items) if item_type(item) in COMPACTION_TYPES), default=-1)
    n = max(n, last + 1)
    while n < len(items) and item_type(items[n]) in OUTPUT_TYPES:
        n += 1
    return n


def _head_text(item: dict[str, Any]) -> str:
    """A head item as the system prompt's text: a message's text, any other item's JSON (counted)."""
    content = item.get("content")
    if item_type(item) == "message" and isinstance(content, str):
        return content
    return json.dumps(item, ensure_ascii=False)


def relay_reason(body: dict[str, Any]) -> str | None:
    for name in UPSTREAM_STATE:
        if body.get(name) is not None:
            return (f"the request uses '{name}': its history is kept upstream, so ctxfold cannot see or "
                    "compact it; relayed as sent")
    items = body.get("input")
    if isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == "item_reference" for i in items):
        return "the request refers to items kept upstream (item_reference); relayed as sent"
    return None


def parse(dialect: Dialect, raw: bytes) -> ParsedRequest:
    body, fast = decode_object(raw)
    stream = bool(body.get("stream"))
    reason = relay_reason(body)
    if reason is not None:
        return ParsedRequest(raw, body, None, [], stream, fast, dialect=dialect, relay_reason=reason)
    items = _input_items(body)
    n = head_length(items)
    instructions = body.get("instructions")
    texts = ([instructions] if isinstance(instructions, str) else []) + [_head_text(i) for i in items[:n]]
    system = "\n\n".join(texts) if texts else None
    units: list[Message] = []
    wire: list[dict[str, Any]] = []
    try:
        groups = unit_groups(items[n:], "input", first_item=n)
        for group, where in groups:
            # Each unit converted once per process (serve/memo.py); ids are given to the new ones only.
            key = dumps(group, fast=fast)
            converted = _converted.get(key)
            if converted is None:
                m = unit_message(group, "", where)
                converted = (m, message_to_openai(m, api=True))
                _converted.put(key, converted)
            units.append(converted[0])
            wire.append(converted[1])
    except FormatError as e:
        raise _bad(str(e), code="invalid_message", param="input") from None
    return ParsedRequest(raw, body, system, wire, stream, fast, dialect=dialect, units=units,
                         sources=Sources(items[:n], [g for g, _ in groups]))


def _response_output(message: dict[str, Any]) -> list[dict[str, Any]]:
    output = message.get("output")
    return [i for i in output if isinstance(i, dict)] if isinstance(output, list) else []


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in _response_output(message) if item_type(i) in CALL_TYPES]


# -- streams --------------------------------------------------------------------------------------------

@dataclass(slots=True)
class ResponseAssembler:
    """The response an event stream carries: ``response.completed``'s (or ``incomplete``'s) whole
    response; its output from the ``output_item.done`` events when that response has none."""

    response: dict[str, Any] = field(default_factory=dict)
    items: dict[int, Any] = field(default_factory=dict)  # output_item.done's items by output_index
    usage: dict[str, Any] | None = None
    failed: bool = False  # an error or response.failed ended it: nothing to record
    done: bool = False
    chunks: int = 0

    def add(self, payload: str | None) -> dict[str, Any] | None:
        event = json_object(payload)
        if event is None:
            return None
        self.chunks += 1
        kind = event.get("type")
        response = event.get("response")
        if kind in _OPENING and isinstance(response, dict):
            self.response = response
        elif kind == "response.output_item.done" and isinstance(event.get("output_index"), int):
            self.items[event["output_index"]] = event.get("item")
        elif kind in _CLOSING or kind == "error":
            self.done = True
            self.failed = kind in ("error", "response.failed")
            if isinstance(response, dict):
                self.response = response
                usage = response.get("usage")
                self.usage = usage if isinstance(usage, dict) else None
        return event

    def message(self) -> dict[str, Any]:
        if self.failed:
            return {"output": []}
        out = dict(self.response)
        if not out.get("output"):
            out["output"] = [self.items[k] for k in sorted(self.items)]
        return out


def _rewritten(raw_event: bytes, event: dict[str, Any], changes: dict[str, Any]) -> bytes:
    """The event with ``changes``: its own bytes when it has them already."""
    if all(event.get(k) == v for k, v in changes.items()):
        return raw_event
    return (b"event: " + str(event.get("type")).encode() + b"\ndata: "
            + json.dumps({**event, **changes}, ensure_ascii=False).encode() + b"\n\n")


class RecallItemFilter(StreamFilter):
    """Holds the ``read_archive`` call items and the closing events of each round; numbers the items
    and events the client gets one after the other across rounds (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.round = -1
        self.first_id: Any = None  # the response id the client got in response.created
        self.client_items = 0  # output items the client has been sent, every round together
        self.last_seq = -1  # the last sequence number the client has been sent
        self._map: dict[int, int] = {}
        self._held: set[int] = set()

    def next_round(self) -> None:
        self.round += 1
        self._map, self._held = {}, set()

    def _out(self, raw_event: bytes, event: dict[str, Any], index: int | None) -> bytes:
        changes: dict[str, Any] = {}
        if index is not None:
            changes["output_index"] = index
        seq = event.get("sequence_number")
        if isinstance(seq, int):
            if self.round > 0:
                seq = self.last_seq + 1  # the client reads one stream: its numbers go on
            self.last_seq = max(self.last_seq, seq)
            changes["sequence_number"] = seq
        if self.round > 0 and event.get("type") in _CLOSING and isinstance(event.get("response"), dict):
            changes["response"] = {**event["response"], "id": self.first_id}
        return _rewritten(raw_event, event, changes)

    def route(self, raw_event: bytes, data: str | None, parsed: dict[str, Any] | None) -> tuple[bool, bytes | None]:
        if parsed is None:
            return False, raw_event
        kind = parsed.get("type")
        index = parsed.get("output_index")
        if kind in _OPENING:
            if self.round > 0:
                return False, None  # the client has its response's head from the first round
            if kind == "response.created":
                self.first_id = (parsed.get("response") or {}).get("id")
        elif kind in _CLOSING:
            return True, raw_event
        elif kind == "response.output_item.added" and isinstance(index, int):
            item = parsed.get("item") or {}
            if item_type(item) == "function_call" and item.get("name") in RECALL_TOOLS:
                self._held.add(index)
                return True, raw_event
            self._map[index] = self.client_items
            self.client_items += 1
        if isinstance(index, int):
            if index in self._held:
                return True, raw_event
            return False, self._out(raw_event, parsed, self._map.get(index, index))
        return False, self._out(raw_event, parsed, None)

    def release(self, held: list[bytes]) -> bytes:
        """The held events (the answer is not a recall round), the held items numbered after those the
        client has."""
        out = []
        for raw_event in held:
            events = SseReader().feed(raw_event)
            event = json.loads(events[0][1]) if events and events[0][1] is not None else None
            if not isinstance(event, dict):
                out.append(raw_event)
                continue
            index = event.get("output_index")
            if isinstance(index, int) and event.get("type") == "response.output_item.added":
                self._map[index] = self.client_items
                self.client_items += 1
            out.append(self._out(raw_event, event, self._map.get(index, index) if isinstance(index, int) else None))
        return b"".join(out)


class ResponsesDialect(Dialect):
    """``/v1/responses``: see the module's docstring."""

    name = "responses"
    path = "/v1/responses"
    asks_stream_usage = False  # response.completed carries the usage

    def parse(self, raw: bytes) -> ParsedRequest:
        return parse(self, raw)

    def new_messages(self, parsed: ParsedRequest, known: int) -> list[Message]:
        # Ids are positions (m<n>, as chat completions numbers its messages): given to the new ones only.
        return [replace(m, id=f"m{parsed.offset + known + k}") for k, m in enumerate((parsed.units or [])[known:])]

    def tool_specs(self, body: dict[str, Any]) -> tuple[ToolSpec, ...]:
        """Function and custom tools by name; the upstream's own (``web_search``, ...) by type, all
        counted by their definitions."""
        out = []
        for k, t in enumerate(body.get("tools") or []):
            if not isinstance(t, dict) or not isinstance(t.get("type"), str):
                raise _bad(f"tools[{k}] must be an object with a 'type'", code="invalid_tools", param=f"tools[{k}]")
            name = t["name"] if isinstance(t.get("name"), str) else t["type"]
            params = t.get("parameters")
            out.append(ToolSpec(name=name, description=str(t.get("description") or ""),
                                parameters=params if isinstance(params, dict) else {},
                                extra={k2: v for k2, v in t.items() if k2 not in ("name", "description", "parameters")}))
        return tuple(out)

    def tool_name(self, tool: Any) -> Any:
        return tool.get("name") if isinstance(tool, dict) else None

    def recall_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", **t["function"]} for t in recall_tools_openai()]

    def max_reply_tokens(self, body: dict[str, Any]) -> int | None:
        n = body.get("max_output_tokens")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None

    def outgoing_messages(self, parsed: ParsedRequest, system: str | None, view: Sequence[Message],
                          origins: Sequence[int], originals: Sequence[Message]) -> dict[str, Any]:
        """``input``: the fixed head, then each unit's items as sent, or as ctxfold wrote it."""
        sources = parsed.sources if isinstance(parsed.sources, Sources) else Sources()
        n = len(sources.items_of)
        items = list(sources.head)
        for m, o in zip(view, origins, strict=True):
            items.extend(sources.items_of[o] if 0 <= o < n and m is originals[o] else written_items(m))
        return {"input": items}

    def error(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
              param: str | None = None) -> web.Response:
        return error_response(status, message, kind=kind, code=code, param=param)

    def stream_error(self, message: str, code: str) -> bytes:
        event = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"

    def answer_of(self, data: Any) -> tuple[dict[str, Any] | None, Any]:
        if not isinstance(data, dict) or not isinstance(data.get("output"), list):
            return None, None
        return data, data.get("usage")

    def assembler(self) -> ResponseAssembler:
        return ResponseAssembler()

    def stream_filter(self) -> StreamFilter:
        return RecallItemFilter()

    def is_recall_round(self, message: dict[str, Any]) -> bool:
        calls = _calls(message)
        return bool(calls) and all(item_type(c) == "function_call" and c.get("name") in RECALL_TOOLS
                                   for c in calls)

    def recall_calls(self, message: dict[str, Any]) -> list[ToolCall]:
        return [ToolCall(id=str(c.get("call_id", "")), name=str(c.get("name", "")), arguments=str(c.get("arguments", "")))
                for c in _calls(message)]

    def with_recall_answers(self, body: dict[str, Any], message: dict[str, Any],
                            results: list[Message]) -> dict[str, Any]:
        raw = body["input"]
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
        answers = [{"type": "function_call_output", "call_id": r.tool_call_id, "output": r.text} for r in results]
        return {**body, "input": [*items, *_response_output(message), *answers]}

    def answer_message(self, message: dict[str, Any], usage: Any, mid: str) -> Message | None:
        output = _response_output(message)
        if any(item_type(i) in COMPACTION_TYPES for i in output):
            # The upstream compacted the conversation itself: the next request starts from its item.
            log.info("answer not recorded: it holds the upstream's own compaction item")
            return None
        try:
            units, _ = units_of(output, 0, "output")
        except FormatError as e:
            log.warning("answer not recorded: %s", e)
            return None
        if len(units) != 1 or units[0].role is not Role.ASSISTANT:
            log.warning("answer not recorded: its output is not one run of assistant items")
            return None
        return replace(units[0], id=mid, usage=usage_of(usage))

    def answer_wire(self, message: dict[str, Any], recorded: Message) -> dict[str, Any]:
        return message_to_openai(recorded, api=True)  # what the client's next request parses it into

    def reported_prompt_tokens(self, usage: Any) -> int | None:
        """``input_tokens``: the whole prompt, the cached tokens (``input_tokens_details``) included."""
        n = usage.get("input_tokens") if isinstance(usage, dict) else None
        return n if isinstance(n, int) and not isinstance(n, bool) else None


RESPONSES = ResponsesDialect()
