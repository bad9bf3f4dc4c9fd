"""A reader of GGUF metadata: the key-value header of a llama.cpp model file, without its tensors.

Only the header is read (its size is independent of the weights: a few MB for a 262k-token
vocabulary), so the first chunk of a split file is enough. Numeric arrays come back as numpy arrays
(zero-copy views of the bytes read), string arrays as ``list[str]``, scalars as Python values.
Format: GGUF v2 and v3, little-endian (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import struct
from collections.abc import Container
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ctxfold.errors import CtxfoldError

_MAGIC = b"GGUF"
# GGUF value types -> struct format of one value (8: string, 9: array are handled apart).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
# A bound on one string or array length: a corrupt length must not become a multi-GB read.
_MAX_LEN = 1 << 31

# llama.cpp token types (tokenizer.ggml.token_type): a control token is never produced from text.
TOKEN_TYPE_CONTROL = 3


class GGUFError(CtxfoldError, ValueError):
    """A file is not a readable GGUF model (bad magic, truncated header, unknown value type)."""


class _Reader:
    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path = f, path

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise GGUFError(f"{self.path}: GGUF header is truncated")
        return b

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def length(self) -> int:
        n = int(self.scalar("<Q"))
        if n > _MAX_LEN:
            raise GGUFError(f"{self.path}: GGUF header has an implausible length {n}")
        return n

    def string(self) -> str:
        return self.read(self.length()).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = int(self.scalar("<I"))
            n = self.length()
            if etype == _STRING:
                if not keep:
                    for _ in range(n):
                        self.f.seek(self.length(), 1)
                    return None
                return [self.string() for _ in range(n)]
            if etype not in _DTYPE:
                raise GGUFError(f"{self.path}: unknown GGUF array type {etype}")
            dtype = np.dtype(_DTYPE[etype])
            if not keep:
                self.f.seek(n * dtype.itemsize, 1)
                return None
            return np.frombuffer(self.read(n * dtype.itemsize), dtype=dtype)
        if vtype not in _SCALAR:
            raise GGUFError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.scalar(_SCALAR[vtype])


def read_metadata(path: str | Path, keys: Container[str] | None = None) -> dict[str, Any]:
    """The metadata of the GGUF file at ``path``: key -> value, for ``keys`` only when given (the
    others are skipped without being decoded). Raises :class:`GGUFError` for a file that is not GGUF,
    ``OSError`` for one that cannot be read."""
    p = Path(path)
    with p.open("rb") as f:
        r = _Reader(f, p)
        if f.read(4) != _MAGIC:
            raise GGUFError(f"{p}: not a GGUF file (no GGUF magic at its start)")
        version = int(r.scalar("<I"))
        if version not in (2, 3):
            raise GGUFError(f"{p}: GGUF version {version} is not supported (2 and 3 are)")
        r.scalar("<Q")  # tensor count: the tensors are not read
        num_kv = int(r.scalar("<Q"))
        out: dict[str, Any] = {}
        for _ in range(num_kv):
            key = r.string()
            vtype = int(r.scalar("<I"))
            keep = keys is None or key in keys
            v = r.value(vtype, keep)
            if keep:
                out[key] = v
        return out


__all__ = ["TOKEN_TYPE_CONTROL", "GGUFError", "read_metadata"]
