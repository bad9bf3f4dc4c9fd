"""Flags made from checked settings (ctxfold.settings): a settings dataclass's fields give a command its
flags (names, help, help group, default, the check of the value) and take back the parsed values, so a
setting is spelled once, in its field. A bad value is argparse's usage error (exit 2) naming the flag."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

from ctxfold.errors import ConfigError
from ctxfold.settings import REQUIRED, SAME, Check, Flag, SettingError, check_value, fmt_number

# k = 1024, as context sizes (and byte sizes) are quoted: 16k, 128K, 1M.
_WHOLE_NUMBER = re.compile(r"\s*(-?\d+)\s*([kKmM]?)\s*")
_SUFFIX = {"": 1, "k": 1024, "m": 1024 * 1024}


def flag_type(check: Check, *, null_text: str | None = None) -> Callable[[str], Any]:
    """An argparse ``type`` for a value ``check`` describes: the flag's text to the value, or
    ArgumentTypeError with the problem (argparse puts the flag before it). ``null_text`` is the text
    that means None."""

    def convert(text: str) -> Any:
        if null_text is not None and text == null_text:
            return None
        if check.parse is not None:
            try:
                return check.parse(text)
            except ConfigError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        if check.kind is int:
            return _whole_number(text, check)
        if check.kind is float:
            return _number(text, check)
        try:
            return check_value("", text, check)
        except SettingError as e:
            raise argparse.ArgumentTypeError(e.problem) from None

    return convert


def _whole_number(text: str, check: Check) -> int:
    m = _WHOLE_NUMBER.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (e.g. 16384 or 16k)")
    value = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not check.in_range(value):
        if check.lo == 1 and check.hi is None:
            expected = "a positive whole number (e.g. 16384 or 16k)"
        elif check.lo == 0 and check.hi is None:
            expected = "0 or a positive whole number"
        elif check.hi is None and check.lo is not None:
            expected = f"a whole number of at least {fmt_number(check.lo)}"
        else:
            expected = f"a whole number in {check.interval()}"
        raise argparse.ArgumentTypeError(f"{text!r} must be {expected}")
    return value


def _number(text: str, check: Check) -> float:
    unit = f" of {check.unit}" if check.unit else ""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number{unit}") from None
    if not (math.isfinite(value) and check.in_range(value)):
        if check.hi is None and check.lo is not None:
            bound = f"above {fmt_number(check.lo)}" if check.lo_open else f"of at least {fmt_number(check.lo)}"
        else:
            bound = f"in {check.interval()}"
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number{unit} {bound}")
    return value


def flag_default(f: Field[Any]) -> Any:
    """The default the flag of field ``f`` has: its own where the command line's differs, else the
    field's (REQUIRED when it has none)."""
    flag: Flag = f.metadata["flag"]
    if flag.cli_default is not SAME:
        return flag.cli_default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def _help(flag: Flag, default: Any) -> str:
    shown = fmt_number(default) if isinstance(default, float) else str(default)
    return flag.help.replace("{default}", shown).replace("%", "%%")  # argparse formats help with %


def add_setting_flags(groups: Mapping[str, Any], cls: type[Any]) -> None:
    """Add the flag of every field of dataclass ``cls`` that has one, to ``groups[its group]`` (argparse
    argument groups, or a parser under the key ""). Each flag's dest is its field's name."""
    for f in fields(cls):
        flag: Flag | None = f.metadata.get("flag")
        if flag is None:
            continue
        check: Check = f.metadata["check"]
        default = flag_default(f)
        kw: dict[str, Any] = {"dest": f.name, "help": _help(flag, default)}
        if check.kind is bool:
            # A flag switches a setting away from its default: --no-X turns off what is on.
            kw["action"] = "store_false" if default else "store_true"
        elif check.choices:
            kw["choices"] = check.choices
        else:
            kw["type"] = flag_type(check, null_text=flag.null_text)
            kw["metavar"] = flag.metavar
        if default is REQUIRED:
            kw["required"] = True
        else:
            kw["default"] = default
        groups[flag.group].add_argument(*flag.names, **kw)


def settings_from_args(cls: type[Any], args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s flagged fields in ``args``, by field name (what ``cls(**...)`` takes)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if "flag" in f.metadata}
