"""The model's search tool: ``search_archive(query, regex=false, case_sensitive=false, offset=0, limit=10)``
over one conversation's archive: every archived tool output and every history dump (the conversation
before each summary), and nothing else. The store is the conversation's own (the proxy's is its
tenant's key's), so no query reaches another conversation's text.

A hit is one archived text that matches, with its id, its size, its number of matches and where the
first few lie (character offsets, the unit read_archive takes, each with a line of context), so the
model can read around a match with ``read_archive(id, offset)``. Hits are ranked by BM25 with the query
as one term: more matches in less text rank higher (k1 1.2, b 0.75, lengths in characters), ties by
more matches, then by id, so pages are stable. The answer is one header line and the hits as text:

    [search_archive "pytest" (literal, any case): 3 matching texts of 12; hits 1-3; end of results]
    1. id=<64 hex> tool output, 25000 chars, 7 matches
       at 1200: ... FAILED tests/test_io.py::test_read - AssertionError ...

Bounds, beside Codex's experimental history tools (literal search, 20 hits, 20,000 characters a read,
10,000 result tokens): at most :data:`MAX_HITS` (20) hits an answer, :data:`MAX_ANSWER_CHARS` (10,000)
characters an answer, :data:`MAX_QUERY_CHARS` (500) characters a query, :data:`MAX_MATCHES_COUNTED`
(1,000) matches counted a text, and :data:`SEARCH_BUDGET_S` (1 s) of matching a search; past the
budget the answer has what was found and says the search stopped. Literal queries use the standard
library's ``re`` on an escaped pattern, which cannot backtrack; regular expressions use the ``regex``
package (``pip install 'ctxfold[search]'``; the proxy's ``serve`` extra has it), whose matcher takes a
timeout and stops a catastrophic pattern such as ``(a|aa)+$`` when it runs out, which Python's ``re``
cannot do. Literal queries of three characters or more are narrowed by the index first.

Every mistake comes back as tool-result text saying what was wrong (as with read_archive); the agent
loop never sees an exception from here.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ctxfold.chat.messages import Message, Role, ToolCall, ToolSpec
from ctxfold.compaction.archive.store import ArchiveStore
from ctxfold.errors import ArchiveError

SEARCH_ARCHIVE = "search_archive"
DEFAULT_HITS = 10
MAX_HITS = 20  # Codex's history search: 20 hits
MAX_ANSWER_CHARS = 10_000  # one read_archive page's worth (about 2.5k tokens); Codex: 10,000 result tokens
MAX_QUERY_CHARS = 500
MAX_MATCHES_COUNTED = 1_000  # a text's matches past this count as this many: ranking saturates long before
MATCHES_SHOWN = 3  # locations shown per hit
CONTEXT_CHARS = 80  # characters shown on each side of a match
# Matching time for one search, all texts together. The regex package checks its clock as it backtracks,
# not at every step: measured on (a|aa)+$ and (a+)+$ over 20,000 'a's and a 'b', it stops within about
# twice its timeout (0.38-0.57 s for 0.25 s, 1.4-1.5 s for 1 s).
SEARCH_BUDGET_S = 1.0
# The regex package compiles a counted repeat by unrolling it: a{1000000} takes 270 MB and a second,
# (?:(?:a{1000}){1000}){1000} all the memory there is, before any timeout applies. The product of a
# pattern's repeat counts (nested or not: an upper bound on the unrolling) is held to this.
MAX_REPEAT_PRODUCT = 10_000
_COUNTED_REPEAT = re.compile(r"\{(\d*)(?:,(\d*))?\}")
_BM25_K1 = 1.2
_BM25_B = 0.75
_FOLD = str.maketrans({"\n": " ", "\r": " ", "\t": " "})

_DESCRIPTION = (
    "Search this conversation's archive: every tool output archived to save context and the full "
    "conversation before each summary. Returns the best-matching archived texts first, each with its "
    "id and the character offsets of its first matches; read around a match with read_archive(id, "
    f"offset). Literal text by default (any case); regex=true for a regular expression. At most {MAX_HITS} "
    "hits an answer: page on with the next_offset an answer gives."
)
PARAMETERS_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "query": {
            "type": "string",
            "description": "The text to find (or, with regex=true, a regular expression).",
            "minLength": 1,
            "maxLength": MAX_QUERY_CHARS,
        },
        "regex": {"type": "boolean", "description": "Treat query as a regular expression (default false).",
                  "default": False},
        "case_sensitive": {"type": "boolean", "description": "Match case exactly (default false).",
                           "default": False},
        "offset": {"type": "integer", "description": "Hits to skip: the next_offset of the previous answer "
                   "(default 0).", "minimum": 0, "default": 0},
        "limit": {"type": "integer", "description": f"Most hits to return (default {DEFAULT_HITS}, at most "
                  f"{MAX_HITS}).", "minimum": 1, "maximum": MAX_HITS, "default": DEFAULT_HITS},
    },
    "required": ["query"],
    "additionalProperties": False,
}


def search_archive_tool_spec() -> ToolSpec:
    return ToolSpec(name=SEARCH_ARCHIVE, description=_DESCRIPTION, parameters=PARAMETERS_SCHEMA)


def search_archive_tool_openai() -> dict[str, Any]:
    """The tool definition in the OpenAI chat-completions ``tools`` format."""
    return {"type": "function",
            "function": {"name": SEARCH_ARCHIVE, "description": _DESCRIPTION, "parameters": dict(PARAMETERS_SCHEMA)}}


def search_archive_tool_anthropic() -> dict[str, Any]:
    """The tool definition in the Anthropic Messages ``tools`` format."""
    return {"name": SEARCH_ARCHIVE, "description": _DESCRIPTION, "input_schema": dict(PARAMETERS_SCHEMA)}


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One archived text that matches."""

    archive_id: str
    kind: str  # "tool output" or "history dump"
    total_chars: int
    num_matches: int  # at most MAX_MATCHES_COUNTED
    score: float  # BM25, the query as one term
    shown: tuple[tuple[int, str], ...]  # (offset in characters, the match with its context) of the first matches


