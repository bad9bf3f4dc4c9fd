"""A session's event log: its records written, read back, folded and salvaged. One codec for every place
a log is kept: a session directory's ``events.jsonl`` (:class:`ctxfold.compaction.session.Session`), a store's
records (:mod:`ctxfold.compaction.store`), the proxy's sessions, and ``ctxfold restore`` of either.

A record is a JSON object with ``seq`` (0, 1, 2, ... in the order written) and ``type``:

- ``header``: the conversation without its messages (system prompt, tools, ids);
- ``append``: one original message, with its ``index`` among the originals (0, 1, 2, ...);
- ``view``: a rewrite of the view (a compaction): entries that refer to originals by index, or carry a
  message compaction wrote, the state after it, and in a folded log how many views it stands for;
- ``state``: compactor state that changed without a rewrite.

So restore is the originals in order (the full history, byte for byte, through any number of
compactions) and resume is the last view plus every original appended after it.

Reading (:func:`load_events`) is strict by default: the first record that cannot be read raises
:class:`FormatError` naming it. With ``salvage``, every readable record is kept and each one left out is
named with its reason: a lost append loses that message alone (the indexes after it say how many are
missing), and a view that could refer to what was lost is dropped, leaving the view as the originals.
No input, of any shape, is anything but a record read, a record named as skipped, or a FormatError.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxfold import fastjson
from ctxfold.chat.codec import (
    decode_conversation_header,
    decode_message,
    encode_conversation_header,
    encode_message,
)
from ctxfold.chat.messages import Conversation, Message
from ctxfold.errors import FormatError

Event = dict[str, Any]
LOG_VERSION = 1
# Records nested deeper are refused when read: nothing ctxfold writes comes near (a message with a JSON
# schema in it is a few dozen levels), and what reads a record back recurses (json.dumps with indent
# fails near 500 levels, json.loads near 1000).
MAX_RECORD_DEPTH = 200
EVENT_TYPES = ("header", "append", "view", "state")
# What a malformed record can raise while it is applied (a field of the wrong type, a number out of
# range): each concerns that record alone.
_RECORD_ERRORS = (FormatError, LookupError, TypeError, ValueError, ArithmeticError, RecursionError)


@dataclass(frozen=True, slots=True)
class ViewEntry:
    """One message of a view: an original by its index in the log, or a message compaction wrote."""

    origin: int  # index of the original message this entry shows (or stands for), -1 for synthetic ones
    message: Message | None = None  # None: the original itself, unchanged


@dataclass(slots=True)
class ResumedState:
    """A log read back (:func:`load_events`, :meth:`ctxfold.compaction.session.Session.load`)."""

    conversation: Conversation  # header of the conversation with its current view as messages
    originals: list[Message]  # every message ever appended, in order
    view_origins: list[int]  # per view message: its original's index, -1 for synthetic messages
    state: dict[str, Any] = field(default_factory=dict)  # compactor state saved with the last event
    num_compactions: int = 0
    torn_lines: int = 0  # lines ignored because a write was cut off
    # With salvage: (where, why) of each record left out because it could not be read or used.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    next_seq: int = 0  # the seq the next record written gets


@dataclass(frozen=True, slots=True)
class Record:
    """One record as read back: its event, or why it could not be read."""

    location: str  # where it was read: "line 7", "seq 12", "stream entry 0-13"
    event: Event | None  # None: unreadable
    why: str = ""  # why it could not be read (event None)


def encode_event(event: Event) -> bytes:
    """One record's bytes (no newline): a line of ``events.jsonl``, a field in Redis."""
    return fastjson.dumps_record(event)


def decode_event(data: bytes | str, *, location: str) -> Record:
    """The record ``data`` holds, or why it holds none; never raises."""
    try:
        event = fastjson.loads(data)
    except RecursionError:
        return Record(location, None, f"nested deeper than {MAX_RECORD_DEPTH} levels")
    except ValueError as exc:  # not JSON, or not UTF-8
        return Record(location, None, f"not JSON: {_short(exc)}")
    return check_event(event, location=location)


def check_event(event: Any, *, location: str) -> Record:
    """``event`` (parsed JSON) as a record, or why it is none: an object with a whole-number ``seq`` and a
    known ``type``, nested no deeper than :data:`MAX_RECORD_DEPTH`. Never raises."""
    if not isinstance(event, dict):
        return Record(location, None, f"a JSON {type(event).__name__}, not an event object")
    if type(event.get("seq")) is not int or event["seq"] < 0:
        return Record(location, None, f"no whole-number seq (got {_short_repr(event.get('seq'))})")
    if event.get("type") not in EVENT_TYPES:
        return Record(location, None, f"unknown event type {_short_repr(event.get('type'))}")
    if _deeper_than(event, MAX_RECORD_DEPTH):
        return Record(location, None, f"nested deeper than {MAX_RECORD_DEPTH} levels")
    return Record(location, event)


def event_seq(event: Event) -> int:
    return int(event["seq"])


