"""Benchmarks read the real traces from ``../shared/traces`` beside the repository, or ``$CTXFOLD_TRACES``.

Without them the benchmarks that need them skip, saying where to get them; with
``CTXFOLD_REQUIRE_TRACES=1`` a missing folder fails instead (synth.need_traces).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from synth import need_traces


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    return need_traces()