@dataclass(frozen=True, slots=True)
class SearchResult:
    """One answer of search_archive: the hits of one page, in rank order."""

    query: str
    regex: bool
    case_sensitive: bool
    hits: tuple[SearchHit, ...]  # this page's
    offset: int  # rank of the first hit of this page, from 0
    num_matching: int  # texts that match, every page together
    num_texts: int  # texts searched
    stopped: str | None  # why the search ended before every text was searched, if it did
    next_offset: int | None  # where the next page starts; None when this one reaches the end

    def render(self, max_chars: int = MAX_ANSWER_CHARS) -> str:
        """The answer text, at most ``max_chars`` (hits that do not fit go to the next page)."""
        lines: list[str] = []
        room = max_chars - 200 - len(json.dumps(self.query, ensure_ascii=False))  # the header, written last
        shown = 0
        for k, hit in enumerate(self.hits):
            block = _render_hit(self.offset + k + 1, hit)
            if len(block) + 1 > room:
                if k > 0 or room < 200:
                    break  # to the next page
                block = block[: room - 1]  # the first hit alone: shown cut rather than not at all
            lines.append(block)
            room -= len(block) + 1
            shown += 1
        next_offset = self.offset + shown if shown < len(self.hits) else self.next_offset
        mode = ("regex" if self.regex else "literal") + (", case-sensitive" if self.case_sensitive else ", any case")
        span = (f"hits {self.offset + 1}-{self.offset + shown}" if shown
                else "no room left in this answer to show hits" if self.hits else "no hits")
        more = f"more follows: next_offset={next_offset}" if next_offset is not None else "end of results"
        stopped = f"; stopped early: {self.stopped}" if self.stopped else ""
        header = (f"[search_archive {json.dumps(self.query, ensure_ascii=False)} ({mode}): {self.num_matching} "
                  f"matching texts of {self.num_texts}; {span}; {more}{stopped}]")
        return "\n".join([header, *lines])


def _render_hit(rank: int, hit: SearchHit) -> str:
    many = "+" if hit.num_matches >= MAX_MATCHES_COUNTED else ""
    head = (f"{rank}. id={hit.archive_id} {hit.kind}, {hit.total_chars} chars, "
            f"{hit.num_matches}{many} match{'es' if hit.num_matches != 1 else ''}")
    return "\n".join([head, *(f"   at {at}: {context}" for at, context in hit.shown)])


