"""Whose a request is and which conversation it belongs to: the tenant (a keyed hash of the client's
credential, never the credential), the conversation key within it (the ``X-Ctxfold-Session`` header, else
a digest of the opening), and the fingerprints that compare messages by what the model sees.

Distinct types keep the ids apart where they meet: a :data:`TenantId` is never a :data:`ConversationKey`
(the store's relative name of a tenant's key, :func:`scope_of`), and neither is a session's own id.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NewType

from ctxfold.chat.formats.openai import message_to_openai
from ctxfold.chat.messages import Message
from ctxfold.compaction.archive.store import make_private_dir, refuse_symlink

TenantId = NewType("TenantId", str)  # 32 hex characters of an HMAC, or "" for the anonymous tenant
# A tenant's conversation key as the store names it: "sessions/<key>" or "tenants/<tenant>/sessions/<key>".
ConversationKey = NewType("ConversationKey", str)

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
    parts: list[bytes] = []
    role = d.get("role")
    _field(parts, b"r", "system" if role == "developer" else role)
    content = d.get("content")
    _field(parts, b"c", "" if content is None else content)
    calls = d.get("tool_calls")
    if isinstance(calls, list):
        parts.append(b"L" + len(calls).to_bytes(8, "little"))
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            fn = fn if isinstance(fn, dict) else {}
            _field(parts, b"i", c.get("id") if isinstance(c, dict) else c)
            _field(parts, b"n", fn.get("name"))
            _field(parts, b"a", fn.get("arguments", ""))
    elif calls is not None:
        _field(parts, b"T", calls)
    if role == "tool":
        _field(parts, b"t", d.get("tool_call_id"))
    return hashlib.blake2b(b"".join(parts), digest_size=16).digest()


def _field(parts: list[bytes], tag: bytes, value: Any) -> None:
    """One field of a fingerprint: its tag, its kind (a string and a JSON value that prints the same,
    "[1]" and [1], are different content), its length and its UTF-8 bytes."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        parts.append(tag + b"s" + len(data).to_bytes(8, "little"))
    else:
        data = _text(value).encode("utf-8", "surrogatepass")
        parts.append(tag + b"j" + len(data).to_bytes(8, "little"))
    parts.append(data)


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


TENANT_KEY_FILE = "tenant.key"  # in the data directory: the HMAC key, when the operator gives none
TENANT_KEY_ENV = "CTXFOLD_TENANT_KEY"
TENANT_KEY_BYTES = 32
ANONYMOUS_TENANT = TenantId("")  # requests without a credential: one tenant, whose sessions keep the old layout


def load_tenant_key(data_dir: Path, key_file: Path | None = None) -> bytes:
    """The HMAC key tenants are derived with: ``key_file``'s bytes, else ``$CTXFOLD_TENANT_KEY``, else
    ``<data_dir>/tenant.key``, created (0600, never through a link) with random bytes the first time,
    so a restarted proxy derives the same tenants. OSError or ValueError with a plain message."""
    if key_file is not None:
        key = Path(key_file).read_bytes().strip()
        if len(key) < 16:
            raise ValueError(f"{key_file}: a tenant key must be at least 16 bytes, got {len(key)}")
        return key
    env = os.environ.get(TENANT_KEY_ENV)
    if env:
        if len(env) < 16:
            raise ValueError(f"{TENANT_KEY_ENV}: a tenant key must be at least 16 characters, got {len(env)}")
        return env.encode("utf-8", "surrogatepass")
    make_private_dir(data_dir)
    path = Path(data_dir) / TENANT_KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        refuse_symlink(path)
        key = path.read_bytes()
        if len(key) < 16:
            raise ValueError(f"{path}: holds {len(key)} bytes, not a tenant key; remove it to make a new "
                             "one (every tenant then starts afresh)") from None
        return key
    key = secrets.token_bytes(TENANT_KEY_BYTES)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def tenant_of(hmac_key: bytes, credential: str | None) -> TenantId:
    """The tenant a credential belongs to: 32 hex characters of HMAC-SHA256 over it, or
    :data:`ANONYMOUS_TENANT` when there is none. The credential itself is never kept."""
    if not credential:
        return ANONYMOUS_TENANT
    # hmac.digest: the one-shot C path, a microsecond (hmac.new builds Python objects: several).
    return TenantId(hmac.digest(hmac_key, credential.encode("utf-8", "surrogatepass"), "sha256").hex()[:32])


def scope_of(tenant: TenantId, key: str) -> ConversationKey:
    """Where a tenant's key lives under the data directory (a relative path, also the store's key)."""
    return ConversationKey(f"sessions/{key}" if tenant == ANONYMOUS_TENANT else f"tenants/{tenant}/sessions/{key}")


def is_anonymous_key(key: str) -> bool:
    """Whether ``key`` (from :func:`scope_of`) is the anonymous tenant's."""
    return key.startswith("sessions/")
