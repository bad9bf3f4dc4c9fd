"""A GGUF model through llama.cpp (llama-cpp-python's ctypes bindings of ``llama.h``): its vocabulary,
metadata and chat template, and its weights when an engine evaluates with it. ``pip install 'ctxfold[llama]'``.

Token level: ``gguf:`` counters (:mod:`ctxfold.tokens.counting`) tokenize with a model loaded ``vocab_only``,
and the llama.cpp engine (:mod:`ctxfold.engines.llama_cpp`) evaluates with one loaded whole.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxfold.core._arrays import ids_view
from ctxfold.errors import EngineError

INSTALL_HINT = "pip install 'ctxfold[llama]'"
GGUF_MAGIC = b"GGUF"
_lib_lock = threading.Lock()
_lib_module: Any = None
_INT32_MAX = 2**31 - 1


def llama_cpp_lib() -> Any:
    """The ``llama_cpp`` module, with llama.cpp's backend initialised once. EngineError when not installed."""
    global _lib_module
    with _lib_lock:
        if _lib_module is None:
            try:
                lib = importlib.import_module("llama_cpp")
            except ImportError as exc:
                raise EngineError(f"llama.cpp is not installed (the llama-cpp-python package); {INSTALL_HINT}") from exc
            # llama-cpp-python prints every llama.cpp log line (model card, buffer sizes) to stderr while its
            # logger has no level; its own Llama(verbose=False) sets ERROR. So does this, unless the
            # application chose a level itself.
            log = logging.getLogger("llama-cpp-python")
            if log.level == logging.NOTSET:
                log.setLevel(logging.ERROR)
            lib.llama_backend_init()
            _lib_module = lib
        return _lib_module


def check_gguf(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path, after checking that it is a GGUF file (EngineError if it is missing or is not)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise EngineError(f"GGUF file not found: {p}; pass the path of a .gguf model file")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise EngineError(f"{p}: cannot read it ({exc.strerror})") from None
    if magic != GGUF_MAGIC:
        raise EngineError(f"{p}: not a GGUF file (a GGUF starts with b'GGUF', this one with {magic!r}); "
                          "pass a .gguf model file")
    return p


def _utf8(text: str | bytes, where: str = "text") -> bytes:
    if isinstance(text, str):
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{where}: contains a lone surrogate at character {exc.start}, which no tokenizer can "
                             "encode; clean it with s.encode('utf-8', 'replace').decode()") from None
    else:
        data = bytes(text)
    if len(data) > _INT32_MAX:
        raise ValueError(f"{where}: {len(data):,} bytes is over what llama.cpp tokenizes in one call (2 GiB)")
    return data


def _read_str(fill: Any, size: int = 256) -> str:
    """A string from a llama.cpp snprintf-style getter: fill(buf, size) returns the full length or < 0."""
    while True:
        buf = ctypes.create_string_buffer(size)
        n = int(fill(buf, size))
        if n < 0:
            return ""
        if n < size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1


class LlamaCppModel:
    """A GGUF model loaded by llama.cpp; ``vocab_only`` loads its tokenizer alone (no weights, milliseconds).

    extra_buffer_types: let llama.cpp repack the weights for its CPU kernels (AMX, AVX repacking), its
    default. A host that reports AMX without letting a process use it (some VMs and sandboxes) kills the
    process with SIGILL at the first evaluation, which nothing can catch: pass False there.

    Thread-safe: tokenizing only reads the vocabulary (llama.cpp's server tokenizes on many threads at once),
    and each call has its own buffer. ``close()`` frees it early; otherwise it is freed with the object.
    """

    def __init__(self, path: str | os.PathLike[str], *, vocab_only: bool = False, n_gpu_layers: int = 0,
                 extra_buffer_types: bool = True) -> None:
        self.path = check_gguf(path)
        lib = llama_cpp_lib()
        params = lib.llama_model_default_params()
        params.vocab_only = vocab_only
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = extra_buffer_types
        handle = lib.llama_model_load_from_file(os.fsencode(self.path), params)
        if not handle:
            raise EngineError(f"{self.path}: llama.cpp could not load this model (an architecture this llama.cpp "
                              "does not know, or a truncated file); upgrade llama-cpp-python or pass another file")
        self._lib = lib
        self._handle = handle
        self._vocab = lib.llama_model_get_vocab(handle)
        self.vocab_only = vocab_only
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(handle))
        self._finalizer = weakref.finalize(self, lib.llama_model_free, handle)

    @property
    def handle(self) -> Any:
        """The raw ``llama_model *`` (a ctypes pointer), for calls this class does not wrap."""
        return self._handle

    def close(self) -> None:
        """Free the model now (contexts over it must be closed first)."""
        self._finalizer()

    def tokenize(self, text: str | bytes, *, parse_special: bool = True, add_special: bool = False
                 ) -> npt.NDArray[np.int32]:
        """int32[n]: ``text`` in llama.cpp's tokens. parse_special: special-token text becomes its id (what
        llama.cpp does with a rendered chat prompt); add_special: add BOS/EOS as the model asks."""
        data = _utf8(text)
        capacity = len(data) + 2  # SentencePiece and byte-level BPE give at most a token a byte, plus BOS/EOS
        while True:
            buf = (ctypes.c_int32 * capacity)()
            n = int(self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special))
            if n >= 0:
                return np.ctypeslib.as_array(buf)[:n].astype(np.int32, copy=True)
            if -n <= capacity:  # INT32_MIN: over 2^31 tokens
                raise ValueError(f"text: llama.cpp could not tokenize {len(data):,} bytes")
            capacity = -n

    def count(self, text: str | bytes, *, parse_special: bool = True, add_special: bool = False) -> int:
        """len(tokenize(text)), without a buffer: llama.cpp returns minus the count when given no room."""
        data = _utf8(text)
        n = int(self._lib.llama_tokenize(self._vocab, data, len(data), None, 0, add_special, parse_special))
        return -n if n < 0 else n

    def detokenize(self, ids: Any, *, special: bool = False) -> str:
        """The text of int32 ids (special tokens written out when ``special``); invalid UTF-8 is replaced."""
        v = np.ascontiguousarray(ids_view(ids), dtype=np.int32)
        ptr = v.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        size = max(64, 8 * len(v))
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(self._lib.llama_detokenize(self._vocab, ptr, len(v), buf, size, False, special))
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n

    def token_id(self, piece: str) -> int | None:
        """The id of a token given as its text (``"<start_of_turn>"``), or None if it is not one token."""
        ids = self.tokenize(piece)
        return int(ids[0]) if len(ids) == 1 else None

    def is_eog(self, token_id: int) -> bool:
        """Whether the token ends a generation (EOS, end of turn)."""
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token_id))

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template in the GGUF's metadata (``tokenizer.chat_template``), or None."""
        raw = self._lib.llama_model_chat_template(self._handle, None)
        return raw.decode("utf-8", errors="replace") if raw else None

    def metadata(self) -> dict[str, str]:
        """The GGUF's metadata, every value as llama.cpp prints it (arrays are summarised)."""
        lib, h = self._lib, self._handle
        out: dict[str, str] = {}
        for i in range(int(lib.llama_model_meta_count(h))):
            key = _read_str(lambda buf, size, i=i: lib.llama_model_meta_key_by_index(h, i, buf, size))
            out[key] = _read_str(lambda buf, size, i=i: lib.llama_model_meta_val_str_by_index(h, i, buf, size))
        return out

    def __repr__(self) -> str:
        return f"LlamaCppModel({str(self.path)!r}{', vocab_only=True' if self.vocab_only else ''})"
