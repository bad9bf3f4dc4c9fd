"""The byte-class estimator: C++ features against a plain-Python reference, its measured error on
held-out conversations for each built-in calibration beside chars/4, and ``ctxfold calibrate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold import _core
from ctxfold.cli import main
from ctxfold.tokens.calibration import (
    ADVERSARIAL_CLASSES,
    TextGroup,
    adversarial_groups,
    exact_counts,
    fit_coefficients,
    measure_bounds,
    read_corpus,
    split,
)
from ctxfold.tokens.counting import (
    Calibration,
    EstimateCounter,
    builtin_calibration,
    builtin_calibrations,
    load_counter,
)


def reference_features(data: bytes, fallback: frozenset[int] = frozenset()) -> list[int]:
    """Plain-Python AccumulateFeatures: classes per character, runs, runs of 2+ spaces, tabs, case,
    consonant clusters, line breaks after 2+ spaces, and the bytes of the ``fallback`` code points."""
    letter, digit, punct, space, newline, multi2, multi3, multi4, cjk, fallback_cls = range(10)
    cnt = [0] * 10
    runs = [0] * 10
    multi_space = tabs = upper = switches = glued = long_letters = clusters = space_newlines = fallback_bytes = 0
    letter_run = consonant_run = 0
    prev = -1
    prev_lower = False
    space_run = 0
    i = 0
    while i < len(data):
        b = data[i]
        size = 1
        lower = False
        if b < 0x80:
            c = chr(b)
            cls = (letter if c.isalpha() else digit if c.isdigit() else space if c in " \t"
                   else newline if c in "\n\r" else multi2 if b < 0x20 or b == 0x7F else punct)
            tabs += c == "\t"
            lower = cls == letter and c.islower()
            upper += cls == letter and not lower
            switches += cls == letter and not lower and prev_lower
        else:
            size = 4 if 0xF0 <= b <= 0xF4 else 3 if 0xE0 <= b <= 0xEF else 2 if 0xC2 <= b <= 0xDF else 1
            ok = size > 1 and i + size <= len(data) and all(0x80 <= x < 0xC0 for x in data[i + 1 : i + size])
            if ok:
                cp = ord(data[i : i + size].decode("utf-8", errors="surrogatepass"))
                is_cjk = (0x2E80 <= cp <= 0x9FFF or 0xAC00 <= cp <= 0xD7AF or 0xF900 <= cp <= 0xFAFF
                          or 0xFF00 <= cp <= 0xFFEF)
                cls = cjk if is_cjk else {2: multi2, 3: multi3, 4: multi4}[size]
                if size < 4 and cp in fallback:
                    cls = fallback_cls
                    fallback_bytes += size
            else:
                size, cls = 1, multi2
        prev_lower = lower
        long_letters += cls == letter and letter_run >= 12
        letter_run = letter_run + 1 if cls == letter else 0
        consonant = cls == letter and chr(b).lower() not in "aeiouy"
        clusters += consonant and consonant_run >= 2
        consonant_run = consonant_run + 1 if consonant else 0
        space_newlines += cls == newline and space_run >= 2
        cnt[cls] += 1
        glued += cls == letter and prev == punct
        if cls == space:
            space_run += 1
            multi_space += space_run == 2
        else:
            space_run = 0
        runs[cls] += cls != prev
        prev = cls
        i += size
    return [cnt[letter], runs[letter], upper, switches, glued, long_letters, clusters, cnt[digit], runs[digit], cnt[punct],
            runs[punct], cnt[space], multi_space, tabs, cnt[newline], space_newlines, cnt[multi2], cnt[multi3], cnt[multi4],
            cnt[cjk], fallback_bytes, 1]


_PIECES = [b"a", b"Zq", b"aB", b"/x", b"str", b"Y", b"e", b"  \n", b"\xe9\xbf\x80", b"\xc4\x80", b"\x00", b"\x7f", b"\x1b[", b"7", b"42", b" ", b"  ", b"\t", b"\n", b"\r\n", b"!", b"{}", b"\xc3\xa9", b"\xe4\xb8\xad",
           b"\xf0\x9f\x98\x80", b"\xff", b"\xe4", b"\x80", b"\xed\xa0\x80"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=300))
def test_features_match_the_python_reference(pieces: list[bytes]) -> None:
    # Up to ~900 bytes: texts cross the 64-byte block path's boundaries in every way.
    data = b"".join(pieces)
    assert _core.feature_rows([data])[0].tolist() == reference_features(data)
    # U+9FC0 and U+0100 spelled byte by byte, and U+4E2D (in _PIECES too) not.
    cal = Calibration(tokenizer="t", coefficients=(0.0,) * _core.NUM_FEATURES,
                      fallback_ranges=((0x100, 0x100), (0x9FC0, 0x9FC0)))
    assert _core.feature_rows([data], cal.fallback_bits())[0].tolist() == reference_features(data, frozenset({0x100, 0x9FC0}))


def test_features_match_the_reference_on_real_text(traces_dir: Path) -> None:
    texts = [t.encode() for g in read_corpus([traces_dir / "claude_code_small", traces_dir / "swe_agent"])
             for t in g.texts]
    rows = _core.feature_rows(texts)
    for data, row in zip(texts, rows, strict=True):
        assert row.tolist() == reference_features(data)
    assert _core.feature_rows([]).shape == (0, _core.NUM_FEATURES)


def test_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(7)
    features = rng.integers(0, 400, size=(3000, _core.NUM_FEATURES)).astype(np.int64)
    features[:, -1] = 1  # the intercept column
    truth = rng.uniform(0.05, 1.5, size=_core.NUM_FEATURES)
    tokens = np.rint(features @ truth).astype(np.int64)
    coef = fit_coefficients(features, tokens, ridge=1e-9)
    assert np.allclose(coef, truth, rtol=0.02, atol=0.5)
    with pytest.raises(ValueError, match="corpus is empty"):
        fit_coefficients(np.zeros((0, _core.NUM_FEATURES), np.int64), np.zeros(0, np.int64))


@pytest.fixture(scope="module")
def held_out(traces_dir: Path) -> list[TextGroup]:
    _, test = split(read_corpus([traces_dir]), 0.2)
    assert len(test) >= 30
    return test


def test_builtin_calibrations_are_upper_bounds(held_out: list[TextGroup]) -> None:
    """On conversations the fit never saw and on adversarial text of a seed it never saw: the
    99.9th percentile under-count of every request is within 1% of the smallest window (4k..200k)
    that holds it, the over-count on real requests stays under 25% at the median, and what each
    calibration file says about itself is what it measures now."""
    adversarial = adversarial_groups(seed=1)
    rows = []
    for name in sorted(builtin_calibrations()):
        cal = builtin_calibration(name)
        groups = [*held_out, *adversarial]
        exact = exact_counts(load_counter(name), groups)
        bounds = measure_bounds(EstimateCounter(cal), groups, exact)
        assert set(bounds) == {"traces", *ADVERSARIAL_CLASSES}, name
        for kind, f in bounds.items():
            assert f["request_under_of_allowance_p99.9"] <= 1.0, (name, kind, f)
        assert bounds["traces"]["request_over_median"] <= 0.25, name
        for kind, f in cal.bounds["estimate"].items():  # the file's own figures, measured on the same texts
            assert f["request_under_of_allowance_p99.9"] == pytest.approx(
                bounds[kind]["request_under_of_allowance_p99.9"], abs=1e-9), (name, kind)
        assert cal.template  # every shipped calibration names the framing the default accounting adds
        rows.append((name, bounds))
    print("\nworst request under-count as a share of the allowance (p99.9), and the median over-count")
    for name, bounds in rows:
        print(name, {k: f"{f['request_under_of_allowance_p99.9']:.0%} / {f['request_over_median']:.1%}"
                     for k, f in bounds.items()})


def test_adversarial_groups_of_some_classes_are_those_classes_texts() -> None:
    every = adversarial_groups(seed=3, texts_per_class=4)
    fitted = adversarial_groups(seed=3, texts_per_class=4, classes=ADVERSARIAL_CLASSES[:-1])
    assert fitted == every[: len(fitted)]  # the last class left out: the others' texts are the same
    assert {g.kind for g in every} - {g.kind for g in fitted} == {ADVERSARIAL_CLASSES[-1]}
    with pytest.raises(ValueError, match="unknown class of text 'prose'"):
        adversarial_groups(classes=["prose"])


def test_estimate_never_exceeds_the_byte_count() -> None:
    counter = load_counter("estimate:deepseek-v4")
    for text in ["x", "ab", "\u00e9", "1", "\U0001F600", " " * 3]:
        assert 1 <= counter.count(text) <= len(text.encode()), text


def test_calibrate_cli_writes_a_calibration_that_loads_and_counts(
    traces_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cal.json"
    code = main(["calibrate", "--tokenizer", "o200k_base", "--corpus", str(traces_dir / "tau_bench"),
                 str(traces_dir / "swe_agent"), "-o", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "chars/4" in printed and "under-count" in printed
    for kind in ("traces", *ADVERSARIAL_CLASSES):
        assert kind in printed
    data = json.loads(out.read_text())
    assert data["format"] == "ctxfold-calibration/1" and data["tokenizer"] == "o200k_base"
    assert data["template"] == "chatml"
    for counter_name in ("estimate", "chars4"):
        for kind in ("traces", *ADVERSARIAL_CLASSES):
            figures = data["bounds"][counter_name][kind]
            assert {"under_p50", "under_p99", "under_p99.9", "under_tokens_p99.9", "over_median",
                    "over_p99", "request_under_of_allowance_p99.9"} <= figures.keys()
    cal = Calibration.load(out)
    assert cal.error["num_conversations"] >= 30  # 20% of the 204 conversations held out
    counter = load_counter(str(out))
    assert isinstance(counter, EstimateCounter) and not counter.exact
    text = "The quick brown fox jumps over the lazy dog.\n" * 50
    exact = load_counter("o200k_base").count(text)
    assert abs(counter.count(text) - exact) <= 0.15 * exact  # fitted on two folders only


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--tokenizer", "nope", "--corpus", "."], 4, "unknown tokenizer 'nope'"),
        (["--tokenizer", "o200k_base", "--corpus", "/nonexistent/corpus"], 3, "corpus path not found"),
        (["--tokenizer", "estimate:deepseek-v4", "--corpus", "."], 2, "must be an exact tokenizer"),
        (["--tokenizer", "o200k_base", "--corpus", ".", "--held-out", "1.5"], 2, "--held-out must be in [0, 1)"),
        (["--tokenizer", "o200k_base", "--corpus", ".", "--template", "nope"], 2, "unknown chat template 'nope'"),
    ],
)
def test_calibrate_cli_errors(args: list[str], code: int, words: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", *args, "-o", str(tmp_path / "x.json")]) == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
