"""The import path ``ctxfold.config``, kept for users; the code lives in :mod:`ctxfold.compaction.config`."""

from ctxfold.compaction.config import (
    DEFAULT_REPLY_RESERVE_TOKENS,
    MAX_REPLY_RESERVE_TOKENS,
    POLICIES,
    SUMMARIZER_KINDS,
    CompactConfig,
    CostConfig,
    HardConfig,
    MajorConfig,
    MinorConfig,
    Policy,
    SoftConfig,
    SummarizerConfig,
    SummarizerKind,
    SummaryConfig,
    TailConfig,
    load_config,
)

__all__ = [
    "DEFAULT_REPLY_RESERVE_TOKENS",
    "MAX_REPLY_RESERVE_TOKENS",
    "POLICIES",
    "SUMMARIZER_KINDS",
    "CompactConfig",
    "CostConfig",
    "HardConfig",
    "MajorConfig",
    "MinorConfig",
    "Policy",
    "SoftConfig",
    "SummarizerConfig",
    "SummarizerKind",
    "SummaryConfig",
    "TailConfig",
    "load_config",
]
