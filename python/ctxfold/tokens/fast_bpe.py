"""Exact byte-level BPE counts at tens of MB/s: fastokens, checked against the reference at load.

The reference tokenizers (Hugging Face ``tokenizers``, tiktoken) count 0.5 to 5 MB/s on one core; a
proxy that counts every new message exactly needs tens. fastokens (Apache-2.0, Rust, PCRE2
pre-tokenizers, a pre-token cache) gives the same ids as the reference for every byte-level BPE
tokenizer ctxfold ships (DeepSeek V3 and V4, Qwen3, Llama 3, o200k, cl100k, Mistral's tekken; measured on every message of
the shared traces and an adversarial set; ``docs/benchmarks.md``) at 40 to 190 MB/s.

It is young, so it is never trusted blind: each tokenizer is checked against its reference on
:data:`PROBES` when it loads (a disagreement keeps the reference and says why), and any error it raises
on a text is answered by the reference for that text. Counting is per text, as the reference's, with
special-token strings recognised the same way (``encode(..., add_special_tokens=False)`` for a
``tokenizer.json``; ``encode_ordinary`` for a tiktoken encoding).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

# Texts on which the fast counter must agree with the reference before it is used: the shapes where
# pre-tokenizers differ (whitespace runs before text, contractions, digit groups, CJK, emoji, newlines
# and carriage returns, code, control tokens typed in text, invalid-looking sequences).
PROBES: tuple[str, ...] = (
    "",
    "hello world",
    "Hello, World! It's we'll they'RE I'M you'd",
    "    indented    code\n\tfunc(x)  \n\n\n  end   ",
    "1234567890 12 3.14159 0x1F 1e-9",
    "中文字符和日本語のテキスト、한국어 텍스트",
    "emoji 😀🎉👍🏽 and symbols ±∑∫ → ✓",
    "\r\n\r\nwindows\r\nline\rendings\n",
    "def f(a, b):\n    return {'k': [a, b]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|><｜User｜><|endoftext|>[INST]<s></s>",
    "         \n            \t\t\t\t   x",
    "ÀÉÎÕÜ àéîõü ñ ß Œ æ ÿ café naïve",
    "a" * 300 + " " + "ab" * 200,
    "path/to/file_name.py:123:45: error: 'x' is not defined [E0425]",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
)


def _installed() -> Any | None:
    try:
        import fastokens
    except ImportError:
        return None
    return fastokens


def installed() -> bool:
    """Whether the fast exact counter's library is installed."""
    return _installed() is not None


class FastBPE:
    """Counts of one tokenizer through fastokens; build with :func:`fast_tokenizer_json` or
    :func:`fast_tiktoken`, which return None where the fast path is not available or not exact."""

    def __init__(self, tokenizer: Any, encode: Callable[[str], Any], batch: Callable[[list[str]], tuple[bytes, bytes]]):
        self._tk = tokenizer
        self._encode = encode
        self._batch = batch

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def count_batch(self, texts: list[str]) -> npt.NDArray[np.int64]:
        _, offsets = self._batch(texts)
        return np.diff(np.frombuffer(offsets, dtype=np.uint64)).astype(np.int64)


def _checked(fast: FastBPE, reference: Callable[[str], int], what: str) -> FastBPE | None:
    for text in PROBES:
        try:
            got = fast.count(text)
        except Exception as exc:  # noqa: BLE001 - any failure of the fast path keeps the reference
            log.warning("fast exact counting is off for %s: it failed on a check text (%s); counting with the reference tokenizer", what, exc)
            return None
        want = reference(text)
        if got != want:
            log.warning("fast exact counting is off for %s: it counted %d tokens where the reference counts %d "
                        "on a check text; counting with the reference tokenizer", what, got, want)
            return None
    return fast


def fast_tokenizer_json(path: Path, reference: Callable[[str], int]) -> FastBPE | None:
    """The fast counter of a ``tokenizer.json`` when fastokens is installed, loads it and agrees with
    ``reference`` on :data:`PROBES`; else None (a reason is logged unless fastokens is absent)."""
    mod = _installed()
    if mod is None:
        return None
    try:
        tk = mod.Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - a tokenizer it cannot read stays with the reference
        log.info("fast exact counting is off for %s: fastokens cannot load it (%s)", path, exc)
        return None
    fast = FastBPE(tk, lambda s: tk.encode(s, add_special_tokens=False),
                   lambda ts: tk.encode_batch_flat(ts, add_special_tokens=False))
    return _checked(fast, reference, str(path))


def fast_tiktoken(vocab_file: Path, encoding: str, reference: Callable[[str], int], *,
                  pattern: str | None = None) -> FastBPE | None:
    """The fast counter of a tiktoken encoding (``encode_ordinary``: special-token text is text), from
    its vocabulary file and its pre-tokenizer ``pattern`` (None: fastokens' own for the OpenAI
    ``encoding`` of that name); None as for :func:`fast_tokenizer_json`."""
    mod = _installed()
    if mod is None:
        return None
    try:
        if pattern is None:
            tk = mod.Tokenizer.from_tiktoken(str(vocab_file), encoding=encoding)
        else:
            tk = mod.Tokenizer.from_tiktoken(str(vocab_file), pattern=pattern, special_tokens={})
    except Exception as exc:  # noqa: BLE001
        log.info("fast exact counting is off for %s: fastokens cannot load it (%s)", encoding, exc)
        return None

    def batch(ts: list[str]) -> tuple[bytes, bytes]:
        # encode_batch_flat would recognise special tokens; encode_ordinary has no batch form.
        lengths = np.fromiter((len(tk.encode_ordinary(t)) for t in ts), dtype=np.uint64, count=len(ts))
        return b"", np.concatenate(([0], np.cumsum(lengths, dtype=np.uint64))).astype(np.uint64).tobytes()

    fast = FastBPE(tk, tk.encode_ordinary, batch)
    return _checked(fast, reference, encoding)


def count_one(fast: FastBPE, text: str, reference: Callable[[str], int]) -> int:
    """``fast.count(text)``, or the reference's count when the fast path raises on it."""
    try:
        return fast.count(text)
    except Exception:  # noqa: BLE001 - e.g. a PCRE2 limit, or a text it cannot encode: the reference decides
        return reference(text)


def count_each(fast: FastBPE, texts: Sequence[str], reference: Callable[[list[str]], npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
    """``fast.count_batch(texts)``, or the reference's counts when the fast path raises on them."""
    try:
        return fast.count_batch(list(texts))
    except Exception:  # noqa: BLE001 - e.g. a PCRE2 limit on a pathological text: the reference decides
        return reference(list(texts))
