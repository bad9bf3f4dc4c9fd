"""Shared fixtures: where the real traces live, and the traces the project generates itself.

The real traces are read from ``../shared/traces`` beside the repository (CI lays it there), or from
``$CTXFOLD_TRACES``. They are never copied into the project. Without them, the tests that need them
skip (a fresh clone passes); with ``CTXFOLD_REQUIRE_TRACES=1`` (CI) a missing folder fails them
instead, so a run that should have read them cannot pass quietly. The ``traces_dir`` fixture is the
one place that decides: tests take it rather than reading the path themselves.

``synthetic_traces`` writes a small folder of generated traces in every format the importers read
(tests/helpers/synthetic_traces.py), so the same behaviour is tested on a fresh clone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from helpers import sdk_clients
from helpers import synthetic_traces as synthetic

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = Path(os.environ.get("CTXFOLD_TRACES", REPO_ROOT.parent / "shared" / "traces"))
REQUIRE_TRACES = os.environ.get("CTXFOLD_REQUIRE_TRACES", "") not in ("", "0")

# CI (.ci/run sets CTXFOLD_HYPOTHESIS_PROFILE=ci) checks a fixed set of examples for each property: a red
# run then means the change broke something, not that a new draw found an old gap. Local runs keep
# drawing new examples, and Hypothesis replays any that failed (.hypothesis/) until they pass.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("CTXFOLD_HYPOTHESIS_PROFILE", "default"))

WHERE_TO_GET_THEM = (
    "the real agent traces are not part of the project; put them in ../shared/traces beside the clone or "
    "point CTXFOLD_TRACES at them (README.md, 'Tests', names each set's public source)"
)


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The real traces folder; skips the test when it is absent (fails with CTXFOLD_REQUIRE_TRACES=1)."""
    if not TRACES_DIR.is_dir():
        message = f"real traces not found at {TRACES_DIR}: {WHERE_TO_GET_THEM}"
        if REQUIRE_TRACES:
            pytest.fail(f"{message} (CTXFOLD_REQUIRE_TRACES is set, so this is a failure)", pytrace=False)
        pytest.skip(message)
    return TRACES_DIR


@pytest.fixture(scope="session")
def _synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Path, synthetic.Expected]]:
    root = tmp_path_factory.mktemp("synthetic_traces")
    return root, synthetic.write_all(root)


@pytest.fixture(scope="session")
def synthetic_traces_dir(_synthetic: tuple[Path, dict[Path, synthetic.Expected]]) -> Path:
    """The folder of the generated traces, laid out like the real one: ``<format>/<files>``."""
    return _synthetic[0]


@pytest.fixture(scope="session")
def synthetic_traces(_synthetic: tuple[Path, dict[Path, synthetic.Expected]]) -> dict[Path, synthetic.Expected]:
    """The generated trace files (tests/helpers/synthetic_traces.py), each with what its importer must read."""
    return _synthetic[1]


# -- a real redis-server on loopback, for the session store's tests ---------------------------------------
# Debian's redis-server (CI installs it: .ci/run). Each test gets a server of its own in its own
# directory, so a test may stop, kill and restart it. Without the binary the tests skip, unless
# CTXFOLD_REQUIRE_REDIS=1 (CI), where a missing server fails them.

import shutil  # this section's own imports, kept with it (merges stay local)

from helpers.redis_server import REQUIRE_REDIS, RedisServer


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for the test; skips without the binary (fails with CTXFOLD_REQUIRE_REDIS=1)."""
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not on PATH (Debian: apt-get install redis-server)"
        if REQUIRE_REDIS:
            pytest.fail(f"{message} (CTXFOLD_REQUIRE_REDIS is set, so this is a failure)", pytrace=False)
        pytest.skip(message)
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(binary, folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def close_sdk_clients() -> Iterator[None]:
    """Closes the SDK clients a test made (tests/helpers/sdk_clients.py): their sockets, left to the
    garbage collector, would fail whichever later test it runs in."""
    yield
    sdk_clients.close_all()
