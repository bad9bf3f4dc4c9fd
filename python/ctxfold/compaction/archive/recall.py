"""The model's recall tool: ``read_archive(id, offset=0, limit=...)`` over one conversation's archive.

Every mistake (unknown id, a path instead of an id, a bad offset, a wrong type, arguments that are not
JSON) comes back as tool-result text saying what was wrong and what to send instead; the agent loop
never sees an exception from here. The store is the conversation's own, so the tool cannot reach
another conversation's archive or any other file.

A slice is returned as one header line followed by the text verbatim (not JSON-escaped, so code and
logs read as they were):

    [read_archive id=<id> chars 0-10000 of 25000; more follows: next_offset=10000]
    <the text>
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ctxfold.chat.messages import Message, Role, ToolCall, ToolSpec
from ctxfold.compaction.archive.search import (
    MAX_ANSWER_CHARS,
    SEARCH_ARCHIVE,
    answer_search_archive,
    search_archive_tool_anthropic,
    search_archive_tool_openai,
)
from ctxfold.compaction.archive.store import ArchiveStore, is_valid_id
from ctxfold.errors import ArchiveError, IntegrityError

READ_ARCHIVE = "read_archive"
RECALL_TOOLS = frozenset({READ_ARCHIVE, SEARCH_ARCHIVE})  # the tools ctxfold offers and answers
DEFAULT_LIMIT_CHARS = 10_000  # about 2.5k tokens: a useful page that leaves room in a busy context
MAX_LIMIT_CHARS = 100_000

_DESCRIPTION = (
    "Read a tool output that was archived to save context. Archived outputs appear as a line starting "
    "with '[ctxfold archived id=<id> chars=<n>'. Pass that id; read long outputs in pieces with "
    "offset and limit (in characters), continuing from the next_offset each answer gives."
)
PARAMETERS_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "id": {
            "type": "string",
            "description": "The archive id: the 64 hex characters after 'id=' in the archive marker.",
            "pattern": "^[0-9a-f]{64}$",
        },
        "offset": {
            "type": "integer",
            "description": "Character offset to start reading from (default 0).",
            "minimum": 0,
            "default": 0,
        },
        "limit": {
            "type": "integer",
            "description": f"Most characters to return (default {DEFAULT_LIMIT_CHARS}, at most {MAX_LIMIT_CHARS}).",
            "minimum": 1,
            "maximum": MAX_LIMIT_CHARS,
            "default": DEFAULT_LIMIT_CHARS,
        },
    },
    "required": ["id"],
    "additionalProperties": False,
}


def read_archive_tool_spec() -> ToolSpec:
    return ToolSpec(name=READ_ARCHIVE, description=_DESCRIPTION, parameters=PARAMETERS_SCHEMA)


def read_archive_tool_openai() -> dict[str, Any]:
    """The tool definition in the OpenAI chat-completions ``tools`` format."""
    return {
        "type": "function",
        "function": {"name": READ_ARCHIVE, "description": _DESCRIPTION, "parameters": dict(PARAMETERS_SCHEMA)},
    }


def read_archive_tool_anthropic() -> dict[str, Any]:
    """The tool definition in the Anthropic Messages ``tools`` format."""
    return {"name": READ_ARCHIVE, "description": _DESCRIPTION, "input_schema": dict(PARAMETERS_SCHEMA)}


def recall_tools_openai() -> list[dict[str, Any]]:
    """Both recall tools, read_archive and search_archive, in the OpenAI chat-completions format."""
    return [read_archive_tool_openai(), search_archive_tool_openai()]


def recall_tools_anthropic() -> list[dict[str, Any]]:
    """Both recall tools in the Anthropic Messages format."""
    return [read_archive_tool_anthropic(), search_archive_tool_anthropic()]


@dataclass(frozen=True, slots=True)
class ArchiveSlice:
    """One answer of read_archive."""

    archive_id: str
    offset_chars: int  # where the slice starts
    text: str  # the slice, verbatim
    total_chars: int  # length of the whole archived text
    next_offset: int | None  # where the next slice starts; None when this one reaches the end

    def render(self) -> str:
        end = self.offset_chars + len(self.text)
        more = (
            f"more follows: next_offset={self.next_offset}" if self.next_offset is not None else "end of output"
        )
        return (
            f"[read_archive id={self.archive_id} chars {self.offset_chars}-{end} of {self.total_chars}; {more}]\n"
            + self.text
        )


def given_id(raw: str) -> str | None:
    """The archive id a read_archive call names in ``raw``, forgiving spaces, capitals and the 'id=' copied
    with it from a marker; None when it names none."""
    archive_id = raw.strip().lower().removeprefix("id=")
    return archive_id if is_valid_id(archive_id) else None


def read_slice(store: ArchiveStore, arguments: Mapping[str, Any]) -> ArchiveSlice | str:
    """The slice the arguments ask for, or an error string for the model."""
    unknown = sorted(set(arguments) - {"id", "offset", "limit"})
    if unknown:
        return f"Error: unknown argument(s) {', '.join(map(repr, unknown))}; read_archive takes id, offset, limit."
    raw_id = arguments.get("id")
    if not isinstance(raw_id, str):
        return (
            f"Error: id must be a string (the 64 hex characters after 'id=' in the archive marker), "
            f"got {type(raw_id).__name__}."
        )
    archive_id = given_id(raw_id)
    if archive_id is None:
        shown = raw_id if len(raw_id) <= 80 else raw_id[:77] + "..."
        return (
            f"Error: {shown!r} is not an archive id. Pass only the 64 hex characters after 'id=' in the "
            "archive marker, not a path or file name."
        )
    offset = arguments.get("offset", 0)
    limit = arguments.get("limit", DEFAULT_LIMIT_CHARS)
    for name, value, low in (("offset", offset, 0), ("limit", limit, 1)):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"Error: {name} must be an integer, got {value!r}."
        if value < low:
            return f"Error: {name} must be >= {low}, got {value}."
        if name == "offset":
            offset = value
        else:
            limit = min(value, MAX_LIMIT_CHARS)
    try:
        text = store.get(archive_id)
    except KeyError:
        return (
            f"Error: no archived output with id {archive_id} in this conversation. Copy the id from an "
            "'[ctxfold archived id=...' line of this conversation."
        )
    except (ArchiveError, IntegrityError) as e:
        return f"Error: the archive could not be read ({e}). Retrying will not help; work without it."
    if offset > len(text):
        return f"Error: offset {offset} is past the end: the output has {len(text)} characters."
    piece = text[offset : offset + limit]
    end = offset + len(piece)
    return ArchiveSlice(archive_id, offset, piece, len(text), end if end < len(text) else None)


def read_archive(store: ArchiveStore, arguments: Mapping[str, Any] | str) -> str:
    """The tool's answer text for ``arguments`` (a mapping, or the JSON string the model sent)."""
    return _answer(store, arguments)[0]


