"""Sessions: one directory per conversation, so compaction is durable and lossless.

Layout::

    <session_dir>/
      events.jsonl          append-only event log (header, appended messages, views, state)
      history/NNNNNN-<sha256>.jsonl   full-history dumps, written before every rewrite
      archive/              the archive store of archived tool outputs (ctxfold.archive)

The event log is the source of truth. Every original message is logged once, in order, as it is
appended; a compaction logs the new view as references to those originals plus the messages it
wrote (summary, markers, resume instruction). So:

- restore = the originals in log order: the full history, byte for byte, through any number of
  compactions;
- resume = the last view plus every original appended after it, and the last saved state.

Each event is one line, written by a single ``write`` on an ``O_APPEND`` descriptor (a batch of
appended messages: one ``write`` for all) and fsynced (unless ``durable=False``; with
``fsync_appends=False`` the header and appended messages wait for the next fsynced event). A
process killed mid-write leaves at most one torn last line, which
resume ignores and the next append cuts off, so a session is always the old view or the new one,
never a mix. History dumps are written whole to a temporary name and renamed into place before the
view event that points at them is logged (write-ahead).
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from ctxfold import fastjson
from ctxfold.archive.store import LocalBackend, make_private_dir, refuse_symlink
from ctxfold.codec import (
    decode_conversation_header,
    decode_message,
    encode_conversation_header,
    encode_message,
)
from ctxfold.errors import FormatError
from ctxfold.messages import Conversation, Message

EVENTS_FILE = "events.jsonl"
HISTORY_DIR = "history"
ARCHIVE_DIR = "archive"
LOG_VERSION = 1


def _open_log(path: Path, flags: int) -> int:
    """``os.open`` of an event log: mode 0600 (it holds a user's conversation), and never through a
    symbolic link (O_NOFOLLOW), which a write would follow to a file of the link's choosing."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_symlink(path)
        raise


@dataclass(frozen=True, slots=True)
class ViewEntry:
    """One message of a view: an original by its index in the log, or a message compaction wrote."""

    origin: int  # index of the original message this entry shows (or stands for), -1 for synthetic ones
    message: Message | None = None  # None: the original itself, unchanged


@dataclass(slots=True)
class ResumedState:
    """What :meth:`Session.load` returns."""

    conversation: Conversation  # header of the conversation with its current view as messages
    originals: list[Message]  # every message ever appended, in order
    view_origins: list[int]  # per view message: its original's index, -1 for synthetic messages
    state: dict[str, Any] = field(default_factory=dict)  # compactor state saved with the last event
    num_compactions: int = 0
    torn_lines: int = 0  # lines ignored because a write was cut off
    # With salvage: (line number, why) of each line left out because it could not be read.
    skipped: list[tuple[int, str]] = field(default_factory=list)


def history_dump_text(messages: Sequence[Message], conversation: Conversation, *, first_index: int = 0,
                      previous: str | None = None) -> str:
    """A history dump: a header line (the conversation, where this part starts, the part before
    it), then one message a line. Deterministic: no clock in it. Encodable as UTF-8 (see
    :func:`fastjson.dumps_text`)."""
    header = {"type": "header", "first_index": first_index, "previous": previous,
              "conversation": encode_conversation_header(conversation)}
    return "".join(fastjson.dumps_text(line, separators=None) + "\n" for line in [header, *map(encode_message, messages)])


class Session:
    """The directory of one conversation. Not thread-safe: the compactor that owns it serialises access."""

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True, fsync_appends: bool = True) -> None:
        self.root = Path(root)
        self.events_path = self.root / EVENTS_FILE
        self.durable = durable  # fsync events (dumps are always durable); off for replays and benchmarks
        # With durable, fsync the header and appended messages too. Off where they have another durable
        # home (the proxy: the client sends its whole history with every request): they are then
        # written (a killed process loses nothing) and made durable by the next fsynced event (a
        # compaction).
        self.fsync_appends = fsync_appends
        self._fd: int | None = None
        self._num_originals = 0
        self._seq = 0
        # The log's size in bytes while this object holds it open for writing (measured once at the
        # opening, then counted write by write); None otherwise. The proxy's memory bound reads it
        # after every request: counting spares a stat system call per request.
        self.log_nbytes: int | None = None

    # -- paths ------------------------------------------------------------------------------------
    @property
    def history_dir(self) -> Path:
        return self.root / HISTORY_DIR

    @property
    def archive_dir(self) -> Path:
        return self.root / ARCHIVE_DIR

    def exists(self) -> bool:
        return self.events_path.is_file()

    # -- writing ----------------------------------------------------------------------------------
    def create(self, conversation: Conversation) -> None:
        """Start a new session for ``conversation`` (its header; messages are appended one by one)."""
        make_private_dir(self.root)
        try:  # O_EXCL: a new log, so no torn tail to cut (see _open), and no race with another creator
            self._fd = _open_log(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)
            self.log_nbytes = 0
        except FileExistsError:
            raise FileExistsError(f"{self.events_path}: a session already exists here; resume it with "
                                  "Session.load()") from None
        # The header (system prompt, tools) is what the owner sends again too: synced like the appends.
        self._write_event({"type": "header", "version": LOG_VERSION,
                           "conversation": encode_conversation_header(conversation)}, sync=self.fsync_appends)

    def append_messages(self, messages: Iterable[Message]) -> None:
        """Log original messages, in order: one event per message, all in one write (all or none)."""
        events = [{"type": "append", "index": self._num_originals + k, "message": encode_message(m)}
                  for k, m in enumerate(messages)]
        if events:
            self._write_events(events, sync=self.fsync_appends)
            self._num_originals += len(events)

    def write_history_dump(self, messages: Sequence[Message], conversation: Conversation, *,
                           first_index: int = 0, previous: str | None = None) -> Path:
        """Write history as JSONL under history/ (atomically) and return its path.

        A dump holds the originals ``first_index`` onwards; its header line names the dump before
        it (``previous``), so each compaction writes only what came since the last one and the
        dumps together hold the whole history. The name is a sequence number and the content's
        sha256: deterministic (a replay is reproducible to the token, since the summary quotes it),
        and two different dumps never share one.
        """
        text = history_dump_text(messages, conversation, first_index=first_index, previous=previous)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        existing = sum(1 for _ in self.history_dir.glob("*.jsonl")) if self.history_dir.is_dir() else 0
        path = self.history_dir / f"{existing:06d}-{digest}.jsonl"
        LocalBackend(self.history_dir).write_atomic(path.name, text.encode())
        return path

    def log_view(self, view: Sequence[ViewEntry], *, kind: str, reason: str, dump: Path | None,
                 state: dict[str, Any], figures: dict[str, Any] | None = None) -> None:
        """Log a rewrite of the view. The view entries must refer to originals already logged."""
        entries: list[dict[str, Any]] = []
        for e in view:
            if e.origin >= self._num_originals:
                raise ValueError(f"view entry refers to original {e.origin}, but only {self._num_originals} are logged")
            if e.message is None:
                entries.append({"ref": e.origin})
            else:
                entries.append({"origin": e.origin, "message": encode_message(e.message)})
        self._write_event({
            "type": "view", "kind": kind, "reason": reason,
            "dump": dump.relative_to(self.root).as_posix() if dump is not None else None,
            "view": entries, "state": state, "figures": figures or {},
        })

    def log_state(self, state: dict[str, Any]) -> None:
        """Log compactor state (breaker, occupancy) that changed without a rewrite."""
        self._write_event({"type": "state", "state": state})

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.log_nbytes = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> int:
        if self._fd is None:
            make_private_dir(self.root)
            self._cut_torn_tail()
            self._fd = _open_log(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            self.log_nbytes = os.fstat(self._fd).st_size
        return self._fd

    def _cut_torn_tail(self) -> None:
        """Drop a last line cut off by a crash so the next event starts on a line of its own."""
        try:
            with os.fdopen(_open_log(self.events_path, os.O_RDWR), "rb+") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                if size == 0:
                    return
                f.seek(size - 1)
                if f.read(1) == b"\n":
                    return
                # Walk back to the previous newline; the events are small, read the tail in blocks.
                pos = size
                while pos > 0:
                    step = min(65536, pos)
                    f.seek(pos - step)
                    block = f.read(step)
                    nl = block.rfind(b"\n")
                    if nl >= 0:
                        f.truncate(pos - step + nl + 1)
                        return
                    pos -= step
                f.truncate(0)
        except FileNotFoundError:
            return

    def _write_event(self, event: dict[str, Any], *, sync: bool = True) -> None:
        self._write_events([event], sync=sync)

    def _write_events(self, events: list[dict[str, Any]], *, sync: bool = True) -> None:
        data = b"".join(fastjson.dumps_record({"seq": self._seq + k, **e}) + b"\n" for k, e in enumerate(events))
        fd = self._open()
        written = os.write(fd, data)
        if written != len(data):
            # A short write on a full disk: take the part back, so the log holds the whole batch or
            # none of it (memory, updated after the log, holds none of it either).
            os.ftruncate(fd, os.fstat(fd).st_size - written)
            self.close()
            raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes); disk full?",
                          str(self.events_path))
        if self.log_nbytes is not None:
            self.log_nbytes += written
        if self.durable and sync:
            os.fsync(fd)
        self._seq += len(events)

    # -- reading ----------------------------------------------------------------------------------
    def iter_events(self, *, skipped: list[tuple[int, str]] | None = None
                    ) -> Iterator[tuple[int, dict[str, Any] | None]]:
        """(line number, event) for each line; event None for a torn last line. A line that is not a
        JSON object raises FormatError, or, given ``skipped``, is left out and noted there."""
        with open(self.events_path, "rb") as f:
            lines = f.read().split(b"\n")
        last = len(lines) - 1  # after the final "\n" comes an empty string; anything else is torn
        for i, raw in enumerate(lines):
            if i == last:
                if raw:
                    yield i + 1, None
                return
            try:
                event = fastjson.loads(raw)
                why = None if isinstance(event, dict) else f"a JSON {type(event).__name__}, not an event object"
            except ValueError as exc:
                why = _short(exc)
            if why is None:
                yield i + 1, event
            elif skipped is None:
                raise FormatError(f"corrupt event log line: {why}", source=str(self.events_path),
                                  location=f"line {i + 1}")
            else:
                skipped.append((i + 1, f"not an event (JSON object): {why}"))

    def load(self, *, salvage: bool = False) -> ResumedState:
        """Read the log: the current view, every original, and the last saved state.

        A line that cannot be read raises FormatError. With ``salvage``, it is left out instead and
        noted in :attr:`ResumedState.skipped` (line number, why), so every readable record comes back:
        a lost append loses that message alone; a lost or unreadable view leaves the view as the
        originals after the last readable one (a view is always rebuilt from references, so one that
        refers to what is missing is dropped too)."""
        if not self.exists():
            raise FileNotFoundError(f"{self.events_path}: no session here (expected {EVENTS_FILE})")
        header: dict[str, Any] | None = None
        originals: list[Message] = []
        last_view: tuple[list[dict[str, Any]], str] | None = None  # None: no rewrite yet, the view is every original
        view_len_at = 0  # originals logged when the last view was written
        state: dict[str, Any] = {}
        compactions = 0
        torn = 0
        seq = 0
        skipped: list[tuple[int, str]] | None = [] if salvage else None
        next_index = 0  # the index the next append should carry: a gap is a lost message
        for line, event in self.iter_events(skipped=skipped):
            if event is None:
                torn += 1
                continue
            where = f"line {line}"
            try:
                kind = event.get("type")
                if kind == "header":
                    header = dict(event["conversation"])
                elif kind == "append":
                    index = int(event.get("index", next_index))
                    if skipped is not None and index > next_index:  # said once per gap
                        skipped.append((line, f"{index - next_index} message(s) before this one are missing"))
                    originals.append(decode_message(event["message"], where=f"{self.events_path}, {where}"))
                    next_index = index + 1
                elif kind == "view":
                    last_view = (list(event["view"]), where)  # only the last view matters: decoded after the loop
                    view_len_at = len(originals)
                    state = dict(event.get("state") or {})
                    compactions += 1
                elif kind == "state":
                    state = dict(event.get("state") or {})
                else:
                    raise FormatError(f"unknown event type {kind!r}", source=str(self.events_path), location=where)
                seq = int(event.get("seq", seq)) + 1
            except (FormatError, KeyError, TypeError, ValueError) as exc:
                if skipped is None:
                    if isinstance(exc, FormatError):
                        raise
                    raise FormatError(f"malformed {event.get('type')!r} event: {_short(exc)}",
                                      source=str(self.events_path), location=where) from exc
                skipped.append((line, f"unreadable {event.get('type')!r} event: {_short(exc)}"))
        if header is None:
            if skipped is None:
                raise FormatError("event log has no header", source=str(self.events_path), location="line 1")
            skipped.append((1, "no readable header: the system prompt and tools are unknown"))
            header = {}
        entries: list[ViewEntry] | None = None
        if last_view is not None:
            raw, where = last_view
            try:
                entries = [ViewEntry(origin=int(e["ref"])) if "ref" in e
                           else ViewEntry(origin=int(e["origin"]), message=decode_message(e["message"], where=where))
                           for e in raw]
                view_line = int(where.removeprefix("line "))
                if skipped and any(line < view_line for line, _ in skipped):
                    # A message lost before it shifts every later index: its references cannot be trusted.
                    raise FormatError("lines before it were left out", source=str(self.events_path), location=where)
                if any(e.message is None and not 0 <= e.origin < view_len_at for e in entries):
                    raise FormatError("the view refers to a message that is not logged before it",
                                      source=str(self.events_path), location=where)
            except (FormatError, KeyError, TypeError, ValueError) as exc:
                if skipped is None:
                    raise
                skipped.append((int(where.removeprefix("line ")), f"view left out: {_short(exc)}"))
                entries, view_len_at = None, 0
        if entries is None:
            entries = [ViewEntry(origin=i) for i in range(view_len_at, len(originals))]
        else:
            entries += [ViewEntry(origin=i) for i in range(view_len_at, len(originals))]
        messages = [originals[e.origin] if e.message is None else e.message for e in entries]
        self._num_originals = len(originals)
        self._seq = seq
        return ResumedState(
            conversation=decode_conversation_header(header, messages),
            originals=originals,
            view_origins=[e.origin for e in entries],
            state=state,
            num_compactions=compactions,
            torn_lines=torn,
            skipped=skipped or [],
        )

    def restore(self, *, salvage: bool = False) -> Conversation:
        """The full original conversation, as it was appended, through any number of compactions.
        ``salvage``: every readable message, leaving out what cannot be read (see :meth:`load`)."""
        resumed = self.load(salvage=salvage)
        conv = resumed.conversation
        conv.messages = resumed.originals
        return conv


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__
