"""How many processes a pytest run of this repository uses (pytest-xdist's ``-n auto``, set in pyproject.toml).

The fast tier of a bare ``pytest`` (or ``pytest -k ...``: every test file) is CPU-bound work spread
over many short tests: it runs on every core, up to eight. Everything else runs in this one process:

- a run of the files or folders named on its command line (``pytest tests/core``): starting workers
  would cost more than most such runs take;
- a run that selects the slow or end-to-end tiers (``-m ""``, ``-m slow``, ``-m e2e``): the real
  engines and the load and soak tests each want the machine to themselves, and their time bounds are
  set for that;
- a run with benchmarks enabled (``bench/run.py``, ``--benchmark-enable``): pytest-benchmark measures
  nothing under xdist.

An explicit ``-n N`` is taken as given (``pytest tests/serve -n 2``).
"""

from __future__ import annotations

import os

import pytest

FAST_TIER = "not slow and not e2e"  # the marker expression pyproject.toml's addopts give a bare pytest
MAX_WORKERS = 8  # past this, starting workers (each collects every test) costs more than it saves


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    if (config.args_source is not pytest.Config.ArgsSource.TESTPATHS
            or config.getoption("markexpr", "") != FAST_TIER or config.getoption("benchmark_enable", False)):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))
