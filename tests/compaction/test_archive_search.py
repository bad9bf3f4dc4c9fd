"""search_archive over one conversation's archive: hits, ranking, bounds and paging, regular expressions
bounded in time, the index rebuilt from the archive, history dumps searched, the library's answer helper."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall
from ctxfold.compaction.archive import (
    MAX_HITS,
    READ_ARCHIVE,
    SEARCH_ARCHIVE,
    ArchiveStore,
    MemoryBackend,
    SearchResult,
    answer_recall_call,
    search,
    search_archive,
    search_archive_tool_anthropic,
    search_archive_tool_openai,
)
from ctxfold.compaction.archive.index import INDEX_FILE
from ctxfold.compaction.archive.recall import recall_tools_anthropic, recall_tools_openai
from ctxfold.compaction.archive.search import MAX_ANSWER_CHARS, MAX_QUERY_CHARS
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.tokens.counting import load_counter
from ctxfold.tokens.templates import get_template

pytest.importorskip("regex")


def page(store: ArchiveStore, query: str, **kw: object) -> SearchResult:
    got = search(store, query, **kw)  # type: ignore[arg-type]
    assert isinstance(got, SearchResult), got
    return got


def ids_of(result: SearchResult) -> list[str]:
    return [h.archive_id for h in result.hits]


# -- hits and ranking --------------------------------------------------------------------------------------

def test_literal_search_ranks_more_matches_in_less_text_first(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path / "archive")
    dense = store.put("FAILED tests/test_io.py::test_read - AssertionError\n" * 4 + "4 failed, 10 passed\n")
    sparse = store.put("building wheel...\n" * 400 + "one AssertionError at the very end\n")
    once_short = store.put("E   AssertionError: expected 3, got 4\n")
    store.put("nothing to see here\n" * 10)
    got = page(store, "assertionerror")
    # Four matches in 200 characters, then one in 40, then one in 7,000.
    assert ids_of(got) == [dense, once_short, sparse]
    assert [h.num_matches for h in got.hits] == [4, 1, 1]
    assert got.num_matching == 3 and got.num_texts == 4 and got.next_offset is None
    top = got.hits[0]
    assert top.kind == "tool output" and top.total_chars == len(store.get(dense))
    # Each shown match is at its offset in the archived text: read_archive(id, offset) starts at it.
    for at, context in top.shown:
        assert store.get(dense)[at:at + len("AssertionError")] == "AssertionError"
        assert "AssertionError" in context and "\n" not in context
    # Case: any case by default, exactly with case_sensitive.
    assert page(store, "ASSERTIONERROR").num_matching == 3
    assert page(store, "ASSERTIONERROR", case_sensitive=True).num_matching == 0
    # Punctuation is literal: the query is not FTS5 syntax, nor a regular expression.
    assert ids_of(page(store, "test_io.py::test_read")) == [dense]
    assert page(store, 'a" OR "b').num_matching == 0
    assert page(store, "test.io").num_matching == 0
    # Two characters: below the trigram, read from every row, found the same.
    assert ids_of(page(store, "E ", case_sensitive=True)) == [once_short]


def test_regex_search_finds_patterns_and_rejects_bad_ones() -> None:
    store = ArchiveStore(MemoryBackend())
    a = store.put("exit code 0\nexit code 2\nexit code 137\n")
    b = store.put("the job ended with exit code 1\n")
    got = page(store, r"^exit code [1-9]\d*$", regex=True)  # ^ and $ at line ends
    assert ids_of(got) == [a] and got.hits[0].num_matches == 2
    assert set(ids_of(page(store, r"exit code [1-9]", regex=True))) == {a, b}
    bad = search_archive(store, {"query": "(unclosed", "regex": True})
    assert bad.startswith("Error: '(unclosed' is not a valid regular expression")
    # A pattern that matches empty strings everywhere counts no match.
    assert page(store, "z*", regex=True).num_matching == 0


@pytest.mark.parametrize("pattern", [r"(a|aa)+$", r"(a+)+$", r"^(a|a?)+$", r"(.*a){12}$"])
def test_a_catastrophic_regex_stops_within_the_budget(pattern: str) -> None:
    """Patterns that backtrack exponentially on 'aaaa...b' (Python's re would not return for years):
    the search stops at its budget and says so."""
    store = ArchiveStore(MemoryBackend())
    for k in range(4):
        store.put("a" * (20_000 + k) + "b")
    budget_s = 0.25
    t0 = time.monotonic()
    got = search(store, pattern, regex=True, budget_s=budget_s)
    elapsed_s = time.monotonic() - t0
    assert isinstance(got, SearchResult)
    # Measured: 0.51-0.57 s for this 0.25 s budget (the regex package checks its clock as it backtracks,
    # not at every step); 4x leaves room for a busy machine. Python's re would still be running.
    assert elapsed_s < 4 * budget_s, elapsed_s
    assert got.stopped is not None and "budget" in got.stopped and "stopped early" in got.render()
    # The tool's own budget holds the same way.
    t0 = time.monotonic()
    text = search_archive(store, {"query": pattern, "regex": True})
    assert time.monotonic() - t0 < 4.0 and text.startswith("[search_archive")


def test_paging_bounds_and_stable_order() -> None:
    store = ArchiveStore(MemoryBackend())
    ids = {store.put(f"result {k}: " + "needle " * (1 + k % 5) + "x" * (50 * k)) for k in range(45)}
    seen: list[str] = []
    offset: int | None = 0
    pages = 0
    while offset is not None:
        got = page(store, "needle", offset=offset, limit=MAX_HITS)
        assert len(got.hits) <= MAX_HITS
        seen += ids_of(got)
        offset = got.next_offset
        pages += 1
    assert pages == 3 and len(seen) == 45 and set(seen) == ids  # every hit once, none twice
    assert seen == ids_of(page(store, "needle", limit=45))  # the pages are the ranking cut in pieces
    # The tool caps the limit and the answer's characters, and says where to go on.
    text = search_archive(store, {"query": "needle", "limit": 1000})
    assert len(text) <= MAX_ANSWER_CHARS
    header = text.splitlines()[0]
    assert header.startswith('[search_archive "needle" (literal, any case): 45 matching texts of 45; hits 1-20;')
    assert "next_offset=20" in header
    # An answer with less room shows fewer hits and goes on from the first it could not show.
    short = search_archive(store, {"query": "needle"}, max_chars=1200)
    assert len(short) <= 1200
    shown = sum(1 for line in short.splitlines() if line[:1].isdigit())
    assert 0 < shown < 10 and f"next_offset={shown}]" in short.splitlines()[0]
    assert search_archive(store, {"query": "q" * (MAX_QUERY_CHARS + 1)}).startswith("Error: query has")


def test_many_matches_in_one_text_are_counted_to_a_bound() -> None:
    store = ArchiveStore(MemoryBackend())
    store.put("ab" * 100_000)
    got = page(store, "ab")
    assert got.hits[0].num_matches == 1_000 and "1000+ matches" in got.render()


# -- the index ---------------------------------------------------------------------------------------------

def test_the_index_lives_beside_a_local_archive_and_follows_it(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path / "archive")
    first = store.put("first output mentions the token alpha")
    assert not (tmp_path / "archive" / INDEX_FILE).exists()  # nothing is made before a search
    assert ids_of(page(store, "alpha")) == [first]
    assert (tmp_path / "archive" / INDEX_FILE).is_file()
    assert store.ids() == [first]  # the index file is no archive id
    # Written after the index was built, by this store or another process: found at the next search.
    later = ArchiveStore(tmp_path / "archive").put("a later output with alpha in it, twice: alpha")
    assert ids_of(page(store, "alpha")) == [later, first]
    # A text removed from the archive (an expired key) leaves the index too.
    (tmp_path / "archive" / f"{first}.txt").unlink()
    assert ids_of(page(store, "alpha")) == [later]


def test_a_missing_or_corrupt_index_is_rebuilt_from_the_archive(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    store = ArchiveStore(root)
    ids = [store.put(f"output {k} with the word kiwi") for k in range(5)]
    before = ids_of(page(store, "kiwi"))
    assert sorted(before) == sorted(ids)
    # Missing: a new process (a new store) finds no file and builds it.
    (root / INDEX_FILE).unlink()
    fresh = ArchiveStore(root)
    assert ids_of(page(fresh, "kiwi")) == before
    # Corrupt: garbage where the database was.
    fresh.search_index.close()
    (root / INDEX_FILE).write_bytes(b"this is not an SQLite database" * 200)
    broken = ArchiveStore(root)
    assert ids_of(page(broken, "kiwi")) == before
    assert broken.search_index.rebuilds == 1
    # Another schema (a later version's file): rebuilt too.
    broken.search_index.close()
    with sqlite3.connect(root / INDEX_FILE) as db:
        db.execute("PRAGMA user_version = 99")
    other = ArchiveStore(root)
    assert ids_of(page(other, "kiwi")) == before and other.search_index.rebuilds == 1


def test_corrupt_archive_files_are_left_out_and_said(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path / "archive")
    good = store.put("a good output about mangoes")
    bad = store.put("a bad output about mangoes")
    (tmp_path / "archive" / f"{bad}.txt").write_text("tampered with: mangoes")
    assert ids_of(page(store, "mangoes")) == [good]
    assert bad in store.search_index.unreadable


def test_text_with_a_lone_surrogate_is_searchable() -> None:
    store = ArchiveStore(MemoryBackend())
    aid = store.put("bytes \ud800 then the word plum")
    got = page(store, "plum")
    assert ids_of(got) == [aid] and got.hits[0].shown[0][0] == store.get(aid).index("plum")


@pytest.mark.parametrize("pattern", [r"a{1000000}", r"(?:(?:a{1000}){1000}){1000}", r"(?:ab|cd){4000000000}",
                                     r"[a-z]{200}\d{200}"])
def test_a_regex_that_would_unroll_past_memory_is_refused_before_it_compiles(pattern: str) -> None:
    """The regex package unrolls counted repeats as it compiles, before any timeout: the second pattern
    took all the machine's memory, the third never returned."""
    store = ArchiveStore(MemoryBackend())
    store.put("a" * 100)
    answer = search_archive(store, {"query": pattern, "regex": True})
    assert answer.startswith("Error: the repeat counts of") and "+ or *" in answer
    assert ids_of(page(store, r"a{10}(?:a{2,5}){3}", regex=True)) != []  # small counts still compile


@pytest.mark.parametrize("query", ["nul \x00 here", "half \ud800 pair"])
def test_a_literal_query_sqlite_cannot_take_reads_every_text(tmp_path: Path, query: str) -> None:
    """A NUL ends an FTS5 string early ("unterminated string", and the index was rebuilt from nothing
    at each such search); SQLite cannot encode a lone surrogate: both raised out of the search."""
    store = ArchiveStore(tmp_path / "archive")
    aid = store.put(f"before {query} after")
    store.put("other text")
    got = page(store, "nul \x00 here")
    assert ids_of(got) == ([aid] if "\x00" in query else [])
    page(store, "half \ud800 pair")  # the index holds the surrogate as '?': no hit, and no error
    assert store.search_index.rebuilds == 0


def test_conversations_are_apart(tmp_path: Path) -> None:
    a = ArchiveStore(tmp_path / "a" / "archive")
    b = ArchiveStore(tmp_path / "b" / "archive")
    a.put("conversation A's secret: the launch code is 0000")
    b.put("conversation B's notes")
    assert page(b, "launch code").num_matching == 0 and page(b, "secret").num_texts == 1
    assert page(a, "launch code").num_matching == 1


# -- history dumps and the summary -------------------------------------------------------------------------

def test_history_dumps_are_searched_and_the_summary_says_so(tmp_path: Path) -> None:
    config = CompactConfig.preset("both", context_tokens=100_000, major={"enabled": False},
                                  minor={"enabled": False}, soft={"enabled": False})
    c = Compactor(Conversation([], id="t", system="You are terse."), config=config,
                  counter=load_counter("deepseek-v4"), template=get_template("deepseek-v4"),
                  session_dir=tmp_path / "session", durable=False)
    for k in range(6):
        c.append(Message(Role.USER, f"question {k}: what about the zebra-{k} module?", id=f"u{k}"))
        c.before_request()
        c.append(Message(Role.ASSISTANT, f"answer {k}: the zebra-{k} module is fine. " * 20, id=f"a{k}"))
    assert c.compact_now().applied
    summary = c.view[0].text
    assert 'search_archive("text") finds text in it' in summary
    got = page(c.store, "zebra-0 module")
    assert got.num_matching == 1 and got.hits[0].kind == "history dump"
    assert ids_of(got)[0] in summary  # the dump the summary points to


def test_a_literal_with_quotes_backslashes_or_line_breaks_is_found_in_a_history_dump(tmp_path: Path) -> None:
    """A history dump stores its messages as JSON lines: what the agent wrote as ``print("hi")`` is
    there as ``print(\\"hi\\")``. A literal search finds it as the agent wrote it (it found nothing)."""
    c = Compactor(Conversation([], id="t", system="You are terse."),
                  config=CompactConfig.preset("both", context_tokens=100_000, major={"enabled": False},
                                              minor={"enabled": False}, soft={"enabled": False}),
                  counter=load_counter("deepseek-v4"), template=get_template("deepseek-v4"),
                  session_dir=tmp_path / "session", durable=False)
    written = ['print("done")', "C:\\build\\out.log", "first line\nsecond line"]
    command = 'grep -n "DECL(pattern);" src/parser.c'  # in a tool call's JSON arguments: escaped twice
    for k, text in enumerate([*written, "carry on", "carry on", "carry on"]):
        c.append(Message(Role.USER, f"step {k}: {text}", id=f"u{k}"))
        c.before_request()
        call = ToolCall(id=f"c{k}", name="bash", arguments=json.dumps({"command": command}))
        c.append(Message(Role.ASSISTANT, f"noted step {k}. " * 40, id=f"a{k}", tool_calls=(call,)))
        c.append_tool_result(Message(Role.TOOL, "no match", id=f"t{k}", tool_call_id=f"c{k}", name="bash"))
    assert c.compact_now().applied
    assert page(c.store, command).num_matching == 1
    for text in written:
        got = page(c.store, text)
        assert got.num_matching == 1 and got.hits[0].kind == "history dump", text
        at = got.hits[0].shown[0][0]  # the offset read_archive takes: the stored form starts there
        assert c.store.get(got.hits[0].archive_id)[at:].startswith(json.dumps(text)[1:-1])


# -- the library's tool definitions and answer helper ------------------------------------------------------

def test_tool_definitions_in_both_shapes() -> None:
    openai, anthropic = search_archive_tool_openai(), search_archive_tool_anthropic()
    assert openai["type"] == "function" and openai["function"]["name"] == SEARCH_ARCHIVE
    assert anthropic["name"] == SEARCH_ARCHIVE and anthropic["input_schema"] == openai["function"]["parameters"]
    schema = anthropic["input_schema"]
    assert schema["required"] == ["query"] and schema["properties"]["limit"]["maximum"] == MAX_HITS
    assert [t["function"]["name"] for t in recall_tools_openai()] == [READ_ARCHIVE, SEARCH_ARCHIVE]
    assert [t["name"] for t in recall_tools_anthropic()] == [READ_ARCHIVE, SEARCH_ARCHIVE]


def test_the_answer_helper_answers_both_tools_and_every_mistake() -> None:
    store = ArchiveStore(MemoryBackend())
    aid = store.put("compile error in src/lib.rs line 12\n")
    found = answer_recall_call(store, ToolCall(id="s1", name=SEARCH_ARCHIVE, arguments=json.dumps({"query": "lib.rs"})))
    assert found.role is Role.TOOL and found.tool_call_id == "s1" and found.name == SEARCH_ARCHIVE
    assert not found.is_error and f"1. id={aid} tool output" in found.text
    read = answer_recall_call(store, ToolCall(id="r1", name=READ_ARCHIVE, arguments=json.dumps({"id": aid})))
    assert not read.is_error and read.text.startswith(f"[read_archive id={aid} chars 0-")
    for arguments, needle in [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"q": "x"}', "unknown argument(s) 'q'"),
        ('{"query": 5}', "query must be a string"),
        ('{"query": ""}', "query is empty"),
        ('{"query": "x", "regex": "yes"}', "regex must be true or false"),
        ('{"query": "x", "offset": -1}', "offset must be >= 0"),
        ('{"query": "x", "limit": 0}', "limit must be >= 1"),
    ]:
        answer = answer_recall_call(store, ToolCall(id="e", name=SEARCH_ARCHIVE, arguments=arguments))
        assert answer.is_error and needle in answer.text, (arguments, answer.text)
    other = answer_recall_call(store, ToolCall(id="o", name="bash", arguments="{}"))
    assert other.is_error and "neither 'read_archive' nor 'search_archive'" in other.text