def search(store: ArchiveStore, query: str, *, regex: bool = False, case_sensitive: bool = False, offset: int = 0,
           limit: int = DEFAULT_HITS, budget_s: float = SEARCH_BUDGET_S) -> SearchResult | str:
    """The page of hits ``query`` finds in ``store``'s archive, or an error string for the model."""
    if not query:
        return "Error: query is empty; give the text to find."
    if len(query) > MAX_QUERY_CHARS:
        return f"Error: query has {len(query)} characters; at most {MAX_QUERY_CHARS}."
    pattern = _compile(query, regex, case_sensitive)
    if isinstance(pattern, str):
        return pattern
    try:
        num_texts = store.search_index.sync(store)
        if regex:
            rows = store.search_index.rows(None)
        else:  # texts that hold either form, in id order
            rows = sorted(dict(r for form in literal_forms(query) for r in store.search_index.rows(form)).items())
    except (ArchiveError, OSError) as e:
        return f"Error: the archive could not be searched ({e}). Retrying will not help; work without it."
    deadline = time.monotonic() + budget_s
    found: list[tuple[str, str, list[int], list[tuple[int, int]]]] = []  # id, text, [count], first spans
    stopped = None
    for done, (aid, text) in enumerate(rows):
        spans: list[tuple[int, int]] = []
        count = _matches(pattern, text, spans, deadline)
        if count is None:
            stopped = (f"the search took its {budget_s:g} s budget after {done} of {len(rows)} texts; "
                       "a simpler pattern searches them all")
            break
        if count:
            found.append((aid, text, [count], spans))
    avg_chars = max(1.0, sum(len(t) for _, t in rows) / max(1, len(rows)))
    ranked = sorted(found, key=lambda f: (-_bm25(f[2][0], len(f[1]), avg_chars), -f[2][0], f[0]))
    page = ranked[offset: offset + limit]
    hits = tuple(SearchHit(aid, _kind(text), len(text), n[0], round(_bm25(n[0], len(text), avg_chars), 4),
                           tuple((s, _context(text, s, e)) for s, e in spans)) for aid, text, n, spans in page)
    end = offset + len(page)
    return SearchResult(query, regex, case_sensitive, hits, offset, len(ranked), num_texts, stopped,
                        end if end < len(ranked) else None)


def literal_forms(query: str) -> tuple[str, ...]:
    """A literal query as the agent wrote it, and as a history dump holds it: the dump is JSON lines, so
    quotes, backslashes and line breaks in its messages are escaped once (``print("hi")`` is stored as
    ``print(\\"hi\\")``), and in a tool call's arguments, a JSON text inside the line, twice."""
    once = json.dumps(query, ensure_ascii=False)[1:-1]
    twice = json.dumps(once, ensure_ascii=False)[1:-1]
    return tuple(dict.fromkeys((query, once, twice)))


def _compile(query: str, regex: bool, case_sensitive: bool) -> Any:
    """The compiled pattern, or an error string."""
    if not regex:
        return re.compile("|".join(map(re.escape, literal_forms(query))), 0 if case_sensitive else re.IGNORECASE)
    try:
        import regex as regex_module
    except ImportError:
        return ("Error: regular-expression search is not installed here (it needs the regex package: pip install "
                "'ctxfold[search]'). Search for literal text instead (regex=false).")
    product = 1
    for low, high in _COUNTED_REPEAT.findall(query):
        product *= max(int(low or 0), int(high or 0), 1)
    if product > MAX_REPEAT_PRODUCT:
        return (f"Error: the repeat counts of {query!r} multiply to {product}; at most {MAX_REPEAT_PRODUCT}. "
                "Use + or * instead of large {n} counts.")
    flags = regex_module.MULTILINE | (0 if case_sensitive else regex_module.IGNORECASE)
    try:
        return regex_module.compile(query, flags)
    except (regex_module.error, ValueError, OverflowError, RecursionError) as e:
        return f"Error: {query!r} is not a valid regular expression ({e})."


