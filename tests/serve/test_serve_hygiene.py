"""The proxy in front of real clients: headers relayed faithfully, other paths relayed, malformed bodies
refused with a 400, credentials kept out of what people read, private files, checked settings, slow and
surplus connections closed, recall output bounded, message fingerprints without collisions.

Real servers on loopback: the scripted upstream and the proxy (its aiohttp app, or ``serve`` itself
where the listening socket is what is tested)."""

from __future__ import annotations

import ast
import asyncio
import gc
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

import ctxfold.serve
from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.compaction.archive.store import LocalBackend
from ctxfold.compaction.session import Session
from ctxfold.errors import ConfigError
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.app import serve
from ctxfold.serve.keys import fingerprint_wire, session_key
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
from helpers.proxy_helpers import chat, post, start_proxy
from helpers.subprocess_env import ctxfold_env

SERVE_DIR = Path(ctxfold.serve.__file__).resolve().parent












# -- 1. faithful relay -------------------------------------------------------------------------------

RATE_HEADERS = [("Retry-After", "7"), ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "7s"), ("x-request-id", "req-abc"),
                ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"),  # repeated: both must arrive
                ("Keep-Alive", "timeout=5"), ("Connection", "X-Hop"), ("X-Hop", "this hop only")]


def _check_relayed(r: httpx.Response) -> None:
    assert r.headers.get("retry-after") == "7"
    assert r.headers.get("x-ratelimit-remaining-requests") == "0"
    assert r.headers.get("x-ratelimit-reset-requests") == "7s"
    assert r.headers.get("x-request-id") == "req-abc"
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]
    # Hop-by-hop headers, and those the upstream's Connection header named, stop at the proxy.
    assert "x-hop" not in r.headers and "keep-alive" not in r.headers


@pytest.mark.parametrize("stream", [False, True])
def test_a_429_reaches_the_client_with_every_header(upstream: tuple[ScriptedUpstream, str],
                                                    proxy: tuple[ProxyApp, str], stream: bool) -> None:
    up, _ = upstream
    up.answer_headers = RATE_HEADERS
    up.fail_status, up.fail_count = 429, 1
    r = post(proxy[1], chat(("user", "too fast"), stream=stream))
    assert r.status_code == 429 and r.json()["error"]["message"] == "scripted failure"
    assert r.headers["content-type"].startswith("application/json")
    _check_relayed(r)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_reaches_the_client_with_every_header(upstream: tuple[ScriptedUpstream, str],
                                                        proxy: tuple[ProxyApp, str], stream: bool) -> None:
    up, _ = upstream
    up.answer_headers = RATE_HEADERS
    with httpx.stream("POST", f"{proxy[1]}/v1/chat/completions", json=chat(("user", "hi"), stream=stream),
                      timeout=30) as r:
        raw = b"".join(r.iter_raw())
    assert r.status_code == 200 and raw == up.sent[-1]
    _check_relayed(r)
    assert r.headers["content-type"].startswith("text/event-stream" if stream else "application/json")