class EventBuilder:
    """The records of one log, numbered: ``seq`` and the originals' indexes. Each method returns the
    records without taking their numbers; :meth:`taken` does, once they are written, so a write that
    fails leaves the numbering as it was."""

    def __init__(self, *, next_seq: int = 0, num_originals: int = 0) -> None:
        self.next_seq = next_seq
        self.num_originals = num_originals

    def header(self, conversation: Conversation) -> list[Event]:
        return self._numbered([{"type": "header", "version": LOG_VERSION,
                                "conversation": encode_conversation_header(conversation)}])

    def appends(self, messages: Iterable[Message]) -> list[Event]:
        return self._numbered([{"type": "append", "index": self.num_originals + k, "message": encode_message(m)}
                               for k, m in enumerate(messages)])

    def view(self, view: Sequence[ViewEntry], *, kind: str, reason: str, dump: str | None,
             state: dict[str, Any], figures: dict[str, Any] | None = None) -> list[Event]:
        """A rewrite of the view; its entries must refer to originals already logged (ValueError)."""
        entries: list[dict[str, Any]] = []
        for e in view:
            if e.origin >= self.num_originals:
                raise ValueError(f"view entry refers to original {e.origin}, but only {self.num_originals} are logged")
            entries.append({"ref": e.origin} if e.message is None
                           else {"origin": e.origin, "message": encode_message(e.message)})
        return self._numbered([{"type": "view", "kind": kind, "reason": reason, "dump": dump, "view": entries,
                                "state": state, "figures": figures or {}}])

    def state(self, state: dict[str, Any]) -> list[Event]:
        return self._numbered([{"type": "state", "state": state}])

    def taken(self, events: Sequence[Event]) -> None:
        """``events`` (from this builder, in order) are written: the next ones come after them."""
        self.next_seq += len(events)
        self.num_originals += sum(1 for e in events if e["type"] == "append")

    def _numbered(self, events: list[Event]) -> list[Event]:
        return [{"seq": self.next_seq + k, **e} for k, e in enumerate(events)]


def load_events(records: Iterable[Record | Event], *, source: str, salvage: bool = False) -> ResumedState:
    """The session ``records`` describe: the current view, every original in order, the last saved
    state. A plain event (a dict) is a record read at ``seq N``. Strict: FormatError at the first
    record that cannot be read or used; ``salvage``: see the module docstring."""
    fold = _Loader(source, salvage)
    for k, item in enumerate(records):
        fold.add(k, item if isinstance(item, Record) else check_event(item, location=f"record {k + 1}"))
    return fold.result()


def restore_events(records: Iterable[Record | Event], *, source: str, salvage: bool = False) -> ResumedState:
    """:func:`load_events` with the conversation's messages set to every original: the full history."""
    resumed = load_events(records, source=source, salvage=salvage)
    resumed.conversation.messages = list(resumed.originals)
    return resumed


