"""JSON on hot paths (the proxy's requests, the session logs): orjson when it is installed (the
``serve`` extra), else the standard library. Every request carries the whole history, so this grows
with the conversation: on a 250 KB body orjson reads in 0.27 ms what ``json`` reads in 0.76 ms, and
it writes strings about fifty times faster.

What parses, and to what, is the same either way. Where orjson refuses what ``json`` accepts (NaN,
a lone surrogate escape, 1e400), ``json`` decides. orjson reads an integer beyond 64 bits as a float,
which ``json`` does not; a text with a number of 19 digits or more (where such an integer could
hide) goes to ``json``. The check is the core's scan (``_core.has_long_number``): digits inside
strings do not count, and strings are skipped with memchr, so it costs a tenth of orjson's parse
(a byte translation of the whole text cost as much as the parse). Writing, orjson would turn NaN
into null: only what orjson itself read (which holds no NaN) is written by it, or what is checked
to hold none (:func:`dumps_record`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ctxfold import _core

try:
    import orjson
except ImportError:  # optional: the standard library does the same, slower
    orjson = None  # type: ignore[assignment]

# orjson reads integers exactly from -2**63 to 2**64 - 1. 19 digits: the shortest literal outside that
# range (-9223372036854775809); a positive one needs 20.
_LONG_NUMBER_DIGITS = 19


def _has_long_number(data: bytes | str) -> bool:
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    return _core.has_long_number(raw, _LONG_NUMBER_DIGITS)


def loads_tagged(data: bytes | str) -> tuple[Any, bool]:
    """``json.loads`` of UTF-8 bytes or a str, and whether orjson read it (then :func:`dumps` may write
    it with orjson too). Raises ValueError (``json.JSONDecodeError``, or ``UnicodeDecodeError`` for
    bytes that are not UTF-8)."""
    if orjson is not None and not _has_long_number(data):
        try:
            return orjson.loads(data), True
        except orjson.JSONDecodeError:
            pass  # json gives the verdict
    return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data), False


def loads(data: bytes | str) -> Any:
    """``json.loads``, faster (see :func:`loads_tagged`)."""
    return loads_tagged(data)[0]


def dumps(value: Any, *, fast: bool = False) -> bytes:
    """Compact UTF-8 JSON (lone surrogates kept as they came). ``fast``: ``value`` holds no float
    that is not finite (what :func:`loads_tagged` read with orjson, plus plain strings and lists),
    so orjson may write it."""
    if fast and orjson is not None:
        try:
            return orjson.dumps(value)
        except (orjson.JSONEncodeError, TypeError):
            pass  # a lone surrogate, or an integer beyond 64 bits: json writes it
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def dumps_record(value: Any) -> bytes:
    """Compact JSON for a file read back with :func:`loads` (a session's event log): valid UTF-8
    whatever the strings hold (a lone surrogate is written as its escape, and reads back the same),
    and every value as ``json`` would read it back (NaN stays NaN)."""
    if orjson is not None:
        try:
            out = orjson.dumps(value)
        except (orjson.JSONEncodeError, TypeError):
            pass  # a lone surrogate, an integer beyond 64 bits, a key that is not a str: json writes it
        else:
            # orjson writes a float that is not finite as null: only where it wrote a null can one hide.
            if b"null" not in out or not _has_non_finite(value):
                return out
    return dumps_text(value).encode()


def dumps_text(value: Any, separators: tuple[str, str] | None = (",", ":")) -> str:
    """``json.dumps`` that always encodes as UTF-8: characters as they are, but a text holding a lone
    surrogate with escapes (which read back the same). ``separators``: as ``json.dumps`` takes them."""
    text = json.dumps(value, ensure_ascii=False, separators=separators)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=separators)
    return text


def _has_non_finite(value: Any) -> bool:
    # Iterative, strings skipped by one type check: a message event is a few dozen nodes.
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is str:
            continue
        if t is dict:
            stack.extend(v.values())
        elif t is list or t is tuple:
            stack.extend(v)
        elif isinstance(v, float) and not math.isfinite(v):
            return True
        elif isinstance(v, Mapping):
            stack.extend(v.values())
    return False