def _answer(store: ArchiveStore, arguments: Mapping[str, Any] | str) -> tuple[str, bool]:
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            return f"Error: the arguments are not valid JSON ({e}); send an object like {{\"id\": \"...\"}}.", True
        arguments = parsed
    if not isinstance(arguments, Mapping):
        return 'Error: the arguments must be a JSON object like {"id": "...", "offset": 0}.', True
    got = read_slice(store, arguments)
    if isinstance(got, str):
        return got, True
    return got.render(), False


def answer_read_archive(store: ArchiveStore, call: ToolCall, *, message_id: str = "") -> Message:
    """The tool-result message answering a ``read_archive`` call."""
    if call.name != READ_ARCHIVE:
        text, is_error = f"Error: {call.name!r} is not {READ_ARCHIVE!r}.", True
    else:
        text, is_error = _answer(store, call.arguments)
    return Message(
        role=Role.TOOL,
        content=text,
        id=message_id,
        tool_call_id=call.id,
        name=READ_ARCHIVE,
        is_error=is_error,
    )


def answer_recall_call(store: ArchiveStore, call: ToolCall, *, message_id: str = "",
                       max_search_chars: int = MAX_ANSWER_CHARS) -> Message:
    """The tool-result message answering a call of either recall tool (read_archive, search_archive);
    any other name is answered with an error naming the two. ``max_search_chars`` bounds a search's answer."""
    if call.name == SEARCH_ARCHIVE:
        return answer_search_archive(store, call, message_id=message_id, max_chars=max_search_chars)
    if call.name == READ_ARCHIVE:
        return answer_read_archive(store, call, message_id=message_id)
    return Message(role=Role.TOOL, content=f"Error: {call.name!r} is neither {READ_ARCHIVE!r} nor {SEARCH_ARCHIVE!r}.",
                   id=message_id, tool_call_id=call.id, name=call.name, is_error=True)
