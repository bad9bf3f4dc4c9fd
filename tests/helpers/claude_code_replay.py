"""Claude Code sessions replayed through ``ctxfold serve`` as Claude Code would send them.

Each conversation of a Claude Code transcript (the main session, and each subagent's) is read with the
importer (``ctxfold.chat.formats.claude_code``) and written back in the Messages API's shape
(``formats.anthropic.dump(api=True)``). For every recorded assistant turn, the client sends what Claude
Code sent for it: the messages before it, streamed (``stream: true``), with a ``cache_control``
breakpoint on the system prompt and on the last message's last block, the tools offered and
``anthropic-beta`` set, through the official ``anthropic`` SDK. The scripted upstream answers with the
recorded assistant turn (``x_replay_answer``), counts each prompt with the real DeepSeek V4 tokenizer
(``testing.deepseek_counter``: Claude's own tokenizer is not public) and refuses one over its window.

The transcripts do not hold Claude Code's system prompt nor its tool definitions: a fixed system prompt
stands in, and each tool the session called is offered with an open schema.

Afterwards each session the proxy kept is restored with ``ctxfold restore --to anthropic`` and compared
with what the client sent in its last request and received as the last answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxfold.chat.formats import load
from ctxfold.chat.formats._common import Reader
from ctxfold.chat.formats.anthropic import dump, load_document
from ctxfold.chat.integrity import count_orphans
from ctxfold.chat.messages import Conversation
from ctxfold.compaction.config import CompactConfig
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream, deepseek_counter
from helpers.proxy_helpers import serve_in_background
from helpers.sdk_clients import anthropic_client
from helpers.subprocess_env import ctxfold_env

SYSTEM = ("You are Claude Code, Anthropic's official CLI for Claude. (The transcript does not record the "
          "system prompt; this one stands in for it.)")
BETA = "claude-code-20250219,interleaved-thinking-2025-05-14"
EPHEMERAL = {"type": "ephemeral"}
REPLY_RESERVE_TOKENS = 1024


def conversations(traces_dir: Path) -> list[Conversation]:
    """Every conversation of every Claude Code transcript: main sessions and subagents."""
    return [c for p in sorted((traces_dir / "claude_code_small").glob("*.jsonl")) for c in load(p)]


def tools_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = sorted({b["name"] for m in messages if isinstance(m["content"], list)
                    for b in m["content"] if b.get("type") == "tool_use"})
    return [{"name": n, "description": f"Claude Code's {n} tool", "input_schema": {"type": "object"}}
            for n in names]


def with_breakpoint(m: dict[str, Any]) -> dict[str, Any]:
    """The message with ``cache_control`` on its last block, as Claude Code marks the newest turn."""
    content = m["content"]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else [dict(b) for b in content]
    blocks[-1]["cache_control"] = EPHEMERAL
    return {**m, "content": blocks}


def requests_of(conv: Conversation) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """(the messages Claude Code sent, the recorded answer's blocks) for each assistant turn."""
    messages = dump(conv, api=True)["messages"]
    for k, m in enumerate(messages):
        if m["role"] == "assistant" and k > 0:
            yield [*messages[: k - 1], with_breakpoint(messages[k - 1])], m["content"]


def sent_in_full(conv: Conversation) -> list[dict[str, Any]]:
    """What the client sent and received in all: every message up to the last recorded answer."""
    messages = dump(conv, api=True)["messages"]
    last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
    return messages[: last + 1]


@dataclass
class Figures:
    """What one replay shows, over every conversation."""

    context_tokens: int
    conversations: int = 0
    requests: int = 0  # requests the client sent (each answered 200)
    upstream_requests: int = 0  # requests the upstream received (summary requests included)
    compactions: int = 0  # compaction passes applied (``ctxfold_compactions_total``)
    passes: dict[str, int] = field(default_factory=dict)  # the same, by kind
    uncompacted_tokens: int = 0  # the longest conversation, whole, by the real tokenizer
    max_prompt_tokens: int = 0  # the largest prompt the upstream received, by the real tokenizer
    over_window: int = 0  # upstream requests whose prompt exceeds the window (the upstream refuses them)
    orphans: int = 0  # tool_result blocks without their tool_use, over every upstream request
    restored_exactly: int = 0
    mismatches: list[str] = field(default_factory=list)


def orphans_in(body: dict[str, Any]) -> int:
    conv = load_document(body, Reader(source="upstream", lenient=False), "request")[0]
    return count_orphans(conv.messages)


def restore(session_dir: Path) -> list[dict[str, Any]]:
    """``ctxfold restore SESSION --to anthropic``, run as a user runs it, in the request's shape: the file it
    writes is a trace (message ids, usage), read back and written as the API takes it."""
    out = subprocess.run([sys.executable, "-m", "ctxfold", "restore", str(session_dir), "-o", "-", "--to",
                          "anthropic"], capture_output=True, text=True, env=ctxfold_env(), check=True)
    conv = load_document(json.loads(out.stdout), Reader(source=str(session_dir), lenient=False), "restored")[0]
    messages: list[dict[str, Any]] = dump(conv, api=True)["messages"]
    return messages


def replay(convs: list[Conversation], context_tokens: int, data_dir: Path) -> Figures:
    """Every conversation's requests through one proxy, in turn; the figures, restores compared."""

    count = deepseek_counter()
    up = ScriptedUpstream(context_tokens=context_tokens, count_tokens=count)
    compact = CompactConfig.from_mapping({"context_tokens": context_tokens,
                                          "reply_reserve_tokens": REPLY_RESERVE_TOKENS})
    fig = Figures(context_tokens=context_tokens, conversations=len(convs))
    with BackgroundServer(up.app()) as upstream:
        proxy = ProxyApp(ProxyConfig(upstream=upstream.url, data_dir=data_dir, compact=compact,
                                     tokenizer="deepseek-v4", summarizer="extractive", fsync="never"))
        with serve_in_background(proxy) as srv:
            client = anthropic_client(srv.url, api_key="sk-replay", default_headers={"anthropic-beta": BETA})
            for conv in convs:
                for messages, answer in requests_of(conv):
                    with client.messages.stream(
                            model="claude-sonnet-4-5", max_tokens=REPLY_RESERVE_TOKENS, messages=messages,
                            system=[{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}],
                            tools=tools_of(sent_in_full(conv)), extra_body={"x_replay_answer": answer}) as s:
                        got = s.get_final_message()
                    fig.requests += 1
                    received = [b.model_dump(exclude_none=True) for b in got.content]
                    if received != answer:
                        fig.mismatches.append(f"{conv.id} answer {fig.requests}: {received!r:.200} != {answer!r:.200}")
        for (kind, _trigger), n in proxy.metrics.compactions.values.items():
            fig.passes[kind] = fig.passes.get(kind, 0) + int(n)
        fig.compactions = sum(fig.passes.values())
    fig.upstream_requests = len(up.received)
    fig.uncompacted_tokens = max(count({"system": SYSTEM, "messages": sent_in_full(c), "tools": tools_of(sent_in_full(c))})
                                 for c in convs)
    fig.max_prompt_tokens = max(up.prompt_tokens_seen)
    fig.over_window = sum(1 for n in up.prompt_tokens_seen if n > context_tokens)
    fig.orphans = sum(orphans_in(b) for b in up.received)
    by_first = {json.dumps(sent_in_full(c)[0], sort_keys=True): c for c in convs}
    for events in sorted(data_dir.rglob("events.jsonl")):
        restored = restore(events.parent)
        conv = by_first.get(json.dumps(restored[0], sort_keys=True))
        if conv is not None and restored == sent_in_full(conv):
            fig.restored_exactly += 1
        else:
            fig.mismatches.append(f"session {events.parent.name} not restored exactly")
    return fig
