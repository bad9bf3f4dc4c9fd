"""Anthropic's messages API (``POST /v1/messages``) as a :class:`~ctxfold.serve.dialect.Dialect`.

A request is parsed into the proxy's form: its system prompt's text, one ctxfold message per unit
(a user message's ``tool_result`` blocks are a tool message each, its other blocks one user message;
an assistant message is one message), and for each unit the chat-completions form routing compares
(without ``cache_control``, which a client moves from turn to turn) and the client's own blocks.
The compacted view goes back out in Anthropic's shape: a message the view shows as the client sent
it goes out as the client sent it, byte for byte in JSON (its ``thinking`` blocks and signatures,
its ``cache_control`` breakpoints); a message ctxfold wrote (a summary, an archive marker) carries
neither thinking nor breakpoints. So a breakpoint is never left on a message that no longer exists,
and every breakpoint on a message that survives stays; at most four go out (the earliest in the
messages go first). A breakpoint is not moved onto the summary that replaced its message: the
rewritten prefix is cached from the client's next breakpoints on.

Answers: JSON (a ``message`` object) or events (``message_start``, ``content_block_*``,
``message_delta``, ``message_stop``), relayed byte for byte and assembled on the side
(:class:`MessageAssembler`). With the recall tool offered, ``read_archive`` ``tool_use`` blocks and
the closing events wait (:class:`RecallEventFilter`); after a recall round the next round's
``message_start`` is dropped and its blocks renumbered after those the client has, the one place
where the proxy changes a streamed event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from ctxfold.chat.formats.anthropic import dump, messages_from_anthropic, tool_spec
from ctxfold.chat.formats.openai import message_to_openai
from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.compaction.archive import RECALL_TOOLS
from ctxfold.compaction.archive.recall import recall_tools_anthropic
from ctxfold.errors import FormatError
from ctxfold.fastjson import dumps
from ctxfold.serve.dialect import Dialect, StreamFilter
from ctxfold.serve.memo import ConversionMemo
from ctxfold.serve.request import BadRequest, ParsedRequest, decode_object
from ctxfold.wire.sse import SseReader, json_object

log = logging.getLogger("ctxfold.serve")

MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control breakpoints in one request
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 529: "overloaded_error"}


@dataclass(slots=True)
class Sources:
    """Where each unit of a request came from: what the dialect sends back out as the client sent it."""

    raw: list[dict[str, Any]]  # the request's messages, as sent
    message_of: list[int] = field(default_factory=list)  # unit -> its message's index in ``raw``
    blocks_of: list[list[Any]] = field(default_factory=list)  # unit -> its blocks as sent
    units_of: list[int] = field(default_factory=list)  # message -> how many units it made


def _no_cache_control(block: Any) -> Any:
    if isinstance(block, dict) and "cache_control" in block:
        return {k: v for k, v in block.items() if k != "cache_control"}
    return block


def _bad(message: str, code: str = "invalid_type", param: str | None = None) -> BadRequest:
    return BadRequest(400, message, code=code, param=param)


def _check(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of messages", param="messages")
    for name, kind in (("model", str), ("stream", bool), ("tools", list), ("max_tokens", int)):
        if name in body and body[name] is not None and not isinstance(body[name], kind):
            raise _bad(f"'{name}' must be a {kind.__name__}, got {type(body[name]).__name__}", param=name)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object, got {type(m).__name__}", param=f"messages[{i}]")
    return messages


def system_text(raw: Any) -> str | None:
    """The system prompt's text: a string, or the texts of its blocks joined by newlines."""
    if raw is None or isinstance(raw, str):
        return raw
    if not isinstance(raw, list) or not all(isinstance(b, dict) and isinstance(b.get("text"), str) for b in raw):
        raise _bad("'system' must be a string or an array of text blocks", param="system")
    return "\n".join(b["text"] for b in raw)


@dataclass(frozen=True, slots=True)
class _Converted:
    """What one Anthropic message makes: its units (without ids: they are positions, given per request),
    each unit's chat form (what routing compares) and its blocks as sent."""

    units: tuple[Message, ...]
    wire: tuple[dict[str, Any], ...]
    pieces: tuple[list[Any], ...]


_converted: ConversionMemo[_Converted] = ConversionMemo()


