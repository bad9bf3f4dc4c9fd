"""The records of compaction: what an attempt did (:class:`CompactionEvent`), what an append did, and
the hooks a user interface gets (:class:`Observer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ctxfold.chat.messages import Message
from ctxfold.compaction.cost import CompactionCost


class Observer(Protocol):
    """Hooks for user interfaces. Every method is optional to implement (see NullObserver)."""

    def compaction_started(self, reason: str, kind: str) -> None: ...
    def summary_token(self, text: str) -> None: ...
    def compaction_finished(self, event: CompactionEvent) -> None: ...
    def prefill_progress(self, done_tokens: int, total_tokens: int) -> None: ...


class NullObserver:
    def compaction_started(self, reason: str, kind: str) -> None:
        pass

    def summary_token(self, text: str) -> None:
        pass

    def compaction_finished(self, event: CompactionEvent) -> None:
        pass

    def prefill_progress(self, done_tokens: int, total_tokens: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class KvPlanFigures:
    """What an engine's KV cache keeps across one rewrite."""

    tokens_reused: int  # cached tokens kept as they are (exact common prefix, page-aligned)
    tokens_to_prefill: int  # tokens of the new request that must be computed again
    tokens_shift_reusable: int = 0  # of those, tokens an engine that can shift positions could move (approximate)
    exact: bool = False  # computed over token ids (True) or over per-message counts (False)


@dataclass(frozen=True, slots=True)
class ArchivedOutput:
    message_id: str  # id of the tool-result message that was archived
    archive_id: str  # content address in the archive store
    chars_before: int  # characters of the original output
    chars_after: int  # characters of the marker that replaced it


@dataclass(frozen=True, slots=True)
class CompactionEvent:
    """The record of one compaction attempt (applied or not)."""

    kind: str  # "archive" (minor), "summary" (major), "last_resort" (a result too big even after compaction)
    trigger: str  # "turn_start", "soft", "major", "mid_turn", "hard", "manual"
    reason: str  # human-readable reason, e.g. "soft limit before user turn"
    applied: bool  # False when the pass failed or would not have shrunk the conversation
    tokens_before: int  # occupancy before, reply reserve included
    tokens_after: int  # occupancy after (equal to before when not applied)
    archived: tuple[ArchivedOutput, ...] = ()
    summary: str | None = None
    summarizer: str | None = None  # which summarizer wrote the summary that was used
    summary_fallback: bool = False  # the configured summarizer failed and the extractive one stood in
    summary_failure: str | None = None  # why the configured summarizer failed
    summary_cut: str | None = None  # "token_cap", "control_boundary", ... when the summary was cut
    tail_start: int | None = None  # index in the old view where the verbatim tail starts
    tail_rule: str | None = None  # which rule chose the tail start
    tail_tokens: int = 0
    history_dump: str | None = None  # where the full-history dump of the rewrite is (on disk once the call returns)
    kv: KvPlanFigures | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # per phase wall time
    failure: str | None = None  # why nothing was applied
    # The window guard's step that ran (GUARD_STEPS), None for a policy pass. The guard runs when a
    # request would leave over the window; its last applied step is the one that made it fit.
    guard_step: str | None = None
    # What the compaction cost and what it is expected to save (ctxfold.compaction.cost): an applied
    # summary's, None for the other kinds.
    cost: CompactionCost | None = None


# The window guard's cascade, in order: each runs only while the request is still over the window.
GUARD_STEPS: tuple[str, ...] = (
    "archive_all",  # every tool output the archive can shrink, the newest too (markers the model reads back)
    "extractive_summary",  # a summary written without a model, with a tail under the trigger line
    "shorter_tail",  # the same with no tail: only what the model has not seen yet stays verbatim
    "oversized_message",  # single huge messages (a result, a pasted file, an agent's summary) archived
    "fold_newest",  # mid-turn: the turn's newest calls and results folded into the summary too
)


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Outcome of :meth:`Compactor.append_tool_result`."""

    appended: Message  # what was appended: the result, or a marker plus tool error
    fitted: bool  # the original result fits (possibly after compaction)
    events: tuple[CompactionEvent, ...] = ()

