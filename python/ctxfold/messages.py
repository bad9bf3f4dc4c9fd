"""The import path ``ctxfold.messages``, kept for users; the code lives in :mod:`ctxfold.chat.messages`."""

from ctxfold.chat.messages import (
    AGENT_FEEDBACK_OPENINGS,
    CTXFOLD_SUMMARY_KEY,
    IMPORTED_SUMMARY_KEY,
    IMPORTED_SUMMARY_OPENINGS,
    Content,
    ContentPart,
    Conversation,
    Message,
    Role,
    ToolCall,
    ToolSpec,
    Usage,
    as_parts,
    is_agent_feedback,
    is_imported_summary,
)

__all__ = [
    "AGENT_FEEDBACK_OPENINGS",
    "CTXFOLD_SUMMARY_KEY",
    "IMPORTED_SUMMARY_KEY",
    "IMPORTED_SUMMARY_OPENINGS",
    "Content",
    "ContentPart",
    "Conversation",
    "Message",
    "Role",
    "ToolCall",
    "ToolSpec",
    "Usage",
    "as_parts",
    "is_agent_feedback",
    "is_imported_summary",
]
