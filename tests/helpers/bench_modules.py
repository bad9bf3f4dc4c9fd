"""A script of bench/ imported as a module by a test, and forgotten after it.

A bench script puts bench/ on ``sys.path`` to import its neighbours (``report``, ``synth``, ...). Those
names must not answer a later test's import of the same name, so the path is restored at once and the
bench modules the import added are dropped when the test is done (ctxfold's own modules stay: dropping
them would make a second copy of every class).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextmanager
def bench_module(filename: str) -> Iterator[ModuleType]:
    """``bench/<filename>`` as a module, for the ``with`` block."""
    path, before = list(sys.path), set(sys.modules)
    name = f"bench_{Path(filename).stem}_under_test"
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        sys.path[:] = path
        yield module
    finally:
        sys.path[:] = path
        bench_names = {p.stem for p in BENCH.glob("*.py")} | {name}
        for added in set(sys.modules) - before:
            if added in bench_names:
                sys.modules.pop(added, None)
