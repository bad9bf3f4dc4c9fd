"""The import path ``ctxfold.compactor``, kept for users; the code lives in :mod:`ctxfold.compaction.compactor`."""

from ctxfold.compaction.compactor import (
    GUARD_STEPS,
    MIN_SHIFT_TOKENS,
    SAMPLE_ARCHIVE_ID,
    SUMMARY_ACKNOWLEDGEMENT,
    AppendResult,
    ArchivedOutput,
    AsyncCompactor,
    CompactionEvent,
    Compactor,
    KvPlanFigures,
    NullObserver,
    Observer,
    frame_summary,
    keep_turns_alternating,
    resume_message,
)

__all__ = [
    "GUARD_STEPS",
    "MIN_SHIFT_TOKENS",
    "SAMPLE_ARCHIVE_ID",
    "SUMMARY_ACKNOWLEDGEMENT",
    "AppendResult",
    "ArchivedOutput",
    "AsyncCompactor",
    "CompactionEvent",
    "Compactor",
    "KvPlanFigures",
    "NullObserver",
    "Observer",
    "frame_summary",
    "keep_turns_alternating",
    "resume_message",
]
