"""The minor compaction passes: archive bulky tool outputs, leave a marker, restore exactly.

Every pass takes a message list and returns a new one (messages are immutable; untouched ones are the
same objects) plus a report. An archived message keeps its id, role, tool_call_id, name, is_error and
extra; only its content changes, so tool calls and results stay paired.

The order is fixed: decide on sizes first (the marker's length is known without hashing), write the
archive, and only once the write is durable put the marker in the conversation. A failed write leaves
the output inline and is reported; a crash at any point leaves the original output or a marker whose
archive is readable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ctxfold.chat.messages import Content, ContentPart, Message, Role
from ctxfold.compaction.archive.marker import (
    MARKER_PREFIX,
    PREVIEW_GAP,
    make_marker,
    make_oversized_notice,
    marker_chars,
    parse_marker,
    preview_matches,
)
from ctxfold.compaction.archive.store import ArchiveStore, content_id
from ctxfold.compaction.config import MinorConfig
from ctxfold.errors import ArchiveError, ConfigError, IntegrityError

Stage = Literal["turn_start", "mid_turn", "oversized"]
# Error outputs get twice the preview: the error line is what the model needs to see.
ERROR_PREVIEW_FACTOR = 2


@dataclass(frozen=True, slots=True)
class ArchiveParams:
    """The minor-compaction knobs (defaults from the Datus agent framework's minor compaction)."""

    keep_recent_user_turns: int = 4  # turn start: tool outputs of the newest N real user turns are kept
    archive_threshold_chars: int = 1000  # turn start: only outputs of at least this many chars are archived
    archive_preview_chars: int = 1000  # preview kept in the marker (twice this for error outputs)
    keep_recent_tool_results: int = 5  # mid-turn: the newest N tool outputs are never archived

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"minor.{f.name} = {value!r}: expected an integer >= 0")

    @classmethod
    def from_config(cls, minor: MinorConfig) -> ArchiveParams:
        """The knobs of a validated ``compact.minor`` section."""
        return cls(
            keep_recent_user_turns=minor.keep_recent_user_turns,
            archive_threshold_chars=minor.archive_threshold,
            archive_preview_chars=minor.archive_preview_chars,
            keep_recent_tool_results=minor.keep_recent_tool_results,
        )


@dataclass(frozen=True, slots=True)
class ArchivedOutput:
    """One output moved to the archive."""

    index: int  # position of the message in the list
    message_id: str  # Message.id
    archive_id: str  # sha256 of the archived text
    chars_before: int  # length of the archived text
    chars_after: int  # length of what replaced it (marker, plus the notice when oversized)
    part: int | None = None  # index of the text part archived; None when the content is a string


@dataclass(frozen=True, slots=True)
class ArchiveReport:
    """What one pass did."""

    stage: Stage  # which pass
    archived: tuple[ArchivedOutput, ...] = ()  # outputs replaced by a marker, in list order
    left_inline: tuple[str, ...] = ()  # ids of messages that qualified but stayed inline: the write failed
    error: str | None = None  # why they stayed inline (the store's write failure)

    @property
    def chars_before(self) -> int:
        return sum(a.chars_before for a in self.archived)

    @property
    def chars_after(self) -> int:
        return sum(a.chars_after for a in self.archived)

    @property
    def chars_saved(self) -> int:
        return self.chars_before - self.chars_after

    @property
    def archive_ids(self) -> frozenset[str]:
        return frozenset(a.archive_id for a in self.archived)


class ArchivePass(NamedTuple):
    messages: list[Message]  # the new list
    report: ArchiveReport


def preview_chars_for(message: Message, params: ArchiveParams) -> int:
    return params.archive_preview_chars * (ERROR_PREVIEW_FACTOR if message.is_error else 1)


def is_archived_text(text: str, store: ArchiveStore) -> bool:
    """Whether ``text`` is a marker of this store: marker syntax and an id the store says it holds
    (:meth:`ArchiveStore.exists`)."""
    if not text.startswith(MARKER_PREFIX):
        return False
    marker = parse_marker(text)
    return marker is not None and store.exists(marker.archive_id)


def _content_chars(content: Content) -> int:
    if isinstance(content, str):
        return len(content)
    # Counted the way Message.text joins parts, without building the joined string.
    texts = [len(p.text) for p in content if p.text is not None]
    return sum(texts) + max(len(texts) - 1, 0)


TokenCounter = Callable[[str], int]