def _matches(pattern: Any, text: str, spans: list[tuple[int, int]], deadline: float) -> int | None:
    """How many non-empty matches ``pattern`` has in ``text`` (at most MAX_MATCHES_COUNTED), the first
    MATCHES_SHOWN appended to ``spans``; None when the deadline passed. A ``regex`` pattern is given the
    time left as its timeout, which its matcher checks as it backtracks: a catastrophic pattern stops."""
    left_s = deadline - time.monotonic()
    if left_s <= 0:
        return None
    count = 0
    timed = not isinstance(pattern, re.Pattern)
    try:
        # concurrent: the regex package lets go of the GIL while it matches (the proxy's loop runs on)
        matches = pattern.finditer(text, concurrent=True, timeout=left_s) if timed else pattern.finditer(text)
        for m in matches:
            if m.end() == m.start():
                continue  # an empty match ("x*" between letters) finds nothing
            count += 1
            if len(spans) < MATCHES_SHOWN:
                spans.append((m.start(), m.end()))
            if count >= MAX_MATCHES_COUNTED:
                break
            if count % 64 == 0 and time.monotonic() > deadline:
                return None
    except TimeoutError:
        return None
    return count


def _bm25(tf: int, num_chars: int, avg_chars: float) -> float:
    """BM25's term weight for a query taken as one term (its idf is the same for every text of one
    search, so it is left out: it does not change the order)."""
    return tf * (_BM25_K1 + 1) / (tf + _BM25_K1 * (1 - _BM25_B + _BM25_B * num_chars / avg_chars))


def _kind(text: str) -> str:
    first = text[:200]
    return "history dump" if first.startswith('{"type": "header", "first_index"') else "tool output"


def _context(text: str, start: int, end: int) -> str:
    """The match with up to CONTEXT_CHARS on each side, line breaks folded; long matches are cut."""
    end = min(end, start + 2 * CONTEXT_CHARS)
    lo, hi = max(0, start - CONTEXT_CHARS), min(len(text), end + CONTEXT_CHARS)
    return ("..." if lo else "") + text[lo:hi].translate(_FOLD) + ("..." if hi < len(text) else "")


# -- the tool's answer -----------------------------------------------------------------------------------

def search_archive(store: ArchiveStore, arguments: Mapping[str, Any] | str, *,
                   max_chars: int = MAX_ANSWER_CHARS) -> str:
    """The tool's answer text for ``arguments`` (a mapping, or the JSON string the model sent), at most
    ``max_chars`` characters."""
    return _answer(store, arguments, max_chars)[0]


def _answer(store: ArchiveStore, arguments: Mapping[str, Any] | str, max_chars: int) -> tuple[str, bool]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            return f'Error: the arguments are not valid JSON ({e}); send an object like {{"query": "..."}}.', True
    if not isinstance(arguments, Mapping):
        return 'Error: the arguments must be a JSON object like {"query": "...", "offset": 0}.', True
    unknown = sorted(set(arguments) - set(PARAMETERS_SCHEMA["properties"]))
    if unknown:
        return (f"Error: unknown argument(s) {', '.join(map(repr, unknown))}; search_archive takes query, regex, "
                "case_sensitive, offset, limit."), True
    query = arguments.get("query")
    if not isinstance(query, str):
        return f"Error: query must be a string, got {type(query).__name__}.", True
    options: dict[str, Any] = {}
    for name in ("regex", "case_sensitive"):
        value = arguments.get(name, False)
        if not isinstance(value, bool):
            return f"Error: {name} must be true or false, got {value!r}.", True
        options[name] = value
    for name, default, low in (("offset", 0, 0), ("limit", DEFAULT_HITS, 1)):
        value = arguments.get(name, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"Error: {name} must be an integer, got {value!r}.", True
        if value < low:
            return f"Error: {name} must be >= {low}, got {value}.", True
        options[name] = min(value, MAX_HITS) if name == "limit" else value
    got = search(store, query, **options)
    if isinstance(got, str):
        return got, True
    return got.render(min(max_chars, MAX_ANSWER_CHARS)), False


def answer_search_archive(store: ArchiveStore, call: ToolCall, *, message_id: str = "",
                          max_chars: int = MAX_ANSWER_CHARS) -> Message:
    """The tool-result message answering a ``search_archive`` call."""
    if call.name != SEARCH_ARCHIVE:
        text, is_error = f"Error: {call.name!r} is not {SEARCH_ARCHIVE!r}.", True
    else:
        text, is_error = _answer(store, call.arguments, max_chars)
    return Message(role=Role.TOOL, content=text, id=message_id, tool_call_id=call.id, name=SEARCH_ARCHIVE,
                   is_error=is_error)