def _convert(d: dict[str, Any], i: int) -> _Converted:
    """Message ``i``'s units, parsed without breakpoints, and their blocks as sent."""
    content = d.get("content")
    clean = dict(d)
    if isinstance(content, list):
        clean["content"] = [_no_cache_control(b) for b in content]
    try:
        got = messages_from_anthropic(clean, "")
    except FormatError as e:
        raise _bad(f"messages[{i}]: {e}", code="invalid_message", param=f"messages[{i}]") from None
    if not isinstance(content, list):
        pieces: list[list[Any]] = [[content]]
    elif d.get("role") == "assistant":
        pieces = [content]
    else:
        results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
        others = [b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_result")]
        pieces = [[b] for b in results] + ([others] if others or not results else [])
    return _Converted(tuple(got), tuple(message_to_openai(m, api=True) for m in got), tuple(pieces))


def _units(d: dict[str, Any], i: int, sources: Sources, wire: list[dict[str, Any]], fast: bool) -> list[Message]:
    """The units of message ``i`` (without ids), their chat forms added to ``wire`` and their blocks as
    sent to ``sources``: converted once per process, then taken from the memo."""
    key = dumps(d, fast=fast)
    converted = _converted.get(key)
    if converted is None:
        converted = _convert(d, i)
        _converted.put(key, converted)
    sources.message_of.extend([i] * len(converted.units))
    sources.blocks_of.extend(converted.pieces)
    sources.units_of.append(len(converted.units))
    wire.extend(converted.wire)
    return list(converted.units)


def _blocks_of(pieces: list[Any]) -> list[Any]:
    """A unit's content as blocks (a string content is one text block)."""
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in pieces if p != ""]


def _written(m: Message) -> tuple[str, list[Any]]:
    """(role, blocks) of a message ctxfold wrote: no thinking (its signature would not match), no breakpoint."""
    d = dump(Conversation(messages=[m]), api=True)["messages"][0]
    content = d["content"]
    blocks = _blocks_of([content]) if isinstance(content, str) else content
    keep = [_no_cache_control(b) for b in blocks if b.get("type") not in ("thinking", "redacted_thinking")]
    return d["role"], keep


def count_breakpoints(body: dict[str, Any]) -> int:
    """The ``cache_control`` breakpoints of a request: on tools, system blocks and message blocks."""
    n = sum(1 for t in body.get("tools") or [] if isinstance(t, dict) and "cache_control" in t)
    system = body.get("system")
    if isinstance(system, list):
        n += sum(1 for b in system if isinstance(b, dict) and "cache_control" in b)
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            n += sum(1 for b in content if isinstance(b, dict) and "cache_control" in b)
    return n