class _Archiver:
    """Archives the text units (the string content, or each text part) of chosen messages."""

    def __init__(self, store: ArchiveStore, stage: Stage, count_tokens: TokenCounter | None = None,
                 tail_chars: int = 0) -> None:
        self.store = store
        self.stage = stage
        self.count_tokens = count_tokens
        self.tail_chars = tail_chars  # the preview's tail (head-and-tail markers), 0 for head only
        self.archived: list[ArchivedOutput] = []
        self.left_inline: list[str] = []
        self.error: ArchiveError | None = None

    def _candidate(self, text: str | None, min_chars: int, preview_chars: int) -> bool:
        """Whether a text unit would be archived: big enough, shrinks, and not a marker already."""
        if text is None:
            return False
        n = len(text)
        if n < min_chars or marker_chars(n, preview_chars + self.tail_chars + len(PREVIEW_GAP)) >= n:
            return False  # too small, or the marker would not be shorter (then nothing is written)
        return not is_archived_text(text, self.store)  # never archive a marker again

    def _unit(self, text: str, preview_chars: int) -> str | None:
        """The marker for one candidate unit, or None to keep it. Raises ArchiveError."""
        if self.count_tokens is not None:
            # Shorter in chars is not always cheaper in tokens (64 hex chars are ~33 tokens, a preview
            # of dense text can tokenize worse than the original's tail): check with the real counter
            # before anything is written.
            marker = make_marker(content_id(text), text, preview_chars, self.tail_chars)
            if self.count_tokens(marker) >= self.count_tokens(text):
                return None
        archive_id = self.store.put(text)
        return make_marker(archive_id, text, preview_chars, self.tail_chars)

    def message(self, index: int, m: Message, min_chars: int, preview_chars: int) -> Message:
        units = [m.content] if isinstance(m.content, str) else [p.text for p in m.content]
        chosen = [k for k, u in enumerate(units) if self._candidate(u, min_chars, preview_chars)]
        if not chosen:
            return m
        if self.error is not None:
            # The store failed earlier in this pass: keep the rest inline rather than retry per output.
            self.left_inline.append(m.id)
            return m
        markers: dict[int, str] = {}
        try:
            for k in chosen:
                unit = units[k]
                assert unit is not None  # a candidate has text
                marker = self._unit(unit, preview_chars)
                if marker is not None:
                    markers[k] = marker
        except ArchiveError as e:
            # Nothing of this message changes, even if some of its parts were written: those files are
            # complete and content-addressed, so a later pass reuses them instead of writing again.
            self.error = e
            self.left_inline.append(m.id)
            return m
        for k, marker in markers.items():
            text = units[k]
            assert text is not None
            self._record(index, m, text, marker, None if isinstance(m.content, str) else k)
        if isinstance(m.content, str):
            return dataclasses.replace(m, content=markers[0]) if markers else m
        parts = tuple(
            dataclasses.replace(p, text=markers[k]) if k in markers else p for k, p in enumerate(m.content)
        )
        return dataclasses.replace(m, content=parts) if markers else m

    def _record(self, index: int, m: Message, text: str, marker: str, part: int | None) -> None:
        aid = marker[len(MARKER_PREFIX) : len(MARKER_PREFIX) + 64]
        self.archived.append(ArchivedOutput(index, m.id, aid, len(text), len(marker), part))

    def report(self) -> ArchiveReport:
        return ArchiveReport(
            self.stage,
            tuple(self.archived),
            tuple(self.left_inline),
            None if self.error is None else str(self.error),
        )


def turn_start_cutoff(messages: Sequence[Message], keep_recent_user_turns: int) -> int:
    """Index of the ``keep_recent_user_turns``-th most recent real user turn; tool outputs before it
    are old enough to archive. -1 when there are not more than that many real user turns."""
    seen = 0
    first_kept = -1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.is_user_turn:
            seen += 1
            if seen == keep_recent_user_turns:
                first_kept = i
            elif seen > keep_recent_user_turns:
                return len(messages) if keep_recent_user_turns == 0 else first_kept
    return -1


