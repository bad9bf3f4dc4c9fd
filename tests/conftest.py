"""Shared fixtures: where the real traces live.

The traces are read from ``../shared/traces`` beside the repository (CI lays it there), or from
``$CTXFOLD_TRACES``. They are never copied into the project.
"""

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
