"""The API a client speaks, as one object the proxy's steps ask: how its request is parsed into the
proxy's form (:class:`~ctxfold.serve.request.ParsedRequest`), how the compacted view goes back out in
its shape, how its answers (JSON or streamed) are read, recorded and calibrated, how the model's
recall calls (``read_archive``, ``search_archive``) are answered in it, and how its errors look.

:data:`OPENAI` is chat completions (``/v1/chat/completions``); :mod:`ctxfold.serve.anthropic` holds
Anthropic's messages (``/v1/messages``). Sessions, tenants, bounds, compaction, the window guard,
recording and calibration are the same code for both: only what this class says differs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web

from ctxfold import fastjson
from ctxfold.chat.formats.openai import message_from_openai
from ctxfold.chat.messages import Message, ToolCall, ToolSpec
from ctxfold.compaction.archive import RECALL_TOOLS
from ctxfold.compaction.archive.recall import recall_tools_openai
from ctxfold.errors import FormatError
from ctxfold.serve.recall import hold_event, is_recall_round, openai_calls, to_wire
from ctxfold.serve.request import ParsedRequest, error_response, parse_messages, parse_request, parse_tools
from ctxfold.serve.sse import AnswerAssembler

log = logging.getLogger("ctxfold.serve")


class Assembler(Protocol):
    """Folds a stream's event payloads into the one answer they carry."""

    done: bool  # the stream's end arrived ([DONE], message_stop)
    chunks: int  # events read as JSON
    usage: dict[str, Any] | None

    def add(self, payload: str | None) -> dict[str, Any] | None: ...

    def message(self) -> dict[str, Any]: ...


class StreamFilter:
    """Which streamed events wait until the proxy knows whether an answer is a recall round (the
    client never sees those calls). Chat completions: the read_archive call deltas and the closing
    events (:func:`~ctxfold.serve.recall.hold_event`), each sent byte for byte."""

    def __init__(self) -> None:
        self.recall_calls: set[int] = set()

    def route(self, raw_event: bytes, data: str | None, parsed: dict[str, Any] | None) -> tuple[bool, bytes | None]:
        """(hold, the bytes to send or hold; None drops the event)."""
        return hold_event(data, parsed, self.recall_calls), raw_event

    def next_round(self) -> None:
        self.recall_calls = set()

    def release(self, held: list[bytes]) -> bytes:
        """The held events, once the answer is not a recall round."""
        return b"".join(held)


class Dialect:
    """Chat completions; :class:`ctxfold.serve.anthropic.AnthropicDialect` overrides what differs."""

    name = "openai"
    path = "/v1/chat/completions"  # on the proxy, and under the upstream's base URL
    asks_stream_usage = True  # a stream may be asked for usage (stream_options.include_usage)
    recall_specs: tuple[ToolSpec, ...] = parse_tools({"tools": recall_tools_openai()})

    # -- the request -----------------------------------------------------------------------------------
    def parse(self, raw: bytes) -> ParsedRequest:
        return parse_request(raw)

    def new_messages(self, parsed: ParsedRequest, known: int) -> list[Message]:
        """The request's messages after the ``known`` ones the session holds, parsed (BadRequest names
        the one that is wrong)."""
        return parse_messages(parsed.messages[known:], parsed.offset + known)

    def tool_specs(self, body: dict[str, Any]) -> tuple[ToolSpec, ...]:
        return parse_tools(body)

    def tool_name(self, tool: Any) -> Any:
        return (tool.get("function") or tool).get("name") if isinstance(tool, dict) else None

    def recall_tools(self) -> list[dict[str, Any]]:
        """The recall tools the proxy offers (read_archive, search_archive), in this API's shape."""
        return recall_tools_openai()

    def max_reply_tokens(self, body: dict[str, Any]) -> int | None:
        """The request's own limit on the answer: ``max_completion_tokens`` (OpenAI's current name) or
        ``max_tokens``; None when it gives neither as a whole number >= 0 (the upstream judges the rest)."""
        for name in ("max_completion_tokens", "max_tokens"):
            n = body.get(name)
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                return n
        return None

    def outgoing_messages(self, parsed: ParsedRequest, system: str | None, view: Sequence[Message],
                          origins: Sequence[int], originals: Sequence[Message]) -> dict[str, Any]:
        """The fields of the body that carry the compacted view: messages the view shows unchanged go
        out as the client sent them; the rest as ctxfold wrote them."""
        sent = parsed.messages
        return {"messages": ([{"role": "system", "content": system}] if system is not None else []) + [
            sent[o] if 0 <= o < len(sent) and m is originals[o] else to_wire(m)
            for m, o in zip(view, origins, strict=True)]}

    def upstream_target(self, base_path: str) -> str:
        """The request line's target on the upstream, under its base path (``/v1``, ``/openai/v1``)."""
        return base_path + self.path.removeprefix("/v1")

    # -- errors --------------------------------------------------------------------------------------
    def error(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
              param: str | None = None) -> web.Response:
        return error_response(status, message, kind=kind, code=code, param=param)

    def stream_error(self, message: str, code: str) -> bytes:
        """The event that ends a stream the upstream failed part way."""
        event = {"error": {"message": message, "type": "upstream_error", "code": code}}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    # -- the answer ----------------------------------------------------------------------------------
    def answer_of(self, data: Any) -> tuple[dict[str, Any] | None, Any]:
        """(the answer's message, its usage) of a JSON answer; a message of None: not an answer."""
        try:
            message = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            return None, None
        return (message if isinstance(message, dict) else None), data.get("usage")

    def assembler(self) -> Assembler:
        return AnswerAssembler()

    def stream_filter(self) -> StreamFilter:
        return StreamFilter()

    def is_recall_round(self, message: dict[str, Any]) -> bool:
        return is_recall_round(message)

    def recall_calls(self, message: dict[str, Any]) -> list[ToolCall]:
        return openai_calls(message)

    def with_recall_answers(self, body: dict[str, Any], message: dict[str, Any],
                            results: list[Message]) -> dict[str, Any]:
        """The request again, the model's answer and the proxy's answers to its calls appended."""
        out = dict(body)
        out["messages"] = list(body["messages"]) + [message] + [to_wire(r) for r in results]
        return out

    def answer_message(self, message: dict[str, Any], usage: Any, mid: str) -> Message | None:
        """The answer as a message of the conversation (None, logged, when it is not one)."""
        wire = dict(message)
        if isinstance(usage, dict):
            wire["usage"] = usage
        try:
            return message_from_openai(wire, mid, keep_id=False)
        except FormatError as e:
            log.warning("answer not recorded: %s", e)
            return None

    def answer_wire(self, message: dict[str, Any], recorded: Message) -> dict[str, Any]:
        """The answer's form in :attr:`~ctxfold.serve.routing.ProxySession.wire` (what routing compares)."""
        return message

    def reported_prompt_tokens(self, usage: Any) -> int | None:
        """The upstream's count of the prompt, from its usage."""
        n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return n if isinstance(n, int) and not isinstance(n, bool) else None

    def dumps(self, body: dict[str, Any], fast: bool) -> bytes:
        return fastjson.dumps(body, fast=fast)

    def has_own_recall(self, tools: list[Any]) -> bool:
        """Whether the client offers a recall tool of its own (a ctxfold library behind the proxy): the
        proxy then offers neither and answers no call, the client does."""
        return any(self.tool_name(t) in RECALL_TOOLS for t in tools)


OPENAI = Dialect()
