"""What every importer shares: decoding, JSON/JSONL parsing with locations, lenient skipping."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ctxfold.chat.messages import Content, ContentPart, Message, Role, Usage
from ctxfold.errors import FormatError

T = TypeVar("T")

ROLES = "system, user, assistant, tool"


@dataclass(slots=True)
class Reader:
    """Where we are reading from and what to do with a bad record."""

    source: str  # a path or "<string>", named in every error
    lenient: bool  # skip bad records (and count them) instead of raising
    skipped: list[str] = field(default_factory=list)  # one line per skipped record: where and why
    ignored: Counter[str] = field(default_factory=Counter)  # non-conversation records passed over, by kind

    def error(self, message: str, location: str | None = None) -> FormatError:
        return FormatError(message, source=self.source, location=location)

    def guard(self, location: str, fn: Callable[[], T]) -> T | None:
        """Run ``fn``; in lenient mode a FormatError skips the record (``None``) and is counted."""
        try:
            return fn()
        except FormatError as exc:
            if not self.lenient:
                if exc.source is None:  # raised deep down without a place: add ours
                    raise self.error(exc.reason, location) from None
                raise
            self.skipped.append(str(exc) if exc.source else f"{self.source}, {location}: {exc.reason}")
            return None

    def meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.skipped:
            out["skipped_records"] = len(self.skipped)
            out["skipped"] = list(self.skipped)
        if self.ignored:
            out["ignored_records"] = dict(self.ignored)
        return out


@dataclass(frozen=True, slots=True)
class Document:
    """A parsed file: one JSON value, or the records of a JSONL file with their line numbers."""

    value: Any = None  # the JSON value when the file is one document
    records: tuple[tuple[int, Any], ...] | None = None  # (line number, value) per JSONL line

    @property
    def is_jsonl(self) -> bool:
        return self.records is not None


def decode(data: bytes | str, reader: Reader) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        if reader.lenient:
            # Lenient: keep going; the JSONL pass below re-decodes line by line and skips bad lines.
            return data.decode("utf-8-sig", errors="surrogateescape")
        raise reader.error(
            f"invalid UTF-8 at byte {exc.start} ({exc.reason}); expected a UTF-8 encoded JSON or JSONL file",
            f"line {line}",
        ) from None


def _has_surrogate_escape(line: str) -> bool:
    # surrogateescape maps each undecodable byte to U+DC80..U+DCFF; JSON text never holds lone
    # surrogates as raw characters, so their presence means the line had invalid UTF-8.
    return any("\udc80" <= ch <= "\udcff" for ch in line)


def parse(data: bytes | str, reader: Reader) -> Document:
    """One JSON document, or JSONL when the text is several JSON values one per line.

    Linear in the input: one ``json.loads`` over the text; a JSONL file costs one more pass.
    """
    text = decode(data, reader)
    # Only a lenient decode of bad bytes leaves escape surrogates; skip the per-line scan otherwise.
    maybe_escaped = reader.lenient and isinstance(data, bytes) and _has_surrogate_escape(text)
    stripped = text.lstrip()
    if not stripped:
        raise reader.error("empty input; expected a JSON document or JSON lines")
    if stripped[0] not in "[{":
        raise reader.error(f"starts with {stripped[:20]!r}; expected a JSON object or array", "line 1")
    try:
        return Document(value=json.loads(text))
    except json.JSONDecodeError as exc:
        first_error = exc
    except RecursionError:
        raise reader.error("JSON nested too deeply; expected messages, not a deep structure") from None
    # Not one document. JSONL if the first non-empty line is a complete JSON value by itself.
    first_line = stripped.split("\n", 1)[0]
    try:
        json.loads(first_line)
        is_jsonl = "\n" in stripped.rstrip()
    except (json.JSONDecodeError, RecursionError):
        is_jsonl = False
    if not is_jsonl:
        e = first_error
        raise reader.error(
            f"invalid JSON: {e.msg} (column {e.colno}); expected one JSON document, or one JSON value a line",
            f"line {e.lineno}",
        ) from None
    records: list[tuple[int, Any]] = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue

        def one(line: str = line, lineno: int = lineno) -> Any:
            if maybe_escaped and _has_surrogate_escape(line):
                raise reader.error("invalid UTF-8 in this line; expected UTF-8 text", f"line {lineno}")
            try:
                return json.loads(line)
            except json.JSONDecodeError as exc:
                raise reader.error(
                    f"invalid JSON: {exc.msg} (column {exc.colno}); expected one complete JSON value a line",
                    f"line {lineno}",
                ) from None

        value = reader.guard(f"line {lineno}", one)
        if value is not None:
            records.append((lineno, value))
    return Document(records=tuple(records))


def type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", type(None): "null", bool: "boolean", int: "number",
            float: "number"}.get(
        type(value), type(value).__name__
    )


def expect_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FormatError(f"{what} is a JSON {type_name(value)}; expected an object")
    return value


def expect_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise FormatError(f"{what} is a JSON {type_name(value)}; expected an array")
    return value


def expect_str(value: Any, what: str, *, optional: bool = False) -> str:
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise FormatError(f"{what} is a JSON {type_name(value)}; expected a string")
    return value


def role_of(value: Any, allowed: Mapping[str, Role], what: str = "'role'") -> Role:
    if isinstance(value, str) and value in allowed:
        return allowed[value]
    raise FormatError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def openai_usage(raw: Any) -> Usage | None:
    """OpenAI-style usage; DeepSeek's ``prompt_cache_hit_tokens`` or ``prompt_tokens_details.cached_tokens``."""
    if not isinstance(raw, dict):
        return None
    cached = int_or_none(raw.get("prompt_cache_hit_tokens"))
    details = raw.get("prompt_tokens_details")
    if cached is None and isinstance(details, dict):
        cached = int_or_none(details.get("cached_tokens"))
    return Usage(
        prompt_tokens=int_or_none(raw.get("prompt_tokens")),
        completion_tokens=int_or_none(raw.get("completion_tokens")),
        cached_prompt_tokens=cached,
        extra=raw,
    )


def anthropic_usage(raw: Any) -> Usage | None:
    """Anthropic usage: the prompt is input + cache writes + cache reads (all three were sent)."""
    if not isinstance(raw, dict):
        return None
    parts = [int_or_none(raw.get(k)) for k in ("input_tokens", "cache_creation_input_tokens",
                                                 "cache_read_input_tokens")]
    prompt = None if parts[0] is None else sum(p or 0 for p in parts)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=int_or_none(raw.get("output_tokens")),
        cached_prompt_tokens=parts[2],
        extra=raw,
    )


def simple_content(parts: list[ContentPart]) -> Content:
    """Plain text when the parts are one text part (or none); the parts otherwise."""
    if not parts:
        return ""
    if len(parts) == 1 and parts[0].type == "text" and parts[0].text is not None and set(parts[0].data) <= {
        "type"
    }:
        return parts[0].text
    return tuple(parts)


def assign_ids(messages: list[Message], prefix: str) -> list[Message]:
    """Give every message without an id a deterministic one: ``prefix`` + its index."""
    return [m if m.id else replace(m, id=f"{prefix}{i}") for i, m in enumerate(messages)]


def iter_records(doc: Document) -> Iterator[tuple[str, Any]]:
    """(location, value) for each record: JSONL lines, or array items."""
    if doc.records is not None:
        for lineno, value in doc.records:
            yield f"line {lineno}", value
    elif isinstance(doc.value, list):
        for i, value in enumerate(doc.value):
            yield f"index {i}", value
    else:
        yield "document", doc.value
