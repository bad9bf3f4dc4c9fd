"""The checks the real traces drive, on traces the project generates itself (tests/helpers/synthetic_traces.py).

A fresh clone has no real traces; these files have their shapes (tool calls with ids, parallel
calls, reasoning, long and huge tool outputs, records that are not conversation) in every format
the importers read. Each is imported with its detected format and nothing dropped or invented,
round-trips through both exporters, replays through the compactor with no request over the window,
no orphaned result and an exact restore, goes through the archive passes losslessly, and is counted
and replayed by the command.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from test_formats_traces import _held_conv

from ctxfold.chat import formats
from ctxfold.chat.integrity import count_orphans, validate
from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.compaction.archive import (
    ArchiveParams,
    ArchiveStore,
    archive_mid_turn,
    archive_turn_start,
    restore,
)
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.replay import default_reply_reserve, replay_conversation
from ctxfold.tokens.counting import load_counter
from helpers import synthetic_traces as synthetic
from helpers.cli_helpers import run_ctxfold, run_main

Manifest = dict[Path, synthetic.Expected]


def conversations(manifest: Manifest) -> list[tuple[Path, Conversation]]:
    return [(p, c) for p in manifest for c in formats.load(p)]


def test_generation_is_deterministic(synthetic_traces_dir: Path, synthetic_traces: Manifest,
                                     tmp_path: Path) -> None:
    again = synthetic.write_all(tmp_path)
    assert {p.relative_to(tmp_path): e for p, e in again.items()} == {
        p.relative_to(synthetic_traces_dir): e for p, e in synthetic_traces.items()}
    for p in again:
        assert p.read_bytes() == (synthetic_traces_dir / p.relative_to(tmp_path)).read_bytes(), p


def test_every_format_is_generated(synthetic_traces: Manifest) -> None:
    assert {e.format for e in synthetic_traces.values()} == set(formats.FORMATS)


def test_every_file_loads_with_its_format_and_nothing_dropped(synthetic_traces_dir: Path,
                                                              synthetic_traces: Manifest) -> None:
    for path, expected in synthetic_traces.items():
        report = formats.read_path(path)  # the format detected from the content alone
        assert report.format == expected.format == path.relative_to(synthetic_traces_dir).parts[0], path
        assert not report.skipped, path
        got = tuple((len(c), c.tool_pairs()) for c in report.conversations)
        assert got == expected.conversations, path
        conv_ids = [c.id for c in report.conversations]
        assert len(set(conv_ids)) == len(conv_ids), path
        for conv in report.conversations:
            ids = [m.id for m in conv.messages]
            assert all(ids) and len(set(ids)) == len(ids), (path, conv.id)
            assert validate(conv) == [], (path, conv.id)
            assert conv.messages[0].role is Role.USER and conv.messages[-1].role is Role.ASSISTANT


def test_the_shapes_real_traces_have_are_there(synthetic_traces: Manifest) -> None:
    convs = conversations(synthetic_traces)
    msgs = [m for _, c in convs for m in c.messages]
    assert any(len(m.tool_calls) >= 2 for m in msgs)  # parallel calls
    assert any(m.reasoning for m in msgs)
    assert any(m.is_error for m in msgs if m.role is Role.TOOL)
    assert any(len(m.text) > 50_000 for m in msgs)  # larger than a small window on its own
    assert sum(len(m.text) > 4_000 for m in msgs) > 20
    # The system prompt is read wherever the format records one (not Claude Code logs, not a JSONL
    # of Anthropic messages).
    assert all(c.system for p, c in convs if c.source_format != "claude_code" and p.name != "messages.jsonl")


def test_import_export_import_keeps_what_the_format_holds(synthetic_traces: Manifest) -> None:
    for path, conv in conversations(synthetic_traces):
        raw = validate(conv)
        for fmt in formats.EXPORT_FORMATS:
            text = formats.dumps(conv, fmt)
            (again,) = formats.loads(text, fmt)
            assert _held_conv(again, fmt) == _held_conv(conv, fmt), (path, conv.id, fmt)
            assert validate(again) == raw
            assert formats.dumps(again, fmt) == text, (path, conv.id, fmt)  # a fixed point after one trip
            if conv.source_format == fmt or (fmt == "openai" and conv.source_format in ("tau_bench",
                                                                                         "mini_swe_agent")):
                assert again.messages == conv.messages, (path, conv.id)


def test_claude_code_merges_each_response_skips_bookkeeping_and_splits_the_subagent(
        synthetic_traces: Manifest) -> None:
    (path,) = [p for p in synthetic_traces if p.name == "subagent.jsonl"]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    main, agent = formats.load(path)
    assert agent.id.startswith(main.id + "/agent-")
    (task,) = [c for m in main.messages for c in m.tool_calls if c.name == "Task"]
    assert agent.meta["parent_tool_use_id"] == task.id
    # Each response is written one record per block: merged back, every record's uuid kept.
    by_response = Counter(r["message"]["id"] for r in records if r["type"] == "assistant")
    assistants = [m for m in main.messages if m.role is Role.ASSISTANT]
    assert [len(m.extra["claude_code"]["uuids"]) for m in assistants] == list(by_response.values())
    (session,) = formats.load(path.parent / "session.jsonl")
    ignored = session.meta["ignored_records"]
    assert ignored and set(ignored) <= {"progress", "file-history-snapshot", "queue-operation", "system"}
    multi = next(m for m in session.messages if len(m.tool_calls) >= 2 and m.reasoning)
    assert multi.usage is not None and multi.usage.cached_prompt_tokens is not None


def test_openhands_pairs_calls_by_id_and_merges_one_response(synthetic_traces: Manifest) -> None:
    (path,) = [p for p in synthetic_traces if p.name == "events.json"]
    events = json.loads(path.read_text())
    (conv,) = formats.load(path)
    assert conv.system == events[0]["args"]["content"] and {t.name for t in conv.tools} == {"bash", "read_file",
                                                                                            "edit_file"}
    calls = [e for e in events if "action" in e and "tool_call_metadata" in e]
    responses = Counter(e["tool_call_metadata"]["model_response"]["id"] for e in calls)
    assert [len(m.tool_calls) for m in conv.messages if m.tool_calls] == list(responses.values())
    assert max(responses.values()) >= 2
    for k, m in enumerate(conv.messages):
        if m.role is Role.TOOL:
            assert m.tool_call_id in {c.id for prev in conv.messages[:k] for c in prev.tool_calls}


def test_mini_swe_agent_usage_is_the_recorded_count(synthetic_traces: Manifest) -> None:
    for path in (p for p, e in synthetic_traces.items() if e.format == "mini_swe_agent"):
        raw = json.loads(path.read_text())
        (conv,) = formats.load(path)
        raw_calls = [m for m in raw["messages"] if m["role"] == "assistant" and m.get("tool_calls")]
        calls = [m for m in conv.messages if m.tool_calls]
        assert len(calls) == len(raw_calls) > 10
        for m, r in zip(calls, raw_calls, strict=True):
            u = r["extra"]["response"]["usage"]
            assert m.usage is not None
            assert (m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.cached_prompt_tokens) == (
                u["prompt_tokens"], u["completion_tokens"], u["prompt_cache_hit_tokens"])
            assert m.reasoning == r.get("reasoning_content")
        assert conv.meta["mini_swe_agent"]["exit"]["role"] == "exit"


@pytest.mark.parametrize("ctx", [8192, 16384, 32768])
def test_replay_through_the_compactor(synthetic_traces: Manifest, ctx: int) -> None:
    counter = load_counter("estimate:deepseek-v4")
    kinds: Counter[str] = Counter()
    for path, conv in conversations(synthetic_traces):
        config = CompactConfig.preset("both", context_tokens=ctx,
                                      reply_reserve_tokens=default_reply_reserve(conv, counter.count, ctx))
        report = replay_conversation(conv, config=config, counter=counter)
        kinds.update(report.compactions)
        assert report.overflows == 0, f"{path.name} {conv.id} at ctx {ctx}: requests over the window"
        assert report.orphans == 0, f"{path.name} {conv.id} at ctx {ctx}: orphaned tool results"
        assert report.restore_exact, f"{path.name} {conv.id} at ctx {ctx}: not restored byte for byte"
    if ctx == 8192:
        assert kinds["summary"] > 0 and sum(kinds.values()) > kinds["summary"], kinds


@pytest.mark.parametrize("params", [ArchiveParams(), ArchiveParams(keep_recent_user_turns=1,
                                                                    archive_threshold_chars=200,
                                                                    archive_preview_chars=0,
                                                                    keep_recent_tool_results=1)])
def test_archive_passes_are_lossless(synthetic_traces: Manifest, tmp_path: Path, params: ArchiveParams) -> None:
    archived = 0
    for k, (path, conv) in enumerate(conversations(synthetic_traces)):
        store = ArchiveStore(tmp_path / f"c{k}")
        history: list[Message] = []
        for m in conv.messages:  # the turn-start pass as an agent runs it, then the mid-turn stage
            history.append(m)
            if m.is_user_turn:
                history, _ = archive_turn_start(history, store, params)
        after, report = archive_mid_turn(history, store, params)
        assert restore(after, store, strict=True) == conv.messages, (path.name, conv.id)
        assert count_orphans(after) == 0
        assert [(m.id, m.role, m.tool_call_id) for m in after] == [(m.id, m.role, m.tool_call_id)
                                                                     for m in conv.messages]
        assert all(a.chars_after < a.chars_before for a in report.archived)
        archived += len(store.ids())
    assert archived > 0


def test_the_occupancy_bound_holds(synthetic_traces: Manifest) -> None:
    counter = load_counter("estimate:deepseek-v4")
    checked = 0
    for _, conv in conversations(synthetic_traces):
        c = Compactor(Conversation(messages=[], system=conv.system, tools=conv.tools), counter=counter,
                      config=CompactConfig(context_tokens=None))
        msgs = list(conv.messages)
        k = 0
        while k < len(msgs):
            batch = msgs[k:k + 1 + k % 3]
            bound = c.occupancy_bound_tokens(batch)
            c.append(*batch)
            k += len(batch)
            if k % 2:
                assert c.occupancy_tokens() <= bound, (conv.id, k)
                checked += 1
    assert checked > 100


@pytest.mark.slow
def test_the_command_counts_and_replays_every_file(synthetic_traces: Manifest, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    files = [str(p) for p in synthetic_traces]
    convs = conversations(synthetic_traces)
    counted = []
    for path in files:  # count reads one file at a time
        code, out, err = run_main(capsys, "count", path, "--json", "-")
        assert code == 0, err
        counted += json.loads(out)["conversations"]
    assert [len(c["messages"]) for c in counted] == [len(c) for _, c in convs]
    for c in counted:
        assert c["total_tokens"] == c["fixed_tokens"] + sum(m["tokens"] for m in c["messages"])
    mini = [c for c, (_, conv) in zip(counted, convs, strict=True) if conv.source_format == "mini_swe_agent"]
    assert len(mini) == 2 and all(c["recorded_requests"] > 10 for c in mini)  # compared with the recorded usage

    replay = run_ctxfold("replay", *files, "--ctx", "16k", "--json", str(tmp_path / "r.json"), "--quiet",
                        "--session-dir", str(tmp_path / "sessions"))
    assert replay.returncode == 0, replay.stderr
    entries = json.loads((tmp_path / "r.json").read_text())["conversations"]
    assert len(entries) == len(convs)
    assert all(e["overflows"] == 0 and e["orphans"] == 0 and e["restore_exact"] for e in entries)
