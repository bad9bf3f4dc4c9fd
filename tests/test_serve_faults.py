"""The proxy when things go wrong mid-request: a client that leaves, an upstream that needs a key
for summaries, an upstream that refuses a prompt as too long."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from ctxfold.serve import ProxyApp
from ctxfold.serve.testing import ScriptedUpstream
from ctxfold.session import Session
from proxy_helpers import chat, post


def _wait_for(check: object, timeout_s: float = 5.0) -> float:
    """Seconds until ``check()`` is true (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - t0


# -- cancellation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_the_upstream_call_and_frees_its_conversation(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], tmp_path: Path, stream: bool) -> None:
    up, _ = upstream
    body = chat(("user", "a slow question"), stream=stream)
    if stream:  # the answer starts, then the engine takes its time
        up.stall_after_chunks, up.stall_s = 1, 60.0
        with httpx.stream("POST", f"{proxy[1]}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_raw())
    else:  # nothing comes for a minute: the client gives up first
        up.delay_s = 60.0
        with pytest.raises(httpx.ReadTimeout):
            post(proxy[1], body, timeout=0.5)
    # The upstream sees its connection closed at once: the engine stops generating.
    assert _wait_for(lambda: up.abandoned == 1) < 3.0
    # The conversation is free: its next request does not wait out the abandoned call.
    up.delay_s, up.stall_after_chunks = 0.0, None
    t0 = time.monotonic()
    r = post(proxy[1], chat(("user", "a slow question"), ("assistant", "never mind"), ("user", "next")))
    assert r.status_code == 200 and time.monotonic() - t0 < 5.0
    _wait_for(lambda: proxy[0].sessions.num_locked == 0)
    # What the client sent before leaving is in the session log.
    sessions = sorted((tmp_path / "data" / "sessions").glob("*/[0-9]*"))
    assert len(sessions) == 1
    texts = [m.text for m in Session(sessions[0]).restore().messages]
    assert texts[:3] == ["a slow question", "never mind", "next"]
