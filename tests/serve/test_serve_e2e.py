"""End to end on loopback: a real trace replayed through ``ctxfold serve`` to an upstream with a small window.

The client sends, for every assistant turn of a recorded tau-bench conversation, the history so far
(as an agent would); the scripted upstream answers with the recorded assistant message and counts
every prompt with the real DeepSeek V4 tokenizer, rejecting any that exceeds its window. The proxy
has to compact to get every request through, stream every answer back byte for byte, and keep the
full history in its data directory. Then the same through a proxy killed with SIGKILL mid-conversation.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream, deepseek_counter
from helpers.proxy_helpers import serve_in_background
from helpers.subprocess_env import ctxfold_env

REPO = Path(__file__).resolve().parents[2]
CONTEXT_TOKENS = 6144  # the longest tau-bench conversations hold about 10k tokens
TRACE_INDEX = 52  # the longest conversation of the file (62 messages)


@cache
def _counter() -> Any:
    return deepseek_counter()


def load_trajectory(traces_dir: Path) -> list[dict[str, Any]]:
    data = json.loads((traces_dir / "tau_bench" / "gpt-4o-airline.json").read_text())
    traj: list[dict[str, Any]] = data[TRACE_INDEX]["traj"]
    return traj


def answer_of(m: dict[str, Any]) -> dict[str, Any]:
    out = {"role": "assistant", "content": m.get("content")}
    if m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    return out


def requests_of(traj: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index of the assistant message, the request that produced it) for each assistant turn."""
    for i, m in enumerate(traj):
        if m["role"] == "assistant":
            yield i, {"model": "gpt-4o", "messages": traj[:i], "stream": True,
                      "stream_options": {"include_usage": True}, "x_replay_answer": answer_of(m)}


