"""A reader of GGUF metadata: the key-value header of a llama.cpp model file, without its tensors.

Only the header is read (its size is independent of the weights: a few MB for a 262k-token
vocabulary), so the first chunk of a split file is enough. Numeric arrays come back as numpy arrays
(zero-copy views of the bytes read), string arrays as ``list[str]``, scalars as Python values.
Format: GGUF v2 and v3, little-endian (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).

A GGUF file comes from anyone, so its header is hostile input: every length and count in it is checked
against the bytes left in the file (and a stated maximum) before anything is read or allocated for it. A
header that claims more than the file holds, is cut short or is malformed raises :class:`GGUFError`, one
line naming the file, the byte offset of the bad field and what is wrong with it.
"""

from __future__ import annotations

import os
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
_TYPE_NAME = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
              8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# The fewest bytes each thing a count counts takes in the file, so that a count can be checked against the
# bytes left before the loop over it starts: a string is at least its 8-byte length; a key-value pair its
# key (8), its value type (4) and a 1-byte value; a tensor info its name (8), dimension count (4), type (4)
# and data offset (8).
_MIN_STRING_NBYTES = 8
_MIN_KV_NBYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_NBYTES = 8 + 4 + 4 + 8
# Bounds whatever the file's size (a model file can be 100 GB, so its size alone bounds little): the largest
# real metadata strings (a chat template, an embedded tokenizer.json) are tens of MB, the largest arrays a
# vocabulary or its merges (about a million entries).
_MAX_STRING_NBYTES = 1 << 30
_MAX_ARRAY_COUNT = 1 << 28
# A key shown in a message: its repr (the key is the file's text, so newlines are escaped), cut to this.
_MAX_SHOWN_CHARS = 80

# llama.cpp token types (tokenizer.ggml.token_type): a control token is never produced from text.
TOKEN_TYPE_CONTROL = 3


class GGUFError(CtxfoldError, ValueError):
    """A file is not a readable GGUF model (bad magic, truncated header, a length the file does not hold,
    unknown value type): one line naming the file and the byte offset of the bad field."""


def _shown(key: str) -> str:
    r = repr(key)
    return r if len(r) <= _MAX_SHOWN_CHARS else r[: _MAX_SHOWN_CHARS - 3] + "..."


