"""Conversations in and out: importers for the traces real agents record, exporters to provider shapes.

    convs = ctxfold.chat.formats.load("session.jsonl")            # format detected from the content
    convs = ctxfold.chat.formats.load(path, format="tau_bench")   # or named
    data = ctxfold.chat.formats.dump(convs[0], format="anthropic")

Every importer returns a list: a file may hold many conversations (tau-bench, OpenHands JSONL, a
Claude Code session with subagents). Malformed input raises :class:`ctxfold.errors.FormatError`
naming the file, the line or index, and what was expected; ``lenient=True`` skips bad records
instead and counts them (:class:`LoadReport`, and ``meta["skipped_records"]`` on each conversation).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ctxfold.chat.formats import anthropic, claude_code, openai, openhands, trajectories
from ctxfold.chat.formats._common import Document, Reader, assign_ids, parse
from ctxfold.chat.messages import Conversation
from ctxfold.errors import FormatError

# Importer names, as accepted by ``format=``.
FORMATS: tuple[str, ...] = ("openai", "anthropic", "claude_code", "tau_bench", "swe_agent", "openhands",
                            "mini_swe_agent")
# Exporter names, as accepted by ``dump(format=)``.
EXPORT_FORMATS: tuple[str, ...] = ("openai", "anthropic")


@dataclass(frozen=True, slots=True)
class LoadReport:
    conversations: list[Conversation]
    format: str  # the importer used
    skipped: tuple[str, ...] = ()  # lenient mode: one line per skipped record, naming where and why
    ignored: dict[str, int] = field(default_factory=dict)  # non-conversation records passed over, by kind


def _value_importer(fn: Callable[[Any, Reader, str], list[Conversation]]) -> Callable[
        [Document, Reader, str], list[Conversation]]:
    def run(doc: Document, reader: Reader, conv_id: str) -> list[Conversation]:
        if doc.is_jsonl:
            raise FormatError("this format is one JSON document, but the input is JSON lines",
                              source=reader.source, location="line 1")
        return fn(doc.value, reader, conv_id)

    return run


def _openai(doc: Document, reader: Reader, conv_id: str) -> list[Conversation]:
    return openai.load_document(doc.value, reader, conv_id, jsonl_lines=doc.records)


def _anthropic(doc: Document, reader: Reader, conv_id: str) -> list[Conversation]:
    if doc.records is not None:  # JSONL: one message a line, or one {"messages": ...} a line
        values = [v for _, v in doc.records]
        if values and all(isinstance(v, dict) and "messages" in v for v in values):
            return [c for k, v in enumerate(values) for c in anthropic.load_document(v, reader, f"{conv_id}:{k}")]
        return anthropic.load_document(values, reader, conv_id)
    return anthropic.load_document(doc.value, reader, conv_id)


_IMPORTERS: dict[str, Callable[[Document, Reader, str], list[Conversation]]] = {
    "openai": _openai,
    "anthropic": _anthropic,
    "claude_code": claude_code.load_document,
    "tau_bench": _value_importer(trajectories.load_tau_bench),
    "swe_agent": _value_importer(trajectories.load_swe_agent),
    "openhands": openhands.load_document,
    "mini_swe_agent": _value_importer(trajectories.load_mini_swe_agent),
}

_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking"})


def _message_flavor(messages: list[Any]) -> str:
    for m in messages[:200]:
        if not isinstance(m, dict):
            continue
        if "tool_calls" in m or m.get("role") in ("tool", "system", "developer") or "tool_call_id" in m:
            return "openai"
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS
                                             for b in content):
            return "anthropic"
    return "openai"


def _detect_value(v: Any) -> str | None:
    if isinstance(v, dict):
        if str(v.get("trajectory_format", "")).startswith("mini-swe-agent"):
            return "mini_swe_agent"
        if isinstance(v.get("history"), list):
            h = v["history"]
            return "openhands" if h and openhands.looks_like_event(h[0]) else "swe_agent"
        if isinstance(v.get("messages"), list):
            if "system" in v and not (v.get("system") is None):
                return "anthropic"
            return _message_flavor(v["messages"])
        if "role" in v:
            return _message_flavor([v])
        return None
    if isinstance(v, list):
        items = [x for x in v[:50] if isinstance(x, dict)]
        if not items:
            return "openai" if not v else None
        if all("traj" in x for x in items):
            return "tau_bench"
        if all(openhands.looks_like_event(x) for x in items):
            return "openhands"
        if all("role" in x for x in items):
            return _message_flavor(v)
        if all(isinstance(x.get("history"), list) for x in items):
            return "openhands"
    return None


def _detect(doc: Document) -> str | None:
    if doc.records is None:
        return _detect_value(doc.value)
    values = [v for _, v in doc.records[:200]]
    if any(isinstance(v, dict) and v.get("type") in claude_code.RECORD_TYPES
           and ("sessionId" in v or "uuid" in v or "messageId" in v) for v in values):
        return "claude_code"
    first = next((v for v in values if isinstance(v, dict)), None)
    if first is None:
        return None
    if isinstance(first.get("history"), list):
        return _detect_value(first)
    if "messages" in first:
        return _detect_value(first)
    if "role" in first:
        return _message_flavor(values)
    return None


def detect_format(data: bytes | str, source: str = "<string>") -> str:
    """The importer name for ``data`` (the content of a file), from its structure alone."""
    reader = Reader(source=source, lenient=True)
    return _detect_or_fail(parse(data, reader), reader)


def _detect_or_fail(doc: Document, reader: Reader) -> str:
    name = _detect(doc)
    if name is None:
        raise reader.error(f"cannot tell which trace format this is; expected one of {', '.join(FORMATS)} "
                           "(choose one: --format NAME on the command line, format= in Python)")
    return name


def read(data: bytes | str, format: str | None = None, *, source: str = "<string>", lenient: bool = False,
         conv_id: str | None = None) -> LoadReport:
    """Parse ``data`` and return the conversations with what was skipped or ignored."""
    if format is not None and format not in _IMPORTERS:
        raise FormatError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}", source=source)
    reader = Reader(source=source, lenient=lenient)
    doc = parse(data, reader)
    name = format or _detect_or_fail(doc, reader)
    base_id = conv_id if conv_id is not None else Path(source).name.split(".")[0] if source != "<string>" else "conv"
    try:
        convs = _IMPORTERS[name](doc, reader, base_id)
    except FormatError as exc:
        if exc.source is None:
            raise FormatError(exc.reason, source=source, location=exc.location or "document") from None
        raise
    extra = reader.meta()
    out = []
    for c in convs:
        c = replace(c, messages=assign_ids(c.messages, "m"))
        if extra:
            c.meta.update(extra)
        out.append(c)
    return LoadReport(conversations=out, format=name, skipped=tuple(reader.skipped), ignored=dict(reader.ignored))


def loads(data: bytes | str, format: str | None = None, *, source: str = "<string>",
          lenient: bool = False) -> list[Conversation]:
    """Conversations in ``data`` (JSON or JSONL text or bytes)."""
    return read(data, format, source=source, lenient=lenient).conversations


def load(path: str | Path, format: str | None = None, *, lenient: bool = False) -> list[Conversation]:
    """Conversations in the file at ``path``; the format is detected from the content unless named."""
    return read_path(path, format, lenient=lenient).conversations


def read_path(path: str | Path, format: str | None = None, *, lenient: bool = False) -> LoadReport:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise FormatError(f"cannot read the file: {exc.strerror}; expected a readable trace file",
                          source=str(p)) from None
    return read(data, format, source=str(p), lenient=lenient, conv_id=p.name.split(".")[0])


def dump(conv: Conversation, format: str = "openai", *, api: bool = False) -> dict[str, Any]:
    """A JSON-able object in the provider's request shape (see the exporter's ``dump``)."""
    if format == "openai":
        return openai.dump(conv, api=api)
    if format == "anthropic":
        return anthropic.dump(conv, api=api)
    raise ValueError(f"unknown export format {format!r}; expected one of {', '.join(EXPORT_FORMATS)}")


def dumps(conv: Conversation, format: str = "openai", *, api: bool = False, indent: int | None = None) -> str:
    return json.dumps(dump(conv, format, api=api), ensure_ascii=False, indent=indent)


__all__ = ["EXPORT_FORMATS", "FORMATS", "LoadReport", "detect_format", "dump", "dumps", "load", "loads", "read",
           "read_path"]
