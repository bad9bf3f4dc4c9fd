"""What `ctxfold serve` writes to its log: a timestamped line per request, per compaction, per failure and
per change of health, as text or as one JSON object a line."""

from __future__ import annotations

import fcntl
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from helpers.proxy_helpers import chat, post
from helpers.subprocess_env import ctxfold_env

FILLER = "lorem ipsum dolor sit amet " * 40


def run_proxy(upstream_url: str, data_dir: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxfold", "serve", "--upstream", upstream_url, "--port", "0", "--data-dir",
         str(data_dir), "--context-tokens", "2048", "--template", "none", "--tokenizer", "chars4",
         "--summarizer", "extractive", "--engine-check", "off", "--no-fsync", *extra],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ctxfold_env())
    assert proc.stderr is not None
    line = proc.stderr.readline()
    m = re.search(r"listening on (\S+),", line)
    assert m is not None, line + proc.stderr.read()[-2000:]
    return proc, m.group(1)


def stop(proc: subprocess.Popen[str]) -> list[str]:
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    return err.splitlines()


def test_json_lines_for_requests_compactions_failures_and_health(tmp_path: Path) -> None:
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as upstream:
        proc, url = run_proxy(upstream.url + "/v1", tmp_path / "data", "--log-format", "json")
        try:
            messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
            for k in range(8):  # enough turns at a 2k window for a compaction
                messages.append({"role": "user", "content": f"question {k} {FILLER}"})
                resp = post(url, {"model": "m", "messages": messages})
                assert resp.status_code == 200
                messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
            up.fail_status, up.fail_count = 503, 1
            assert post(url, chat(("user", "this one fails"))).status_code == 503
        finally:
            upstream.close()  # the upstream goes: /health says so, once
            time.sleep(0.1)
            for _ in range(3):
                httpx.get(url + "/health", timeout=30)
            lines = stop(proc)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and len(records) == len([line for line in lines if line.strip()]), lines  # every line is JSON
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["time"]) for r in records)
    access = [r for r in records if r["logger"] == "ctxfold.access"]
    assert [r["status"] for r in access] == [200] * 8 + [503]
    assert all(r["tenant"] == "anonymous" and r["ms"] > 0 for r in access)
    assert any(r["compactions"] > 0 for r in access) and any(r["prompt_tokens"] for r in access)
    compactions = [r for r in records if r["message"].startswith("compaction: ")]
    assert compactions and all(r["applied"] and r["tokens_after"] < r["tokens_before"] for r in compactions)
    assert sum(r["compactions"] for r in access) == len(compactions)
    degraded = [r for r in records if r.get("health") == "degraded"]
    assert len(degraded) == 1 and "cannot be reached" in degraded[0]["reason"]


def test_text_lines_have_a_timestamp_and_the_level_filters(tmp_path: Path) -> None:
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as upstream:
        proc, url = run_proxy(upstream.url + "/v1", tmp_path / "a")
        assert post(url, chat(("user", "hi"))).status_code == 200
        lines = stop(proc)
        quiet, url = run_proxy(upstream.url + "/v1", tmp_path / "b", "--log-level", "warning")
        assert post(url, chat(("user", "hi"))).status_code == 200
        quiet_lines = stop(quiet)
    (access,) = [line for line in lines if " ctxfold.access: " in line]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO ctxfold\.access: POST /v1/chat/completions 200 "
                        r"tenant=anonymous prompt_tokens=\S+ compactions=0 warnings=0 [\d.]+ ms", access), access
    assert not [line for line in quiet_lines if "ctxfold.access" in line]


def test_a_stderr_nobody_reads_never_blocks_the_proxy(tmp_path: Path) -> None:
    """A script that reads the listening line and nothing more: once the pipe is full, a log write
    that waited would stop the proxy's loop (the bench's 64 conversations hung so), and its exit."""
    up = ScriptedUpstream()
    with BackgroundServer(up.app()) as upstream:
        proc, url = run_proxy(upstream.url + "/v1", tmp_path / "data", "--log-level", "debug")
        assert proc.stderr is not None
        # The smallest pipe Linux allows (a page): full after about twenty lines, not three hundred.
        fcntl.fcntl(proc.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)
        try:
            with httpx.Client(timeout=30) as client:
                for k in range(300):  # ~200 bytes of access line each: many times the pipe's 4 kB
                    r = client.post(url + "/v1/chat/completions", json=chat(("user", f"hello {k}")))
                    assert r.status_code == 200
        finally:
            t0 = time.monotonic()
            proc.terminate()
            proc.wait(timeout=30)
        assert proc.returncode == 0 and time.monotonic() - t0 < 10
        assert proc.stderr is not None
        proc.stderr.close()


def test_a_full_log_queue_drops_and_counts_instead_of_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging
    from collections import deque

    from ctxfold.serve import logs

    monkeypatch.setattr(logs, "QUEUE_LINES", 3)
    lines: deque[logging.LogRecord] = deque()
    handler = logs._DroppingQueueHandler(lines)
    for k in range(10):
        handler.handle(logging.LogRecord("ctxfold.access", logging.INFO, "", 0, "line %d", (k,), None))
    assert handler.dropped == 7 and [r.getMessage() for r in lines] == ["line 0", "line 1", "line 2"]
    # A record waits with its traceback as text, not with the frames (and all they hold) alive.
    lines.clear()
    try:
        raise ValueError("boom")
    except ValueError:
        handler.handle(logging.LogRecord("ctxfold.serve", logging.ERROR, "", 0, "failed", None, sys.exc_info()))
    assert lines[0].exc_info is None and "ValueError: boom" in (lines[0].exc_text or "")


@pytest.fixture
def serve_logging() -> Iterator[None]:
    """``ctxfold serve``'s logging in this process, undone after: the ctxfold logger as it was (other
    tests read its records through the root logger)."""
    import logging

    from ctxfold.serve.logs import stop_logging

    logger = logging.getLogger("ctxfold")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        yield
    finally:
        stop_logging()
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_a_line_that_cannot_be_formatted_is_said_and_the_writer_goes_on(
        serve_logging: None, capfd: pytest.CaptureFixture[str]) -> None:
    """The writer thread formats the lines: one whose arguments do not fit its message is written as
    such, and the lines after it are written too (a writer that died would lose every later line)."""
    import logging

    from ctxfold.serve.logs import configure_logging, stop_logging

    configure_logging("info", "json")
    log = logging.getLogger("ctxfold.serve")
    log.info("two values %d %d", 1)  # noqa: PLE1206 - one missing, on purpose
    log.info("after it %s", "still written")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed")
    stop_logging()
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines()]  # every line JSON
    messages = [line["message"] for line in lines]
    assert any(m.startswith("this log line could not be formatted (TypeError") and "'two values %d %d'" in m
               for m in messages), messages
    assert "after it still written" in messages
    failed = [line for line in lines if line.get("message") == "it failed"]
    assert failed and "ValueError: boom" in failed[0]["exception"], lines
