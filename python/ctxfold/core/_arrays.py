"""Checked, zero-copy views of caller arrays for the C++ core.

numpy arrays pass through untouched (the core itself rejects a wrong dtype or a non-contiguous
array with a ValueError naming the argument); CPU torch tensors and other DLPack producers become
numpy views through ``np.from_dlpack``; plain Python sequences are converted once, visibly, here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def as_view(x: Any, dtype: type[np.generic], name: str) -> npt.NDArray[Any]:
    """A 1-D numpy view of ``x`` without copying when ``x`` is an ndarray or DLPack tensor.

    A dtype or layout mismatch is left for the core to report; lists and tuples are converted to
    ``dtype`` (a copy, which is the only way to hand them to C++).
    """
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as e:  # e.g. a CUDA tensor
            raise ValueError(f"{name}: cannot view this tensor from the CPU without a copy ({e})") from e
    if isinstance(x, (list, tuple, range)):
        try:
            return np.asarray(x, dtype=dtype)
        except OverflowError as e:
            raise ValueError(f"{name}: a value does not fit {np.dtype(dtype)} ({e})") from e
    raise ValueError(f"{name}: expected a numpy array, a CPU tensor or a list, got {type(x).__name__}")


def ids_view(ids: Any, name: str = "ids") -> npt.NDArray[np.int32]:
    """:func:`as_view` of token ids, checked to be int32[n] here (the engines hand them to llama.cpp)."""
    v = as_view(ids, np.int32, name)
    if v.dtype != np.int32 or v.ndim != 1:
        raise ValueError(f"{name}: expected int32[n] token ids, got {v.dtype}{list(v.shape)}; "
                         "convert once with np.ascontiguousarray(x, dtype=np.int32)")
    return v
