"""Benchmarks read the real traces from ``../shared/traces`` beside the repository, or ``$CTXFOLD_TRACES``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = Path(os.environ.get("CTXFOLD_TRACES", REPO_ROOT.parent / "shared" / "traces"))


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES_DIR.is_dir():
        pytest.fail(f"real traces not found at {TRACES_DIR}; set CTXFOLD_TRACES to the shared/traces folder")
    return TRACES_DIR
