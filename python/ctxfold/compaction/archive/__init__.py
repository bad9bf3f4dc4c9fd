"""Minor compaction: bulky tool outputs move to a content-addressed archive the model can still read.

- :mod:`ctxfold.compaction.archive.store`: the per-conversation store (local directory or fsspec URL).
- :mod:`ctxfold.compaction.archive.marker`: the one-line marker that replaces an archived output.
- :mod:`ctxfold.compaction.archive.passes`: the turn-start pass, the mid-turn stage, the hard trigger's last
  resort, and the byte-exact restore.
- :mod:`ctxfold.compaction.archive.recall`: the ``read_archive`` tool, and :func:`answer_recall_call`, which
  answers either recall tool.
- :mod:`ctxfold.compaction.archive.search`: the ``search_archive`` tool, over the index of
  :mod:`ctxfold.compaction.archive.index`.
"""

from __future__ import annotations

from ctxfold.compaction.archive.marker import (
    MARKER_PREFIX,
    Marker,
    fold_preview,
    is_marker,
    make_marker,
    parse_marker,
)
from ctxfold.compaction.archive.passes import (
    ArchivedOutput,
    ArchiveParams,
    ArchivePass,
    ArchiveReport,
    OversizedResult,
    archive_mid_turn,
    archive_oversized,
    archive_turn_start,
    archive_whole,
    is_archived_text,
    restore,
    turn_start_cutoff,
)
from ctxfold.compaction.archive.recall import (
    DEFAULT_LIMIT_CHARS,
    MAX_LIMIT_CHARS,
    READ_ARCHIVE,
    RECALL_TOOLS,
    ArchiveSlice,
    answer_read_archive,
    answer_recall_call,
    read_archive,
    read_archive_tool_anthropic,
    read_archive_tool_openai,
    read_archive_tool_spec,
    read_slice,
    recall_tools_anthropic,
    recall_tools_openai,
)
from ctxfold.compaction.archive.search import (
    MAX_HITS,
    SEARCH_ARCHIVE,
    SearchHit,
    SearchResult,
    answer_search_archive,
    search,
    search_archive,
    search_archive_tool_anthropic,
    search_archive_tool_openai,
    search_archive_tool_spec,
)
from ctxfold.compaction.archive.store import (
    ArchiveId,
    ArchiveStore,
    Backend,
    FsspecBackend,
    LocalBackend,
    MemoryBackend,
    check_id,
    content_id,
    is_valid_id,
)

__all__ = [
    "DEFAULT_LIMIT_CHARS",
    "MARKER_PREFIX",
    "MAX_HITS",
    "MAX_LIMIT_CHARS",
    "READ_ARCHIVE",
    "RECALL_TOOLS",
    "SEARCH_ARCHIVE",
    "ArchiveId",
    "ArchiveParams",
    "ArchivePass",
    "ArchiveReport",
    "ArchiveSlice",
    "ArchiveStore",
    "ArchivedOutput",
    "Backend",
    "FsspecBackend",
    "LocalBackend",
    "Marker",
    "MemoryBackend",
    "OversizedResult",
    "SearchHit",
    "SearchResult",
    "answer_read_archive",
    "answer_recall_call",
    "answer_search_archive",
    "archive_mid_turn",
    "archive_oversized",
    "archive_turn_start",
    "archive_whole",
    "check_id",
    "content_id",
    "fold_preview",
    "is_archived_text",
    "is_marker",
    "is_valid_id",
    "make_marker",
    "parse_marker",
    "read_archive",
    "read_archive_tool_anthropic",
    "read_archive_tool_openai",
    "read_archive_tool_spec",
    "read_slice",
    "recall_tools_anthropic",
    "recall_tools_openai",
    "restore",
    "search",
    "search_archive",
    "search_archive_tool_anthropic",
    "search_archive_tool_openai",
    "search_archive_tool_spec",
    "turn_start_cutoff",
]
