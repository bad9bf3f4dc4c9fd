"""Fitting and measuring the byte-class estimator against an exact counter.

The estimator predicts ``tokens = features @ coefficients`` (features from ``_core.feature_rows``),
capped at the text's UTF-8 byte count. It is the default counter, and a count under the truth lets
a request overflow the window, so it is fitted as an upper bound: its under-count must stay within
1% of the window (:data:`ALLOWANCE_FRACTION`) at the 99.9th percentile, for every window from
:data:`MIN_WINDOW_TOKENS` to :data:`MAX_WINDOW_TOKENS` that holds the request, on real traces and
on generated adversarial text (:func:`adversarial_text`). A count above the truth wastes window,
so the over-count is measured and reported too.

Before the fit, :func:`fallback_ranges` asks the exact tokenizer which characters of the basic plane
it spells byte by byte; the estimator counts their UTF-8 bytes (feature ``fallback_bytes``, its
coefficient fixed at 1, :data:`FIXED_COEFFICIENTS`), as no class's average can.

A random unit of letters repeated ("qyqyqy..", a hash said again and again) is one long run of
letters that costs what its unit costs, up to a token a letter, and its features are those of any
other long run: after the fit, the coefficient of the letters past the 12th of a run
(``long_run_letters``) is raised to the most a letter costs in a run of a repeated letter or pair
(:func:`repeated_letters_cost`, a token in every shipped vocabulary). Real text has few such letters.

The fit has three steps:

1. weighted least squares with a small ridge term (below), the best estimate in the mean;
2. asymmetric reweighting (an expectile fit, :func:`fit_upper_coefficients`): residuals where the
   estimate is under the truth weigh more (:data:`UNDER_WEIGHT_ADVERSARIAL` on adversarial text,
   :data:`UNDER_WEIGHT_TRACES` on real text), which moves every coefficient toward the top of its
   class's range (a random 4-byte character costs up to 4 tokens, a common emoji 1); coefficients
   are kept >= 0;
3. a safety margin: every fitted coefficient times the smallest factor that brings the under-count of the
   fitting texts, and of every request of the fitting conversations, within half the allowance at
   the 99.9th percentile (the other half is for texts the fit never saw).

Step 1's weighting:

- weights 1/(tokens + 8) make the loss close to squared *relative* error, the figure reported,
  without letting one-token texts dominate;
- features are scaled to unit weighted RMS before the ridge term, so the penalty treats them
  alike; the ridge keeps collinear features (letters vs letter runs) from trading large opposite
  coefficients that extrapolate badly;
- the split is by conversation (a stable hash of its source and id), so held-out figures are on
  conversations the fit never saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ctxfold import _core
from ctxfold.tokens.calibration_corpus import (
    ADVERSARIAL_CLASSES,
    CORPUS_SUFFIXES,
    MIN_GROUPS_TO_HOLD_OUT,
    TextGroup,
    adversarial_groups,
    adversarial_text,
    conversation_texts,
    corpus_files,
    is_held_out,
    message_text,
    read_corpus,
    split,
    why_nothing_held_out,
)
from ctxfold.tokens.counting import TokenCounter
from ctxfold.tokens.estimators import Calibration, CharsPerTokenCounter, EstimateCounter

__all__ = [
    "ADVERSARIAL_CLASSES",
    "ALLOWANCE_FRACTION",
    "BOUNDED_WITHOUT_FIT",
    "BOUND_PERCENTILE",
    "CORPUS_SUFFIXES",
    "DEFAULT_TEMPLATES",
    "FIXED_COEFFICIENTS",
    "MAX_WINDOW_TOKENS",
    "MIN_GROUPS_TO_HOLD_OUT",
    "MIN_WINDOW_TOKENS",
    "UNDER_WEIGHT_ADVERSARIAL",
    "UNDER_WEIGHT_TRACES",
    "ErrorStats",
    "TextGroup",
    "adversarial_groups",
    "adversarial_text",
    "allowance_tokens",
    "bound_stats",
    "calibrate",
    "conversation_texts",
    "corpus_files",
    "exact_counts",
    "fallback_ranges",
    "fit_coefficients",
    "fit_upper_coefficients",
    "is_held_out",
    "measure",
    "measure_bounds",
    "message_text",
    "predict",
    "read_corpus",
    "repeated_letters_cost",
    "safety_margin",
    "split",
    "why_nothing_held_out",
]


def fit_coefficients(
    features: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], *, ridge: float = 1e-3
) -> npt.NDArray[np.float64]:
    """Weighted ridge least squares: features int64[n, NUM_FEATURES], tokens int64[n] -> float64[NUM_FEATURES]."""
    x = features.astype(np.float64)
    y = tokens.astype(np.float64)
    if x.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[1] != _core.NUM_FEATURES:
        raise ValueError(f"features must be [n, {_core.NUM_FEATURES}] and tokens [n]; got {x.shape} and {y.shape}")
    if x.shape[0] == 0:
        raise ValueError("no texts to fit on: the corpus is empty")
    return _weighted_ridge(x, y, 1.0 / (y + 8.0), ridge)


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Absolute relative error of an estimate against exact counts."""

    message_median: float
    message_p95: float
    conversation_median: float
    conversation_p95: float
    num_messages: int
    num_conversations: int

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {
            f"{prefix}message_median": self.message_median,
            f"{prefix}message_p95": self.message_p95,
            f"{prefix}conversation_median": self.conversation_median,
            f"{prefix}conversation_p95": self.conversation_p95,
            f"{prefix}num_messages": float(self.num_messages),
            f"{prefix}num_conversations": float(self.num_conversations),
        }


