"""Fitting and measuring the byte-class estimator against an exact counter.

The estimator predicts ``tokens = features @ coefficients`` (features from ``_core.feature_rows``).
What a caller budgets with is a conversation, so the figure that matters is the error on the sum of
a conversation's messages; single messages are noisier and are reported beside it.

The fit is weighted least squares with a small ridge term:

- weights 1/(tokens + 8) make the loss close to squared *relative* error, the figure reported,
  without letting one-token texts dominate;
- features are scaled to unit weighted RMS before the ridge term, so the penalty treats them
  alike; the ridge keeps collinear features (letters vs letter runs) from trading large opposite
  coefficients that extrapolate badly;
- the split is by conversation (a stable hash of its source and id), so held-out figures are on
  conversations the fit never saw.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxfold import _core
from ctxfold.counting import Calibration, CharsPerTokenCounter, EstimateCounter, TokenCounter
from ctxfold.errors import FormatError
from ctxfold.messages import Conversation, Message

CORPUS_SUFFIXES = (".json", ".jsonl", ".traj")


@dataclass(frozen=True, slots=True)
class TextGroup:
    """The texts of one conversation (or one file when no importer reads it)."""

    key: str  # stable identity, for the train/held-out split
    texts: tuple[str, ...]  # one per message (content, reasoning, tool calls), plus the system prompt


def message_text(m: Message) -> str:
    """Everything of a message a tokenizer sees as text: reasoning, content, tool names and arguments."""
    parts = [m.reasoning or "", m.text]
    parts += [f"{c.name} {c.arguments}" for c in m.tool_calls]
    return "\n".join(p for p in parts if p)


def conversation_texts(conv: Conversation) -> tuple[str, ...]:
    texts = [conv.system] if conv.system else []
    texts += [message_text(m) for m in conv.messages]
    return tuple(t for t in texts if t)


def _walk_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk_strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk_strings(v)


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in CORPUS_SUFFIXES)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"corpus path not found: {p}")
    return out


def read_corpus(paths: Iterable[str | Path], *,
                on_skip: Callable[[Path, str], None] | None = None) -> list[TextGroup]:
    """Text groups from trace files and directories (``.json``, ``.jsonl``, ``.traj`` under a directory).

    A file the trace importers read gives one group per conversation; any other JSON/JSONL file
    gives one group of all its strings (a plain recursive walk); a text file gives its lines'
    paragraphs as one group. A file that gives no text (empty, unreadable) is skipped, and
    ``on_skip`` hears which and why.
    """
    from ctxfold import formats  # the importers; imported here so counting does not need them

    groups: list[TextGroup] = []
    for f in _files(paths):
        try:
            convs = formats.load(f)
        except (FormatError, ValueError, OSError):
            convs = []
        if convs:
            before = len(groups)
            for i, c in enumerate(convs):
                texts = conversation_texts(c)
                if texts:
                    groups.append(TextGroup(f"{f.name}:{c.id or i}", texts))
            if len(groups) == before and on_skip is not None:
                on_skip(f, "its conversations hold no text")
            continue
        try:
            raw = f.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            if on_skip is not None:
                on_skip(f, f"cannot read it ({exc.strerror or exc})")
            continue
        values: list[Any] = []
        try:
            values = [json.loads(raw)]
        except ValueError:
            try:
                values = [json.loads(line) for line in raw.splitlines() if line.strip()]
            except ValueError:
                values = [raw]
        texts = tuple(s for v in values for s in _walk_strings(v) if s.strip())
        if texts:
            groups.append(TextGroup(f.name, texts))
        elif on_skip is not None:
            on_skip(f, "empty file" if not raw.strip() else "no text in it")
    return groups


def is_held_out(key: str, fraction: float) -> bool:
    """Deterministic split by a hash of the group key: the same groups are held out on every run."""
    h = int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def split(groups: Sequence[TextGroup], held_out_fraction: float) -> tuple[list[TextGroup], list[TextGroup]]:
    train = [g for g in groups if not is_held_out(g.key, held_out_fraction)]
    test = [g for g in groups if is_held_out(g.key, held_out_fraction)]
    return train, test


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
    w = 1.0 / (y + 8.0)
    sw = np.sqrt(w)[:, None]
    xw = x * sw
    scale = np.sqrt((xw**2).mean(axis=0))
    scale[scale == 0] = 1.0  # a feature absent from the corpus keeps a zero coefficient
    xs = xw / scale
    gram = xs.T @ xs + ridge * x.shape[0] * np.eye(x.shape[1])
    coef_scaled = np.linalg.solve(gram, xs.T @ (y * sw[:, 0]))
    return np.asarray(coef_scaled / scale, dtype=np.float64)


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


def calibrate(
    counter: TokenCounter,
    groups: Sequence[TextGroup],
    *,
    tokenizer: str | None = None,
    corpus: str = "",
    held_out_fraction: float = 0.2,
    ridge: float = 1e-3,
) -> Calibration:
    """Fits the estimator to ``counter`` on the training groups and measures it on the held-out ones.

    With fewer than 5 groups nothing can be held out honestly: the error is then measured on the
    training texts and the metadata says so.
    """
    if not counter.exact:
        raise ValueError(f"calibrate against an exact tokenizer, not the estimate {counter.name!r}")
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
    train, test = split(groups, held_out_fraction)
    evaluated_on = "held-out conversations"
    if len(groups) < 5 or not test or not train:
        train, test, evaluated_on = list(groups), list(groups), "the fitting texts (corpus too small to hold out)"
    train_texts = [t for g in train for t in g.texts]
    if not train_texts:
        raise ValueError("the corpus has no text to fit on")
    coef = fit_coefficients(_core.feature_rows(train_texts), counter.count_batch(train_texts), ridge=ridge)
    provisional = Calibration(tokenizer=tokenizer or counter.name, coefficients=tuple(float(c) for c in coef))
    exact = exact_counts(counter, test)
    stats = measure(EstimateCounter(provisional), test, exact)
    base = measure(CharsPerTokenCounter(), test, exact)
    return Calibration(
        tokenizer=tokenizer or counter.name,
        coefficients=provisional.coefficients,
        corpus=corpus,
        num_texts=len(train_texts),
        method=f"weighted ridge least squares (weights 1/(tokens+8), ridge {ridge:g}); error measured on "
        f"{evaluated_on}, split by a hash of the conversation id, {held_out_fraction:.0%} held out",
        error={**stats.as_dict(), **base.as_dict("chars4_")},
    )
