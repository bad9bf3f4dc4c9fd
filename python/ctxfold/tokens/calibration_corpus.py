"""The texts the byte-class estimator is fitted and measured on: real traces and generated adversarial text.

:func:`read_corpus` reads trace files and directories into :class:`TextGroup` s (one per conversation);
:func:`split` holds conversations out by a stable hash of their key; :func:`adversarial_groups`
generates, from a seed, the classes of text where a byte-class model is furthest from the truth.
:mod:`ctxfold.tokens.calibration` fits and measures on them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxfold.chat.messages import Conversation, Message
from ctxfold.errors import FormatError

CORPUS_SUFFIXES = (".json", ".jsonl", ".traj")


@dataclass(frozen=True, slots=True)
class TextGroup:
    """The texts of one conversation (or one file when no importer reads it)."""

    key: str  # stable identity, for the train/held-out split
    texts: tuple[str, ...]  # one per message (content, reasoning, tool calls), plus the system prompt
    kind: str = "traces"  # the class of text: "traces" or one of ADVERSARIAL_CLASSES


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


def corpus_files(paths: Iterable[str | Path]) -> list[Path]:
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
    from ctxfold.chat import formats  # the importers; imported here so counting does not need them

    groups: list[TextGroup] = []
    for f in corpus_files(paths):
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


MIN_GROUPS_TO_HOLD_OUT = 5  # with fewer, a held-out set of one or two conversations says nothing


def why_nothing_held_out(groups: Sequence[TextGroup], held_out_fraction: float) -> str:
    """Why :func:`ctxfold.tokens.calibration.calibrate` measures the error on the fitting texts instead of held-out conversations,
    in plain words; "" when it can hold some out. One rule for the fit and for what is said about it."""
    n = len(groups)
    if n < MIN_GROUPS_TO_HOLD_OUT:
        return (f"only {n} conversation{'' if n == 1 else 's'}; at least {MIN_GROUPS_TO_HOLD_OUT} are needed "
                "to hold some out")
    if held_out_fraction <= 0.0:
        return "the held-out fraction is 0"
    train, test = split(groups, held_out_fraction)
    if not test:
        return f"none of the {n} conversations fell in the held-out {held_out_fraction:.0%}"
    if not train:
        return f"all {n} conversations fell in the held-out {held_out_fraction:.0%}, leaving none to fit on"
    return ""


# --- adversarial text ------------------------------------------------------------------------------

# Classes of text where a byte-class model is furthest from the truth, generated from a seed so that
# a fit and a test see the same texts on every machine.
ADVERSARIAL_CLASSES = (
    "random_unicode", "emoji", "cjk", "base64", "hex", "digit_runs", "minified_json", "whitespace_runs",
    "random_letters", "repeated_letters",
)

_EMOJI_RANGES = ((0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F900, 0x1F9FF),
                 (0x1FA70, 0x1FAFF), (0x2600, 0x26FF), (0x2700, 0x27BF))
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0xAC00, 0xD7A3), (0x3000, 0x303F),
               (0xFF01, 0xFF5E))


# Code points by UTF-8 length. Drawn uniformly over all scalar values, 94% of random characters
# would be 4 bytes long; drawing the length first covers 2- and 3-byte characters as well.
_SCALAR_RANGES = ((0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF))


def _random_scalar(rng: random.Random, ranges: Sequence[tuple[int, int]] = _SCALAR_RANGES) -> str:
    """A random Unicode scalar value of a random UTF-8 length (2 to 4 bytes; no surrogates)."""
    while True:
        lo, hi = ranges[rng.randrange(len(ranges))]
        cp = rng.randint(lo, hi)
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def _from_ranges(rng: random.Random, ranges: Sequence[tuple[int, int]]) -> str:
    lo, hi = ranges[rng.randrange(len(ranges))]
    return chr(rng.randint(lo, hi))


def _emoji(rng: random.Random) -> str:
    e = _from_ranges(rng, _EMOJI_RANGES)
    r = rng.random()
    if r < 0.15:
        e += chr(rng.randint(0x1F3FB, 0x1F3FF))  # a skin tone
    elif r < 0.3:
        e += "\u200d" + _from_ranges(rng, _EMOJI_RANGES)  # a ZWJ sequence
    elif r < 0.4:
        e += "\ufe0f"  # emoji presentation
    return e + (" " if rng.random() < 0.2 else "")


def _json_value(rng: random.Random, depth: int) -> Any:
    r = rng.random()
    if depth < 3 and r < 0.25:
        return {_word(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 6))}
    if depth < 3 and r < 0.4:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(1, 6))]
    if r < 0.6:
        return rng.randint(-10**12, 10**12)
    if r < 0.7:
        return round(rng.uniform(-1e6, 1e6), rng.randint(0, 8))
    if r < 0.75:
        return rng.choice([True, False, None])
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-/.:")
                   for _ in range(rng.randint(0, 24)))


_LETTER_ALPHABETS = ("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
                     "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(1, 12)))


def adversarial_text(kind: str, num_chars: int, rng: random.Random) -> str:
    """About ``num_chars`` characters of one adversarial class (see :data:`ADVERSARIAL_CLASSES`)."""
    if num_chars < 1:
        raise ValueError(f"num_chars must be >= 1, got {num_chars}")
    parts: list[str] = []
    size = 0
    # Texts of one UTF-8 length as well as mixed ones: a mix lets an under-count on one length
    # hide behind an over-count on another.
    lengths = [_SCALAR_RANGES, *((r,) for r in _SCALAR_RANGES)][rng.randrange(4)]
    # Or the 128 code points of one block, as text of one script is: a tokenizer holds some scripts
    # whole and lacks others, which characters drawn from everywhere average out.
    script = None
    if kind == "random_unicode" and rng.random() < 0.5:
        script = ord(_random_scalar(rng, lengths)) & ~127  # never a surrogate block: the scalar is none
    while size < num_chars:
        if kind == "random_unicode":
            piece = _random_scalar(rng, lengths) if script is None else chr(rng.randint(script, script + 127))
        elif kind == "emoji":
            piece = _emoji(rng)
        elif kind == "cjk":
            piece = _from_ranges(rng, _CJK_RANGES)
        elif kind == "base64":
            piece = base64.b64encode(rng.randbytes(rng.randint(3, 600))).decode() + rng.choice(["\n", " ", ""])
        elif kind == "hex":
            piece = rng.randbytes(rng.randint(1, 64)).hex() + rng.choice(["", " ", "\n", ":"])
        elif kind == "digit_runs":
            piece = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 400))) + rng.choice(" ,\n.")
        elif kind == "minified_json":
            piece = json.dumps(_json_value(rng, 0), separators=(",", ":"))
        elif kind == "random_letters":
            # Letters without a word in them (base32 ids, hashes, a repeated syllable): far more
            # tokens per letter than words of the same length.
            alphabet = rng.choice(_LETTER_ALPHABETS)
            unit = "".join(rng.choice(alphabet) for _ in range(rng.choice([rng.randint(1, 4), rng.randint(1, 40)])))
            piece = unit * rng.randint(1, 60) + rng.choice(["", " ", "\n", "_", "."])
        elif kind == "repeated_letters":
            # One random unit of letters repeated with nothing between, the whole text one run of
            # letters: each repeat is spelled as the unit is, so the text costs what its unit costs a
            # letter, up to a token a letter ("qyqy.."), with no mix of units to average it down.
            alphabet = rng.choice(_LETTER_ALPHABETS)
            unit = "".join(rng.choice(alphabet) for _ in range(rng.choice([rng.randint(1, 4), rng.randint(1, 60)])))
            piece = unit * (num_chars // len(unit) + 1)
        elif kind == "whitespace_runs":
            r = rng.random()
            if r < 0.3:
                # A short unit ending in a line break, repeated (blank lines that keep their
                # indentation, a space and a newline alternating): a token for the spaces and one
                # for the break, where one long run costs a token per dozen spaces.
                unit = "".join(rng.choice(" \t\n") if rng.random() < 0.2 else " " for _ in range(rng.randint(0, 16)))
                piece = (unit + "\n") * rng.randint(1, 600)
            else:
                mixed = r < 0.65  # spaces with tabs and newlines, or one long run of spaces
                n = rng.choice([rng.randint(1, 300), rng.randint(300, 8000)])
                piece = "".join(rng.choice(" \t\n") if mixed and rng.random() < 0.3 else " " for _ in range(n))
            piece += _word(rng)
        else:
            raise ValueError(f"unknown class of text {kind!r}; classes: {', '.join(ADVERSARIAL_CLASSES)}")
        parts.append(piece)
        size += len(piece)
    return "".join(parts)[:num_chars]


def adversarial_groups(seed: int = 0, texts_per_class: int = 48, max_chars: int = 12_000,
                       classes: Sequence[str] = ADVERSARIAL_CLASSES) -> list[TextGroup]:
    """``texts_per_class`` texts of each adversarial class of ``classes`` (in the order of
    :data:`ADVERSARIAL_CLASSES`, so that leaving the last out changes no other class's texts), one
    group each, lengths log-uniform from 1 to ``max_chars`` characters; the same for the same seed."""
    unknown = set(classes) - set(ADVERSARIAL_CLASSES)
    if unknown:
        raise ValueError(f"unknown class of text {min(unknown)!r}; classes: {', '.join(ADVERSARIAL_CLASSES)}")
    rng = random.Random(seed)
    groups: list[TextGroup] = []
    for kind in (k for k in ADVERSARIAL_CLASSES if k in classes):
        for i in range(texts_per_class):
            n = max(1, int(math.exp(rng.uniform(0.0, math.log(max_chars)))))
            groups.append(TextGroup(f"adversarial/{kind}/{seed}/{i}", (adversarial_text(kind, n, rng),), kind))
    return groups