def _rel(est: npt.NDArray[np.int64], exact: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    e = exact.astype(np.float64)
    return np.asarray(np.abs(est.astype(np.float64) - e) / np.maximum(e, 1.0), dtype=np.float64)


def measure(
    estimate: TokenCounter, groups: Sequence[TextGroup], exact_counts: Sequence[npt.NDArray[np.int64]]
) -> ErrorStats:
    """Errors of ``estimate`` against ``exact_counts`` (one int64 array per group)."""
    msg_err: list[npt.NDArray[np.float64]] = []
    conv_err: list[float] = []
    for g, exact in zip(groups, exact_counts, strict=True):
        est = estimate.count_batch(list(g.texts))
        msg_err.append(_rel(est, exact))
        conv_err.append(float(_rel(np.array([est.sum()]), np.array([exact.sum()]))[0]))
    m = np.concatenate(msg_err) if msg_err else np.zeros(0)
    c = np.asarray(conv_err)
    if m.size == 0:
        raise ValueError("no texts to measure on")
    return ErrorStats(
        message_median=float(np.median(m)),
        message_p95=float(np.percentile(m, 95)),
        conversation_median=float(np.median(c)),
        conversation_p95=float(np.percentile(c, 95)),
        num_messages=int(m.size),
        num_conversations=int(c.size),
    )


def exact_counts(counter: TokenCounter, groups: Sequence[TextGroup]) -> list[npt.NDArray[np.int64]]:
    flat = [t for g in groups for t in g.texts]
    counts = counter.count_batch(flat)
    out: list[npt.NDArray[np.int64]] = []
    pos = 0
    for g in groups:
        out.append(counts[pos : pos + len(g.texts)])
        pos += len(g.texts)
    return out


# --- the upper-bound fit ---------------------------------------------------------------------------

# The chat template whose framing the default accounting adds to each tokenizer's estimate: the one
# its model is served with (DeepSeek's API renders deepseek-v3.2; ChatML stands in for OpenAI's
# framing, a few tokens per message).
DEFAULT_TEMPLATES = {"deepseek-v4": "deepseek-v3.2", "qwen3": "chatml", "mistral-v7": "mistral-v7",
                     "mistral": "mistral-v7", "o200k_base": "chatml", "cl100k_base": "chatml"}

ALLOWANCE_FRACTION = 0.01  # the under-count allowed, as a fraction of the window
MIN_WINDOW_TOKENS = 4_096  # the smallest window the allowance is checked for
MAX_WINDOW_TOKENS = 200_000  # the largest
# How much more an under-count weighs than an over-count in the expectile fit: on adversarial text,
# where the bound is hardest to meet, and on the real traces, where an over-count wastes window.
UNDER_WEIGHT_ADVERSARIAL = 100.0
UNDER_WEIGHT_TRACES = 3.0
BOUND_PERCENTILE = 99.9  # the percentile at which the under-count must be within the allowance
# Classes of adversarial text measured but not fitted: the raised long_run_letters coefficient
# (repeated_letters_cost) bounds them. Fitted as well, their 100x under-weight pulls the letter
# coefficients toward them (held-out per-message error 13.3% -> 15.6% on deepseek-v4).
BOUNDED_WITHOUT_FIT = ("repeated_letters",)
# Coefficients the fit does not touch: a byte the tokenizer spells alone is one token.
FIXED_COEFFICIENTS = {"fallback_bytes": 1.0}


def fallback_ranges(counter: TokenCounter) -> tuple[tuple[int, int], ...]:
    """The characters of U+0080..U+FFFF that ``counter`` spells a token a byte, as inclusive ranges.

    A character counts when three of it in a row cost at least two times its UTF-8 bytes more than
    one alone: measured on a run, not on the character alone, so that a tokenizer that adds a token
    to every text (a SentencePiece word-start mark) or merges the character with itself is judged
    by what a run of it costs.
    """
    cps, run_cost = _run_costs(counter)
    nbytes = np.array([1 + (cp >= 0x80) + (cp >= 0x800) for cp in cps], dtype=np.int64)
    out: list[tuple[int, int]] = []
    for cp, lacks in zip(cps, run_cost >= nbytes, strict=True):
        if not lacks:
            continue
        if out and out[-1][1] == cp - 1:
            out[-1] = (out[-1][0], cp)
        else:
            out.append((cp, cp))
    return tuple(out)


def _run_costs(counter: TokenCounter) -> tuple[list[int], npt.NDArray[np.float64]]:
    """Each code point of U+0080..U+FFFF (no surrogates) and its cost a character within a run of it:
    (tokens of three - tokens of one) / 2."""
    cps = [cp for cp in range(0x80, 0x10000) if not 0xD800 <= cp <= 0xDFFF]
    one = np.asarray(counter.count_batch([chr(cp) for cp in cps]), dtype=np.float64)
    three = np.asarray(counter.count_batch([chr(cp) * 3 for cp in cps]), dtype=np.float64)
    return cps, (three - one) / 2


def coefficient_floors(counter: TokenCounter, fallback: Sequence[tuple[int, int]]) -> npt.NDArray[np.float64]:
    """The least each coefficient may be (float64[NUM_FEATURES]), measured on ``counter``: what a
    class's costliest character the vocabulary holds costs in a run of it, for the 2-byte, 3-byte and
    CJK classes; the rest 0. The generated text the fit sees draws too few characters of one script
    to hold the bound on the script that costs the most."""
    lacking = np.zeros(0x10000, dtype=bool)
    for lo, hi in fallback:
        lacking[lo : hi + 1] = True
    cps, run_cost = _run_costs(counter)
    cp = np.array(cps)
    held = ~lacking[cp]
    cjk = (((cp >= 0x2E80) & (cp <= 0x9FFF)) | ((cp >= 0xAC00) & (cp <= 0xD7AF)) | ((cp >= 0xF900) & (cp <= 0xFAFF))
           | ((cp >= 0xFF00) & (cp <= 0xFFEF)))
    floors = np.zeros(_core.NUM_FEATURES)
    names = list(_core.FEATURE_NAMES)
    for name, sel in (("other2_chars", held & (cp < 0x800)), ("other3_chars", held & (cp >= 0x800) & ~cjk),
                      ("cjk_chars", held & cjk)):
        floors[names.index(name)] = float(run_cost[sel].max()) if sel.any() else 0.0
    return floors


# Short units of whitespace with a line break, each repeated (blank lines that keep their
# indentation): texts the fit must hold the bound on, weighted as UNDER_WEIGHT_ANCHORS.
ANCHOR_TEXTS = tuple(unit * 256 for n in range(17) for unit in
                     (" " * n + "\n", "\t" * min(n, 4) + "\n", " " * n + "\n \n", "\n" + " " * n + "\n"))
UNDER_WEIGHT_ANCHORS = 300.0


def _fixed_mask() -> npt.NDArray[np.bool_]:
    return np.array([name in FIXED_COEFFICIENTS for name in _core.FEATURE_NAMES])


def _fixed_values() -> npt.NDArray[np.float64]:
    return np.array([FIXED_COEFFICIENTS.get(name, 0.0) for name in _core.FEATURE_NAMES])


def repeated_letters_cost(counter: TokenCounter) -> float:
    """The most a letter costs in a long run of one ASCII letter or a pair of them repeated ("qyqy..",
    "ZRZR.."): (tokens of 96 letters - tokens of 48) / 48, over the 52 letters and 2,704 pairs.

    A token a letter in every vocabulary shipped (15% to 50% of the pairs cost that much), so the
    cost of any repeated unit is within it."""
    units = [*_LETTERS, *(a + b for a in _LETTERS for b in _LETTERS)]
    short = np.asarray(counter.count_batch([u * (48 // len(u)) for u in units]), dtype=np.float64)
    long = np.asarray(counter.count_batch([u * (96 // len(u)) for u in units]), dtype=np.float64)
    return float(((long - short) / 48).max())


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def allowance_tokens(exact_tokens: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The under-count a request of ``exact_tokens`` may have: 1% of the smallest window (at least
    :data:`MIN_WINDOW_TOKENS`) that holds it, the strictest of the windows it fits."""
    e = np.asarray(exact_tokens, dtype=np.float64)
    return np.asarray(ALLOWANCE_FRACTION * np.maximum(e, MIN_WINDOW_TOKENS), dtype=np.float64)


def predict(features: npt.NDArray[np.int64], coefficients: npt.ArrayLike,
            nbytes: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """What ``_core.estimate_batch`` returns, from feature rows: rounded, clamped to [0, nbytes]."""
    raw = np.rint(features.astype(np.float64) @ np.asarray(coefficients, dtype=np.float64))
    out = np.clip(raw, 0, nbytes).astype(np.int64)
    out[nbytes == 0] = 0
    return out


def _weighted_ridge(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64], w: npt.NDArray[np.float64],
                    ridge: float) -> npt.NDArray[np.float64]:
    sw = np.sqrt(w)[:, None]
    xw = x * sw
    scale = np.sqrt((xw**2).mean(axis=0))
    scale[scale == 0] = 1.0  # a feature absent from the corpus keeps a zero coefficient
    xs = xw / scale
    gram = xs.T @ xs + ridge * x.shape[0] * np.eye(x.shape[1])
    coef_scaled = np.linalg.solve(gram, xs.T @ (y * sw[:, 0]))
    return np.asarray(coef_scaled / scale, dtype=np.float64)


def fit_upper_coefficients(
    features: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], under_weights: npt.NDArray[np.float64], *,
    ridge: float = 1e-3, iterations: int = 40, offset: npt.NDArray[np.float64] | None = None,
    floors: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.float64]:
    """Step 2 of the fit (see the module docstring): an expectile fit in which text i's under-count
    weighs ``under_weights[i]`` times its over-count, every coefficient >= 0 (a negative one would
    let more of some text lower the count, which adversarial text exploits).

    features int64[n, k], tokens int64[n], under_weights float64[n] -> float64[k]; ``offset``
    float64[n], the part of each count known without the fit (fixed coefficients), is taken off the
    tokens first; ``floors`` float64[k] (default 0) are the least each coefficient may be. The base weights are 1/sqrt(tokens + 8): between relative error (1/tokens) and
    absolute error, as a request's count is a sum in which long texts weigh most.
    """
    x = features.astype(np.float64)
    base = 1.0 / np.sqrt(tokens.astype(np.float64) + 8.0)
    y = tokens.astype(np.float64) - (0.0 if offset is None else offset)
    floor = np.zeros(x.shape[1]) if floors is None else np.asarray(floors, dtype=np.float64)
    active = np.ones(x.shape[1], dtype=bool)
    coef = floor.copy()
    for _ in range(x.shape[1]):  # active set: a coefficient that goes under its floor is fixed there, the rest refitted
        coef = np.where(active, 0.0, floor)
        rest = y - x[:, ~active] @ floor[~active]
        coef[active] = _weighted_ridge(x[:, active], rest, base, ridge)
        for _ in range(iterations):
            under = y > x @ coef
            new = coef.copy()
            new[active] = _weighted_ridge(x[:, active], rest, base * np.where(under, under_weights, 1.0), ridge)
            done = np.allclose(new, coef, rtol=1e-6, atol=1e-9)
            coef = new
            if done:
                break
        low = active & (coef < floor)
        if not low.any():
            break
        active &= ~low
    return np.maximum(coef, floor)


def _request_sums(values: npt.NDArray[np.int64], group_sizes: Sequence[int]) -> npt.NDArray[np.int64]:
    """Running sums within each group: the request each message ends (int64[len(values)])."""
    out = np.empty_like(values)
    pos = 0
    for n in group_sizes:
        out[pos : pos + n] = np.cumsum(values[pos : pos + n])
        pos += n
    return out


def _worst_fraction(under: npt.NDArray[np.int64], exact: npt.NDArray[np.int64]) -> float:
    """The BOUND_PERCENTILE of under-count / allowance (<= 1 meets the bound)."""
    if under.size == 0:
        return 0.0
    return float(np.percentile(under / allowance_tokens(exact), BOUND_PERCENTILE))


def safety_margin(features: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64],
                  coefficients: npt.NDArray[np.float64], group_sizes: Sequence[int], *,
                  target: float = 0.5, fixed: npt.NDArray[np.bool_] | None = None) -> float:
    """Step 3: the smallest factor >= 1 (to 0.1%) that brings the BOUND_PERCENTILE under-count of
    every text and every request (running sums of ``group_sizes``) within ``target`` of the allowance.
    Coefficients where ``fixed`` (bool[NUM_FEATURES]) is set are not scaled."""
    keep = np.zeros(len(coefficients), dtype=bool) if fixed is None else fixed


    def worst(factor: float) -> float:
        est = predict(features, np.where(keep, coefficients, coefficients * factor), nbytes)
        return max(_worst_fraction(tokens - est, tokens),
                   _worst_fraction(_request_sums(tokens, group_sizes) - _request_sums(est, group_sizes),
                                   _request_sums(tokens, group_sizes)))

    lo, hi = 1.0, 1.0
    while worst(hi) > target and hi < 8.0:
        hi *= 1.25
    if hi == lo:
        return 1.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        if worst(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


# --- measuring ---------------------------------------------------------------------------------------


def _pct(values: npt.NDArray[np.float64], q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def bound_stats(est: npt.NDArray[np.int64], exact: npt.NDArray[np.int64],
                group_sizes: Sequence[int]) -> dict[str, float]:
    """Under- and over-count figures of ``est`` against ``exact`` (texts in groups of ``group_sizes``).

    Per text: the absolute relative error (median, p95); the under-count (exact - estimate) / exact
    and in tokens at p50, p99, p99.9 (a negative under-count is an over-count); the over-count
    (estimate - exact) / exact, median and p99. Per request (running sums within a group): the
    relative under-count at p99.9, the relative over-count (median, p99), the under-count as a
    fraction of the allowance (p99.9, max), and the share of requests within the allowance.
    """
    e = exact.astype(np.float64)
    d = e - est.astype(np.float64)
    keep = exact > 0
    rel_under = d[keep] / e[keep]
    req_exact = _request_sums(exact, group_sizes)
    req_under = req_exact - _request_sums(est, group_sizes)
    req_frac = req_under / allowance_tokens(req_exact) if req_under.size else np.zeros(0)
    return {
        "num_texts": float(exact.size),
        "num_requests": float(req_under.size),
        "error_median": _pct(np.abs(rel_under), 50),
        "error_p95": _pct(np.abs(rel_under), 95),
        "under_p50": _pct(rel_under, 50),
        "under_p99": _pct(rel_under, 99),
        "under_p99.9": _pct(rel_under, 99.9),
        "under_tokens_p50": _pct(d, 50),
        "under_tokens_p99": _pct(d, 99),
        "under_tokens_p99.9": _pct(d, 99.9),
        "over_median": _pct(-rel_under, 50),
        "over_p99": _pct(-rel_under, 99),
        "request_under_p99.9": _pct(req_under / np.maximum(req_exact, 1), 99.9),
        "request_over_median": _pct(-req_under / np.maximum(req_exact, 1), 50),
        "request_over_p99": _pct(-req_under / np.maximum(req_exact, 1), 99),
        "request_under_of_allowance_p99.9": _pct(req_frac, 99.9),
        "request_under_of_allowance_max": float(req_frac.max()) if req_frac.size else 0.0,
        "requests_within_allowance": float((req_frac <= 1.0).mean()) if req_frac.size else 1.0,
    }


def measure_bounds(counter: TokenCounter, groups: Sequence[TextGroup],
                   exact: Sequence[npt.NDArray[np.int64]]) -> dict[str, dict[str, float]]:
    """:func:`bound_stats` of ``counter`` per class of text (``TextGroup.kind``)."""
    by_kind: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_kind.setdefault(g.kind, []).append(i)
    out: dict[str, dict[str, float]] = {}
    for kind, idx in by_kind.items():
        texts = [t for i in idx for t in groups[i].texts]
        est = np.asarray(counter.count_batch(texts), dtype=np.int64)
        ex = np.concatenate([exact[i] for i in idx])
        out[kind] = bound_stats(est, ex, [len(groups[i].texts) for i in idx])
    return out


def calibrate(
    counter: TokenCounter,
    groups: Sequence[TextGroup],
    *,
    tokenizer: str | None = None,
    template: str = "",
    corpus: str = "",
    held_out_fraction: float = 0.2,
    ridge: float = 1e-3,
    adversarial_seed: int | None = 0,
) -> Calibration:
    """Fits the estimator to ``counter`` as an upper bound (see the module docstring) on the training
    groups plus, unless ``adversarial_seed`` is None, generated adversarial text, and measures it on
    the held-out groups and on adversarial text from another seed. ``template`` names the chat
    template whose framing the default accounting adds with this calibration.

    With fewer than :data:`MIN_GROUPS_TO_HOLD_OUT` groups, or a split that leaves either side empty,
    nothing can be held out honestly (:func:`why_nothing_held_out`): the error is then measured on the
    training texts, ``error["held_out"]`` is 0 and ``method`` says so.
    """
    if not counter.exact:
        raise ValueError(f"calibrate against an exact tokenizer, not the estimate {counter.name!r}")
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
    not_held_out = why_nothing_held_out(groups, held_out_fraction)
    if not_held_out:
        train, test = list(groups), list(groups)
        evaluated_on = (f"the fitting texts themselves, not on held-out conversations ({not_held_out}), "
                        "which overstates the accuracy")
    else:
        train, test = split(groups, held_out_fraction)
        evaluated_on = ("held-out conversations, split by a hash of the conversation id, "
                        f"{held_out_fraction:.0%} held out")
    if adversarial_seed is not None:
        # More texts to fit on than to measure on: the rare worst cases of a class must be seen.
        fitted = [k for k in ADVERSARIAL_CLASSES if k not in BOUNDED_WITHOUT_FIT]
        train = [*train, *adversarial_groups(adversarial_seed, texts_per_class=128, classes=fitted),
                 *(TextGroup(f"anchor/{i}", (t,), "anchors") for i, t in enumerate(ANCHOR_TEXTS))]
        test = [*test, *adversarial_groups(adversarial_seed + 1)]
    train_texts = [t for g in train for t in g.texts]
    if not train_texts:
        raise ValueError("the corpus has no text to fit on")
    fallback = Calibration(tokenizer=tokenizer or counter.name, coefficients=(0.0,) * _core.NUM_FEATURES,
                           fallback_ranges=fallback_ranges(counter))
    features = _core.feature_rows(train_texts, fallback.fallback_bits())
    floors = coefficient_floors(counter, fallback.fallback_ranges)
    tokens = np.asarray(counter.count_batch(train_texts), dtype=np.int64)
    nbytes = np.fromiter((len(t.encode("utf-8")) for t in train_texts), dtype=np.int64, count=len(train_texts))
    class_weight = {"traces": UNDER_WEIGHT_TRACES, "anchors": UNDER_WEIGHT_ANCHORS}
    under_weights = np.array([class_weight.get(g.kind, UNDER_WEIGHT_ADVERSARIAL) for g in train for _ in g.texts])
    fixed = _fixed_mask()
    coef = _fixed_values()
    coef[~fixed] = fit_upper_coefficients(features[:, ~fixed], tokens, under_weights, ridge=ridge,
                                          offset=features[:, fixed] @ coef[fixed], floors=floors[~fixed])
    # After the fit, not as its floor: held at a token a letter during the fit, long_run_letters
    # over-counts the random letters the fit sees, which drags the other letter coefficients down
    # and the margin up (held-out per-message error 13.3% -> 19.2% on deepseek-v4).
    letter_cost = repeated_letters_cost(counter)
    long_run = list(_core.FEATURE_NAMES).index("long_run_letters")
    coef[long_run] = max(coef[long_run], letter_cost)
    margin = safety_margin(features, tokens, nbytes, coef, [len(g.texts) for g in train], fixed=fixed)
    coef = np.where(fixed, coef, coef * margin)
    provisional = Calibration(tokenizer=tokenizer or counter.name, coefficients=tuple(float(c) for c in coef),
                              fallback_ranges=fallback.fallback_ranges)
    exact = exact_counts(counter, test)
    real = [i for i, g in enumerate(test) if g.kind == "traces"]
    real_groups = [test[i] for i in real]
    real_exact = [exact[i] for i in real]
    error: dict[str, float] = {}
    if real_groups:
        error = {**measure(EstimateCounter(provisional), real_groups, real_exact).as_dict(),
                 **measure(CharsPerTokenCounter(), real_groups, real_exact).as_dict("chars4_"),
                 # 1: measured on conversations the fit never saw; 0: on the fitting texts themselves.
                 "held_out": 0.0 if not_held_out else 1.0}
    return Calibration(
        tokenizer=tokenizer or counter.name,
        coefficients=provisional.coefficients,
        fallback_ranges=provisional.fallback_ranges,
        template=template,
        corpus=corpus + ("" if adversarial_seed is None else
                         f"; adversarial text, seed {adversarial_seed}: {len(ADVERSARIAL_CLASSES)} classes"),
        num_texts=len(train_texts),
        method=f"upper bound: an expectile fit by weighted ridge least squares (weights 1/sqrt(tokens+8), "
        f"ridge {ridge:g}; under-counts weigh {UNDER_WEIGHT_TRACES:g}x on traces, "
        f"{UNDER_WEIGHT_ADVERSARIAL:g}x on adversarial text, {UNDER_WEIGHT_ANCHORS:g}x on {len(ANCHOR_TEXTS)} repeated "
        f"whitespace units; coefficients >= 0, the 2-byte, 3-byte and CJK ones at least what the costliest "
        f"character the vocabulary holds costs), long_run_letters raised to {letter_cost:g} "
        f"(the costliest letter in a run of a repeated letter or pair; {', '.join(BOUNDED_WITHOUT_FIT)} not fitted), "
        f"then every coefficient times {margin:.3f} "
        f"(the margin that brings the fitting texts' p{BOUND_PERCENTILE:g} under-count within half of "
        f"{ALLOWANCE_FRACTION:.0%} of a {MIN_WINDOW_TOKENS:,}..{MAX_WINDOW_TOKENS:,}-token window), but "
        f"{', '.join(FIXED_COEFFICIENTS)} fixed at 1 token a byte, for the {len(fallback.fallback_ranges)} ranges "
        f"of basic-plane characters the tokenizer spells byte by byte; measured on "
        f"{evaluated_on}"
        + ("" if adversarial_seed is None else f", and on adversarial text of seed {adversarial_seed + 1}"),
        error=error,
        bounds={"estimate": measure_bounds(EstimateCounter(provisional), test, exact),
                "chars4": measure_bounds(CharsPerTokenCounter(), test, exact)},
    )
