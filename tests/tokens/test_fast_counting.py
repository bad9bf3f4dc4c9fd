"""The fast exact counter (fastokens) gives the reference tokenizer's counts, or stands aside saying why.

The reference is the tokenizer's own library (Hugging Face ``tokenizers``, tiktoken), loaded here with
the fast path off; for Mistral's tekken and Meta's Llama 3 and 4, whose tiktoken Encodings ctxfold builds
itself, mistral-common's Tekkenizer and Meta's Tokenizer too. Every message of every shared trace is checked in test_counting.py (the slow tier);
here: generated texts of the shapes where pre-tokenizers differ, every shared request as rendered, the
guard that keeps a disagreeing fast counter out, and the default counter.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxfold.chat import formats
from ctxfold.errors import FormatError
from ctxfold.tokens import fast_bpe
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import (
    DEFAULT_TOKENIZER,
    EstimateCounter,
    HFTokenizerCounter,
    TiktokenCounter,
    TokenCounter,
    load_counter,
)
from ctxfold.tokens.templates import get_template
from helpers import meta_reference
from helpers.named_counters import load_or_skip
from helpers.tekken_reference import reference_count

pytest.importorskip("fastokens", reason="the fast exact counter is in the tokenizers extra")

BPE_TOKENIZERS = ["deepseek-v4", "deepseek-v3", "qwen3", "o200k_base", "cl100k_base", "tekken", "llama3", "llama4"]


@functools.cache
def _pair(name: str) -> tuple[TokenCounter, TokenCounter]:
    fast = load_or_skip(name)
    if isinstance(fast, HFTokenizerCounter):
        return fast, HFTokenizerCounter(fast.path, fast=False)
    assert isinstance(fast, TiktokenCounter)
    return fast, TiktokenCounter(fast.name, fast=False)


@pytest.mark.parametrize("name", BPE_TOKENIZERS)
def test_the_byte_level_bpe_tokenizers_count_through_the_fast_path(name: str) -> None:
    fast, ref = _pair(name)
    assert getattr(fast, "backend", None) == "fastokens"
    assert getattr(ref, "backend", None) in ("tokenizers", "tiktoken")


# Pieces whose joins stress pre-tokenizers: whitespace runs before words and newlines, contractions,
# digit groups, CJK next to Latin, emoji with modifiers, code, and control tokens typed in text.
_PIECES = st.sampled_from([
    " ", "  ", "\t", "\n", "\r\n", "\n\n\n", "   \n", "\u00a0", "\u3000", "\u2028",
    "'s", "'T", "'re", "'ll", "n't", "I'M",
    "0", "12", "123", "1234", "3.14", "1e-9", "٣٤٥",
    "中文", "日本語の", "한국어", "العربية", "Ελληνικά", "Ωmega",
    "😀", "👍🏽", "🏳️‍🌈", "∑∫", "→",
    "def", "f(x)", "{'k': [1, 2]}", "->", "::", "/*", "*/", "#!", "==", "!==", "...",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<｜User｜>", "<｜Assistant｜>", "<s>", "</s>", "[INST]",
    "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[IMG_BREAK]", "<unk>", "<SPECIAL_42>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>", "<|python_tag|>", "<|header_start|>", "<|eot|>",
    # DeepSeek's: V3 reads the first four as one token each; <think>, the placeholders' slots and DSML are
    # single tokens in R1, V3.1, V3.2 and V4 only.
    "<｜fim▁hole｜>", "<｜tool▁calls▁begin｜>", "<|EOT|>", "<｜begin▁of▁sentence｜>", "<think>", "</think>",
    "<｜place▁holder▁no▁798｜>", "｜DSML｜", "<｜search▁begin｜>",
    "Hello", "WORLD", "camelCase", "snake_case", "ALLCAPS", "x",
])
_TEXTS = st.one_of(
    st.lists(_PIECES, max_size=40).map("".join),
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec="utf-8", categories=["Zs", "Cc", "Nd", "Lu", "Ll", "Lo", "Mn", "So", "Po"]), max_size=120),
)


@pytest.mark.parametrize("name", BPE_TOKENIZERS)
@settings(max_examples=150, deadline=None,  # a loaded machine generates slowly: not a finding
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(texts=st.lists(_TEXTS, min_size=1, max_size=8))
def test_fast_counts_equal_the_reference_on_generated_text(name: str, texts: list[str]) -> None:
    fast, ref = _pair(name)
    want = [ref.count(t) for t in texts]
    if name == "tekken":  # ctxfold built this reference from the JSON: mistral-common's own must agree
        assert [reference_count(fast.name, t) for t in texts] == want
    if name.startswith("llama"):  # the same from llama-models' ranks: Meta's own tokenizer must agree
        assert [meta_reference.reference_count(name, t) for t in texts] == want
    assert [fast.count(t) for t in texts] == want
    assert fast.count_batch(texts).tolist() == want


@pytest.mark.slow
@pytest.mark.parametrize(("name", "template"), [("deepseek-v4", "deepseek-v4"), ("qwen3", "chatml")])
def test_every_shared_request_counts_the_same_as_the_reference(traces_dir: Path, name: str, template: str) -> None:
    """Each conversation of the shared traces rendered whole, as the engine receives it (control tokens
    included), counted by the fast path and by the reference tokenizer."""
    fast, ref = _pair(name)
    requests = 0
    for path in sorted(p for p in traces_dir.rglob("*") if p.suffix in (".json", ".jsonl", ".traj")):
        try:
            conversations = formats.load(path)
        except FormatError:  # licence files and indexes are not traces
            continue
        for conv in conversations:
            acct = RequestAccounting(fast, get_template(template))
            acct.reset(conv)
            text = acct.request_text()
            assert fast.count(text) == ref.count(text), (path.name, conv.id)
            requests += 1
    assert requests >= 221  # every conversation of every set


def test_a_fast_counter_that_disagrees_is_kept_out_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    fast, _ = _pair("deepseek-v4")
    assert isinstance(fast, HFTokenizerCounter)
    with caplog.at_level(logging.WARNING, logger="ctxfold.tokens.fast_bpe"):
        off = fast_bpe.fast_tokenizer_json(fast.path, lambda s: fast.count(s) + (s == "hello world"))
    assert off is None
    assert "counted 2 tokens where the reference counts 3" in caplog.text


def test_a_text_the_fast_path_refuses_is_answered_by_the_reference() -> None:
    fast, _ = _pair("deepseek-v4")
    with pytest.raises(ValueError, match="surrogate"):
        fast.count("ok \ud800 not ok")  # the reference names what cannot be encoded
    assert fast.count_batch(["a", "b c"]).tolist() == [1, 2]


def test_the_default_counter_is_exact_when_installed() -> None:
    counter = load_counter(DEFAULT_TOKENIZER)
    assert counter.exact and counter.name == "deepseek-v4"


def test_without_the_fast_counter_the_default_is_the_estimate_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ctxfold.tokens import counting

    monkeypatch.setattr(fast_bpe, "_installed", lambda: None)
    monkeypatch.setattr(counting, "_cache", {})
    with caplog.at_level(logging.WARNING, logger="ctxfold.tokens.counting"):
        counter = load_counter("auto:qwen3")
    assert isinstance(counter, EstimateCounter) and not counter.exact
    assert "counting qwen3 tokens with its estimate" in caplog.text
    assert "the fast exact counter is not installed; pip install 'ctxfold[tokenizers]'" in caplog.text


@pytest.mark.slow
def test_the_tekken_ranks_file_is_written_once_and_a_corrupt_one_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fastokens reads tekken's ranks from a .tiktoken file ctxfold writes into its cache, named by content:
    both shipped releases share one file, and a damaged file is written again, not trusted."""
    monkeypatch.setenv("CTXFOLD_CACHE_DIR", str(tmp_path))
    first = TiktokenCounter("tekken-240911")
    assert first.backend == "fastokens"
    files = list((tmp_path / "tiktoken").iterdir())
    assert [f.name.startswith("tekken-") and f.suffix == ".tiktoken" for f in files] == [True]
    files[0].write_bytes(b"garbage")
    again = TiktokenCounter("tekken-240718")
    assert again.backend == "fastokens" and list((tmp_path / "tiktoken").iterdir()) == files
    assert again.count("[TOOL_CALLS] 1234") == reference_count("tekken-240718", "[TOOL_CALLS] 1234")
