"""The ``gguf:PATH`` counter: a GGUF model's own tokenizer through llama.cpp (vocabulary only).

Its counts must be what llama-cpp-python's own ``Llama`` (loaded the same way, ``vocab_only=True``) gives for
the text of a rendered chat prompt (``tokenize(..., add_bos=False, special=True)``, as its chat handlers
call it), on real trace text; the errors a user can meet are one plain line.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ctxfold.errors import TokenizerError
from ctxfold.tokens.calibration import read_corpus
from ctxfold.tokens.counting import GgufCounter, load_counter
from helpers.gemma_gguf import gemma_gguf_path, require_llama_cpp


@pytest.fixture(scope="module")
def gguf() -> Path:
    require_llama_cpp()
    return gemma_gguf_path()


@pytest.fixture(scope="module")
def reference(gguf: Path) -> object:
    """llama-cpp-python's own Llama over the same file, vocabulary only."""
    import llama_cpp

    return llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)


def _ref_count(reference: object, text: str) -> int:
    return len(reference.tokenize(text.encode("utf-8"), add_bos=False, special=True))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def trace_texts(traces_dir: Path) -> list[str]:
    texts = [t for g in read_corpus([traces_dir]) for t in g.texts]
    assert len(texts) > 5000
    return texts


def test_counts_equal_llama_cpp_on_chat_markup(gguf: Path, reference: object) -> None:
    counter = load_counter(f"gguf:{gguf}")
    assert isinstance(counter, GgufCounter) and counter.exact
    assert counter.name == f"gguf:{gguf.name}"
    texts = ["", " ", "hello world", "<start_of_turn>user\nFix the bug.<end_of_turn>\n<start_of_turn>model\n",
             "<bos>", "a\n\n\n  b\t\tc", "naïve café 日本語 🙂", "x" * 5000]
    for t in texts:
        assert counter.count(t) == _ref_count(reference, t), t[:40]
    # The turn markers are one token each (special text parsed, as the engine does for a chat prompt).
    start = counter.token_id("<start_of_turn>")
    assert start is not None and counter.count("<start_of_turn>") == 1
    ids = counter.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert ids.dtype == np.int32 and int(ids[0]) == start
    assert counter.token_id("hello world, twice") is None
    # bytes are strict UTF-8, like every counter's
    assert counter.count("café".encode()) == counter.count("café")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        counter.count(b"\xff\xfe")


def test_counts_equal_llama_cpp_on_a_sample_of_trace_text(gguf: Path, reference: object,
                                                          trace_texts: list[str]) -> None:
    counter = load_counter(f"gguf:{gguf}")
    sample = trace_texts[:: max(1, len(trace_texts) // 300)]
    got = counter.count_batch(sample)
    assert got.dtype == np.int64 and len(got) == len(sample)
    assert got.tolist() == [_ref_count(reference, t) for t in sample]


@pytest.mark.slow
def test_counts_equal_llama_cpp_on_every_trace_message(gguf: Path, reference: object,
                                                       trace_texts: list[str]) -> None:
    counter = load_counter(f"gguf:{gguf}")
    got = counter.count_batch(trace_texts)
    want = [_ref_count(reference, t) for t in trace_texts]
    bad = [i for i, (a, b) in enumerate(zip(got.tolist(), want, strict=True)) if a != b]
    assert not bad, f"{len(bad)} of {len(want)} texts differ, first: {trace_texts[bad[0]][:80]!r}"


def test_threads_count_the_same(gguf: Path, trace_texts: list[str]) -> None:
    counter = load_counter(f"gguf:{gguf}")
    sample = trace_texts[:400]
    want = counter.count_batch(sample).tolist()
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(offset: int) -> None:  # each thread walks the sample from another place
        try:
            results[offset] = [counter.count(t) for t in sample[offset:] + sample[:offset]]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k * 37,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert {offset: got for offset, got in results.items()} == {
        k * 37: want[k * 37:] + want[:k * 37] for k in range(4)}


def test_a_path_ending_in_gguf_loads_the_same_counter(gguf: Path) -> None:
    counter = load_counter(str(gguf))
    assert isinstance(counter, GgufCounter)
    assert counter.count("<start_of_turn>user\nhi") == load_counter(f"gguf:{gguf}").count("<start_of_turn>user\nhi")


def test_errors_are_one_plain_line(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="GGUF file not found"):
        GgufCounter(tmp_path / "missing.gguf")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(TokenizerError, match=r"not a GGUF file .*pass a \.gguf model file") as info:
        load_counter(f"gguf:{not_gguf}")
    assert "\n" not in str(info.value)


def test_without_llama_cpp_python_the_error_says_what_to_install(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import ctxfold.tokens.llama_model as adapter

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    monkeypatch.setattr(adapter, "_lib_module", None)
    with pytest.raises(TokenizerError, match=r"llama-cpp-python.*pip install 'ctxfold\[llama\]'"):
        GgufCounter(fake)
