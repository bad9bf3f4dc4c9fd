"""Chat templates: ctxfold's presets (:mod:`ctxfold.tokens.templates.presets`, templates as data) and a model's own
Jinja template (:mod:`ctxfold.tokens.templates.jinja`), found by name with :func:`get_template`.

This module sits above both kinds: the presets know nothing of Jinja, and the Jinja renderer builds on
the presets' request types, so neither imports the other's resolver. Incremental rendering goes through one
protocol, :class:`ctxfold.tokens.templates.session.RenderSession`, that both kinds implement
(:mod:`ctxfold.tokens.templates.preset_session`, :mod:`ctxfold.tokens.templates.jinja_session`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxfold.errors import ConfigError
from ctxfold.tokens.templates.presets import (
    CHATML_QWEN3,
    DEEPSEEK_V4,
    DEEPSEEK_V32,
    DEEPSEEK_V32_API,
    MISTRAL_V7,
    PRESETS,
    Arguments,
    ChatTemplate,
    Part,
    Reasoning,
    RenderedRequest,
    Renderer,
    RenderOptions,
    Segment,
    last_user_index,
    segment_text,
    tool_schema,
)

if TYPE_CHECKING:
    from ctxfold.tokens.templates.jinja_loading import JinjaChatTemplate

__all__ = ["CHATML_QWEN3", "DEEPSEEK_V4", "DEEPSEEK_V32", "DEEPSEEK_V32_API", "JINJA_PRESETS", "MISTRAL_V7",
           "PRESETS", "Arguments", "ChatTemplate", "Part", "Reasoning", "RenderOptions", "RenderedRequest",
           "Renderer", "Segment", "get_template", "last_user_index", "segment_text", "tool_schema"]

# Presets kept as the model's own Jinja text (ctxfold.tokens.templates.sources), rendered through jinja2.
JINJA_PRESETS: tuple[str, ...] = ("gemma-3", "gemma3", "llama-3", "llama-3.1", "llama-3.2", "llama3")


def get_template(spec: str) -> ChatTemplate | JinjaChatTemplate:
    """The chat template ``spec`` names: a preset, or ``hf:PATH``, ``gguf:PATH``, ``file:PATH`` (a model's
    own Jinja template, rendered as transformers renders it; needs jinja2). Raises ConfigError with one
    line a user can act on: an unknown name, a missing file, a file without a template, a template that
    took too long, too much memory or recursed without end when loaded and test-rendered
    (:func:`ctxfold.tokens.templates.loader.load_checked`)."""
    hit = PRESETS.get(spec)
    if hit is not None:
        return hit
    kind, sep, rest = spec.partition(":")
    if spec in JINJA_PRESETS:
        from ctxfold.tokens.templates.jinja_loading import jinja_presets

        return jinja_presets()[spec]
    if sep and kind in ("hf", "gguf", "file") and rest:
        from ctxfold.tokens.templates.loader import load_checked

        # A template from a model file is hostile input: loaded, compiled and test-rendered in a child
        # process with a timeout and a memory limit before this process runs it.
        return load_checked(spec)
    names = ", ".join(sorted({*PRESETS, *JINJA_PRESETS}))
    raise ConfigError(f"unknown chat template {spec!r}; presets: {names}; or hf:PATH, gguf:PATH, file:PATH")
