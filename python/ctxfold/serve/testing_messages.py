"""The scripted upstream's ``POST /v1/messages`` (Anthropic's messages API), JSON and event stream, for
the proxy's tests: it records each request's body and headers, answers the next of ``messages_script``, else
``x_replay_answer`` (a list of content blocks) verbatim, or echoes the last user text, and refuses a prompt over
its window as Anthropic does (``prompt is too long: N tokens > M maximum``), the prompt counted by the upstream's
``count_tokens`` (characters / 4 unless told otherwise)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from ctxfold.serve.testing import ScriptedUpstream

CHUNK_CHARS = 8


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _blocks_for(up: ScriptedUpstream, body: dict[str, Any]) -> list[dict[str, Any]]:
    if up.messages_script:
        return up.messages_script.pop(0)
    replay = body.get("x_replay_answer")
    if isinstance(replay, list):
        return replay
    user: dict[str, Any] = next((m for m in reversed(body.get("messages") or []) if m.get("role") == "user"
                 and _text_of(m.get("content"))), {})
    return [{"type": "text", "text": f"echo: {_text_of(user.get('content'))[:200]}"}]


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}).encode() + b"\n\n"


def _block_events(k: int, block: dict[str, Any]) -> list[bytes]:
    kind = block.get("type")
    if kind == "text":
        start: dict[str, Any] = {"type": "text", "text": ""}
        pieces = [
            {"type": "text_delta", "text": block["text"][i:i + CHUNK_CHARS]}
            for i in range(0, len(block["text"]), CHUNK_CHARS)]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": ""}
        pieces = [{"type": "thinking_delta", "thinking": block["thinking"]},
                  {"type": "signature_delta", "signature": block.get("signature", "")}]
    elif kind == "tool_use":
        start = {**block, "input": {}}
        args = json.dumps(block.get("input", {}))
        pieces = [{"type": "input_json_delta", "partial_json": args[i:i + 16]} for i in range(0, len(args), 16)]
    else:
        start, pieces = block, []
    return ([_event("content_block_start", {"index": k, "content_block": start})]
            + [_event("content_block_delta", {"index": k, "delta": d}) for d in pieces]
            + [_event("content_block_stop", {"index": k})])


async def answer_messages(up: ScriptedUpstream, request: web.Request) -> web.StreamResponse:
    body = await request.json()
    up.received.append(body)
    up.received_headers.append(dict(request.headers))
    if up.fail_status is not None and up.fail_count > 0:
        up.fail_count -= 1
        return web.json_response({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
                                 status=up.fail_status)
    prompt = up.count_tokens(body)
    up.prompt_tokens_seen.append(prompt)
    if up.context_tokens is not None and prompt > up.context_tokens:
        up.rejected_over_context += 1
        return web.json_response({"type": "error", "error": {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {prompt} tokens > {up.context_tokens} maximum"}}, status=400)
    blocks = _blocks_for(up, body)
    stop = "tool_use" if any(b.get("type") == "tool_use" for b in blocks) else "end_turn"
    usage = {"input_tokens": prompt, "output_tokens": max(1, len(json.dumps(blocks)) // 4),
             "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    head = {"id": f"msg_{len(up.received)}", "type": "message", "role": "assistant",
            "model": body.get("model", up.model), "stop_reason": None, "stop_sequence": None}
    if not body.get("stream"):
        raw = json.dumps({**head, "content": blocks, "stop_reason": stop, "usage": usage}).encode()
        up.sent.append(raw)
        return web.Response(body=raw, content_type="application/json")
    events = [_event("message_start", {"message": {**head, "content": [], "usage": {**usage, "output_tokens": 1}}}),
              _event("ping", {})]
    for k, b in enumerate(blocks):
        events += _block_events(k, b)
    events += [_event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                        "usage": {"output_tokens": usage["output_tokens"]}}),
               _event("message_stop", {})]
    up.sent.append(b"".join(events))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for e in events:
        await resp.write(e)
    await resp.write_eof()
    return resp
