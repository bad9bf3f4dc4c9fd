"""The proxy's answers to the model's recall calls: ``read_archive`` (the archived outputs it asks for)
and ``search_archive`` (hits in the conversation's archive), within a budget of characters per request,
so that hundreds of calls in one answer cannot build a huge upstream request. :func:`hold_event` decides
which streamed events wait until the proxy knows whether an answer is a recall round (the client never
sees those calls). Every dialect answers through :func:`recall_results`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from ctxfold.chat.formats.openai import message_to_openai
from ctxfold.chat.messages import Message, Role, ToolCall
from ctxfold.compaction.archive import (
    READ_ARCHIVE,
    RECALL_TOOLS,
    SEARCH_ARCHIVE,
    ArchiveStore,
    answer_recall_call,
)
from ctxfold.compaction.archive.recall import DEFAULT_LIMIT_CHARS, MAX_LIMIT_CHARS, given_id
from ctxfold.compaction.archive.search import MAX_ANSWER_CHARS
from ctxfold.compaction.store.buffer import BufferedArchive
from ctxfold.serve.metrics import ProxyMetrics


def is_recall_round(message: dict[str, Any]) -> bool:
    """Whether an answer (a ``choices[0].message`` dict) calls recall tools and nothing else."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return False
    return all(isinstance(c, dict) and isinstance(c.get("function"), dict) and c["function"].get("name") in RECALL_TOOLS
               for c in calls)


def to_wire(m: Message) -> dict[str, Any]:
    """A message as the upstream receives it: the client's own fields, without ctxfold's ids and usage."""
    out = message_to_openai(m)
    out.pop("id", None)
    out.pop("usage", None)
    return out


def openai_calls(message: dict[str, Any]) -> list[ToolCall]:
    """The tool calls of a ``choices[0].message`` dict."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        out.append(ToolCall(id=str(call.get("id", "")), name=str(fn.get("name", "")),
                            arguments=str(fn.get("arguments", ""))))
    return out


async def recall_results(store: ArchiveStore, calls: list[ToolCall], left: list[int], *, max_chars: int,
                         metrics: ProxyMetrics) -> list[Message]:
    """The answers to the model's recall ``calls``, one tool message each. ``left`` (one number,
    shared by the request's rounds): the characters of archived text the request may still receive;
    a read asking for more gets what is left, and the answer says so; a search's answer is bounded
    by what is left and counted whole."""
    results = []
    for tc in calls:
        metrics.recall_calls.inc()
        if tc.name == SEARCH_ARCHIVE:
            if left[0] < _MIN_SEARCH_CHARS:
                results.append(_recall_refused(tc, max_chars))
                continue
            await fetch_for(store, tc)
            answer = await asyncio.to_thread(answer_recall_call, store, tc,
                                             max_search_chars=min(left[0], MAX_ANSWER_CHARS))
            left[0] -= len(answer.text)
            results.append(answer)
            continue
        wanted = _recall_limit(tc.arguments)
        if wanted is not None and left[0] <= 0:
            results.append(_recall_refused(tc, max_chars))
            continue
        cut = wanted is not None and wanted > left[0]
        if cut:
            args = json.loads(tc.arguments)
            args["limit"] = left[0]
            tc = replace(tc, arguments=json.dumps(args))
        await fetch_for(store, tc)
        answer = await asyncio.to_thread(answer_recall_call, store, tc)
        if wanted is not None and not answer.is_error:
            header, _, piece = answer.text.partition("\n")
            left[0] -= len(piece)
            if cut and "next_offset=" in header:  # the limit, not the end of the output, stopped it
                answer = replace(answer, content=answer.text + _recall_cut_note(max_chars))
        results.append(answer)
    return results


async def fetch_for(store: ArchiveStore, call: ToolCall) -> None:
    """Reads from a session store, on the event loop, what answering ``call`` in a worker thread will
    read: the archived output a read asks for; for a search, the store's names and every text its
    index lacks. Nothing for an archive in a directory or in memory, which the worker reads itself."""
    backend = store.backend
    if not isinstance(backend, BufferedArchive):
        return
    if call.name == SEARCH_ARCHIVE:
        # Not what the index holds, nor what it left out as unreadable: it never reads those again, and a
        # fetched text waits in memory until it is read.
        skip = store.search_index.indexed_ids() | store.search_index.unreadable
        await backend.fetch(name for name in await backend.relist() if name.removesuffix(".txt") not in skip)
        return
    try:
        raw_id = json.loads(call.arguments).get("id")
    except (ValueError, AttributeError):
        return  # the tool answers the malformed call itself, reading nothing
    archive_id = given_id(raw_id) if isinstance(raw_id, str) else None
    if archive_id is not None:
        await backend.fetch([f"{archive_id}.txt"])


# A search answer shorter than this would show no hit (its header alone takes a few hundred characters).
_MIN_SEARCH_CHARS = 1_000


def _recall_limit(arguments: str) -> int | None:
    """The characters a read_archive call asks for (its limit, or the tool's default, within the tool's
    cap), or None when its arguments are not an object with a usable limit: the tool answers those
    with an error, which reads nothing."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    limit = args.get("limit", DEFAULT_LIMIT_CHARS)
    if isinstance(limit, float) and limit.is_integer():
        limit = int(limit)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        return None
    return min(limit, MAX_LIMIT_CHARS)


def _recall_cut_note(max_chars: int) -> str:
    return (f"\n[cut: read_archive output is limited to {max_chars} characters per answer; "
            "read the rest from next_offset in a later answer]")


def _recall_refused(call: ToolCall, max_chars: int) -> Message:
    name = call.name if call.name in RECALL_TOOLS else READ_ARCHIVE
    return Message(role=Role.TOOL, id="", tool_call_id=call.id, name=name, is_error=True,
                   content=f"Not {'searched' if name == SEARCH_ARCHIVE else 'read'}: this answer's read_archive "
                           f"output already reached its limit of {max_chars} characters. Answer with what you have, "
                           f"and call {name} again with the same arguments in a later answer if you still need it.")



def hold_event(data: str | None, chunk: dict[str, Any] | None, recall_calls: set[int]) -> bool:
    """Whether a streamed event waits for the end of the answer: recall call deltas and the closing
    events. ``recall_calls`` collects the indexes of recall calls as their names appear."""
    if data is not None and data.strip() == "[DONE]":
        return True
    if chunk is None:
        return False
    choices = chunk.get("choices")
    if not choices:
        return "usage" in chunk  # the usage-only chunk at the end
    choice = choices[0] if isinstance(choices[0], dict) else {}
    if choice.get("finish_reason"):
        return True
    delta = choice.get("delta")
    calls = delta.get("tool_calls") if isinstance(delta, dict) else None
    if not isinstance(calls, list) or not calls:
        return False
    hold = False
    for k, tc in enumerate(calls):
        if not isinstance(tc, dict):
            continue
        index = tc.get("index", k)
        fn = tc.get("function")
        if isinstance(fn, dict) and fn.get("name") in RECALL_TOOLS:
            recall_calls.add(index)
        hold = hold or index in recall_calls
    return hold
