"""Summarizers behind one protocol, the summary request and the answer's post-processing.

- :class:`ExtractiveSummarizer`: no model; the default and the fallback of every other one.
- :class:`OpenAICompatibleSummarizer`: any OpenAI-compatible ``/chat/completions`` endpoint, streamed.
- :class:`CallableSummarizer`: an in-process generator (engines that generate themselves).
- :class:`ChunkedSummarizer`: rolling summaries when the summary request itself does not fit.
- :class:`FallbackSummarizer`: fail-open wrapper (extractive on failure).

:func:`make_summarizer` builds the configured one from a :class:`~ctxfold.compaction.config.CompactConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ctxfold.compaction.config import CompactConfig, SummarizerConfig
from ctxfold.compaction.summarize.base import (
    CutReason,
    Summarizer,
    SummaryResult,
    TokenCallback,
    TokenCounter,
    count_tokens,
)
from ctxfold.compaction.summarize.callable import CallableSummarizer, GenerateFn
from ctxfold.compaction.summarize.chunked import ChunkedSummarizer, render_chunk, split_into_chunks
from ctxfold.compaction.summarize.extractive import ExtractiveSummarizer, extractive_summary
from ctxfold.compaction.summarize.fallback import FallbackSummarizer
from ctxfold.compaction.summarize.openai import OpenAICompatibleSummarizer
from ctxfold.compaction.summarize.postprocess import (
    CONTROL_MARKERS,
    EOS_MARKERS,
    StreamCutter,
    clean_summary,
    garbage_reason,
    trim_to_tokens,
    with_trail,
)
from ctxfold.compaction.summarize.request import (
    FRAME_CLOSE,
    FRAME_OPEN,
    SUMMARY_CONTRACT,
    SUMMARY_TEXT_KEY,
    SummaryRequest,
    build_summary_request,
    contract_text,
    to_openai_messages,
)
from ctxfold.errors import ConfigError


def make_summarizer(
    config: CompactConfig | SummarizerConfig,
    *,
    counter: TokenCounter | None = None,
    generate: GenerateFn | None = None,
    environ: Mapping[str, str] | None = None,
) -> Summarizer:
    """The summarizer the configuration asks for (``summarizer.kind``); ``generate`` is the callable for
    kind "callable". Raises ConfigError when the kind needs something that is missing (an endpoint, a model,
    a callable), naming the key and the environment variable that can supply it."""
    sc = config.summarizer if isinstance(config, CompactConfig) else config
    timeout_s = config.summary.timeout_s if isinstance(config, CompactConfig) else 120.0
    if sc.kind == "extractive":
        return ExtractiveSummarizer(counter=counter)
    if sc.kind == "openai":
        return OpenAICompatibleSummarizer.from_config(config, counter=counter, environ=environ)
    if generate is None:
        raise ConfigError("summarizer.kind: 'callable' needs a generate function; pass generate=... to "
                          "make_summarizer (or choose kind 'extractive' or 'openai')")
    return CallableSummarizer(generate, counter=counter, timeout_s=timeout_s)


__all__ = [
    "CONTROL_MARKERS",
    "EOS_MARKERS",
    "FRAME_CLOSE",
    "FRAME_OPEN",
    "SUMMARY_CONTRACT",
    "SUMMARY_TEXT_KEY",
    "CallableSummarizer",
    "ChunkedSummarizer",
    "CutReason",
    "ExtractiveSummarizer",
    "FallbackSummarizer",
    "GenerateFn",
    "OpenAICompatibleSummarizer",
    "StreamCutter",
    "Summarizer",
    "SummaryRequest",
    "SummaryResult",
    "TokenCallback",
    "TokenCounter",
    "build_summary_request",
    "clean_summary",
    "contract_text",
    "count_tokens",
    "extractive_summary",
    "garbage_reason",
    "make_summarizer",
    "render_chunk",
    "split_into_chunks",
    "to_openai_messages",
    "trim_to_tokens",
    "with_trail",
]
