"""Segment flags of the C++ ledger (``cpp/include/ctxfold/core/ledger.hpp``), and how messages map to them."""

from __future__ import annotations

import enum

from ctxfold.chat.messages import Message, Role


class SegmentFlag(enum.IntFlag):
    """Bits of a ledger segment. Values mirror ``ctxfold::SegmentFlag``; keep them in sync."""

    SYSTEM = 1 << 0  # system prompt or tool definitions: never part of a tail
    USER = 1 << 1  # any user-role message
    USER_TURN = 1 << 2  # a real user turn: not a queued insert, resume message or tool result
    ASSISTANT = 1 << 3  # assistant message
    TOOL_CALL = 1 << 4  # assistant message that carries tool calls
    TOOL_RESULT = 1 << 5  # tool result
    THINKING = 1 << 6  # carries thinking / reasoning
    QUEUED = 1 << 7  # user message queued while a turn was running
    RESUME = 1 << 8  # synthetic resume/continue instruction
    ERROR = 1 << 9  # tool result that reports an error
    SUMMARY = 1 << 10  # a compaction summary
    ARCHIVED = 1 << 11  # tool result replaced by an archive marker


def message_flags(m: Message) -> SegmentFlag:
    """The ledger flags of one message. ARCHIVED is the archive pass's to set: it knows its markers."""
    f = SegmentFlag(0)
    if m.role is Role.USER:
        f |= SegmentFlag.USER
        if m.is_user_turn:
            f |= SegmentFlag.USER_TURN
        if m.queued:
            f |= SegmentFlag.QUEUED
        if m.resume:
            f |= SegmentFlag.RESUME
    elif m.role is Role.ASSISTANT:
        f |= SegmentFlag.ASSISTANT
        if m.tool_calls:
            f |= SegmentFlag.TOOL_CALL
    elif m.role is Role.TOOL:
        f |= SegmentFlag.TOOL_RESULT
        if m.is_error:
            f |= SegmentFlag.ERROR
    else:
        f |= SegmentFlag.SYSTEM
    if m.reasoning:
        f |= SegmentFlag.THINKING
    if m.summary:
        # A summary belongs to the fixed prefix of a compacted view: a later tail never reaches
        # back into it, since the next summary covers it.
        f |= SegmentFlag.SUMMARY | SegmentFlag.SYSTEM
    return f
