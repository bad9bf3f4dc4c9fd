"""Benchmarks read the real traces from ``../shared/traces`` beside the repository, or ``$CTXFOLD_TRACES``."""

from __future__ import annotations

from pathlib import Path

import pytest

from synth import TRACES_DIR


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES_DIR.is_dir():
        pytest.fail(f"real traces not found at {TRACES_DIR}; set CTXFOLD_TRACES to the shared/traces folder")
    return TRACES_DIR