def test_paths_the_proxy_does_not_handle_are_relayed(upstream: tuple[ScriptedUpstream, str],
                                                     proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    up.answer_headers = [("x-request-id", "req-models")]
    r = httpx.get(f"{proxy[1]}/v1/models", headers={"Authorization": "Bearer sk-client"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "scripted-model"
    assert r.headers["x-request-id"] == "req-models"
    # Method, path, query, body and end-to-end headers go as they came; status and headers come back.
    r = httpx.request("PUT", f"{proxy[1]}/v1/embeddings?dims=8&x=%2F", content=b'{"input": "abc"}',
                      headers={"Authorization": "Bearer sk-client", "X-Vendor": "v1", "Content-Type": "text/plain"},
                      timeout=30)
    assert r.status_code == 201 and r.headers["x-upstream-path"] == "/v1/embeddings"
    seen = up.other_requests[-1]
    assert (seen["method"], seen["raw_path"], seen["body"]) == ("PUT", "/v1/embeddings?dims=8&x=%2F",
                                                                '{"input": "abc"}')
    headers = {k.lower(): v for k, v in seen["headers"]}
    assert headers["authorization"] == "Bearer sk-client" and headers["x-vendor"] == "v1"
    assert headers["content-type"] == "text/plain"
    r = httpx.delete(f"{proxy[1]}/tokenize", timeout=30)  # outside /v1: the same path on the upstream
    assert r.status_code == 201 and up.other_requests[-1]["method"] == "DELETE"
    assert up.other_requests[-1]["path"] == "/tokenize"
    # HEAD: the answer ends with its head (the upstream's connection is not left waiting for a body).
    with httpx.Client(timeout=10) as client:
        for _ in range(2):
            r = client.head(f"{proxy[1]}/v1/models")
            assert r.status_code == 200 and r.content == b"" and r.headers["content-type"].startswith("application/json")
    # The proxy's own paths stay its own.
    assert httpx.get(f"{proxy[1]}/health", timeout=30).json()["status"] == "ok"


def test_completions_forward_the_clients_end_to_end_headers(upstream: tuple[ScriptedUpstream, str],
                                                            proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    seen: list[dict[str, str]] = []
    original = up._answer

    async def record(request: Any) -> Any:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        return await original(request)

    up._answer = record  # type: ignore[method-assign]
    post(proxy[1], chat(("user", "hi")), headers={"OpenAI-Beta": "assistants=v2", "X-Title": "agent",
                                                   "Authorization": "Bearer sk-client", "X-Ctxfold-Session": "s"})
    h = seen[-1]
    assert h["openai-beta"] == "assistants=v2" and h["x-title"] == "agent" and h["authorization"] == "Bearer sk-client"
    assert "x-ctxfold-session" not in h and h["content-type"] == "application/json"


# -- 2. malformed bodies -------------------------------------------------------------------------------

_MSGS = b'"messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize(("raw", "needle"), [
    (b'{' + _MSGS + b', "x": ' + b'[' * 1100 + b']' * 1100 + b'}', "nested too deeply"),
    (b'{' + _MSGS + b', "x": ' + b'{"a": ' * 1100 + b'1' + b'}' * 1100 + b'}', "nested too deeply"),
    (b'{' + _MSGS + b', "seed": ' + b'9' * 5000 + b'}', "more than 4300 digits"),
    (b'{' + _MSGS + b', "temperature": NaN}', "NaN is not a JSON number"),
    (b'{' + _MSGS + b', "temperature": Infinity}', "Infinity is not a JSON number"),
    (b'{' + _MSGS + b', "temperature": -Infinity}', "-Infinity is not a JSON number"),
    (b'{' + _MSGS + b', "temperature": 1e999}', "1e999 is not a JSON number"),
])
def test_malformed_bodies_get_a_400_and_are_not_forwarded(upstream: tuple[ScriptedUpstream, str],
                                                          proxy: tuple[ProxyApp, str], raw: bytes,
                                                          needle: str) -> None:
    up, _ = upstream
    before = len(up.received)
    r = post(proxy[1], None, raw=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert needle in err["message"], err["message"]
    assert len(up.received) == before
    assert post(proxy[1], chat(("user", "still there?"))).status_code == 200


@pytest.mark.parametrize(("messages", "needle"), [
    ({"role": "user", "content": "x"}, "'messages' must be a non-empty array"),
    (["x"], "messages[0] must be an object"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0]: 'content'"),
    ([{"role": "user", "content": [7]}], "messages[0]: 'content'[0]"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}], "messages[1]: 'content'"),
    ([{"role": "assistant", "content": "x", "tool_calls": "ls"}], "messages[0]: 'tool_calls'"),
])
def test_wrong_types_get_a_400_that_names_where(proxy: tuple[ProxyApp, str], messages: Any, needle: str) -> None:
    r = post(proxy[1], {"model": "m", "messages": messages})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_no_assert_on_the_proxys_request_path() -> None:
    """``python -O`` strips asserts: a check the proxy relies on must be an if."""
    for path in sorted(SERVE_DIR.glob("*.py")):
        if path.name == "testing.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
        assert not lines, f"{path.name}: assert on lines {lines}"


def test_a_200_that_is_not_a_chat_completion_is_a_502(tmp_path: Path) -> None:
    from aiohttp import web

    async def odd(request: web.Request) -> web.Response:  # a message that is a string, not an object
        return web.json_response({"choices": [{"index": 0, "message": "just text"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", odd)
    with BackgroundServer(app) as up:
        _, srv = start_proxy(up.url, tmp_path / "d")
        try:
            r = post(srv.url, chat(("user", "hi")))
        finally:
            srv.close()
    assert r.status_code == 502 and r.json()["error"]["code"] == "bad_upstream_body"


# -- 3. credentials ----------------------------------------------------------------------------------

SECRET = "s3cret-Pa55"


def test_the_upstreams_password_never_shows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        url = f"http://alice:{SECRET}@127.0.0.1:{port}/v1"
        caplog.set_level(logging.DEBUG)
        _, srv = start_proxy(url, tmp_path / "d")
        try:
            health = httpx.get(f"{srv.url}/health", timeout=30)
            r = post(srv.url, chat(("user", "anyone?")), headers={"Authorization": "Bearer sk-client-key"})
            models = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer sk-client-key"}, timeout=30)
            metrics = httpx.get(f"{srv.url}/metrics", timeout=30)
        finally:
            srv.close()
    assert health.json()["upstream"] == f"http://alice:***@127.0.0.1:{port}/v1/chat/completions"
    assert r.status_code == 502 and models.status_code == 502
    for text in (health.text, r.text, models.text, metrics.text, caplog.text):
        assert SECRET not in text and "sk-client-key" not in text
    with pytest.raises(ConfigError) as e:
        ProxyConfig(upstream=f"http://alice:{SECRET}@127.0.0.1:99999/v1", data_dir=tmp_path)
    assert SECRET not in str(e.value)


def test_the_startup_line_hides_the_password(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ctxfold", "serve", "--upstream",
                             f"http://alice:{SECRET}@127.0.0.1:1/v1", "--port", "0", "--data-dir", str(tmp_path / "d")],
                            stderr=subprocess.PIPE, text=True, env=ctxfold_env())
    assert proc.stderr is not None
    with proc.stderr:
        try:
            line = proc.stderr.readline()
        finally:
            proc.terminate()
            proc.wait(30)
    assert "listening on" in line and "alice:***@127.0.0.1:1" in line and SECRET not in line


# -- 4. private files ---------------------------------------------------------------------------------

def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_everything_the_proxy_writes_is_private(upstream: tuple[ScriptedUpstream, str],
                                               proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    old = os.umask(0o022)  # the usual umask: what it lets through, the proxy must not ask for
    try:
        r = post(proxy[1], chat(("user", "hello")))
        assert r.status_code == 200
        session = proxy[0].sessions.loaded()[0]
        session.compactor.store.put("archived output\n" * 200)
        # Archive writes are stored with the session's next request (as a compaction's are): one more turn.
        answer = r.json()["choices"][0]["message"]["content"]
        assert post(proxy[1], chat(("user", "hello"), ("assistant", answer), ("user", "more"))).status_code == 200
        dump = Session(session.path).write_history_dump([Message(role=Role.USER, content="hi")],
                                                        Conversation(messages=[]))
    finally:
        os.umask(old)
    data = tmp_path / "data"
    written = sorted(p for p in data.rglob("*"))
    assert any(p.name == "events.jsonl" for p in written) and dump in written
    assert any(p.parent.name == "archive" for p in written)
    for p in written:
        assert _mode(p) == (0o700 if p.is_dir() else 0o600), f"{p.relative_to(data)}: {oct(_mode(p))}"


def test_a_link_planted_in_the_data_dir_is_refused(upstream: tuple[ScriptedUpstream, str],
                                                   proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    key = session_key("victim", None, None)
    (tmp_path / "data" / "sessions").mkdir(parents=True)
    (tmp_path / "data" / "sessions" / key).symlink_to(outside)
    r = post(proxy[1], chat(("user", "hello")), headers={"X-Ctxfold-Session": "victim"})
    assert r.status_code == 500 and "symbolic link" in r.json()["error"]["message"]
    assert list(outside.iterdir()) == []
    # Other conversations are served.
    assert post(proxy[1], chat(("user", "hello"))).status_code == 200


def test_the_archive_and_the_log_refuse_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "archive").symlink_to(outside)
    with pytest.raises(OSError, match="symbolic link"):
        LocalBackend(tmp_path / "archive").write_atomic("a.txt", b"x")
    assert list(outside.iterdir()) == []
    # A session whose log is a link to another file: resuming it must not append there.
    real = Session(tmp_path / "real")
    real.create(Conversation(messages=[Message(role=Role.USER, content="hi")]))
    real.close()
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "events.jsonl").symlink_to(tmp_path / "real" / "events.jsonl")
    size = (tmp_path / "real" / "events.jsonl").stat().st_size
    with pytest.raises(OSError, match="symbolic link"):
        Session(tmp_path / "s").append_messages([Message(role=Role.USER, content="more")])
    assert (tmp_path / "real" / "events.jsonl").stat().st_size == size


# -- 5. startup validation ----------------------------------------------------------------------------

@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--port", "99999", "argument --port: 99999 is outside the port range 0 to 65535"),
    ("--port", "-1", "argument --port: -1 is outside the port range 0 to 65535"),
    ("--read-timeout-s", "nan", "argument --read-timeout-s: 'nan' must be a finite number of seconds"),
    ("--connect-timeout-s", "-3", "argument --connect-timeout-s: '-3' must be a finite number of seconds"),
    ("--client-timeout-s", "inf", "argument --client-timeout-s: 'inf' must be a finite number of seconds"),
    ("--max-connections", "0", "argument --max-connections: '0' must be a positive whole number"),
    ("--max-recall-chars", "0", "argument --max-recall-chars: '0' must be a positive whole number"),
])
def test_bad_serve_flags_are_a_one_line_usage_error(tmp_path: Path, flag: str, value: str, needle: str) -> None:
    # A subprocess with a timeout: a port accepted by mistake would start serving.
    out = subprocess.run([sys.executable, "-m", "ctxfold", "serve", "--upstream", "http://127.0.0.1:1/v1",
                          "--data-dir", str(tmp_path / "d"), flag + "=" + value],
                         capture_output=True, text=True, env=ctxfold_env(), timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr


@pytest.mark.parametrize(("field", "value"), [
    ("read_timeout_s", float("nan")), ("connect_timeout_s", float("inf")), ("client_timeout_s", 0.0),
    ("max_connections", 0), ("max_recall_chars", -1), ("max_body_bytes", 1.5), ("upstream", "http://h:99999/v1"),
])
def test_proxy_config_checks_every_setting(tmp_path: Path, field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        ProxyConfig(**{"upstream": "http://127.0.0.1:1/v1", "data_dir": tmp_path, field: value})


# -- 6. slow and surplus connections -------------------------------------------------------------------

@contextmanager
def running_serve(config: ProxyConfig) -> Iterator[str]:
    """``serve`` itself (the socket, the runner, the limits) in a thread of its own."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    url: list[str] = []

    def on_ready(u: str) -> None:
        url.append(u)
        ready.set()

    task: list[asyncio.Task[None]] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(serve(config, "127.0.0.1", 0, ready=on_ready)))
        try:
            loop.run_until_complete(task[0])
        except asyncio.CancelledError:
            pass
        finally:
            loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert ready.wait(30), "the proxy did not start"
        yield url[0]
    finally:
        loop.call_soon_threadsafe(task[0].cancel)
        thread.join(30)
        gc.unfreeze()  # serve froze what the test process had built


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed ``s`` within ``seconds``, and what it sent before."""
    s.settimeout(seconds)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        pass
    return True, got


def test_half_sent_requests_are_timed_out(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    cfg = ProxyConfig(upstream=upstream[1], data_dir=tmp_path / "d", summarizer="extractive", fsync="never",
                      client_timeout_s=0.5)
    with running_serve(cfg) as url:
        host, port = url.removeprefix("http://").split(":")
        heads = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
        bodies = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
        try:
            t0 = time.monotonic()
            for s in heads:  # the head never ends
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")
            for s in bodies:  # the head does, the body never comes whole
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mess")
            for s in heads:
                assert _closed_within(s, 5.0)[0]
            for s in bodies:
                closed, got = _closed_within(s, 5.0)
                assert closed and got.startswith(b"HTTP/1.1 408") and b"--client-timeout-s" in got, got
            assert time.monotonic() - t0 < 5.0
        finally:
            for s in heads + bodies:
                s.close()
        assert post(url, chat(("user", "still serving"))).status_code == 200


def test_connections_beyond_the_limit_are_refused(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    cfg = ProxyConfig(upstream=upstream[1], data_dir=tmp_path / "d", summarizer="extractive", fsync="never",
                      max_connections=4, client_timeout_s=30)
    with running_serve(cfg) as url:
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
        try:
            time.sleep(0.2)  # all four accepted
            extra = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
            for s in extra:
                closed, got = _closed_within(s, 5.0)
                s.close()
                assert closed and got.startswith(b"HTTP/1.1 503"), got
                assert b"too_many_connections" in got and b"Retry-After: 1" in got
        finally:
            for s in idle:
                s.close()
        time.sleep(0.2)  # the slots are free again
        assert post(url, chat(("user", "room again"))).status_code == 200


# -- 7. recall output bounded --------------------------------------------------------------------------

def test_recall_output_is_bounded_per_answer(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    up, url = upstream
    proxy, srv = start_proxy(url, tmp_path / "d", max_recall_chars=3000)
    try:
        post(srv.url, chat(("user", "start")))
        aid = proxy.sessions.loaded()[0].compactor.store.put("0123456789" * 500)  # 5000 characters
        calls = [{"id": f"c{k}", "type": "function",
                  "function": {"name": "read_archive", "arguments": json.dumps({"id": aid, "limit": 100000})}}
                 for k in range(3)]
        answers: Iterator[dict[str, Any]] = iter([{"role": "assistant", "content": None, "tool_calls": calls},
                        {"role": "assistant", "content": None, "tool_calls": calls[:1]},
                        {"role": "assistant", "content": "done"}])
        up.answer_for = lambda body: next(answers)  # type: ignore[method-assign]
        body = chat(("user", "start"), ("assistant", "echo: start"), ("user", "read it all"),
                    tools=[{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}])
        assert post(srv.url, body).json()["choices"][0]["message"]["content"] == "done"
    finally:
        srv.close()
    results = [m for m in up.received[-1]["messages"] if m["role"] == "tool"]
    assert len(results) == 4
    first = results[0]["content"]
    assert first.startswith(f"[read_archive id={aid} chars 0-3000 of 5000; more follows: next_offset=3000]")
    assert "cut: read_archive output is limited to 3000 characters per answer" in first
    for later in results[1:]:  # the rest of this round, and the next round's call
        assert later["content"].startswith("Not read: this answer's read_archive output already reached its limit")
    assert len(json.dumps(up.received[-1])) < 10_000


# -- 8. message fingerprints ----------------------------------------------------------------------------

def test_fingerprints_do_not_collide_on_crafted_content() -> None:
    """Fields joined by a NUL alone: a text holding NULs could pose as a tool call, or a call id as text."""
    call = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"role": "assistant", "content": "ok", "tool_calls": [call]},
         {"role": "assistant", "content": "ok\x00tcall_1\x00bash\x00{}"}),
        ({"role": "tool", "content": "x", "tool_call_id": "y\x00r"},
         {"role": "tool", "content": "x\x00ry", "tool_call_id": ""}),
        ({"role": "user", "content": "[1]"}, {"role": "user", "content": [1]}),
    ]
    for a, b in pairs:
        assert fingerprint_wire(a) != fingerprint_wire(b), (a, b)
    # What must stay equal does: a dropped null field, reordered keys, developer for system.
    assert fingerprint_wire({"role": "user", "content": "q"}) == fingerprint_wire({"content": "q", "role": "user",
                                                                                   "name": None})
    assert fingerprint_wire({"role": "developer", "content": "s"}) == fingerprint_wire({"role": "system",
                                                                                        "content": "s"})