class _Loader:
    """:func:`load_events`, one record at a time."""

    def __init__(self, source: str, salvage: bool) -> None:
        self.source = source
        self.salvage = salvage
        self.header: tuple[dict[str, Any], str] | None = None
        self.originals: list[Message] = []
        self.view: tuple[list[Any], str, int] | None = None  # raw entries, location, ordinal: the last view
        self.view_len_at = 0  # originals logged when the last view was written
        self.state: dict[str, Any] = {}
        self.compactions = 0
        self.next_seq = 0
        self.next_index = 0  # the index the next append should carry: a gap is a lost message
        self.skipped: list[tuple[int, str, str]] = []  # (ordinal, location, why)

    def fail(self, ordinal: int, location: str, why: str) -> None:
        if not self.salvage:
            raise FormatError(why, source=self.source, location=location)
        self.skipped.append((ordinal, location, why))

    def add(self, ordinal: int, record: Record) -> None:
        event = record.event
        if event is None:
            self.fail(ordinal, record.location, f"not an event: {record.why}")
            return
        kind = event.get("type")
        try:
            if kind == "header":
                if not isinstance(event["conversation"], dict):
                    raise TypeError("its conversation is not an object")
                self.header = (event["conversation"], record.location)
            elif kind == "append":
                self.add_original(ordinal, record.location, event)
            elif kind == "view":
                if not isinstance(event["view"], list):
                    raise TypeError("its view is not a list")
                self.view = (event["view"], record.location, ordinal)
                self.view_len_at = len(self.originals)
                self.state = _state_of(event)
                # A folded log keeps only the last view and says how many it stands for.
                self.compactions += int(event.get("compactions", 1))
            elif kind == "state":
                self.state = _state_of(event)
            else:
                raise FormatError(f"unknown event type {_short_repr(kind)}")
        except _RECORD_ERRORS as exc:
            why = exc.reason if isinstance(exc, FormatError) else _short(exc)
            self.fail(ordinal, record.location, f"unreadable {_short_repr(kind)} event: {why}")
            return
        self.next_seq = max(self.next_seq, int(event["seq"]) + 1)

    def add_original(self, ordinal: int, location: str, event: Event) -> None:
        index = event.get("index", self.next_index)
        if type(index) is not int:
            raise TypeError(f"its index is {_short_repr(index)}, not a whole number")
        message = decode_message(_mapping(event["message"]), where=f"{self.source}, {location}")
        if index != self.next_index:
            # Said once per gap; strict, an index out of order is a log that cannot be trusted.
            self.fail(ordinal, location, f"{index - self.next_index} message(s) before this one are missing"
                      if index > self.next_index else f"index {index} where {self.next_index} was expected")
            if index < self.next_index:
                return
        self.originals.append(message)
        self.next_index = index + 1

    def result(self) -> ResumedState:
        header = self.conversation_header()
        entries = self.view_entries()
        if entries is None:
            entries, self.view_len_at = [], 0
        entries += [ViewEntry(origin=i) for i in range(self.view_len_at, len(self.originals))]
        messages = [self.originals[e.origin] if e.message is None else e.message for e in entries]
        try:
            conversation = decode_conversation_header(header, messages)
        except _RECORD_ERRORS as exc:
            self.fail(len(self.skipped), self.header[1] if self.header else "header",
                      f"header left out: {_short(exc)}")
            conversation = decode_conversation_header({}, messages)
        return ResumedState(
            conversation=conversation,
            originals=self.originals,
            view_origins=[e.origin for e in entries],
            state=self.state,
            num_compactions=self.compactions,
            skipped=[(location, why) for _, location, why in self.skipped],
            next_seq=self.next_seq,
        )

    def conversation_header(self) -> dict[str, Any]:
        if self.header is None:
            self.fail(-1, "the first record", "no readable header: the system prompt and tools are unknown")
            return {}
        return self.header[0]

    def view_entries(self) -> list[ViewEntry] | None:
        """The last view's entries, or None: no view, or one that cannot be used (salvage)."""
        if self.view is None:
            return None
        raw, location, ordinal = self.view
        try:
            entries = [ViewEntry(origin=_whole(e["ref"])) if "ref" in _mapping(e)
                       else ViewEntry(origin=_whole(e["origin"]),
                                      message=decode_message(_mapping(e["message"]), where=location))
                       for e in raw]
            if any(k < ordinal for k, _, _ in self.skipped):
                # A message lost before it shifts every later index: its references cannot be trusted.
                raise FormatError("records before it were left out")
            if any(e.message is None and not 0 <= e.origin < self.view_len_at for e in entries):
                raise FormatError("it refers to a message that is not logged before it")
        except _RECORD_ERRORS as exc:
            self.fail(ordinal, location, f"view left out: {exc.reason if isinstance(exc, FormatError) else _short(exc)}")
            return None
        return entries


def fold_events(events: Sequence[Event]) -> list[Event]:
    """The checkpoint of ``events``: the header, every append, the last view (with how many views it
    stands for) and the last state event after it, each with its own ``seq``. Loading the fold gives
    what loading ``events`` gives, and loading the fold followed by later events gives what loading
    all of them gives, so the events a fold covers can be trimmed. Linear in the records."""
    header: Event | None = None
    appends: list[Event] = []
    view: Event | None = None
    view_pos = 0  # appends logged before the last view: the view must come after exactly these
    state: Event | None = None  # a state event after the last view
    views = 0
    for e in events:
        kind = e.get("type")
        if kind == "header":
            header = e
        elif kind == "append":
            appends.append(e)
        elif kind == "view":
            views += int(e.get("compactions", 1))
            view, view_pos, state = e, len(appends), None
        elif kind == "state":
            state = e
        else:
            raise FormatError(f"unknown event type {kind!r}", source="checkpoint", location=f"event {e.get('seq')}")
    out: list[Event] = [header] if header is not None else []
    out += appends[:view_pos]
    if view is not None:
        out.append({**view, "compactions": views})
    out += appends[view_pos:]
    if state is not None:
        out.append(state)
    # Records keep their seq and order among themselves: the fold is a subsequence of the log.
    out.sort(key=event_seq)
    return out


def _state_of(event: Event) -> dict[str, Any]:
    state = event.get("state") or {}
    if not isinstance(state, dict):
        raise TypeError(f"its state is a {type(state).__name__}, not an object")
    return dict(state)


def _mapping(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got a {type(value).__name__}")
    return value


def _whole(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"expected a whole number, got {_short_repr(value)}")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    # Iterative: the point is to refuse what recursion cannot read back.
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(v, dict):
            stack.extend((c, depth + 1) for c in v.values() if isinstance(c, dict | list))
        elif isinstance(v, list):
            stack.extend((c, depth + 1) for c in v if isinstance(c, dict | list))
    return False


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def _short_repr(value: Any) -> str:
    if isinstance(value, dict | list):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    if isinstance(value, int) and value.bit_length() > 200:
        return "a number of over 60 digits"  # repr of a long enough one raises
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