def archive_turn_start(
    messages: Sequence[Message],
    store: ArchiveStore,
    params: ArchiveParams,
    *,
    count_tokens: TokenCounter | None = None,
) -> ArchivePass:
    """Turn start: with more than ``keep_recent_user_turns`` real user turns, archive every tool output
    of at least ``archive_threshold_chars`` that lies before the newest ``keep_recent_user_turns``
    turns, where its marker is shorter than it (and, given the model's ``count_tokens``, has fewer
    tokens).

    Cheap when there is nothing to do: one backward scan for the cutoff, then a length check per
    message; only outputs that will be archived are hashed or counted.
    """
    out = list(messages)
    archiver = _Archiver(store, "turn_start", count_tokens)
    cutoff = turn_start_cutoff(out, params.keep_recent_user_turns)
    threshold = params.archive_threshold_chars
    tool = Role.TOOL
    for i in range(max(cutoff, 0)):
        m = out[i]
        if m.role is not tool:
            continue
        c = m.content
        if (len(c) if isinstance(c, str) else _content_chars(c)) < threshold:
            continue
        out[i] = archiver.message(i, m, threshold, preview_chars_for(m, params))
    return ArchivePass(out, archiver.report())


def archive_mid_turn(
    messages: Sequence[Message],
    store: ArchiveStore,
    params: ArchiveParams,
    *,
    count_tokens: TokenCounter | None = None,
) -> ArchivePass:
    """Mid-turn archive stage: every tool output but the newest ``keep_recent_tool_results``, where the
    marker is shorter than the output (and, given ``count_tokens``, has fewer tokens). The caller
    decides when (occupancy >= the mid-turn threshold)."""
    out = list(messages)
    archiver = _Archiver(store, "mid_turn", count_tokens)
    tool_indexes = [i for i, m in enumerate(out) if m.role is Role.TOOL]
    keep = params.keep_recent_tool_results
    older = tool_indexes[: len(tool_indexes) - keep] if keep else tool_indexes
    for i in older:
        out[i] = archiver.message(i, out[i], 0, preview_chars_for(out[i], params))
    return ArchivePass(out, archiver.report())


def archive_whole(
    message: Message, store: ArchiveStore, *, head_chars: int, tail_chars: int,
    count_tokens: TokenCounter | None = None, index: int = 0,
) -> ArchivePass:
    """One message of any role but assistant (a huge tool result, a pasted file, another agent's
    summary) archived behind a marker with a head-and-tail preview, each text unit whole, where the
    marker is shorter (and, given ``count_tokens``, has fewer tokens). The window guard's last step:
    ``messages`` of the result is the one new message."""
    if message.role is Role.ASSISTANT:
        raise ValueError(f"message {message.id!r} is an assistant message: its calls must stay as written")
    archiver = _Archiver(store, "oversized", count_tokens, tail_chars=tail_chars)
    return ArchivePass([archiver.message(index, message, 0, head_chars)], archiver.report())


class OversizedResult(NamedTuple):
    message: Message  # the marker plus the tool error, or the input unchanged
    report: ArchiveReport
    fits: bool  # whether ``message`` is within the limit; False only when archiving failed


