"""The proxy's sessions: which stored conversation a request continues, and its compactor.

A chat.completions client sends the whole history with every request. The proxy keeps each
conversation as a ctxfold session (event log, history dumps, archive) under its data directory:

    <data_dir>/sessions/<key digest>/<n>/     one session directory (see ctxfold.session)

The key is the ``X-Ctxfold-Session`` header when the client sends one, else a digest of the system
prompt and the first message. Several sessions can share a key (two conversations that start alike,
or a client that rewrote its history); a request continues the one whose stored messages are the
longest prefix of the messages it carries, and starts a new one when none is. Messages are compared
by a fingerprint of what the model sees (role, content, tool calls, the call a result answers), not
by their JSON bytes, so a client may drop a field or reorder keys; reasoning is left out because
clients are told to drop it when they send history back.

Everything is durable in the session directory, so a restarted proxy finds every conversation again
and resumes it on its next request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ctxfold.compactor import Compactor
from ctxfold.messages import Conversation, Message

SESSION_HEADER = "X-Ctxfold-Session"
MAX_SESSION_KEY_CHARS = 200


def fingerprint(m: Message) -> bytes:
    """What the model sees of a message, hashed: role, content, tool calls, the answered call."""
    h = hashlib.blake2b(digest_size=16)
    h.update(m.role.value.encode())
    if isinstance(m.content, str):
        h.update(b"\x00s" + m.content.encode("utf-8", "surrogatepass"))
    else:
        for p in m.content:
            h.update(b"\x00p" + p.type.encode("utf-8", "surrogatepass"))
            h.update(b"\x00" + (p.text if p.text is not None else json.dumps(dict(p.data), sort_keys=True))
                     .encode("utf-8", "surrogatepass"))
    for c in m.tool_calls:
        h.update(b"\x00c" + "\x00".join((c.id, c.name, c.arguments)).encode("utf-8", "surrogatepass"))
    if m.tool_call_id is not None:
        h.update(b"\x00r" + m.tool_call_id.encode("utf-8", "surrogatepass"))
    return h.digest()


def session_key(header_value: str | None, conversation: Conversation) -> str:
    """The digest naming a conversation's key directory (hex, 32 chars)."""
    h = hashlib.sha256()
    if header_value is not None:
        h.update(b"header\x00" + header_value.encode("utf-8", "surrogatepass"))
    else:
        h.update(b"auto\x00" + (conversation.system or "").encode("utf-8", "surrogatepass") + b"\x00")
        if conversation.messages:
            h.update(fingerprint(conversation.messages[0]))
    return h.hexdigest()[:32]


@dataclass(slots=True)
class ProxySession:
    """One stored conversation and its compactor. Used only under its key's lock."""

    key: str  # the key digest
    path: Path  # the session directory
    compactor: Compactor
    fingerprints: list[bytes] = field(default_factory=list)  # of compactor.originals, in order
    calibration: float = 1.0  # upstream prompt tokens / ctxfold's estimate, smoothed (see ProxyApp)
    inject_recall: bool = False  # sticky: once the tool was offered, keep offering it (stable prompt prefix)

    def refresh_fingerprints(self) -> None:
        n = len(self.fingerprints)
        self.fingerprints.extend(fingerprint(m) for m in self.compactor.originals[n:])

    def matches(self, system: str | None, fps: list[bytes]) -> bool:
        n = len(self.fingerprints)
        return self.compactor.header.system == system and n <= len(fps) and self.fingerprints == fps[:n]


CompactorFactory = Callable[[Conversation, Path], Compactor]


class SessionStore:
    """The sessions of one data directory, loaded lazily, one asyncio lock per key."""

    def __init__(self, data_dir: Path, make_compactor: CompactorFactory) -> None:
        self.root = Path(data_dir) / "sessions"
        self.make_compactor = make_compactor
        self._locks: dict[str, asyncio.Lock] = {}
        self._sessions: dict[str, list[ProxySession]] = {}

    def lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    @property
    def num_sessions(self) -> int:
        return sum(len(v) for v in self._sessions.values())

    def loaded(self) -> list[ProxySession]:
        return [s for v in self._sessions.values() for s in v]

    async def match(self, key: str, conversation: Conversation, fps: list[bytes]) -> tuple[ProxySession, int]:
        """The session this request continues (a new one if none) and how many of its messages are stored.
        Call under ``lock(key)``."""
        candidates = self._sessions.get(key)
        if candidates is None:
            candidates = await asyncio.to_thread(self._load_key, key)
            self._sessions[key] = candidates
        best: ProxySession | None = None
        for s in candidates:
            if s.matches(conversation.system, fps) and (best is None or len(s.fingerprints) > len(best.fingerprints)):
                best = s
        if best is not None:
            return best, len(best.fingerprints)
        n = len(candidates)
        while (self.root / key / f"{n:04d}").exists():  # a directory left without a log by a crash
            n += 1
        path = self.root / key / f"{n:04d}"
        # A new session starts empty; the caller appends the request's messages through the compactor,
        # so the hard trigger and the event log see them like any other append.
        header = Conversation(messages=[], id=f"{key}/{path.name}", system=conversation.system,
                              tools=conversation.tools, source_format="openai", source="ctxfold serve")
        compactor = await asyncio.to_thread(self.make_compactor, header, path)
        s = ProxySession(key, path, compactor)
        candidates.append(s)
        return s, 0

    def _load_key(self, key: str) -> list[ProxySession]:
        folder = self.root / key
        if not folder.is_dir():
            return []
        out = []
        for entry in sorted(os.listdir(folder)):
            path = folder / entry
            if not (path / "events.jsonl").is_file():
                continue
            compactor = self.make_compactor(Conversation(messages=[]), path)  # resumes from the log
            s = ProxySession(key, path, compactor)
            s.refresh_fingerprints()
            out.append(s)
        return out

    def close(self) -> None:
        for s in self.loaded():
            s.compactor.close()
