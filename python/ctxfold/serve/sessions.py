"""The proxy's sessions: which stored conversation a request continues, and its compactor.

A chat.completions client sends the whole history with every request. The proxy keeps each
conversation as a ctxfold session (event log, history dumps, archive) under its data directory:

    <data_dir>/sessions/<key digest>/<n>/     one session directory (see ctxfold.session)
    <data_dir>/sessions/<key digest>/archive/ the archive the key's sessions share (content-addressed)

The key is the ``X-Ctxfold-Session`` header when the client sends one, else a digest of the system
prompt and the first message. Several sessions can share a key (two conversations that start alike,
or a client that rewrote its history); a request continues the one whose stored messages are the
longest prefix of the messages it carries, and starts a new one when none is. Messages are compared
by what the model sees (role, content, tool calls, the call a result answers), not by their JSON
bytes, so a client may drop a field or reorder keys; reasoning is left out because clients are told
to drop it when they send history back. The common case, a client that sends its history back as it
sent it before, costs one comparison of dicts (in C): each session keeps the dict each of its
messages last came in, and falls back to :func:`fingerprint_wire` only where a dict differs.

Everything is durable in the session directory, so a restarted proxy finds every conversation again
and resumes it on its next request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from ctxfold.archive.store import refuse_symlink
from ctxfold.compactor import Compactor
from ctxfold.formats.openai import message_to_openai
from ctxfold.messages import Conversation, Message
from ctxfold.serve import DEFAULT_MAX_LOADED_CONVERSATIONS

SESSION_HEADER = "X-Ctxfold-Session"
MAX_SESSION_KEY_CHARS = 200


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)


def fingerprint_wire(d: Mapping[str, Any]) -> bytes:
    """What the model sees of an OpenAI chat message dict, hashed: role, content, tool calls (id, name,
    arguments), the call a result answers. Never raises, whatever the types (bad messages are checked
    elsewhere); ``fingerprint_wire(message_to_openai(m, api=True))`` equals it for the parsed message.

    Every field goes in with a tag and its length in bytes: two different messages cannot feed the
    hash the same bytes, whatever their text holds (separators alone let text that contains one
    shift a field boundary)."""
    h = hashlib.blake2b(digest_size=16)

    def field(tag: bytes, value: Any) -> None:
        # A string and a JSON value that prints the same ("[1]" and [1]) are different content.
        data = _text(value).encode("utf-8", "surrogatepass")
        h.update(tag + (b"s" if isinstance(value, str) else b"j") + len(data).to_bytes(8, "little") + data)

    role = d.get("role")
    field(b"r", "system" if role == "developer" else role)
    content = d.get("content")
    field(b"c", "" if content is None else content)
    calls = d.get("tool_calls")
    if isinstance(calls, list):
        h.update(b"L" + len(calls).to_bytes(8, "little"))
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            fn = fn if isinstance(fn, dict) else {}
            field(b"i", c.get("id") if isinstance(c, dict) else c)
            field(b"n", fn.get("name"))
            field(b"a", fn.get("arguments", ""))
    elif calls is not None:
        field(b"T", calls)
    if role == "tool":
        field(b"t", d.get("tool_call_id"))
    return h.digest()


def fingerprint(m: Message) -> bytes:
    """:func:`fingerprint_wire` of a parsed message."""
    return fingerprint_wire(message_to_openai(m, api=True))


def session_key(header_value: str | None, system: str | None, first: bytes | None) -> str:
    """The digest naming a conversation's key directory (hex, 32 chars): the header's value, else the
    system prompt and the fingerprint of the first message."""
    h = hashlib.sha256()
    if header_value is not None:
        h.update(b"header\x00" + header_value.encode("utf-8", "surrogatepass"))
    else:
        h.update(b"auto\x00" + (system or "").encode("utf-8", "surrogatepass") + b"\x00")
        h.update(first or b"")
    return h.hexdigest()[:32]


@dataclass(slots=True)
class ProxySession:
    """One stored conversation and its compactor. Used only under its key's lock."""

    key: str  # the key digest
    path: Path  # the session directory
    compactor: Compactor
    # The wire form of each of compactor.originals, in order: the dict the message last came in (from a
    # request, or the upstream's answer), or rebuilt from the message when the session was loaded.
    wire: list[Mapping[str, Any]] = field(default_factory=list)
    calibration: float = 1.0  # upstream prompt tokens / ctxfold's estimate, smoothed (see ProxyApp)
    inject_recall: bool = False  # sticky: once the tool was offered, keep offering it (stable prompt prefix)
    recall_scanned: bool = False  # the view was searched for archive markers once since loading
    tools_wire: Any = None  # the last request's "tools" as it sent them: counted again only when they change

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

    def matches(self, system: str | None, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Whether the request (its system prompt and messages) continues this session: its messages
        start with the stored ones, by what the model sees. Where only the form differs (a dropped
        field, reordered keys), the request's dicts are kept, so its next request compares as dicts."""
        n = len(self.wire)
        if self.compactor.header.system != system or n > len(messages):
            return False
        if messages[:n] == self.wire:
            return True
        for sent, known in zip(messages, self.wire):
            if sent != known and fingerprint_wire(sent) != fingerprint_wire(known):
                return False
        self.wire[:] = messages[:n]
        return True


CompactorFactory = Callable[[Conversation, Path], Compactor]


class SessionStore:
    """The sessions of one data directory, loaded lazily, one asyncio lock per key; at most
    ``max_loaded_keys`` keys stay loaded (least recently used first out, see :meth:`trim`)."""

    def __init__(self, data_dir: Path, make_compactor: CompactorFactory, *,
                 max_loaded_keys: int = DEFAULT_MAX_LOADED_CONVERSATIONS, create_in_thread: bool = True) -> None:
        if max_loaded_keys < 1:
            raise ValueError(f"max_loaded_keys: must be >= 1, got {max_loaded_keys}")
        self.root = Path(data_dir) / "sessions"
        self.make_compactor = make_compactor
        self.max_loaded_keys = max_loaded_keys
        # Building a compactor blocks (an fsync, object storage) or not (mkdir and a write): only then is
        # a worker thread worth its two context switches (Python work in it holds the loop anyway).
        self.create_in_thread = create_in_thread
        # A lock lives as long as its key is loaded, or someone holds or awaits it: the entry goes with
        # the last reference, so the table does not grow with every conversation ever seen, and a key
        # never has two locks.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._loaded_locks: dict[str, asyncio.Lock] = {}  # the locks of the keys in _sessions
        self._sessions: OrderedDict[str, list[ProxySession]] = OrderedDict()  # least recently used first

    def lock(self, key: str) -> asyncio.Lock:
        lock = self._loaded_locks.get(key) or self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    def trim(self) -> list[str]:
        """Close and forget the least recently used keys beyond ``max_loaded_keys``; returns them.
        A key whose lock is held stays (its sessions are in use). Everything is on disk: the next
        request of an evicted conversation loads it again and continues the same session."""
        excess = len(self._sessions) - self.max_loaded_keys
        if excess <= 0:
            return []
        evicted: list[str] = []
        for key in list(islice(self._sessions, excess)):  # the oldest only: not a list of every key
            lock = self._locks.get(key)
            if lock is not None and lock.locked():
                continue
            for s in self._sessions.pop(key):
                s.compactor.close()
            self._loaded_locks.pop(key, None)
            evicted.append(key)
        return evicted

    @property
    def num_locked(self) -> int:
        """Loaded keys whose lock is held: requests under way, an answer not yet recorded."""
        return sum(1 for lock in list(self._loaded_locks.values()) if lock.locked())

    @property
    def num_sessions(self) -> int:
        return sum(len(v) for v in self._sessions.values())

    def loaded(self) -> list[ProxySession]:
        return [s for v in self._sessions.values() for s in v]

    async def find(self, key: str, system: str | None, messages: Sequence[Mapping[str, Any]]) -> ProxySession | None:
        """The stored session whose messages are the longest prefix of ``messages`` (a request's, after
        its system prompt), or None. Under ``lock(key)``."""
        candidates = self._sessions.get(key)
        if candidates is None:
            # A key never seen has no directory: no thread hop to find that out.
            candidates = await asyncio.to_thread(self._load_key, key) if (self.root / key).is_dir() else []
            self._sessions[key] = candidates
            self._loaded_locks[key] = self.lock(key)
        else:
            self._sessions.move_to_end(key)
        best: ProxySession | None = None
        for s in candidates:
            if s.matches(system, messages) and (best is None or s.num_known > best.num_known):
                best = s
        return best

    async def create(self, key: str, conversation: Conversation) -> ProxySession:
        """A new session holding ``conversation`` (system prompt, tools, messages). Under ``lock(key)``,
        after :meth:`find`."""
        candidates = self._sessions[key]
        self._refuse_links(key)
        n = len(candidates)
        while os.path.lexists(self.root / key / f"{n:04d}"):  # a directory left without a log by a crash
            n += 1
        path = self.root / key / f"{n:04d}"
        # The whole history goes in at construction: a conversation first seen long (a proxy put in front
        # of a running agent, a fork) is compacted once by the next pass, not by a hard trigger per tool
        # result while it is read in.
        conv = Conversation(messages=list(conversation.messages), id=f"{key}/{path.name}",
                            system=conversation.system, tools=conversation.tools, source_format="openai",
                            source="ctxfold serve")
        if self.create_in_thread:
            compactor = await asyncio.to_thread(self.make_compactor, conv, path)
        else:
            compactor = self.make_compactor(conv, path)
        s = ProxySession(key, path, compactor)
        candidates.append(s)
        return s

    def _refuse_links(self, key: str) -> None:
        """OSError when the sessions folder or the key's folder is a symbolic link: the proxy writes
        only into directories of its data directory, never where a link planted there points. (The
        data directory itself may be a link: the operator chose it.)"""
        refuse_symlink(self.root)
        refuse_symlink(self.root / key)

    def _load_key(self, key: str) -> list[ProxySession]:
        folder = self.root / key
        self._refuse_links(key)
        if not folder.is_dir():
            return []
        out = []
        for entry in sorted(os.listdir(folder)):
            path = folder / entry
            if entry != "archive":
                refuse_symlink(path)
            if not (path / "events.jsonl").is_file():
                continue
            compactor = self.make_compactor(Conversation(messages=[]), path)  # resumes from the log
            s = ProxySession(key, path, compactor)
            s.note_wire([])
            out.append(s)
        return out

    def close(self) -> None:
        for s in self.loaded():
            s.compactor.close()
