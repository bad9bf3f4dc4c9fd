"""What a client sent: the body read within its limits, decoded and checked (:func:`parse_request`),
its messages and tools parsed when they are new; a client mistake is a :class:`BadRequest`, answered
in OpenAI's error shape (:func:`error_response`). Also which headers cross the proxy
(:func:`relayed_headers`)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ctxfold import fastjson
from ctxfold.chat.formats._common import Reader
from ctxfold.chat.formats.openai import conversation_from_messages, message_from_openai
from ctxfold.chat.messages import Message, ToolSpec
from ctxfold.errors import CtxfoldError, FormatError
from ctxfold.serve.config import ProxyConfig
from ctxfold.serve.keys import SESSION_HEADER

if TYPE_CHECKING:
    from ctxfold.serve.dialect import Dialect

# Headers that describe one connection, not the message (RFC 9110, 7.6.1): never relayed either way.
# Those a Connection header names are dropped too.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                         "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
OPERATOR_HEADER = "X-Ctxfold-Operator-Token"  # carries ProxyConfig.operator_token: never sent upstream
# Request headers the proxy writes itself on a chat completion: the body may be rewritten (length,
# type), and the proxy reads the answer, so it must come uncompressed (no Accept-Encoding).
OWN_REQUEST_HEADERS = frozenset({"host", "content-length", "content-type", "accept-encoding", "expect",
                                 SESSION_HEADER.lower(), OPERATOR_HEADER.lower()})
# Request headers a relayed request does not carry upstream: framing the proxy writes, and the operator's
# secret, which is the proxy's alone.
RELAY_DROPPED_HEADERS = frozenset({"host", "content-length", "expect", OPERATOR_HEADER.lower()})
# Answer headers aiohttp writes for the body the client receives (a completion's body may be the last of
# several recall rounds, and is sent with the proxy's own framing).
OWN_ANSWER_HEADERS = frozenset({"content-length", "content-encoding"})


class BadRequest(CtxfoldError):
    """A client mistake: becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def error_response(status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


@dataclass(slots=True)
class ParsedRequest:
    raw: bytes  # the body as sent
    body: dict[str, Any]  # the request object
    system: str | None  # the system prompt: a leading plain system message
    messages: list[dict[str, Any]]  # the chat messages after the system prompt, as sent
    stream: bool
    fast_json: bool  # read by orjson, so orjson may write it back (see fastjson)
    # The API the request speaks (chat completions, Anthropic messages): None is chat completions.
    dialect: Dialect | None = None
    # A dialect whose messages are not one dict per ctxfold message (Anthropic's: tool results are
    # blocks of a user message) parses them all up front: ``messages`` then holds the chat form of each
    # (what routing compares) and ``units`` the parsed messages; ``sources`` what the dialect needs to
    # send the client's own blocks back out.
    units: list[Message] | None = None
    sources: Any = None
    # Why the proxy relays the request as sent instead of compacting it (the Responses API's
    # previous_response_id: the history is upstream); None: it is compacted.
    relay_reason: str | None = None
    # The client's Authorization header: the credentials of the summaries this request triggers.
    authorization: str | None = None

    @property
    def offset(self) -> int:
        """Index of messages[0] in the request's own list (1 when a system prompt leads)."""
        return 1 if self.system is not None else 0


def _decode_body(raw: bytes) -> tuple[Any, bool]:
    """The request object, and whether orjson read it (see fastjson). Only standard JSON: no NaN or
    Infinity, no number beyond a float (an upstream would refuse them, or read something else)."""
    try:
        value, fast = fastjson.loads_tagged(raw)
    except (ValueError, RecursionError):
        pass  # below, the same verdict, and what is wrong where
    else:
        if fast:  # orjson reads standard JSON alone
            return value, True
        # The standard library read it (orjson refused it, or it holds a long number), and that one
        # also takes NaN, Infinity and 1e999: read again, strictly. Rare: lone surrogates, long numbers.
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
                              "cannot be decoded; send the JSON encoded as UTF-8", code="invalid_utf8") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float), False
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"request body is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}",
                         code="invalid_json") from None
    except _NotFinite as e:  # JSON has no NaN or Infinity; an upstream would choke on them, or read null
        raise BadRequest(400, f"request body is not valid JSON: {e} is not a JSON number; send a finite "
                              "number or null", code="invalid_json") from None
    except RecursionError:
        raise BadRequest(400, "request body is not valid JSON for this proxy: arrays and objects are nested "
                              "too deeply (about a thousand levels); flatten it", code="invalid_json") from None
    except ValueError:  # an integer of more digits than Python reads
        raise BadRequest(400, "request body is not valid JSON for this proxy: a number has more than "
                              f"{sys.get_int_max_str_digits()} digits", code="invalid_json") from None


class _NotFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON, but no float holds it, and it would go out as Infinity
        raise _NotFinite(text if len(text) <= 40 else text[:37] + "...")
    return value


