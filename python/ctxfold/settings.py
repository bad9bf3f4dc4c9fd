"""Checked settings: the one description of a setting that its checks, and its command-line flag, come from.

A frozen dataclass field made with :func:`setting` carries a :class:`Check` (kind, bounds, choices, an extra
rule) and, where a command sets it, a :class:`Flag` (names, help, metavar, help group). The dataclass's
``__post_init__`` runs :func:`validate_fields`, so a value is checked the same way whether it came from a
file (:class:`ctxfold.compaction.config.CompactConfig`), an embedder's code or a flag (:class:`ctxfold.serve.config
.ProxyConfig`); ``ctxfold.cli._flags`` makes the flags, and reads them back, from the same fields. A
setting is so spelled once: its field.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from ctxfold.errors import ConfigError

REQUIRED: Any = MISSING  # setting()'s default for a field without one (an embedder must give it)
# A Flag's cli_default when the command line's default is the field's own (the usual case).
SAME: Any = object()


class SettingError(ConfigError):
    """A value a :class:`Check` refused. The message starts with the setting's key; ``problem`` is the rest,
    for a caller that names the setting its own way (a flag)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Check:
    """What a setting's value may be. ``kind`` is bool, int, float, str, dict (a mapping), Path (a file
    system path: text or os.PathLike, kept as a Path) or any other class (an instance of it)."""

    kind: type
    lo: float | None = None  # lower bound, inclusive unless lo_open
    hi: float | None = None  # upper bound, inclusive unless hi_open
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()  # allowed strings, when the setting is an enumeration
    optional: bool = False  # None is allowed (means "unknown" or "use the rule")
    unit: str = ""  # what a number counts ("seconds"), for the command line's messages
    # A test the kind and bounds cannot say (a URL's scheme, a header name's characters): the problem as
    # the message's tail ("'x' is not an http(s) URL; ..."), None when the value passes. It names the value
    # itself, so that it can leave a secret out.
    rule: Callable[[Any], str | None] | None = None
    # A flag's text to a value of a kind that is neither text nor a number (a price table); it raises
    # ConfigError with the problem.
    parse: Callable[[str], Any] | None = None

    def allowed(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            return "a string"
        if self.kind is dict:
            return "a mapping"
        if self.kind is Path:
            return "a path"
        if self.kind not in (int, float):
            return f"a {self.kind.__name__}"
        noun = "an integer" if self.kind is int else "a number"
        if self.lo is None and self.hi is None:
            return noun
        return f"{noun} in {self.interval()}"

    def interval(self) -> str:
        """The bounds in interval notation: ``[1, inf)``, ``(0, 1]``."""
        lo = "-inf" if self.lo is None else fmt_number(self.lo)
        hi = "inf" if self.hi is None else fmt_number(self.hi)
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        return f"{left}{lo}, {hi}{right}"

    def in_range(self, value: float) -> bool:
        """Whether a number lies within the bounds (finite numbers; the kind is checked before)."""
        too_low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        too_high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        return not (too_low or too_high)


def fmt_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def check_value(key: str, value: Any, check: Check) -> Any:
    """Validate one value; returns it normalised (int -> float for float fields, text -> Path for paths).
    Raises :class:`SettingError` (a ConfigError) starting with ``key``."""
    if value is None:
        if check.optional:
            return None
        raise SettingError(key, f"null is not allowed; expected {check.allowed()}")
    value = _kind_checked(key, value, check)
    if check.rule is not None:
        problem = check.rule(value)
        if problem is not None:
            raise SettingError(key, problem)
    return value


def _kind_checked(key: str, value: Any, check: Check) -> Any:
    if check.kind is bool:
        if not isinstance(value, bool):
            raise SettingError(key, f"{value!r} is not a boolean; expected true or false")
        return value
    if check.kind is str:
        if not isinstance(value, str):
            raise SettingError(key, f"{value!r} is not a string; expected {check.allowed()}")
        if check.choices and value not in check.choices:
            hint = did_you_mean(value, check.choices)
            raise SettingError(key, f"{value!r} is not {check.allowed()}{hint}")
        return value
    if check.kind is dict:
        if not isinstance(value, Mapping):
            raise SettingError(key, f"{value!r} is not a mapping")
        return dict(value)
    if check.kind is Path:
        text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
        # Path("") is ".": an empty setting (an unset shell variable) would quietly mean the working directory.
        if not isinstance(text, str) or not text or "\0" in text:
            raise SettingError(key, f"{value!r} is not a path; expected the name of a file or directory")
        return Path(text)
    if check.kind not in (int, float):
        if not isinstance(value, check.kind):
            raise SettingError(key, f"{value!r} is not {check.allowed()}")
        return value
    return _number(key, value, check)


def _number(key: str, value: Any, check: Check) -> Any:
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            raise SettingError(key, f"{value!r} is not {check.allowed()}") from None
        raise SettingError(
            key, f"{value!r} is a quoted string, expected {check.allowed()}; write the number without quotes"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingError(key, f"{value!r} is not {check.allowed()}")
    if check.kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise SettingError(key, f"{value!r} is not {check.allowed()}")
            value = int(value)
    else:
        if not math.isfinite(value):
            raise SettingError(key, f"{value!r} is not {check.allowed()}")
        value = float(value)
    if not check.in_range(value):
        raise SettingError(key, f"{value!r} is out of range {check.interval()}")
    return value


def did_you_mean(word: str, options: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True, slots=True)
class Flag:
    """The command-line flag that sets a field (``ctxfold.cli._flags`` makes it)."""

    names: tuple[str, ...]  # the flag and its aliases, e.g. ("--max-loaded-sessions", "--max-loaded-conversations")
    help: str  # "{default}" in it is replaced with the default the flag has
    metavar: str | None = None
    group: str = ""  # the --help section it is listed in
    # The command line's default where it differs from an embedder's (each such field says why); SAME:
    # the field's own.
    cli_default: Any = SAME
    null_text: str | None = None  # the flag's text that means None ("none" for --template)


def setting(default: Any = REQUIRED, check: Check | None = None, *flag_names: str, help: str = "",
            metavar: str | None = None, group: str = "", cli_default: Any = SAME, null_text: str | None = None,
            via: str = "", default_factory: Any = MISSING, repr: bool = True) -> Any:
    """A dataclass field with its check and, given ``flag_names``, its flag. ``via`` names what sets the
    field on the command line when no flag of its own does (an environment variable's flag, a file)."""
    metadata: dict[str, Any] = {}
    if check is not None:
        metadata["check"] = check
    if flag_names:
        metadata["flag"] = Flag(flag_names, help, metavar, group, cli_default, null_text)
    if via:
        metadata["via"] = via
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata, repr=repr)
    return field(default=default, metadata=metadata, repr=repr)


def validate_fields(obj: Any, path: str) -> None:
    """Check (and normalise) every field of a frozen dataclass that carries a Check; ``path`` prefixes
    the field names in messages ("major" -> "major.token_threshold")."""
    for f in fields(obj):
        check = f.metadata.get("check")
        if check is None:
            continue
        value = check_value(f"{path}.{f.name}" if path else f.name, getattr(obj, f.name), check)
        object.__setattr__(obj, f.name, value)


def field_check(cls: type[Any], name: str) -> Check:
    """The Check of field ``name`` of dataclass ``cls`` (for a flag that sets it from outside the class)."""
    found: Field[Any] = next(f for f in fields(cls) if f.name == name)
    check: Check = found.metadata["check"]
    return check
