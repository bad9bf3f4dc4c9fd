"""The import path ``ctxfold.tail``, kept for users; the code lives in :mod:`ctxfold.core.tail`."""

from ctxfold.core.tail import (
    DEFAULT_MIN_FILL,
    NO_TAIL,
    RAW_CUT,
    Boundary,
    SegmentCut,
    SegmentTail,
    TailRule,
    TokenTail,
    WidenedTail,
    align_down_to_page,
    select_cut,
    select_tail,
    select_tail_from_ledger,
    select_token_tail,
    widen_tail,
    widened_preview_chars,
)

__all__ = [
    "DEFAULT_MIN_FILL",
    "NO_TAIL",
    "RAW_CUT",
    "Boundary",
    "SegmentCut",
    "SegmentTail",
    "TailRule",
    "TokenTail",
    "WidenedTail",
    "align_down_to_page",
    "select_cut",
    "select_tail",
    "select_tail_from_ledger",
    "select_token_tail",
    "widen_tail",
    "widened_preview_chars",
]
