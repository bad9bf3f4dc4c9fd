"""Every real trace loads, round-trips through both exporters, and gains no integrity violation."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat import formats
from ctxfold.chat.integrity import validate
from ctxfold.chat.messages import Conversation, Message, Role

_NOT_TRACES = {"README.md", "LICENSE", "LICENSE.md", "SOURCE.txt"}


def trace_files(traces_dir: Path) -> list[Path]:
    return sorted(p for p in traces_dir.rglob("*") if p.is_file() and p.name not in _NOT_TRACES)


def set_name(traces_dir: Path, path: Path) -> str:
    return path.relative_to(traces_dir).parts[0]

# Formats each set must be detected as, from the content alone.
EXPECTED_FORMAT = {
    "claude_code_small": "claude_code",
    "deepseek_sample": "mini_swe_agent",
    "openhands": "openhands",
    "swe_agent": "swe_agent",
    "tau_bench": "tau_bench",
}


@pytest.fixture(scope="module")
def loaded(traces_dir: Path) -> dict[Path, formats.LoadReport]:
    return {p: formats.read_path(p) for p in trace_files(traces_dir)}


def test_every_trace_file_loads_with_its_detected_format(traces_dir: Path,
                                                        loaded: dict[Path, formats.LoadReport]) -> None:
    assert len(loaded) >= 18
    for path, report in loaded.items():
        assert report.format == EXPECTED_FORMAT[set_name(traces_dir, path)], path
        assert report.conversations, path
        assert not report.skipped, path
        conv_ids = [c.id for c in report.conversations]
        assert len(set(conv_ids)) == len(conv_ids), path
        for conv in report.conversations:
            assert conv.messages, (path, conv.id)
            ids = [m.id for m in conv.messages]
            assert all(ids) and len(set(ids)) == len(ids), (path, conv.id)


def test_per_set_table_and_export_adds_no_violation(traces_dir: Path,
                                                    loaded: dict[Path, formats.LoadReport]) -> None:
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for path, report in loaded.items():
        row = rows[set_name(traces_dir, path)]
        row[0] += 1
        for conv in report.conversations:
            raw = validate(conv)
            row[1] += 1
            row[2] += len(conv)
            row[3] += conv.tool_pairs()
            row[4] += len(raw)
            for v in raw:
                kinds[set_name(traces_dir, path)][v.kind.value] += 1
            for fmt in formats.EXPORT_FORMATS:
                (again,) = formats.loads(formats.dumps(conv, fmt), fmt)
                assert validate(again) == raw, (path, conv.id, fmt)
    print(f"\n{'set':<20}{'files':>6}{'convs':>7}{'messages':>10}{'tool pairs':>12}{'raw violations':>16}")
    for name, (files, convs, msgs, pairs, viol) in sorted(rows.items()):
        detail = ", ".join(f"{k} {n}" for k, n in sorted(kinds[name].items()))
        print(f"{name:<20}{files:>6}{convs:>7}{msgs:>10}{pairs:>12}{viol:>16}  {detail}")
    # Figures of the data as recorded upstream (see the traces README): if an importer drops or
    # invents messages, these move.
    assert rows["tau_bench"][1:4] == [200, 5108, 1164]
    assert rows["deepseek_sample"][1] == 4


def _held(m: Message, fmt: str) -> tuple[Any, ...]:
    """What a format can hold of a message."""
    usage = None if m.usage is None else (m.usage.prompt_tokens, m.usage.completion_tokens,
                                          m.usage.cached_prompt_tokens)
    if fmt == "openai":
        calls = tuple((c.id, c.name, c.arguments) for c in m.tool_calls)
        return (m.role, m.content, m.id, calls, m.tool_call_id, m.name, m.reasoning, usage)
    calls = tuple((c.id, c.name, json.dumps(c.parsed_arguments())) for c in m.tool_calls)
    name = m.name if m.role is not Role.TOOL else None  # Anthropic results carry no tool name
    return (m.role, m.content, m.id, calls, m.tool_call_id, m.is_error, m.reasoning, usage, name)


def _held_conv(c: Conversation, fmt: str) -> tuple[Any, ...]:
    tools = tuple((t.name, t.description, dict(t.parameters)) for t in c.tools)
    return (c.system, tools, tuple(_held(m, fmt) for m in c.messages))


@pytest.mark.parametrize("fmt", ["openai", "anthropic"])
def test_import_export_import_keeps_what_the_format_holds(loaded: dict[Path, formats.LoadReport],
                                                          fmt: str) -> None:
    checked = 0
    for path, report in loaded.items():
        for conv in report.conversations:
            text = formats.dumps(conv, fmt)
            (again,) = formats.loads(text, fmt)
            assert _held_conv(again, fmt) == _held_conv(conv, fmt), (path, conv.id)
            # Export is a fixed point after one trip: nothing drifts on the next.
            assert formats.dumps(again, fmt) == text, (path, conv.id)
            if conv.source_format == fmt or (fmt == "openai" and conv.source_format in ("tau_bench",
                                                                                         "mini_swe_agent")):
                # Native messages: the whole model, extras included, comes back.
                assert again.messages == conv.messages, (path, conv.id)
            checked += 1
    assert checked >= 200


def test_mini_swe_agent_usage_is_deepseeks_own_count(traces_dir: Path) -> None:
    path = traces_dir / "deepseek_sample" / "deepseek_reasoner" / "sqlfluff__sqlfluff-2419.traj.json"
    (conv,) = formats.load(path)
    raw = json.loads(path.read_text())
    raw_assistants = [m for m in raw["messages"] if m["role"] == "assistant"]
    assistants = [m for m in conv.messages if m.role is Role.ASSISTANT]
    assert len(assistants) == len(raw_assistants) == 55
    for m, r in zip(assistants, raw_assistants, strict=True):
        u = r["extra"]["response"]["usage"]
        assert m.usage is not None
        assert (m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.cached_prompt_tokens) == (
            u["prompt_tokens"], u["completion_tokens"], u["prompt_cache_hit_tokens"])
        assert m.reasoning == r["reasoning_content"]
    assert conv.system == raw["messages"][0]["content"]
    assert conv.meta["mini_swe_agent"]["exit"]["role"] == "exit"  # the run's end is kept, not a message


def test_claude_code_merges_one_response_and_splits_the_subagent(traces_dir: Path) -> None:
    convs = formats.load(traces_dir / "claude_code_small" / "subagent.jsonl")
    main, agent = convs
    assert agent.id.startswith(main.id + "/agent-")
    assert agent.meta["parent_tool_use_id"] in {c.id for m in main.messages for c in m.tool_calls}
    # The first response was written as text, thinking, text and four tool_use records: one message.
    first = next(m for m in main.messages if m.role is Role.ASSISTANT and len(m.tool_calls) == 4)
    assert first.reasoning and first.usage is not None and first.usage.completion_tokens is not None
    assert len(first.extra["claude_code"]["uuids"]) == 7
    assert all(m.role is not Role.SYSTEM for m in main.messages)


def test_openhands_pairs_actions_and_observations_by_call_id(traces_dir: Path) -> None:
    (conv,) = formats.load(traces_dir / "openhands" / "trajs_wrong_initial_state.json")
    roles = [m.role for m in conv.messages]
    assert roles == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT, Role.TOOL,
                     Role.ASSISTANT]
    assert conv.messages[2].tool_call_id == conv.messages[1].tool_calls[0].id == "toolu_01USom24cuiyvAembLhEryrn"
    assert json.loads(conv.messages[1].tool_calls[0].arguments) == {"command": "view", "path": "/workspace"}
    assert [m.id for m in conv.messages[:3]] == ["e0", "e3", "e4"]
    runs = formats.load(traces_dir / "openhands" / "multi_swe_bench_output.jsonl")
    assert len(runs) == 3
    assert all(r.system and {t.name for t in r.tools} >= {"execute_bash", "finish"} for r in runs)
