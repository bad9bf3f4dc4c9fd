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


class LogBacklogError(CtxfoldError, OSError):
    """A session's log has been refused writes (a full disk, an archive that refuses) for so long that what
    waits for it in memory is over its bound: the call that raised it did nothing, and nothing is lost."""


class IntegrityError(CtxfoldError):
    """A conversation breaks a structural invariant (orphan tool result, split tool-call group)."""


class NoFitError(CtxfoldError):
    """No request can fit the context window, whatever is compacted: what must be sent (the system
    prompt, the tool definitions, the newest user request, at their smallest) and the reply reserve are
    over it. Raised before the request is sent, never after; ``parts_tokens`` says what takes the room."""

    def __init__(self, context_tokens: int, parts_tokens: dict[str, int], note: str = "") -> None:
        needed = sum(parts_tokens.values())
        parts = " + ".join(f"{name} {n:,}" for name, n in parts_tokens.items())
        super().__init__(
            f"the request cannot fit the {context_tokens:,}-token context window: {parts} = {needed:,} tokens"
            + (f" ({note})" if note else "")
            + "; shorten the newest message, the system prompt or the tools, or lower max_tokens")
        self.context_tokens = context_tokens
        self.parts_tokens = dict(parts_tokens)
        self.needed_tokens = needed


class EngineError(CtxfoldError):
    """An inference engine could not do what ctxfold asked of it (load a model, evaluate tokens, edit its
    KV cache): names the operation and what to change."""


class TemplateRenderError(CtxfoldError, ValueError):
    """The model's chat template refused a conversation (its own ``raise_exception``) or failed on it."""


class TemplateBoundsError(TemplateRenderError):
    """A render of the chat template went past a bound (:mod:`ctxfold.tokens.templates.guard`): its time, its loop
    iterations, the size of a value or of its output, memory, call depth. The template is broken or
    hostile, and is stopped rather than run on. ``reason``: "time", "iterations", "size", "output",
    "memory" (the process grew too much), "oom" (out of memory), "recursion"; ``what``: what it did."""

    def __init__(self, what: str, *, reason: str, template: str | None = None) -> None:
        self.what = what
        self.reason = reason
        self.template = template
        super().__init__(f"chat template {template}: stopped: {what}; fix the template or choose another"
                         if template is not None else what)
