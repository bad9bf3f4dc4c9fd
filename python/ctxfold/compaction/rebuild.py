"""The messages ctxfold writes into a rebuilt view (the framed summary, the acknowledgement a template
that wants alternating turns needs, the resume instruction) and the rules a rebuild keeps (a call group
still waiting for its results stays whole). No counting, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ctxfold.chat.messages import Message, Role
from ctxfold.compaction.summarize import FRAME_CLOSE, FRAME_OPEN, SUMMARY_TEXT_KEY


@dataclass(frozen=True, slots=True)
class Summary:
    """A summary as a pass applies it."""

    text: str
    summarizer: str
    cut_reason: str
    fallback_from: str | None  # why the configured summarizer was not used, when the extractive one stood in


# A marker's header alone (the 64-hex id and the recall hint), in tokens, at least.
MARKER_MIN_TOKENS = 40
# An archive id as a marker or the summary frame's pointer shows one, to size them before anything is
# written: hex digits of a sha256, which tokenize worse than text (about two characters a token).
SAMPLE_ARCHIVE_ID = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def frame_summary(summary: str, history_id: str | None) -> str:
    """The summary as the rebuilt view shows it: framed, with a pointer to the full history."""
    pointer = (f'The conversation before this summary is archived: read_archive("{history_id}") gives it '
               "(JSON lines, one message each; the first line names the earlier part, if any); "
               'search_archive("text") finds text in it, in earlier parts and in every archived tool output.\n'
               if history_id else "")
    # Frames never nest, whatever a summary holds: lines of an earlier frame inside it are dropped.
    body = "\n".join(line for line in summary.rstrip().splitlines()
                     if not line.lstrip().startswith(("[ctxfold compacted ", "[End of summary.")))
    return f"{FRAME_OPEN}\n{body}\n{pointer}{FRAME_CLOSE}"


def open_call_group(view: Sequence[Message], end: int) -> int:
    """Index of the assistant message whose calls are still waiting for results in view[:end]
    (the group is open at ``end``), else -1."""
    answered: set[str | None] = set()
    for i in range(end - 1, -1, -1):
        m = view[i]
        if m.role is Role.TOOL:
            answered.add(m.tool_call_id)
        elif m.role is Role.ASSISTANT:
            return i if any(c.id not in answered for c in m.tool_calls) else -1
        # A user message can sit between a call and its results (queued, or typed meanwhile): go on.
    return -1


def keep_turns_alternating(view: list[Message], origins: list[int], n: int) -> None:
    """For a template that wants user and assistant turns to alternate: where a user message ctxfold
    wrote (the summary, the resume instruction) meets another user message, an acknowledgement in the
    assistant's turn goes between them. Part of the summary (flagged so: it is no turn, no tail reaches
    into it, and a later summary carries nothing of it). In place, ``origins`` beside ``view``."""
    i = 1
    while i < len(view):
        if (view[i - 1].role is Role.USER and view[i].role is Role.USER
                and (origins[i - 1] < 0 or origins[i] < 0)):
            view.insert(i, Message(Role.ASSISTANT, SUMMARY_ACKNOWLEDGEMENT, id=f"ctxfold-summary-{n}-ack-{i}",
                                   summary=True, extra={SUMMARY_TEXT_KEY: ""}))
            origins.insert(i, -1)
        i += 1


SUMMARY_ACKNOWLEDGEMENT = "Understood. I will continue from the summary above."


def resume_message(n: int) -> Message:
    """The hidden instruction that ends a mid-turn rebuild, so the model resumes the task."""
    return Message(
        Role.USER,
        "[ctxfold] The conversation above was compacted while you were working. Continue the task from the "
        "summary exactly where it left off: do not ask the user to confirm, do not repeat completed work, and "
        "do not mention the compaction.",
        id=f"ctxfold-resume-{n}", resume=True,
    )
