"""The scripted upstream's ``POST /v1/responses`` (OpenAI's Responses API), JSON and event stream, for
the proxy's tests: it records each request's body and headers, answers the next of ``responses_script``
(a list of output items), else ``x_replay_answer`` (a list of output items) verbatim, or echoes the
last user text; it refuses a prompt over its window as OpenAI does (``context_length_exceeded``).
Usage: ``input_tokens`` as :func:`responses_tokens` counts, ``cached_tokens`` as ``cached_tokens``
says (a fixed figure a test sets)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from ctxfold.serve.testing import ScriptedUpstream

CHUNK_CHARS = 8


def responses_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens as characters / 4 plus 4 per item (as ``chars_estimate``)."""
    items = body.get("input")
    items = [items] if isinstance(items, str) else items or []
    n = sum(4 + len(json.dumps(i, ensure_ascii=False)) // 4 for i in items)
    n += len(json.dumps(body.get("instructions") or "", ensure_ascii=False)) // 4
    return n + len(json.dumps(body.get("tools") or [], ensure_ascii=False)) // 4


def _user_text(body: dict[str, Any]) -> str:
    items = body.get("input")
    if isinstance(items, str):
        return items
    for item in reversed(items or []):
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                return content
            return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
    return ""


def _output_for(up: ScriptedUpstream, body: dict[str, Any]) -> list[dict[str, Any]]:
    if up.responses_script:
        items = up.responses_script.pop(0)
    elif isinstance(body.get("x_replay_answer"), list):
        items = body["x_replay_answer"]
    else:
        items = [{"type": "message", "role": "assistant",
                  "content": [{"type": "output_text", "text": f"echo: {_user_text(body)[:200]}", "annotations": []}]}]
    out = []
    for k, item in enumerate(items):  # ids and status as OpenAI gives them
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}.get(item.get("type", ""), "it")
        out.append({"id": f"{prefix}_{len(up.received)}_{k}", **item,
                    **({"status": "completed"} if item.get("type") != "reasoning" else {})})
    return out


def _event(kind: str, seq: int, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, "sequence_number": seq, **data}).encode() \
        + b"\n\n"


def _item_events(k: int, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(type, fields) of the events that stream one output item."""
    kind = item.get("type")
    base = {"output_index": k, "item_id": item["id"]}
    if kind == "message":
        text = "".join(p.get("text", "") for p in item.get("content") or [])
        added = {**item, "content": [], "status": "in_progress"}
        part = {"type": "output_text", "text": "", "annotations": []}
        events = [("response.output_item.added", {"output_index": k, "item": added}),
                  ("response.content_part.added", {**base, "content_index": 0, "part": part})]
        events += [("response.output_text.delta", {**base, "content_index": 0, "delta": text[i:i + CHUNK_CHARS]})
                   for i in range(0, len(text), CHUNK_CHARS)]
        events += [("response.output_text.done", {**base, "content_index": 0, "text": text}),
                   ("response.content_part.done", {**base, "content_index": 0, "part": {**part, "text": text}})]
    elif kind == "function_call":
        args = item.get("arguments", "")
        events = [("response.output_item.added", {"output_index": k, "item": {**item, "arguments": "",
                                                                               "status": "in_progress"}})]
        events += [("response.function_call_arguments.delta", {**base, "delta": args[i:i + 16]})
                   for i in range(0, len(args), 16)]
        events += [("response.function_call_arguments.done", {**base, "arguments": args})]
    else:
        events = [("response.output_item.added", {"output_index": k, "item": item})]
    return [*events, ("response.output_item.done", {"output_index": k, "item": item})]


async def answer_responses(up: ScriptedUpstream, request: web.Request) -> web.StreamResponse:
    body = await request.json()
    up.received.append(body)
    up.received_headers.append(dict(request.headers))
    if up.fail_status is not None and up.fail_count > 0:
        up.fail_count -= 1
        return web.json_response({"error": {"message": "The server is overloaded", "type": "server_error",
                                            "param": None, "code": None}}, status=up.fail_status)
    prompt = responses_tokens(body)
    up.prompt_tokens_seen.append(prompt)
    if up.context_tokens is not None and prompt > up.context_tokens:
        up.rejected_over_context += 1
        return web.json_response({"error": {
            "message": f"Your input exceeds the context window of this model ({prompt} tokens).",
            "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}}, status=400)
    output = _output_for(up, body)
    output_tokens = max(1, len(json.dumps(output)) // 4)
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": min(up.cached_tokens, prompt)},
             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt + output_tokens}
    head = {"id": f"resp_{len(up.received)}", "object": "response", "created_at": 1700000000,
            "model": body.get("model", up.model), "instructions": body.get("instructions"),
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": body.get("tools") or []}
    done = {**head, "status": "completed", "output": output, "usage": usage}
    if not body.get("stream"):
        raw = json.dumps(done).encode()
        up.sent.append(raw)
        return web.Response(body=raw, content_type="application/json")
    kinds = [("response.created", {"response": {**head, "status": "in_progress", "output": []}}),
             ("response.in_progress", {"response": {**head, "status": "in_progress", "output": []}})]
    for k, item in enumerate(output):
        kinds += _item_events(k, item)
    kinds.append(("response.completed", {"response": done}))
    events = [_event(kind, seq, data) for seq, (kind, data) in enumerate(kinds)]
    up.sent.append(b"".join(events))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        for k, e in enumerate(events):
            if up.cut_after_chunks is not None and k >= up.cut_after_chunks:
                up.cut_after_chunks = None
                if request.transport is not None:
                    request.transport.close()  # drop the connection without ending the stream
                return resp
            if up.stall_after_chunks is not None and k == up.stall_after_chunks:
                up.stall_after_chunks = None
                if not await up.wait(request, up.stall_s):
                    return resp
            await resp.write(e)
        await resp.write_eof()
    except ConnectionError:
        pass  # the client went away
    return resp