class _Reader:
    """Reads the header front to back, counting the bytes read: ``offset`` is where the next field starts, so
    every length can be checked against ``size_nbytes - offset`` before it is read, and every error can say
    where the bad field is."""

    def __init__(self, f: BinaryIO, path: Path, size_nbytes: int) -> None:
        self.f, self.path, self.size_nbytes = f, path, size_nbytes
        self.offset = 0
        self.where = ""  # the key-value pair being read, for messages

    def error(self, offset: int, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: bad GGUF header at byte offset {offset}{self.where}: {problem}")

    def remaining_nbytes(self) -> int:
        return self.size_nbytes - self.offset

    def claim(self, offset: int, nbytes: int, what: str, *, at_least: bool = False) -> None:
        """Refuse ``what`` (read from the field at ``offset``) if its ``nbytes`` are not all in the file."""
        if nbytes > self.remaining_nbytes():
            least = "at least " if at_least else ""
            raise self.error(offset, f"{what} claims {least}{nbytes:,} bytes, but only {self.remaining_nbytes():,} "
                                     f"remain in the {self.size_nbytes:,}-byte file")

    def read(self, nbytes: int, what: str) -> bytes:
        if nbytes > self.remaining_nbytes():
            raise self.error(self.offset, f"the file ends inside the {nbytes}-byte {what} "
                                          f"(it is {self.size_nbytes:,} bytes: truncated)")
        b = self.f.read(nbytes)
        if len(b) != nbytes:  # the file shrank while being read
            raise self.error(self.offset + len(b), f"the file ends inside the {nbytes}-byte {what} (truncated)")
        self.offset += nbytes
        return b

    def skip(self, nbytes: int) -> None:
        # Only after a claim(): seeking past the end would not fail, and a truncated value would pass unseen.
        self.f.seek(nbytes, os.SEEK_CUR)
        self.offset += nbytes

    def u32(self, what: str) -> int:
        return int(_U32.unpack(self.read(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack(self.read(8, what))[0])

    def string_nbytes(self) -> int:
        """The length of the string that starts here, checked (the string's bytes follow it)."""
        offset = self.offset
        nbytes = self.u64("string length")
        self.claim(offset, nbytes, "the string length")
        if nbytes > _MAX_STRING_NBYTES:  # in a file that does hold it
            raise self.error(offset, f"a string length of {nbytes:,} bytes is over the maximum of "
                                     f"{_MAX_STRING_NBYTES:,} a metadata string may have")
        return nbytes

    def string(self) -> str:
        # Invalid UTF-8 is replaced, not refused: a byte-level token must not make the whole file unreadable.
        return self.read(self.string_nbytes(), "string").decode("utf-8", errors="replace")

    def value(self, keep: bool) -> Any:
        """The value (type, then data) that starts here; None (skipped, checked all the same) if not ``keep``."""
        offset = self.offset
        vtype = self.u32("value type")
        if vtype == _STRING:
            if keep:
                return self.string()
            self.skip(self.string_nbytes())
            return None
        if vtype == _ARRAY:
            return self.array(keep)
        fmt = _SCALAR.get(vtype)
        if fmt is None:
            raise self.error(offset, f"unknown value type {vtype} (GGUF has types 0 to 12)")
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), f"{_TYPE_NAME[vtype]} value"))[0]

    def array(self, keep: bool) -> Any:
        etype_offset = self.offset
        etype = self.u32("array element type")
        if etype == _ARRAY:
            # Refused, not recursed into: llama.cpp does not read them either, and no nesting depth can
            # then exhaust the stack.
            raise self.error(etype_offset, "an array of arrays, which GGUF readers (llama.cpp's too) do not read")
        if etype != _STRING and etype not in _DTYPE:
            raise self.error(etype_offset, f"unknown array element type {etype} (GGUF has types 0 to 12)")
        count_offset = self.offset
        count = self.u64("array count")
        name = _TYPE_NAME[etype]
        itemsize = _MIN_STRING_NBYTES if etype == _STRING else np.dtype(_DTYPE[etype]).itemsize
        # For strings a lower bound (each is checked again as it is read), which bounds the list before it grows.
        self.claim(count_offset, count * itemsize, f"the array count of {count:,} {name} values",
                   at_least=etype == _STRING)
        if count > _MAX_ARRAY_COUNT:  # in a file that does hold it
            raise self.error(count_offset, f"an array count of {count:,} is over the maximum of "
                                           f"{_MAX_ARRAY_COUNT:,} a metadata array may have")
        if etype == _STRING:
            if keep:
                return [self.string() for _ in range(count)]
            for _ in range(count):
                self.skip(self.string_nbytes())
            return None
        nbytes = count * itemsize
        if not keep:
            self.skip(nbytes)
            return None
        return np.frombuffer(self.read(nbytes, f"{name} array"), dtype=np.dtype(_DTYPE[etype]))

    def header(self) -> int:
        """Reads magic, version and counts; returns the number of key-value pairs, checked."""
        if self.f.read(4) != _MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (no GGUF magic at byte offset 0)")
        self.offset = 4
        version = self.u32("version")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = "; this is a big-endian GGUF file, which this reader does not read" if swapped in (2, 3) else ""
            raise self.error(4, f"GGUF version {version} is not supported (2 and 3 are){hint}")
        # The tensor infos are never read, but a count the file cannot hold says the header is not sound.
        n_tensors = self.u64("tensor count")
        num_kv = self.u64("key-value count")
        self.claim(8, n_tensors * _MIN_TENSOR_INFO_NBYTES, f"the tensor count of {n_tensors:,}", at_least=True)
        self.claim(16, num_kv * _MIN_KV_NBYTES, f"the key-value count of {num_kv:,}", at_least=True)
        return num_kv


def read_metadata(path: str | Path, keys: Container[str] | None = None) -> dict[str, Any]:
    """The metadata of the GGUF file at ``path``: key -> value, for ``keys`` only when given (the
    others are skipped without being decoded, though checked all the same). Raises :class:`GGUFError` for a
    file that is not GGUF or not sound (a length it does not hold, truncation, an unknown type), and for a
    path that is not a regular file; ``OSError`` for one that cannot be read."""
    p = Path(path)
    # Before opening: opening a FIFO blocks until someone writes to it, and the checks need a file's size.
    if p.exists() and not p.is_file():
        raise GGUFError(f"{p}: not a GGUF file: not a regular file (a directory, pipe or device)")
    with p.open("rb") as f:
        r = _Reader(f, p, os.fstat(f.fileno()).st_size)
        num_kv = r.header()
        out: dict[str, Any] = {}
        for i in range(num_kv):
            r.where = f" (the key of metadata entry {i})"
            key = r.string()
            r.where = f" (the value of key {_shown(key)})"
            keep = keys is None or key in keys
            v = r.value(keep)
            if keep:
                out[key] = v
        return out


__all__ = ["TOKEN_TYPE_CONTROL", "GGUFError", "read_metadata"]
