import numpy as np
import pytest

from ctxfold import _core


def test_feature_rows_shape_and_classes() -> None:
    rows = _core.feature_rows(["hello world", "", "中文"])
    assert rows.shape == (3, _core.NUM_FEATURES)
    assert rows.dtype == np.int64
    names = _core.FEATURE_NAMES
    assert rows[0, names.index("letters")] == 10
    assert rows[2, names.index("cjk_chars")] == 2


def test_ledger_rejects_wrong_dtype_with_a_named_argument() -> None:
    ledger = _core.Ledger()
    with pytest.raises(ValueError, match="num_tokens: expected dtype int64"):
        ledger.append_batch(
            np.zeros(2, np.uint64), np.zeros(2, np.int32), np.zeros(2, np.uint32), np.arange(2, dtype=np.int64)
        )
    with pytest.raises(ValueError, match="C-contiguous"):
        ledger.append_batch(
            np.zeros(4, np.uint64)[::2],
            np.zeros(2, np.int64),
            np.zeros(2, np.uint32),
            np.arange(2, dtype=np.int64),
        )
    assert len(ledger) == 0
