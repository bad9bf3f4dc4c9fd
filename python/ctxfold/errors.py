"""The exception contract.

Bad input raises a specific exception with a message a user can act on (what, where, what to do):
``ValueError`` for a bad value, ``IndexError`` for an index out of range, and subclasses of
:class:`CtxfoldError` for the rest. In a serving loop an expected failure (a summary that timed
out) is a result, not an exception.
"""

from __future__ import annotations


class CtxfoldError(Exception):
    """Base class of every ctxfold-specific error."""


class FormatError(CtxfoldError, ValueError):
    """A trace or message could not be read: names the file, the line or index, and what was expected."""

    def __init__(self, message: str, *, source: str | None = None, location: str | None = None) -> None:
        where = ", ".join(x for x in (source, location) if x)
        super().__init__(f"{where}: {message}" if where else message)
        self.source = source
        self.location = location
        self.reason = message


class TokenizerError(CtxfoldError):
    """A tokenizer could not be loaded (missing or corrupt file, unknown name, missing package)."""


class ConfigError(CtxfoldError, ValueError):
    """A configuration value is invalid: names the key, the value and the allowed range."""


class ArchiveError(CtxfoldError):
    """An archive could not be written or read."""


class IntegrityError(CtxfoldError):
    """A conversation breaks a structural invariant (orphan tool result, split tool-call group)."""