def decode_object(raw: bytes) -> tuple[dict[str, Any], bool]:
    """The request object and whether orjson read it; BadRequest when it is not a JSON object."""
    body, fast = _decode_body(raw)
    if not isinstance(body, dict):
        raise BadRequest(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_type")
    return body, fast


def parse_request(raw: bytes) -> ParsedRequest:
    """Decode a chat.completions request body and check its shape. Raises BadRequest (400) with what
    and where. The messages themselves are checked by :func:`parse_messages` when they are new."""
    body, fast = decode_object(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty array of chat messages", code="invalid_type",
                         param="messages")
    for name, kind in (("model", str), ("stream", bool), ("tools", list)):
        if name in body and body[name] is not None and not isinstance(body[name], kind):
            raise BadRequest(400, f"'{name}' must be a {kind.__name__}, got {type(body[name]).__name__}",
                             code="invalid_type", param=name)
    if set(map(type, messages)) != {dict}:  # in C: the loop below only names the culprit
        i, m = next((i, m) for i, m in enumerate(messages) if not isinstance(m, dict))
        raise BadRequest(400, f"messages[{i}] must be an object, got {type(m).__name__}", code="invalid_type",
                         param=f"messages[{i}]")
    first = messages[0]
    system = None
    if first.get("role") == "system" and isinstance(first.get("content"), str) and first.keys() <= {"role", "content"}:
        system = first["content"]
        messages = messages[1:]
    return ParsedRequest(raw, body, system, messages, bool(body.get("stream")), fast)


def parse_messages(items: list[dict[str, Any]], first_index: int) -> list[Message]:
    """Chat message dicts -> messages with ids by position (``m<index in the request>``). BadRequest
    names the message that is wrong."""
    out = []
    for k, d in enumerate(items):
        try:
            out.append(message_from_openai(d, f"m{first_index + k}", keep_id=False))
        except FormatError as e:
            raise BadRequest(400, f"messages[{first_index + k}]: {e}", code="invalid_message",
                             param=f"messages[{first_index + k}]") from None
    return out


def parse_tools(body: dict[str, Any]) -> tuple[ToolSpec, ...]:
    try:
        conv = conversation_from_messages([], Reader(source="request", lenient=False), where="", conv_id="request",
                                          tools=body.get("tools") or [], require_pairing=False)
    except FormatError as e:
        raise BadRequest(400, f"invalid tool definition: {e}", code="invalid_tools", param="tools") from None
    return conv.tools




def relayed_headers(pairs: Iterable[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """The end-to-end headers of ``pairs`` (name, value), in order, repeated ones included: without
    hop-by-hop ones, those a ``Connection`` header names, and ``drop`` (lower-case names)."""
    out: list[tuple[str, str]] = []
    connection: list[str] = []
    for k, v in pairs:  # one pass, on every request and answer
        low = k.lower()
        if low in _HOP_BY_HOP or low in drop or low.startswith("proxy-"):
            if low == "connection":
                connection.append(v)
            continue
        out.append((k, v))
    named = {t.strip().lower() for v in connection for t in v.split(",")} - _HOP_BY_HOP  # keep-alive, close: gone
    if named:
        out = [(k, v) for k, v in out if k.lower() not in named]
    return out



def check_one_credential(headers: Mapping[str, str], config: ProxyConfig) -> None:
    """400 for a request that repeats ``Authorization``, the tenant header or ``X-Ctxfold-Session``: the
    tenant must come from exactly the credential that is forwarded, and two values could put one
    tenant's data under another's credential."""
    getall = getattr(headers, "getall", None)
    if getall is None:  # a plain mapping holds each name once
        return
    for name in dict.fromkeys(("Authorization", config.tenant_header, "X-Ctxfold-Session")):
        if len(getall(name, ())) > 1:
            raise BadRequest(400, f"the {name} header is sent more than once; send it once", code="invalid_request",
                             param=name)


async def read_body(request: web.Request, config: ProxyConfig) -> bytes:
    """The body within ``max_body_bytes`` (else 413) and ``client_timeout_s`` (else 408)."""
    if request.content.is_eof():  # all of it has arrived (the usual request): nothing to wait for, no timer
        return await _read_body_unbounded(request, config.max_body_bytes)
    try:
        async with asyncio.timeout(config.client_timeout_s):
            return await _read_body_unbounded(request, config.max_body_bytes)
    except TimeoutError:
        raise BadRequest(408, f"the request body did not arrive within {config.client_timeout_s:g} s "
                              "(--client-timeout-s)", code="request_timeout") from None


async def _read_body_unbounded(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(413, f"request body is {request.content_length} bytes; this proxy accepts at most "
                              f"{limit} bytes (--max-body-bytes)", code="request_too_large")
    if request.content_length is not None:
        return await request.read()  # at most the limit, checked above
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"request body exceeds {limit} bytes (--max-body-bytes)",
                             code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
