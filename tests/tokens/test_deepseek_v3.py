"""DeepSeek V3 by name: its tokenizer.json found where the user put it (a path in the environment, the
Hugging Face cache), checked to be V3's and not a sibling's, and a clear way to get it when it is absent.

Its counts against the reference, on every trace message and on generated text, are checked with the other
tokenizers' (test_counting.py, test_fast_counting.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxfold.errors import TokenizerError
from ctxfold.tokens import counting
from ctxfold.tokens.counting import HFTokenizerCounter
from ctxfold.tokens.deepseek_v3 import ENV_VAR, HF_REPO
from helpers.named_counters import load_or_skip

hf_constants = pytest.importorskip("huggingface_hub.constants", reason="tokenizers brings it; the tokenizers extra")


@pytest.fixture
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No V3 named in the environment, and a Hugging Face cache of our own (empty until a test fills it)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def v3_file() -> Path:
    counter = load_or_skip("deepseek-v3")
    assert isinstance(counter, HFTokenizerCounter)
    return counter.path


def test_without_the_file_the_error_says_how_to_get_it(empty_hf_cache: Path) -> None:
    with pytest.raises(TokenizerError) as info:
        counting._load("deepseek-v3")
    assert f"hf download {HF_REPO} tokenizer.json" in str(info.value)
    assert ENV_VAR in str(info.value)


def test_a_path_that_is_not_a_file_is_named(empty_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(empty_hf_cache / "nowhere.json"))
    with pytest.raises(TokenizerError, match=f"{ENV_VAR} names .*nowhere.json, which is not a file"):
        counting._load("deepseek-v3")


def test_v4s_file_is_refused_as_v3(empty_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """V4 shares V3's vocabulary but adds control tokens: its counts differ on text that types them."""
    v4 = load_or_skip("deepseek-v4")
    assert isinstance(v4, HFTokenizerCounter)
    monkeypatch.setenv(ENV_VAR, str(v4.path))
    with pytest.raises(TokenizerError, match="added control tokens differ from V3's.*pass its path"):
        counting._load("deepseek-v3")


def test_another_vocabulary_is_refused_by_its_size(empty_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenizers import Tokenizer, models

    small = empty_hf_cache / "tokenizer.json"
    Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")])).save(str(small))
    monkeypatch.setenv(ENV_VAR, str(empty_hf_cache))  # a folder holding a tokenizer.json names it
    with pytest.raises(TokenizerError, match="vocabulary has 3 entries, V3's 128,000"):
        counting._load("deepseek-v3")
    small.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        counting._load("deepseek-v3")


def test_found_in_the_hugging_face_cache(v3_file: Path, empty_hf_cache: Path) -> None:
    """The layout ``hf download`` writes: refs/main names the snapshot that holds the file."""
    repo = empty_hf_cache / f"models--{HF_REPO.replace('/', '--')}"
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision, encoding="utf-8")
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "tokenizer.json").write_bytes(v3_file.read_bytes())
    counter = counting._load("deepseek-v3")
    assert isinstance(counter, HFTokenizerCounter) and counter.name == "deepseek-v3"
    assert counter.path == repo / "snapshots" / revision / "tokenizer.json"
    assert counter.backend == "fastokens"


def test_v3_saved_again_is_still_v3_and_reads_think_as_text(
    v3_file: Path, empty_hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another indent and key order is the same tokenizer; <think> is plain text in V3, one token in V4."""
    again = empty_hf_cache / "v3-saved-again.json"
    again.write_text(json.dumps(json.loads(v3_file.read_bytes()), indent=1, sort_keys=True), encoding="utf-8")
    monkeypatch.setenv(ENV_VAR, str(again))
    v3 = counting._load("deepseek-v3")
    v4 = load_or_skip("deepseek-v4")
    assert v3.count("<｜User｜>hi<｜Assistant｜>") == v4.count("<｜User｜>hi<｜Assistant｜>") == 3
    assert v4.count("<think>") == 1 < v3.count("<think>")
