"""The proxy's fixtures: the scripted upstream and a proxy in front of it, on loopback. The serve tests get
them from tests/serve/conftest.py; a test elsewhere that needs them imports them by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxfold.serve import ProxyApp
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from helpers.proxy_helpers import start_proxy


@pytest.fixture()
def upstream() -> Iterator[tuple[ScriptedUpstream, str]]:
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as srv:
        yield up, srv.url


@pytest.fixture()
def proxy(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> Iterator[tuple[ProxyApp, str]]:
    p, srv = start_proxy(upstream[1], tmp_path / "data")
    try:
        yield p, srv.url
    finally:
        srv.close()
