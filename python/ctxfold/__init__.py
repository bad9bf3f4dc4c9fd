"""ctxfold: context compaction for LLM agents and the inference servers that run them."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ctxfold import _core
from ctxfold.chat.messages import ContentPart, Conversation, Message, Role, ToolCall, ToolSpec, Usage
from ctxfold.errors import (
    ArchiveError,
    ConfigError,
    CtxfoldError,
    FormatError,
    IntegrityError,
    TokenizerError,
)

try:
    __version__ = version("ctxfold")
except PackageNotFoundError:  # running from a source tree (PYTHONPATH=python)
    __version__ = "0.0.0+source"

__all__ = [
    "ArchiveError",
    "ConfigError",
    "ContentPart",
    "Conversation",
    "CtxfoldError",
    "FormatError",
    "IntegrityError",
    "Message",
    "Role",
    "TokenizerError",
    "ToolCall",
    "ToolSpec",
    "Usage",
    "__version__",
    "_core",
]
