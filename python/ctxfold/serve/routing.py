"""Which stored conversation a request continues: :class:`ProxySession` (one stored conversation, its
compactor and the wire form of its messages) and :func:`route` (the choice among a key's sessions).

A request continues the session whose stored messages are the longest prefix of the messages it
carries; re-sends an answered request of one (a retry, a regeneration: its messages are a session's minus
the answers the proxy recorded); or, when its history diverges from every session, forks the one it
shares the longest prefix with. Messages are compared by what the model sees (:func:`fingerprint_wire`),
as dicts first: a client that sends its history back as it came costs one comparison in C.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxfold.chat.formats.openai import message_to_openai
from ctxfold.chat.messages import Message
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.store import BufferedLog, Lease, SessionId
from ctxfold.serve.keys import ConversationKey, fingerprint_wire


@dataclass(slots=True)
class ProxySession:
    """One stored conversation and its compactor. Used only under its key's lock."""

    key: ConversationKey  # the store's key: tenant and key digest (scope_of)
    path: Path  # the session's directory under the data directory (a local store's; names the key)
    compactor: Compactor
    # The wire form of each of compactor.originals, in order: the dict the message last came in (from a
    # request, or the upstream's answer), or rebuilt from the message when the session was loaded.
    wire: list[Mapping[str, Any]] = field(default_factory=list)
    calibration: float = 1.0  # upstream prompt tokens / ctxfold's estimate, smoothed (see ProxyApp)
    inject_recall: bool = False  # sticky: once the tool was offered, keep offering it (stable prompt prefix)
    recall_scanned: bool = False  # the view was searched for archive markers once since loading
    tools_wire: Any = None  # the last request's "tools" as it sent them: counted again only when they change
    # Answers at the end of the session that the current request does not carry: it re-sends a request
    # answered before (a retry, a regeneration). Its view goes without them and its answer is not
    # recorded (the session holds one). Set by SessionStore.find for each request.
    resend_drop: int = 0
    log_nbytes: int = 0  # size of the event log when last looked at: what loading it costs, roughly
    # The session's id in the store (None only for a session built by hand, outside a SessionStore), its
    # buffered log (what the compactor wrote since the last commit), the lease held while a request
    # works on it, and the fencing token of the last lease this process held: the next grant is that
    # plus one exactly when no other replica held it meanwhile, so what this process has loaded is
    # still the stored session.
    store_id: SessionId | None = None
    log: BufferedLog | None = None
    lease: Lease | None = None
    token: int = 0
    broken: bool = False  # memory went ahead of the store (a write failed, not spooled): never committed

    @property
    def num_known(self) -> int:
        """Messages stored: a request continuing the session carries them first."""
        return len(self.wire)

    def note_wire(self, dicts: Sequence[Mapping[str, Any]], first: int = 0) -> None:
        """Bring :attr:`wire` up to the compactor's originals after an append: ``dicts[j]`` is the wire
        form of original ``first + j`` (a request's messages: ``first`` 0; an answer: its index).
        Whatever was stored is known, even when an append failed part way."""
        originals = self.compactor.originals
        self.wire.extend(dicts[len(self.wire) - first:len(originals) - first])
        self.wire.extend(message_to_openai(m, api=True) for m in originals[len(self.wire):])

    def common_prefix(self, system: str | None, messages: Sequence[Mapping[str, Any]]) -> int:
        """How many of the stored messages the request carries first, by what the model sees; -1 when
        its system prompt differs. Where only the form differs (a dropped field, reordered keys), the
        request's dicts are kept, so its next request compares as dicts."""
        if self.compactor.header.system != system:
            return -1
        n = len(self.wire)
        if messages[:n] == self.wire:
            return min(n, len(messages))
        common = 0
        for sent, known in zip(messages, self.wire):
            if sent != known and fingerprint_wire(sent) != fingerprint_wire(known):
                break
            common += 1
        self.wire[:common] = messages[:common]
        return common

    def matches(self, system: str | None, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Whether the request (its system prompt and messages) continues this session: its messages
        start with the stored ones, by what the model sees."""
        return len(self.wire) <= len(messages) and self.common_prefix(system, messages) == len(self.wire)

    def is_resend(self, num_sent: int) -> bool:
        """Whether a request that carries the first ``num_sent`` stored messages and nothing else
        re-sends an answered request: what the session holds beyond them is answers."""
        return 0 < num_sent < len(self.wire) and all(m.get("role") == "assistant" for m in self.wire[num_sent:])

    def request_view(self) -> tuple[list[Message], list[int], list[Message]]:
        """(view, view origins, originals) the current request goes out with: the compactor's, less
        the answers a re-sent request does not carry (:attr:`resend_drop`), which show last in the
        view when they show at all (the tail keeps the latest messages in order)."""
        c = self.compactor
        if not self.resend_drop:
            return c.view, c.view_origins, c.originals
        keep = len(c.originals) - self.resend_drop
        end = len(c.view)
        while end > 0 and c.view_origins[end - 1] >= keep:
            end -= 1
        return c.view[:end], c.view_origins[:end], c.originals[:keep]


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes among its key's sessions."""

    session: ProxySession | None  # the session it continues (or re-sends an answered request of)
    continues: bool  # it carries new messages for ``session`` to store (not a re-send)
    parent: ProxySession | None = None  # without ``session``: the session to fork, if any
    num_common: int = 0  # the messages the fork keeps of ``parent``


def route(sessions: Sequence[ProxySession], system: str | None, messages: Sequence[Mapping[str, Any]]) -> Route:
    """The route of a request (its system prompt and messages) among ``sessions``. Sets each session's
    :attr:`ProxySession.resend_drop` for this request: non-zero only on a re-sent one."""
    best: ProxySession | None = None
    resent: ProxySession | None = None
    parent: ProxySession | None = None
    parent_common = 0
    for s in sessions:
        s.resend_drop = 0
        common = s.common_prefix(system, messages)
        if common == s.num_known:
            if best is None or common > best.num_known:
                best = s
        elif common == len(messages) and s.is_resend(common):
            if resent is None or common > resent.num_known - resent.resend_drop:
                if resent is not None:
                    resent.resend_drop = 0
                resent = s
                s.resend_drop = s.num_known - common
        elif common > parent_common:
            parent, parent_common = s, common
    if best is not None:
        if resent is not None:
            resent.resend_drop = 0
        return Route(best, continues=True)
    if resent is not None:
        return Route(resent, continues=False)
    return Route(None, continues=False, parent=parent, num_common=parent_common)
