"""A session's events as records, independent of where they are kept.

An event is what :class:`ctxfold.session.Session` writes as one line of ``events.jsonl``: a dict with
``seq`` (0, 1, 2, ... in the order written) and ``type`` (header, append, view, state). A store keeps
the same records, one per event, so a session moves between stores unchanged and the local store
reads and writes today's files.

:func:`load_events` rebuilds what :meth:`Session.load` returns from any sequence of records;
:func:`fold_events` is the checkpoint: the fewest records that load to the same state (the header,
every original, the last view and the state after it), so the events before it can be trimmed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ctxfold import fastjson
from ctxfold.codec import decode_conversation_header, decode_message
from ctxfold.errors import FormatError
from ctxfold.messages import Conversation
from ctxfold.session import ResumedState, ViewEntry

Event = dict[str, Any]


def encode_event(event: Event) -> bytes:
    """One record's bytes (no newline): what the local log writes as a line and Redis keeps as a field."""
    return fastjson.dumps_record(event)


def decode_event(data: bytes | str, *, source: str, location: str) -> Event:
    try:
        event = fastjson.loads(data)
    except ValueError as exc:
        raise FormatError(f"corrupt event record: {exc}", source=source, location=location) from exc
    if not isinstance(event, dict) or not isinstance(event.get("seq"), int):
        raise FormatError("event record is not an object with a whole-number seq", source=source,
                          location=location)
    return event


def event_seq(event: Event) -> int:
    return int(event["seq"])


def load_events(events: Iterable[Event], *, source: str) -> ResumedState:
    """The session the records describe: the same result as :meth:`Session.load` over a log holding
    them (the current view, every original in order, the last saved state)."""
    header: dict[str, Any] | None = None
    originals = []
    last_view: tuple[list[dict[str, Any]], str] | None = None  # None: no rewrite yet, the view is every original
    view_len_at = 0  # originals logged when the last view was written
    state: dict[str, Any] = {}
    compactions = 0
    for event in events:
        kind = event.get("type")
        where = f"event {event.get('seq')}"
        if kind == "header":
            header = event["conversation"]
        elif kind == "append":
            originals.append(decode_message(event["message"], where=f"{source}, {where}"))
        elif kind == "view":
            last_view = (event["view"], where)
            view_len_at = len(originals)
            state = dict(event.get("state") or {})
            # A folded log keeps only the last view and says how many it stands for.
            compactions += int(event.get("compactions", 1))
        elif kind == "state":
            state = dict(event.get("state") or {})
        else:
            raise FormatError(f"unknown event type {kind!r}", source=source, location=where)
    if header is None:
        raise FormatError("event log has no header", source=source, location="event 0")
    if last_view is None:
        entries = [ViewEntry(origin=i) for i in range(len(originals))]
    else:
        raw, where = last_view
        entries = [ViewEntry(origin=int(e["ref"])) if "ref" in e
                   else ViewEntry(origin=int(e["origin"]), message=decode_message(e["message"], where=where))
                   for e in raw]
        entries += [ViewEntry(origin=i) for i in range(view_len_at, len(originals))]
    messages = [originals[e.origin] if e.message is None else e.message for e in entries]
    return ResumedState(
        conversation=decode_conversation_header(header, messages),
        originals=originals,
        view_origins=[e.origin for e in entries],
        state=state,
        num_compactions=compactions,
    )


def restore_events(events: Iterable[Event], *, source: str) -> Conversation:
    """The full original conversation the records hold, through any number of compactions."""
    resumed = load_events(events, source=source)
    conv = resumed.conversation
    conv.messages = resumed.originals
    return conv


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