def cap_breakpoints(body: dict[str, Any], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the earliest breakpoints dropped while the request has more than four."""
    extra = count_breakpoints({**body, "messages": messages}) - MAX_BREAKPOINTS
    if extra <= 0:
        return messages
    out = []
    for m in messages:
        content = m.get("content")
        if extra > 0 and isinstance(content, list) and any(isinstance(b, dict) and "cache_control" in b
                                                           for b in content):
            blocks = []
            for b in content:
                if extra > 0 and isinstance(b, dict) and "cache_control" in b:
                    b, extra = _no_cache_control(b), extra - 1
                blocks.append(b)
            m = {**m, "content": blocks}
        out.append(m)
    return out


def outgoing_messages(sources: Sources, view: Sequence[Message], origins: Sequence[int],
                      originals: Sequence[Message]) -> list[dict[str, Any]]:
    """The view in Anthropic's shape: consecutive units of one role make one message; a message whose
    units all show as the client sent them, and only they, goes out as it was sent."""
    groups: list[tuple[str, list[tuple[int | None, Message]]]] = []
    n = len(sources.message_of)
    for m, o in zip(view, origins, strict=True):
        own = o if 0 <= o < n and m is originals[o] else None
        role = "assistant" if m.role is Role.ASSISTANT else "user"
        if groups and groups[-1][0] == role:
            groups[-1][1].append((own, m))
        else:
            groups.append((role, [(own, m)]))
    out: list[dict[str, Any]] = []
    for role, units in groups:
        owns = [u for u, _ in units]
        first = owns[0]
        if first is not None and None not in owns:
            i = sources.message_of[first]
            start = sources.message_of.index(i)
            if owns == list(range(start, start + sources.units_of[i])):
                out.append(sources.raw[i])  # the client's own message, as it came
                continue
        blocks: list[Any] = []
        for own, m in units:
            blocks.extend(_blocks_of(sources.blocks_of[own]) if own is not None else _written(m)[1])
        # Tool results lead a user message (Anthropic's rule); the order is otherwise kept.
        blocks.sort(key=lambda b: not (isinstance(b, dict) and b.get("type") == "tool_result"))
        out.append({"role": role, "content": blocks})
    return out


# -- answers ------------------------------------------------------------------------------------------

def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_use"] \
        if isinstance(content, list) else []


@dataclass(slots=True)
class MessageAssembler:
    """The message an Anthropic event stream carries, built from its events."""

    content: list[dict[str, Any]] = field(default_factory=list)
    head: dict[str, Any] = field(default_factory=dict)  # message_start's message
    partial_json: dict[int, list[str]] = field(default_factory=dict)  # a tool_use block's input, in pieces
    usage: dict[str, Any] | None = None
    done: bool = False  # message_stop arrived
    chunks: int = 0

    def add(self, payload: str | None) -> dict[str, Any] | None:
        event = json_object(payload)
        if event is None:
            return None
        self.chunks += 1
        try:
            self._fold(event)
        except (KeyError, IndexError, TypeError, AttributeError):
            pass  # not ours to judge: its bytes went to the client as they came
        return event

    def _fold(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self.head = dict(event["message"])
            self.usage = dict(self.head.get("usage") or {})
        elif kind == "content_block_start":
            index = event["index"]
            while len(self.content) <= index:
                self.content.append({})
            self.content[index] = dict(event["content_block"])
        elif kind == "content_block_delta":
            index, delta = event["index"], event["delta"]
            block = self.content[index]
            kinds = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}
            if delta.get("type") == "input_json_delta":
                self.partial_json.setdefault(index, []).append(delta["partial_json"])
            elif delta.get("type") in kinds:
                name = kinds[delta["type"]]
                block[name] = (block.get(name) or "") + delta[name]
        elif kind == "content_block_stop":
            pieces = self.partial_json.pop(event["index"], None)
            if pieces is not None:
                self.content[event["index"]]["input"] = json.loads("".join(pieces) or "{}")
        elif kind == "message_delta":
            self.head.update({k: v for k, v in (event.get("delta") or {}).items()})
            self.usage = {**(self.usage or {}), **(event.get("usage") or {})}
        elif kind == "message_stop":
            self.done = True

    def message(self) -> dict[str, Any]:
        return {**self.head, "role": "assistant", "content": [b for b in self.content if b],
                **({"usage": self.usage} if self.usage is not None else {})}


def _with_index(raw_event: bytes, event: dict[str, Any], index: int) -> bytes:
    """The event with its block index ``index``: its own bytes when that is its index already."""
    if event.get("index") == index:
        return raw_event
    return b"event: " + str(event.get("type")).encode() + b"\ndata: " + json.dumps(
        {**event, "index": index}, ensure_ascii=False).encode() + b"\n\n"


class RecallEventFilter(StreamFilter):
    """Holds the ``read_archive`` blocks and the closing events of each round; numbers the blocks the
    client is sent one after the other across rounds (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = False  # a message_start went to the client
        self.client_blocks = 0  # blocks the client has been sent, every round together
        self._map: dict[int, int] = {}
        self._held: set[int] = set()

    def next_round(self) -> None:
        self._map, self._held = {}, set()

    def route(self, raw_event: bytes, data: str | None, parsed: dict[str, Any] | None) -> tuple[bool, bytes | None]:
        if parsed is None:
            return False, raw_event
        kind = parsed.get("type")
        index = parsed.get("index")
        if kind == "message_start":
            if self.started:
                return False, None  # the client has its message's head from the first round
            self.started = True
        elif kind in ("message_delta", "message_stop"):
            return True, raw_event
        elif kind == "content_block_start" and isinstance(index, int):
            block = parsed.get("content_block") or {}
            if block.get("type") == "tool_use" and block.get("name") in RECALL_TOOLS:
                self._held.add(index)
                return True, raw_event
            self._map[index] = self.client_blocks
            self.client_blocks += 1
        if isinstance(index, int) and kind in ("content_block_start", "content_block_delta", "content_block_stop"):
            if index in self._held:
                return True, raw_event
            return False, _with_index(raw_event, parsed, self._map.get(index, index))
        return False, raw_event

    def release(self, held: list[bytes]) -> bytes:
        """The held events, the held blocks numbered after those the client has."""
        out = []
        for raw_event in held:
            events = SseReader().feed(raw_event)
            event = json.loads(events[0][1]) if events and events[0][1] is not None else None
            index = event.get("index") if isinstance(event, dict) else None
            if isinstance(event, dict) and isinstance(index, int):
                if event.get("type") == "content_block_start":
                    self._map[index] = self.client_blocks
                    self.client_blocks += 1
                raw_event = _with_index(raw_event, event, self._map.get(index, index))
            out.append(raw_event)
        return b"".join(out)


class AnthropicDialect(Dialect):
    """``/v1/messages``: see the module's docstring."""

    name = "anthropic"
    path = "/v1/messages"
    asks_stream_usage = False  # its streams carry usage in message_start and message_delta
    recall_specs = tuple(tool_spec(t, k) for k, t in enumerate(recall_tools_anthropic()))

    def parse(self, raw: bytes) -> ParsedRequest:
        body, fast = decode_object(raw)
        messages = _check(body)
        system = system_text(body.get("system"))
        sources = Sources(messages)
        units: list[Message] = []
        wire: list[dict[str, Any]] = []
        for i, d in enumerate(messages):
            units.extend(_units(d, i, sources, wire, fast))
        return ParsedRequest(raw, body, system, wire, bool(body.get("stream")), fast, dialect=self, units=units,
                             sources=sources)

    def new_messages(self, parsed: ParsedRequest, known: int) -> list[Message]:
        # Ids are positions (m<n>, as chat completions numbers its messages): given to the new ones only.
        return [replace(m, id=f"m{parsed.offset + known + k}") for k, m in enumerate((parsed.units or [])[known:])]

    def tool_specs(self, body: dict[str, Any]) -> tuple[ToolSpec, ...]:
        try:
            return tuple(tool_spec(t, k) for k, t in enumerate(body.get("tools") or []))
        except FormatError as e:
            raise _bad(f"invalid tool definition: {e}", code="invalid_tools", param="tools") from None

    def tool_name(self, tool: Any) -> Any:
        return tool.get("name") if isinstance(tool, dict) else None

    def recall_tools(self) -> list[dict[str, Any]]:
        return recall_tools_anthropic()

    def max_reply_tokens(self, body: dict[str, Any]) -> int | None:
        n = body.get("max_tokens")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None

    def outgoing_messages(self, parsed: ParsedRequest, system: str | None, view: Sequence[Message],
                          origins: Sequence[int], originals: Sequence[Message]) -> dict[str, Any]:
        sources = parsed.sources if isinstance(parsed.sources, Sources) else Sources([])
        return {"messages": cap_breakpoints(parsed.body, outgoing_messages(sources, view, origins, originals))}

    def error(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
              param: str | None = None) -> web.Response:
        if kind == "upstream_error":
            kind = "overloaded_error" if status in (502, 503, 504) else "api_error"
        elif kind != "invalid_request_error" or status != 400:
            kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return web.json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status)

    def stream_error(self, message: str, code: str) -> bytes:
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"

    def answer_of(self, data: Any) -> tuple[dict[str, Any] | None, Any]:
        if not isinstance(data, dict) or data.get("type") != "message" or not isinstance(data.get("content"), list):
            return None, None
        return data, data.get("usage")

    def assembler(self) -> MessageAssembler:
        return MessageAssembler()

    def stream_filter(self) -> StreamFilter:
        return RecallEventFilter()

    def is_recall_round(self, message: dict[str, Any]) -> bool:
        calls = _calls(message)
        return bool(calls) and all(c.get("name") in RECALL_TOOLS for c in calls)

    def recall_calls(self, message: dict[str, Any]) -> list[ToolCall]:
        return [ToolCall(id=str(c.get("id", "")), name=str(c.get("name", "")),
                         arguments=json.dumps(c.get("input", {}), ensure_ascii=False)) for c in _calls(message)]

    def with_recall_answers(self, body: dict[str, Any], message: dict[str, Any],
                            results: list[Message]) -> dict[str, Any]:
        answers = [{"type": "tool_result", "tool_use_id": r.tool_call_id, "content": r.text,
                    **({"is_error": True} if r.is_error else {})} for r in results]
        out = dict(body)
        out["messages"] = [*body["messages"], {"role": "assistant", "content": message["content"]},
                           {"role": "user", "content": answers}]
        return out

    def answer_message(self, message: dict[str, Any], usage: Any, mid: str) -> Message | None:
        content = message.get("content")
        clean = {"role": "assistant", "content": [_no_cache_control(b) for b in content]
                 if isinstance(content, list) else content}
        if isinstance(usage, dict):
            clean["usage"] = usage
        try:
            got = messages_from_anthropic(clean, mid)
        except FormatError as e:
            log.warning("answer not recorded: %s", e)
            return None
        return replace(got[0], id=mid) if len(got) == 1 else None

    def answer_wire(self, message: dict[str, Any], recorded: Message) -> dict[str, Any]:
        return message_to_openai(recorded, api=True)  # what the client's next request parses it into

    def reported_prompt_tokens(self, usage: Any) -> int | None:
        """Anthropic's prompt: ``input_tokens`` plus the cache's reads and writes (all three were sent)."""
        if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
            return None
        return sum(n for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
                   if isinstance(n := usage.get(k), int) and not isinstance(n, bool))


ANTHROPIC = AnthropicDialect()


def count_tokens_body(parsed: ParsedRequest, count: Any) -> web.Response:
    """``/v1/messages/count_tokens``'s answer: ``count`` (a header and messages -> tokens) of the request."""
    header = Conversation(messages=[], system=parsed.system, tools=ANTHROPIC.tool_specs(parsed.body))
    return web.json_response({"input_tokens": int(count(header, parsed.units or []))})
