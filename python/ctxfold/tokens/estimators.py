"""The counters that estimate: the C++ byte-class estimator under a calibration, and chars/4.

A :class:`Calibration` holds the estimator's coefficients for one tokenizer and how they were
obtained (:mod:`ctxfold.tokens.calibration` fits them); the built-in ones ship in ``ctxfold/tokens/calibrations``.
It also holds the characters of the basic plane the tokenizer's vocabulary lacks, which it spells a
token a byte: the estimator counts their UTF-8 bytes (feature ``fallback_bytes``) instead of a class's
average, which is what keeps a run of one such character from being counted low.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxfold import _core
from ctxfold.errors import TokenizerError
from ctxfold.tokens.counter_input import Text, as_text, as_texts


@dataclass(frozen=True, slots=True)
class Calibration:
    """Coefficients of the byte-class estimator for one tokenizer, with how they were obtained."""

    tokenizer: str  # the counter spec the coefficients were fitted against ("deepseek-v4", a path)
    coefficients: tuple[float, ...]  # one per feature, in _core.FEATURE_NAMES order
    feature_names: tuple[str, ...] = tuple(_core.FEATURE_NAMES)  # checked against the core's on load
    corpus: str = ""  # what the fit was run on (files, number of texts)
    num_texts: int = 0  # texts in the fitting set
    method: str = ""  # how the fit was made (least squares variant, weights)
    error: dict[str, float] = field(default_factory=dict)  # measured on held-out texts: medians, p95s
    # The chat template (a preset name) whose framing the default accounting adds to this estimator's
    # counts when no template is given: without it the count of a request is its message texts alone,
    # under the truth on every request. "" for none.
    template: str = ""
    # Under- and over-count figures per counter ("estimate", "chars4") and class of text ("traces",
    # the adversarial classes): see ctxfold.tokens.calibration.bound_stats.
    bounds: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # Inclusive code point ranges (U+0080..U+FFFF) of the characters the tokenizer spells byte by byte
    # (see ctxfold.tokens.calibration.fallback_ranges), sorted and disjoint.
    fallback_ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        names = tuple(_core.FEATURE_NAMES)
        if tuple(self.feature_names) != names:
            raise TokenizerError(
                f"calibration for {self.tokenizer!r} uses features {list(self.feature_names)}, this ctxfold "
                f"computes {list(names)}; re-run `ctxfold calibrate`"
            )
        if len(self.coefficients) != len(names) or not all(math.isfinite(c) for c in self.coefficients):
            raise TokenizerError(
                f"calibration for {self.tokenizer!r}: expected {len(names)} finite coefficients, "
                f"got {list(self.coefficients)}"
            )
        last = 0x7F
        for lo, hi in self.fallback_ranges:
            if not last < lo <= hi <= 0xFFFF:
                raise TokenizerError(
                    f"calibration for {self.tokenizer!r}: fallback characters must be sorted, disjoint ranges within "
                    f"U+0080..U+FFFF; got U+{lo:04X}..U+{hi:04X} after U+{last:04X}; re-run `ctxfold calibrate`"
                )
            last = hi

    def fallback_bits(self) -> npt.NDArray[np.uint64] | None:
        """The fallback ranges as the core's bit set, uint64[_core.FALLBACK_WORDS]; None when there are none."""
        if not self.fallback_ranges:
            return None
        flags = np.zeros(_core.FALLBACK_WORDS * 64, dtype=bool)
        for lo, hi in self.fallback_ranges:
            flags[lo : hi + 1] = True
        # Bit (cp & 63) of word cp >> 6: little-endian bit order within each little-endian word.
        packed = np.packbits(flags, bitorder="little")
        return np.ascontiguousarray(packed.view("<u8").astype(np.uint64))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "ctxfold-calibration/1",
            "tokenizer": self.tokenizer,
            "feature_names": list(self.feature_names),
            "coefficients": list(self.coefficients),
            "corpus": self.corpus,
            "num_texts": self.num_texts,
            "method": self.method,
            "error": self.error,
            "template": self.template,
            "bounds": self.bounds,
            # Compact and readable: hex code points, a range as LO-HI, separated by spaces.
            "fallback_chars": " ".join(f"{lo:04X}" if lo == hi else f"{lo:04X}-{hi:04X}"
                                       for lo, hi in self.fallback_ranges),
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "calibration") -> Calibration:
        if not isinstance(data, dict) or data.get("format") != "ctxfold-calibration/1":
            raise TokenizerError(f"{source}: not a ctxfold calibration (expected format ctxfold-calibration/1)")
        try:
            return cls(
                tokenizer=str(data["tokenizer"]),
                coefficients=tuple(float(x) for x in data["coefficients"]),
                feature_names=tuple(str(x) for x in data["feature_names"]),
                corpus=str(data.get("corpus", "")),
                num_texts=int(data.get("num_texts", 0)),
                method=str(data.get("method", "")),
                error={str(k): float(v) for k, v in dict(data.get("error", {})).items()},
                template=str(data.get("template", "")),
                bounds={str(c): {str(k): {str(n): float(v) for n, v in dict(figs).items()}
                                 for k, figs in dict(kinds).items()}
                        for c, kinds in dict(data.get("bounds", {})).items()},
                fallback_ranges=_parse_ranges(str(data.get("fallback_chars", ""))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TokenizerError(f"{source}: malformed calibration ({exc!r}); re-run `ctxfold calibrate`") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TokenizerError(f"calibration file not found: {p}") from None
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{p}: not a readable calibration JSON ({exc})") from None
        return cls.from_json(data, str(p))

    def save(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, p)


def _parse_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """"0800-0815 0817" -> ((0x800, 0x815), (0x817, 0x817)); ValueError on anything else."""
    out: list[tuple[int, int]] = []
    for item in text.split():
        lo, _, hi = item.partition("-")
        out.append((int(lo, 16), int(hi or lo, 16)))
    return tuple(out)


def builtin_calibrations() -> tuple[str, ...]:
    """Names of the calibrations shipped with ctxfold (usable as ``estimate:<name>``)."""
    root = importlib.resources.files("ctxfold.tokens") / "calibrations"
    return tuple(sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json")))


def builtin_calibration(name: str) -> Calibration:
    res = importlib.resources.files("ctxfold.tokens") / "calibrations" / f"{name}.json"
    if not res.is_file():
        raise TokenizerError(
            f"no built-in calibration {name!r}; built in: {', '.join(builtin_calibrations()) or 'none'}; "
            "or pass a calibration file written by `ctxfold calibrate`"
        )
    return Calibration.from_json(json.loads(res.read_text(encoding="utf-8")), f"built-in calibration {name}")


class EstimateCounter:
    """The C++ byte-class estimator under one calibration. Not exact: see ``calibration.error`` and
    ``calibration.bounds``. ``template`` names the chat template whose framing a
    :class:`~ctxfold.tokens.accounting.RequestAccounting` adds when it is given none ("" for none)."""

    exact = False

    def __init__(self, calibration: Calibration, name: str | None = None) -> None:
        self.calibration = calibration
        self.coefficients = np.ascontiguousarray(calibration.coefficients, dtype=np.float64)
        self.fallback_bits = calibration.fallback_bits()  # held here: the core reads it during each call
        self.name = name or f"estimate:{calibration.tokenizer}"
        self.template = calibration.template

    def count(self, text: Text) -> int:
        if isinstance(text, str):
            return int(_core.estimate_tokens(text, self.coefficients, self.fallback_bits))
        # bytes go through the core as they are: the estimator counts invalid UTF-8 byte by byte.
        return int(_core.estimate_tokens(bytes(text), self.coefficients, self.fallback_bits))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        if isinstance(texts, (str, bytes)):
            raise TypeError("count_batch takes a sequence of texts, not one text; use count() for one")
        return _core.estimate_batch(texts if isinstance(texts, list) else list(texts), self.coefficients,
                                    self.fallback_bits)

    def __repr__(self) -> str:
        return f"EstimateCounter({self.name!r})"


class CharsPerTokenCounter:
    """The baseline everyone uses: characters / 4 (rounded), whatever the tokenizer."""

    exact = False

    def __init__(self, chars_per_token: float = 4.0) -> None:
        if not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {chars_per_token}")
        self.chars_per_token = chars_per_token
        self.name = "chars4" if chars_per_token == 4.0 else f"chars/{chars_per_token:g}"

    def count(self, text: Text) -> int:
        return int(len(as_text(text)) / self.chars_per_token + 0.5)

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        lengths = np.fromiter((len(t) for t in as_texts(texts)), dtype=np.float64, count=len(texts))
        return np.floor(lengths / self.chars_per_token + 0.5).astype(np.int64)

    def __repr__(self) -> str:
        return f"CharsPerTokenCounter({self.chars_per_token})"