def stream(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        return r.status_code, b"".join(r.iter_raw())


def view_of(m: Any) -> tuple[str, str, tuple[tuple[str, str, str], ...], str | None]:
    return (m.role.value, m.text, tuple((c.id, c.name, c.arguments) for c in m.tool_calls), m.tool_call_id)


def wire_view(d: dict[str, Any]) -> tuple[str, str, tuple[tuple[str, str, str], ...], str | None]:
    calls = tuple((c["id"], c["function"]["name"], c["function"]["arguments"]) for c in d.get("tool_calls") or [])
    return (d["role"], d.get("content") or "", calls, d.get("tool_call_id"))


def sent_history(traj: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a replay sends through the proxy: every message up to the last assistant answer."""
    last = max(i for i, m in enumerate(traj) if m["role"] == "assistant")
    return traj[1 : last + 1]


def only_session(data_dir: Path) -> Path:
    sessions = [p for p in (data_dir / "sessions").glob("*/*") if (p / "events.jsonl").is_file()]
    assert len(sessions) == 1, sessions
    return sessions[0]


@pytest.mark.parametrize("summarizer", ["upstream", "extractive", "upstream-failing"])
def test_trace_replay_stays_inside_the_window(traces_dir: Path, tmp_path: Path, summarizer: str) -> None:
    traj = load_trajectory(traces_dir)
    up = ScriptedUpstream(context_tokens=CONTEXT_TOKENS, count_tokens=_counter())
    if summarizer == "upstream-failing":
        up.fail_summaries = True
    compact = CompactConfig.from_mapping({"context_tokens": CONTEXT_TOKENS, "reply_reserve_tokens": 1024})
    with BackgroundServer(up.app()) as upstream:
        cfg = ProxyConfig(upstream=upstream.url, data_dir=tmp_path / "data", compact=compact,
                          summarizer="extractive" if summarizer == "extractive" else "upstream", fsync="never")
        proxy = ProxyApp(cfg)
        with serve_in_background(proxy) as srv:
            for i, body in requests_of(traj):
                status, raw = stream(srv.url, body)
                assert status == 200, (i, raw[:300])
                assert raw == up.sent[-1], f"answer {i} did not come back byte for byte"
            metrics = proxy.metrics
            # The upstream's usage calibrated the conversation's estimate: its window is scaled by the factor.
            session = proxy.sessions.loaded()[0]
            assert session.calibration != 1.0
            assert session.compactor.config.context_tokens == int(CONTEXT_TOKENS / (session.calibration * 1.02))
    # Nothing over the window ever reached the upstream, and the proxy had to compact to manage it.
    assert up.rejected_over_context == 0
    assert max(up.prompt_tokens_seen) <= CONTEXT_TOKENS
    direct = _counter()({"messages": traj})
    assert direct > CONTEXT_TOKENS, "the conversation must not fit uncompacted, else nothing is shown"
    assert sum(metrics.compactions.values.values()) >= 1
    assert metrics.tokens_saved.get() > 0
    if summarizer == "upstream":
        summaries = [b for b in up.received if b["messages"][-1].get("content", "").startswith(
            "Internal context compaction request")]
        assert summaries, "the upstream model itself was asked for the summary"
        assert sum(metrics.summary_fallbacks.values.values()) == 0
    if summarizer == "upstream-failing":
        # The extractive summary stood in, counted by why the upstream failed; no request was lost.
        assert sum(metrics.summary_fallbacks.values.values()) >= 1
        reasons = {labels[0] for labels in metrics.summary_fallbacks.values}
        assert reasons and all(r and "(" not in r and len(r) <= 60 for r in reasons), reasons
    # The data directory holds the whole conversation: every message sent and every answer.
    restored = Session(only_session(tmp_path / "data")).restore()
    assert restored.system == traj[0]["content"]
    assert [view_of(m) for m in restored.messages] == [wire_view(d) for d in sent_history(traj)]


# -- kill and restart --------------------------------------------------------------------------------

class ProxyProcess:
    def __init__(self, upstream_url: str, data_dir: Path, *extra: str) -> None:
        env = ctxfold_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ctxfold", "serve", "--upstream", upstream_url, "--port", "0", "--data-dir",
             str(data_dir), "--context-tokens", str(CONTEXT_TOKENS), "--reply-reserve-tokens", "1024",
             "--summarizer", "extractive", *extra],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        if "listening on " not in line:
            self.proc.kill()
            raise RuntimeError(f"proxy did not start: {line}{self.proc.stderr.read()}")
        self.url = line.split("listening on ", 1)[1].split(",")[0]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.stop()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.mark.slow
def test_sigkill_mid_conversation_loses_nothing(traces_dir: Path, tmp_path: Path) -> None:
    traj = load_trajectory(traces_dir)
    reqs = list(requests_of(traj))
    data = tmp_path / "data"
    up = ScriptedUpstream(context_tokens=CONTEXT_TOKENS, count_tokens=_counter())
    with BackgroundServer(up.app()) as upstream:
        proxy = ProxyProcess(upstream.url, data)
        half = len(reqs) // 2
        for _, body in reqs[:half]:
            assert stream(proxy.url, body)[0] == 200
        # Killed while a request is in flight upstream: the client sees the connection drop.
        up.delay_s = 3.0
        failed: list[BaseException] = []

        def in_flight() -> None:
            try:
                stream(proxy.url, reqs[half][1])
            except httpx.HTTPError as e:
                failed.append(e)

        t = threading.Thread(target=in_flight)
        t.start()
        deadline = time.monotonic() + 10
        while len(up.received) < half + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        proxy.kill()
        t.join(10)
        assert failed, "the in-flight request should have failed with the proxy"
        up.delay_s = 0.0
        # Restarted on the same data directory (on asyncio's own event loop, the first ran on the default:
        # uvloop where installed): the client retries and carries on.
        proxy = ProxyProcess(upstream.url, data, "--event-loop", "asyncio")
        try:
            for _, body in reqs[half:]:
                status, raw = stream(proxy.url, body)
                assert status == 200 and raw == up.sent[-1]
        finally:
            proxy.stop()
    assert up.rejected_over_context == 0
    restored = Session(only_session(data)).restore()
    assert [view_of(m) for m in restored.messages] == [wire_view(d) for d in sent_history(traj)]


def test_an_oversized_tool_result_is_archived_and_recalled_through_the_proxy(tmp_path: Path) -> None:
    """A tool result far over the window: the proxy archives it (the hard trigger's last resort), the
    upstream sees a marker and the read_archive tool, calls it, and the proxy answers from the archive."""
    import re

    huge = "".join(f"line {i}: value={i * 7919 % 10007}\n" for i in range(3000))  # ~80k chars
    up = ScriptedUpstream(context_tokens=4096, count_tokens=_counter())
    compact = CompactConfig.from_mapping({"context_tokens": 4096, "reply_reserve_tokens": 512})
    call = {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "dump"}'}}
    history = [{"role": "system", "content": "You are a coding agent."},
               {"role": "user", "content": "dump the table and tell me line 2"},
               {"role": "assistant", "content": None, "tool_calls": [call]}]

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last["role"] == "tool" and last["tool_call_id"] == "t1":
            aid = re.search(r"id=([0-9a-f]{64})", last["content"])
            assert aid, last["content"][:200]
            args = json.dumps({"id": aid.group(1), "offset": 0, "limit": 60})
            return {"role": "assistant", "content": None, "tool_calls": [
                {"id": "r1", "type": "function", "function": {"name": "read_archive", "arguments": args}}]}
        return {"role": "assistant", "content": f"line 2 reads: {last['content'].splitlines()[3]}"}

    up.answer_for = answer  # type: ignore[method-assign]
    with BackgroundServer(up.app()) as upstream:
        proxy = ProxyApp(ProxyConfig(upstream=upstream.url, data_dir=tmp_path / "data", compact=compact,
                                     summarizer="extractive", fsync="never"))
        with serve_in_background(proxy) as srv:
            body = {"model": "m", "messages": [*history, {"role": "tool", "tool_call_id": "t1", "content": huge}],
                    "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]}
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "line 2 reads: line 2: value=5831"
    assert up.rejected_over_context == 0 and max(up.prompt_tokens_seen) <= 4096
    first, second = up.received[-2], up.received[-1]
    assert any(t["function"]["name"] == "read_archive" for t in first["tools"])
    assert len(first["messages"][-1]["content"]) < 10_000  # the marker and a preview, not the output
    assert second["messages"][-1]["content"].startswith("[read_archive id=")
    assert proxy.metrics.recall_calls.get() == 1
    # Nothing is lost: the data directory has the output verbatim.
    restored = Session(only_session(tmp_path / "data")).restore()
    assert restored.messages[2].text == huge