def archive_oversized(
    message: Message,
    store: ArchiveStore,
    *,
    max_chars: int | None = None,
    max_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
    preview_chars: int = 1000,
    index: int = 0,
) -> OversizedResult:
    """The hard trigger's last resort for one tool result that does not fit even after compaction.

    Give the room left as ``max_chars``, or as ``max_tokens`` with ``count_tokens`` (the model's own
    counter). When the result is larger, each of its text units is archived whole and replaced by its
    marker and a tool error telling the model to page through it with ``read_archive`` in pieces that
    fit; the message becomes ``is_error``. A result that fits comes back unchanged.
    If the archive cannot be written the message comes back unchanged with ``fits=False`` and the
    error in the report: the caller must not send it as is, and nothing has been dropped.
    """
    from ctxfold.compaction.archive.recall import MAX_LIMIT_CHARS

    if message.role is not Role.TOOL:
        raise ValueError(f"message {message.id!r} is a {message.role.value} message, not a tool result")
    if (max_chars is None) == (max_tokens is None):
        raise ValueError("give exactly one of max_chars or max_tokens")
    if max_tokens is not None and count_tokens is None:
        raise ValueError("max_tokens needs count_tokens, the model's token counter")
    limit = max_chars if max_chars is not None else max_tokens
    assert limit is not None
    if isinstance(limit, bool) or limit <= 0:
        raise ValueError(f"the size limit must be a positive integer, got {limit!r}")

    text = message.text
    size: Callable[[str], int] = len if max_chars is not None or count_tokens is None else count_tokens

    total = size(text)
    if total <= limit:
        return OversizedResult(message, ArchiveReport("oversized"), True)
    # Pieces of half the room: a piece plus the answer's header must fit beside the rest of the turn.
    chars_per_unit = 1.0 if max_chars is not None else len(text) / max(total, 1)
    piece_chars = max(1, min(MAX_LIMIT_CHARS, int(limit * chars_per_unit / 2)))
    limit_desc = f"{limit} characters" if max_chars is not None else f"{limit} tokens"
    preview = preview_chars * (ERROR_PREVIEW_FACTOR if message.is_error else 1)

    def replace_unit(unit: str, archive_id: str, preview_n: int) -> str:
        notice = make_oversized_notice(
            archive_id, len(unit), tool_error=message.is_error, limit_desc=limit_desc, piece_chars=piece_chars
        )
        return make_marker(archive_id, unit, preview_n) + "\n" + notice

    units = [message.content] if isinstance(message.content, str) else [p.text for p in message.content]
    try:
        ids = [None if u is None or len(u) == 0 else store.put(u) for u in units]
    except ArchiveError as e:
        rep = ArchiveReport("oversized", left_inline=(message.id,), error=str(e))
        return OversizedResult(message, rep, False)

    def build(preview_n: int) -> tuple[Content, list[ArchivedOutput]]:
        done: list[ArchivedOutput] = []
        new_units: list[str | None] = []
        whole = isinstance(message.content, str)
        for k, (u, aid) in enumerate(zip(units, ids, strict=True)):
            if u is None or aid is None:
                new_units.append(u)
                continue
            r = replace_unit(u, aid, preview_n)
            done.append(ArchivedOutput(index, message.id, aid, len(u), len(r), None if whole else k))
            new_units.append(r)
        if isinstance(message.content, str):
            return str(new_units[0]), done
        parts = tuple(
            p if p.text is None else dataclasses.replace(p, text=t)
            for p, t in zip(message.content, new_units, strict=True)
        )
        return parts, done

    content, done = build(preview)
    new = dataclasses.replace(message, content=content, is_error=True)
    if size(new.text) > limit:
        content, done = build(0)  # drop the preview before giving up on fitting
        new = dataclasses.replace(message, content=content, is_error=True)
    report = ArchiveReport("oversized", tuple(done))
    return OversizedResult(new, report, size(new.text) <= limit)


def restore(messages: Sequence[Message], store: ArchiveStore, *, strict: bool = False) -> list[Message]:
    """The conversation as it was before archiving: every marker whose archive resolves (and matches
    the marker's size and preview) expanded back to the exact original text; oversized results get
    their original ``is_error`` back.

    With ``strict``, a tool output with marker syntax that does not resolve raises IntegrityError
    naming the message and the archive id; otherwise it is left as text (it may be a tool output that
    only looks like a marker).

    The one case this cannot tell apart: a tool output that is, byte for byte, a valid marker of this
    same archive (a tool that printed one). It is expanded like a marker; the passes never produce it.
    """
    out = list(messages)
    for i, m in enumerate(out):
        if m.role is not Role.TOOL:
            continue
        if isinstance(m.content, str):
            if not m.content.startswith(MARKER_PREFIX):
                continue
            got = _expand(m.content, store, m, strict)
            if got is not None:
                out[i] = dataclasses.replace(m, content=got[0], is_error=got[1])
            continue
        parts: list[ContentPart] = []
        is_error = m.is_error
        changed = False
        for p in m.content:
            got = None if p.text is None or not p.text.startswith(MARKER_PREFIX) else _expand(p.text, store, m, strict)
            if got is None:
                parts.append(p)
                continue
            parts.append(dataclasses.replace(p, text=got[0]))
            is_error = got[1]
            changed = True
        if changed:
            out[i] = dataclasses.replace(m, content=tuple(parts), is_error=is_error)
    return out


def _expand(text: str, store: ArchiveStore, m: Message, strict: bool) -> tuple[str, bool] | None:
    marker = parse_marker(text)
    if marker is None:
        return None
    problem = None
    original = ""
    try:  # one read, not a test then a read: an archive may say it lacks what it has (JournalArchive.exists)
        original = store.get(marker.archive_id)
    except (KeyError, ValueError):
        problem = "is not in the archive"
    except (ArchiveError, IntegrityError) as e:
        problem = f"cannot be read: {e}"
    else:
        if len(original) != marker.chars or not preview_matches(original, marker.preview):
            problem = "does not match the marker's size and preview"
    if problem is not None:
        if strict:
            raise IntegrityError(f"message {m.id!r}: archive {marker.archive_id} {problem} ({store.location})")
        return None
    return original, (marker.tool_error if marker.oversized else m.is_error)
