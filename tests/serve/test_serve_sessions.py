"""The proxy's sessions before careless and hostile clients: tenants, bounds, retries, forks, faults.

Each test reproduces a failure of the proxy as it was (it fails there) on loopback, against the
scripted upstream; the ones that need a resource limit or a real full or read-only file system run
the proxy in a subprocess (``ctxfold serve``), under setrlimit or in a private mount namespace.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session
from ctxfold.compaction.store import LocalStore
from ctxfold.serve import ProxyApp, ProxyConfig
from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream, is_summary_request
from helpers.proxy_helpers import chat, metric, post, settle, start_proxy
from helpers.subprocess_env import can_mount, ctxfold_env

# Spelled out, not imported: the tests must run (and fail) on a proxy that has none of this.
WARNING_HEADER = "X-Ctxfold-Warning"
QUARANTINE_FILE = "QUARANTINED"
TENANT_KEY_FILE = "tenant.key"


def eventually(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Whether ``cond`` holds within ``timeout_s``: the proxy trims right after a request lets go of
    its conversation's lock, in the event loop's thread, so a test that sees the lock free may be early."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)
    return cond()


def session_dirs(data: Path) -> list[Path]:
    """Every session directory under a data directory, any tenant."""
    return sorted(p.parent for p in data.rglob("events.jsonl"))


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["message"]["content"]
    return text


def open_fds_under(root: Path) -> int:
    """File descriptors of this process open on files under ``root``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(str(root))
    return n


# -- a proxy in a subprocess ----------------------------------------------------------------------------

@contextmanager
def proxy_process(upstream_url: str, data_dir: Path, *, nofile: int | None = None, mount: str | None = None,
                  extra: tuple[str, ...] = (), pids: list[int] | None = None) -> Iterator[str]:
    """``ctxfold serve`` in a child process; yields its URL. ``nofile``: its RLIMIT_NOFILE. ``mount``: a
    shell command run first in a private mount namespace (a real full or read-only file system; the
    test reaches it through ``/proc/<pid>/root``). ``pids``: gets the proxy's process id."""
    argv = [sys.executable, "-m", "ctxfold", "serve", "--upstream", upstream_url, "--data-dir", str(data_dir),
            "--port", "0", "--summarizer", "extractive", "--no-fsync", "--event-loop", "asyncio", *extra]

    script = "exec " + " ".join(shlex.quote(a) for a in argv)  # exec: the signal that stops it reaches it
    if nofile is not None:  # the shell sets it for the proxy alone (no preexec_fn: this process has threads)
        script = f"ulimit -n {nofile} && {script}"
    argv = ["sh", "-c", script if mount is None else f"{mount} && {script}"]
    if mount is not None:
        argv = ["unshare", "-m", *argv]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=ctxfold_env())
    assert proc.stderr is not None
    if pids is not None:
        pids.append(proc.pid)  # unshare and sh exec the proxy: one process throughout
    lines: list[str] = []
    url = None
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = proc.stderr.readline().decode()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (\S+),", line)
        if m:
            url = m.group(1)
    if url is None:
        proc.kill()
        proc.wait()
        pytest.fail("the proxy did not start:\n" + "".join(lines))
    drain = threading.Thread(target=lambda: [lines.append(x.decode()) for x in iter(proc.stderr.readline, b"")]
                             if proc.stderr else None, daemon=True)
    drain.start()
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        drain.join(timeout=5)
        proc.stderr.close()


# -- tenants ---------------------------------------------------------------------------------------------

def recall_through(up: ScriptedUpstream, url: str, opening: str, aid: str, headers: dict[str, str]) -> str:
    """The conversation that opened with ``opening`` goes on, and its model asks read_archive for ``aid``:
    what the proxy answered the call with."""
    call = {"id": "c1", "type": "function", "function": {"name": "read_archive", "arguments": json.dumps({"id": aid})}}
    answers = iter([{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "assistant", "content": "done"}])
    up.answer_for = lambda body: next(answers)  # type: ignore[method-assign]
    body = chat(("user", opening), ("assistant", f"echo: {opening}"), ("user", "recall it"),
                tools=[{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}])
    assert answer(post(url, body, headers=headers)) == "done"
    return str(up.received[-1]["messages"][-1]["content"])


def test_tenants_with_the_same_opening_share_no_session_and_no_archive(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    """Tenant B's model asking read_archive for the id of A's archived output gets "not found"."""
    up, url = upstream
    app, srv = start_proxy(url, tmp_path / "data")
    a, b = {"Authorization": "Bearer sk-tenant-a-secret"}, {"Authorization": "Bearer sk-tenant-b-secret"}
    try:
        answer(post(srv.url, chat(("user", "start")), headers=a))
        store_a = app.sessions.loaded()[0].compactor.store
        secret = "tenant A's secret text\n" * 40
        aid = store_a.put(secret)
        answer(post(srv.url, chat(("user", "start")), headers=b))  # the same opening: its own session
        settle(app)
        assert len(app.sessions.loaded()) == 2
        recalled = recall_through(up, srv.url, "start", aid, b)
        assert "secret text" not in recalled and recalled.startswith(f"Error: no archived output with id {aid}")
    finally:
        srv.close()
    data = tmp_path / "data"
    # Two tenants' directories; the credentials appear nowhere on disk.
    assert len(list((data / "tenants").iterdir())) == 2
    for path in data.rglob("*"):
        if path.is_file():
            assert b"sk-tenant" not in path.read_bytes(), path
    key = data / TENANT_KEY_FILE
    assert key.stat().st_mode & 0o777 == 0o600


def test_anonymous_conversations_with_one_guessable_key_share_no_archive(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    """Without a credential, a key is no secret (a guessable X-Ctxfold-Session, a common opening): each
    anonymous conversation has its own archive, so B's model asking for A's archived output gets "not
    found". A fork still reads what its copied history refers to."""
    up, url = upstream
    app, srv = start_proxy(url, tmp_path / "data")
    key = {"X-Ctxfold-Session": "demo"}
    try:
        answer(post(srv.url, chat(("user", "A starts")), headers=key))
        store_a = app.sessions.loaded()[0].compactor.store
        aid = store_a.put("anonymous A's secret text\n" * 40)
        # A's next request commits what its compactor wrote (the archived output with it).
        answer(post(srv.url, chat(("user", "A starts"), ("assistant", "echo: A starts"), ("user", "more")), headers=key))
        answer(post(srv.url, chat(("user", "B starts")), headers=key))  # the same key, another conversation
        settle(app)
        assert len(app.sessions.loaded()) == 2
        recalled = recall_through(up, srv.url, "B starts", aid, key)
        assert "secret text" not in recalled and recalled.startswith(f"Error: no archived output with id {aid}")
    finally:
        srv.close()
    archives = sorted(p.relative_to(tmp_path / "data").as_posix() for p in (tmp_path / "data").rglob("archive"))
    # A's (B archived nothing), in its conversation's folder: sessions/<key>/<n>/archive, not the key's.
    assert len(archives) == 1 and archives[0].count("/") == 3, archives


def test_an_anonymous_fork_copies_the_archived_outputs_its_history_refers_to(tmp_path: Path) -> None:
    from ctxfold.serve.stored_sessions import copy_referenced_archive

    held = {"a" * 64: b"kept", "b" * 64: b"not referred to"}
    copied: dict[str, bytes] = {}
    history = b'{"seq": 3, "type": "view", "view": [{"message": {"content": "[ctxfold archived id=' + b"a" * 64 + b'"}}]}'
    assert copy_referenced_archive(history + b"c" * 64, held.get, copied.__setitem__) == 1
    assert copied == {"a" * 64: b"kept"}


def test_tenants_survive_a_restart(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    _, url = upstream
    a = {"Authorization": "Bearer sk-a"}
    for k in range(2):
        app, srv = start_proxy(url, tmp_path / "data")
        try:
            turns = [("user", "hello")] + ([("assistant", "echo: hello"), ("user", "again")] if k else [])
            answer(post(srv.url, chat(*turns), headers=a))
            settle(app)
        finally:
            srv.close()
    sessions = session_dirs(tmp_path / "data")
    assert len(sessions) == 1 and len(Session(sessions[0]).restore().messages) == 4


def test_a_tenant_does_not_wait_behind_another_tenants_slow_call(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str]) -> None:
    up, _ = upstream
    _, url = proxy
    up.stall_after_chunks = 1  # A's stream stalls once, for stall_s, with A's session locked
    up.stall_s = 3.0
    slow = threading.Thread(target=lambda: httpx.post(
        f"{url}/v1/chat/completions", json=chat(("user", "same opening"), stream=True), timeout=30,
        headers={"Authorization": "Bearer sk-a"}).read())
    slow.start()
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        answer(post(url, chat(("user", "same opening")), headers={"Authorization": "Bearer sk-b"}))
        assert time.monotonic() - t0 < 2.0
    finally:
        slow.join()


def test_a_configured_tenant_header(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    _, url = upstream
    app, srv = start_proxy(url, tmp_path / "data", tenant_header="X-Api-Key")
    try:
        for key in ("k1", "k2", "k1"):
            answer(post(srv.url, chat(("user", "hi")), headers={"X-Api-Key": key, "Authorization": "Bearer same"}))
        settle(app)
    finally:
        srv.close()
    assert len(list((tmp_path / "data" / "tenants").iterdir())) == 2


def test_a_repeated_credential_or_tenant_header_is_refused(upstream: tuple[ScriptedUpstream, str],
                                                          tmp_path: Path) -> None:
    """Two values of a credential: the tenant would come from one and the upstream get the other."""
    up, url = upstream
    app, srv = start_proxy(url, tmp_path / "data", tenant_header="X-Api-Key")
    try:
        for name in ("Authorization", "X-Api-Key", "X-Ctxfold-Session"):
            for path in ("/v1/chat/completions", "/v1/models"):
                body = json.dumps(chat(("user", "hi"))).encode() if path.endswith("completions") else b""
                resp = httpx.post(srv.url + path, content=body, timeout=30,
                                  headers=[("Content-Type", "application/json"), (name, "Bearer one"),
                                           (name, "Bearer two")])
                assert resp.status_code == 400, (name, path, resp.text)
                error = resp.json()["error"]
                assert error["param"] == name and "more than once" in error["message"]
        settle(app)
    finally:
        srv.close()
    assert not up.received and not up.other_requests and not (tmp_path / "data" / "tenants").exists()


def test_request_metrics_are_labelled_by_tenant_within_a_bound(upstream: tuple[ScriptedUpstream, str],
                                                               tmp_path: Path) -> None:
    """requests_total and responses_total carry the tenant: a short prefix of its HMAC name (never the
    credential) for the first tenants seen, "other" beyond (a label per credential would grow the
    metrics without bound), "anonymous" without a credential."""
    from ctxfold.serve.keys import tenant_of

    _, url = upstream
    app, srv = start_proxy(url, tmp_path / "data")
    app.metrics.tenants.max_labels = 2
    try:
        for k in (1, 2, 3, 1):
            answer(post(srv.url, chat(("user", f"hi {k}")), headers={"Authorization": f"Bearer sk-{k}"}))
        answer(post(srv.url, chat(("user", "hi"))))
        assert post(srv.url, None, raw=b"{", headers={"Authorization": "Bearer sk-2"}).status_code == 400
        text = httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.close()
    t1, t2 = (tenant_of(app.sessions.tenant_key(), f"Bearer sk-{k}")[:12] for k in (1, 2))
    assert f'ctxfold_requests_total{{stream="false",tenant="{t1}"}} 2' in text
    assert f'ctxfold_requests_total{{stream="false",tenant="{t2}"}} 1' in text
    assert 'ctxfold_requests_total{stream="false",tenant="other"} 1' in text  # the third tenant
    assert 'ctxfold_requests_total{stream="false",tenant="anonymous"} 1' in text
    assert f'ctxfold_responses_total{{status="200",tenant="{t1}"}} 2' in text
    assert f'ctxfold_responses_total{{status="400",tenant="{t2}"}} 1' in text  # a bad body, still its tenant's
    assert len(set(re.findall(r'tenant="([^"]*)"', text))) == 4
    assert "sk-" not in text


# -- bounds, retries, duplicates --------------------------------------------------------------------------

def test_retries_of_an_answered_request_continue_its_session(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    """A client re-sending the same request (retry, regenerate) N times: no new session directory, no
    new open file, the answer not recorded twice, and the view goes out without the recorded answer."""
    up, _ = upstream
    app, purl = proxy
    data = tmp_path / "data"
    body = chat(("user", "first"), ("assistant", "echo: first"), ("user", "second"))
    with httpx.Client(timeout=30) as client:
        def send() -> httpx.Response:
            return client.post(f"{purl}/v1/chat/completions", json=body)

        answer(send())
        settle(app)
        dirs, fds = session_dirs(data), open_fds_under(data)
        first_sent = up.received[-1]["messages"]
        for _ in range(30):
            answer(send())
            settle(app)
            assert up.received[-1]["messages"] == first_sent  # the recorded answer is not sent back
        for _ in range(3):  # streamed, the same
            with client.stream("POST", f"{purl}/v1/chat/completions", json=dict(body, stream=True)) as r:
                assert r.status_code == 200 and b"[DONE]" in r.read()
            settle(app)
            assert up.received[-1]["messages"] == first_sent
    assert session_dirs(data) == dirs and open_fds_under(data) == fds
    assert [m.text for m in Session(dirs[0]).restore().messages] == ["first", "echo: first", "second", "echo: second"]
    # The conversation goes on in the same session.
    answer(post(purl, chat(("user", "first"), ("assistant", "echo: first"), ("user", "second"),
                           ("assistant", "echo: second"), ("user", "third"))))
    settle(app)
    assert session_dirs(data) == dirs


def test_concurrent_duplicates_are_queued_into_one_session(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    app, url = proxy
    body = chat(("user", "duplicate me"))
    with ThreadPoolExecutor(8) as pool:
        for r in pool.map(lambda _: post(url, body), range(16)):
            answer(r)
    settle(app)
    dirs = session_dirs(tmp_path / "data")
    assert len(dirs) == 1
    assert len(Session(dirs[0]).restore().messages) == 2


def test_retries_under_a_low_file_limit_keep_serving(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    """120 retries of one request under a 64-descriptor limit: all answered, one session."""
    _, url = upstream
    data = tmp_path / "data"
    with proxy_process(url, data, nofile=64) as purl, httpx.Client(timeout=30) as client:
        body = chat(("user", "first"), ("assistant", "echo: first"), ("user", "second"))
        statuses = [client.post(f"{purl}/v1/chat/completions", json=body).status_code for _ in range(120)]
        other = client.post(f"{purl}/v1/chat/completions", json=chat(("user", "another conversation")))
    assert statuses == [200] * 120 and other.status_code == 200
    assert len(session_dirs(data)) == 2


def test_eviction_counts_sessions_and_closes_their_files(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    """Conversations sharing one key (one X-Ctxfold-Session value, different openings) are sessions
    of one key: the bound counts them, and evicted ones hold no open file."""
    _, url = upstream
    data = tmp_path / "data"
    app, srv = start_proxy(url, data, max_loaded_conversations=3)
    try:
        for k in range(10):
            answer(post(srv.url, chat(("user", f"opening {k}")), headers={"X-Ctxfold-Session": "shared"}))
            settle(app)
            assert eventually(lambda: app.sessions.num_sessions <= 3)
            assert open_fds_under(data) <= 3
        assert len(session_dirs(data)) == 10
    finally:
        srv.close()


def test_loaded_bytes_are_bounded(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    _, url = upstream
    app, srv = start_proxy(url, tmp_path / "data", max_loaded_bytes=200_000)
    try:
        for k in range(8):
            answer(post(srv.url, chat(("user", f"{k} " + "a long pasted text. " * 3000))))
            settle(app)
            assert eventually(lambda: app.sessions.loaded_bytes <= 200_000 or app.sessions.num_sessions <= 1)
    finally:
        srv.close()
    assert len(session_dirs(tmp_path / "data")) == 8


def test_loaded_bytes_are_the_logs_sizes(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    """The byte bound's figure (counted as the logs are written, not measured) is what the disk holds."""
    _, url = upstream
    app, srv = start_proxy(url, tmp_path / "data")
    try:
        for k in range(3):
            history: list[tuple[str, str]] = []
            for turn in range(3):
                history.append(("user", f"conversation {k} turn {turn} " + "text " * 50))
                history.append(("assistant", answer(post(srv.url, chat(*history)))))
            settle(app)
        on_disk = sum((d / "events.jsonl").stat().st_size for d in session_dirs(tmp_path / "data"))
        assert eventually(lambda: app.sessions.loaded_bytes == on_disk), (app.sessions.loaded_bytes, on_disk)
    finally:
        srv.close()


# -- forks ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("summarizer", ["extractive", "upstream"])
def test_an_edited_history_forks_from_the_common_prefix(upstream: tuple[ScriptedUpstream, str], tmp_path: Path,
                                                        summarizer: str) -> None:
    """40 turns with compactions, then a request that edits turn 35 (or the next one at which nothing
    was compacted): the new session continues the parent's log up to the turn before (its
    compactions kept: none runs again for the prefix), and what goes upstream starts as the parent's
    request of that turn did, the prior summary included."""
    up, url = upstream
    data = tmp_path / "data"
    compact = CompactConfig(context_tokens=8192)
    if summarizer == "extractive":
        app, srv = start_proxy(url, data, compact=compact)
    else:  # summaries written by the upstream: a summary request is one the upstream sees
        app = ProxyApp(ProxyConfig(upstream=url, data_dir=data, compact=compact, summarizer="upstream", fsync="never"))
        srv = BackgroundServer(app.app()).__enter__()
    try:
        turns: list[tuple[str, str]] = []
        sent: list[list[dict[str, Any]]] = []
        compactions: list[float] = []
        for k in range(40):
            turns.append(("user", f"turn {k}: " + "please look at this part of the log. " * 40))
            before = _compactions(app)
            text = answer(post(srv.url, chat(*turns)))
            settle(app)
            compactions.append(_compactions(app) - before)
            sent.append(up.received[-1]["messages"])
            turns.append(("assistant", text))
        # Edit the first turn from 35 on at which the parent did not compact: the fork must not either.
        e = next(k for k in range(34, 40) if compactions[k] == 0)
        assert sum(compactions[:e]) >= 1  # the prefix holds compactions
        parent = session_dirs(data)
        assert len(parent) == 1
        edited = [*turns[:2 * e], ("user", turns[2 * e][1].replace(f"turn {e}", f"turn {e} (edited)"))]
        before, summaries = _compactions(app), _summary_requests(up)
        answer(post(srv.url, chat(*edited)))
        settle(app)
        assert _compactions(app) == before  # the prefix is not counted or compacted again
        assert _summary_requests(up) == summaries > (0 if summarizer == "upstream" else -1)
        fork_sent = up.received[-1]["messages"]
        assert fork_sent[:-1] == sent[e][:-1]  # the parent's view of the prefix, its summary included
        assert "[ctxfold compacted" in json.dumps(fork_sent)
        assert fork_sent[-1]["content"].startswith(f"turn {e} (edited)")
    finally:
        srv.close()
    dirs = session_dirs(data)
    assert len(dirs) == 2
    fork = next(d for d in dirs if d not in parent)
    assert [m.text for m in Session(fork).restore().messages] == [t for _, t in edited] + [f"echo: {edited[-1][1][:200]}"]
    parent_log = (parent[0] / "events.jsonl").read_bytes().splitlines(keepends=True)
    fork_log = (fork / "events.jsonl").read_bytes().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(parent_log) if json.loads(line).get("index") == 2 * e)
    assert fork_log[1:cut] == parent_log[1:cut]  # all but the header, which names the fork
    parent_header, fork_header = json.loads(parent_log[0]), json.loads(fork_log[0])
    assert fork_header["conversation"].pop("id").endswith(fork.name)
    assert parent_header["conversation"].pop("id").endswith(parent[0].name)
    assert fork_header == parent_header


def _summary_requests(up: ScriptedUpstream) -> int:
    return sum(1 for body in up.received if is_summary_request(body))


def _compactions(app: ProxyApp) -> float:
    return sum(app.metrics.compactions.values.values())


def test_a_client_sending_back_different_tool_calls_stays_in_one_family(
        upstream: tuple[ScriptedUpstream, str], proxy: tuple[ProxyApp, str], tmp_path: Path) -> None:
    """Each request sends back tool calls instead of the answer it got: every request forks from the
    session before it (its log carried over, not started afresh)."""
    app, url = proxy
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "go"}]
    for k in range(6):
        r = post(url, {"model": "m", "messages": history})
        answer(r)
        settle(app)
        # The client parsed a call out of the answer's text and sends that back instead of the text.
        call = {"id": f"call_{k}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": f"ls {k}"})}}
        history += [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{k}", "content": f"output {k}"}]
    dirs = session_dirs(tmp_path / "data")
    assert len(dirs) == 6 and app.sessions.num_forks == 5
    # Each fork's log is its parent's up to the message the client changed (the header names the fork).
    for parent, fork in pairwise(dirs):
        parent_log = (parent / "events.jsonl").read_bytes().splitlines()
        fork_log = (fork / "events.jsonl").read_bytes().splitlines()
        cut = next(i for i in range(1, len(fork_log)) if i >= len(parent_log) or fork_log[i] != parent_log[i])
        assert fork_log[1:cut] == parent_log[1:cut] and json.loads(fork_log[cut])["message"]["tool_calls"]
    last = max(dirs, key=lambda d: len(Session(d).restore().messages))
    assert len(Session(last).restore().messages) == len(history) - 2 - 1 + 1  # the last request's, and its answer


def test_a_client_that_drops_the_answers_has_its_history_summarized(upstream: tuple[ScriptedUpstream, str],
                                                                     tmp_path: Path) -> None:
    """mini-swe-agent leaves a malformed answer out of its history and sends the next observation: no
    request carries an answer, so each forks from the one before. What went out was seen by the model
    all the same: the automatic passes summarize it, and the window guard has nothing left to do."""
    up, url = upstream
    app, srv = start_proxy(url, tmp_path / "data", compact=CompactConfig(context_tokens=4096))
    try:
        turns: list[tuple[str, str]] = [("user", "Fix the failing test in the repository.")]
        for k in range(24):
            answer(post(srv.url, chat(*turns)))
            settle(app)
            turns.append(("user", f"observation {k}: " + f"line {k} of the build log, unchanged. " * 30))
        metrics = httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.close()
    assert app.sessions.num_forks >= 20
    summaries = {trigger: metric(metrics, "ctxfold_compactions_total", kind="summary", trigger=trigger) or 0
                 for trigger in ("soft", "hard", "turn_start", "guard")}
    assert summaries["guard"] == 0 and sum(summaries.values()) >= 1, summaries
    assert max(up.prompt_tokens_seen) <= 4096


# -- faults ----------------------------------------------------------------------------------------------------

def test_a_corrupt_session_is_set_aside_and_the_rest_keep_serving(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    _, url = upstream
    data = tmp_path / "data"
    turns: list[tuple[str, str]] = [("user", "shared opening")]
    app, srv = start_proxy(url, data)
    try:
        for k in range(3):
            turns.append(("assistant", answer(post(srv.url, chat(*turns)))))
            turns.append(("user", f"more {k}"))
        settle(app)
    finally:
        srv.close()
    (victim,) = session_dirs(data)
    lines = (victim / "events.jsonl").read_bytes().splitlines(keepends=True)
    lines.insert(3, b"this is not json\n")
    (victim / "events.jsonl").write_bytes(b"".join(lines))
    app, srv = start_proxy(url, data)
    try:
        r = post(srv.url, chat(*turns))
        answer(r)
        assert "could not be read" in r.headers[WARNING_HEADER]
        assert (victim / QUARANTINE_FILE).is_file()
        assert app.sessions.num_quarantined == 1
        assert metric(httpx.get(f"{srv.url}/metrics").text, "ctxfold_sessions_quarantined") == 1
        # A sibling with the same opening, a brand-new one, a retry: all served, no warning.
        for body in (chat(("user", "shared opening"), ("assistant", "x"), ("user", "y")),
                     chat(("user", "shared opening")), chat(*turns)):
            r = post(srv.url, body)
            answer(r)
            assert WARNING_HEADER not in r.headers
        assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"
        settle(app)
    finally:
        srv.close()
    # The conversation's history is whole in its new session.
    fresh = [d for d in session_dirs(data) if d != victim]
    assert any([m.text for m in Session(d).restore().messages][:len(turns)] == [t for _, t in turns] for d in fresh)


@pytest.mark.skipif(not can_mount(), reason="needs unshare -m (mount namespaces) to mount a real file system")
@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_data_dir_that_takes_no_writes_passes_requests_through(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path, fault: str) -> None:
    up, url = upstream
    root = tmp_path / "fs"
    root.mkdir()
    if fault == "read-only":
        mount = f"mount -t tmpfs -o ro,mode=0700 tmpfs {root}"
    else:  # a file fills it to the last byte
        mount = (f"mount -t tmpfs -o size=256k,mode=0700 tmpfs {root} && "
                 f"(dd if=/dev/zero of={root}/filler bs=4k 2>/dev/null; true)")
    with proxy_process(url, root, mount=mount) as purl:
        r = post(purl, chat(("user", "hello")))
        assert answer(r) == "echo: hello"
        assert "not compacted" in r.headers[WARNING_HEADER]
        sent = up.received[-1]
        assert sent["messages"] == chat(("user", "hello"))["messages"]
        # A tenant's first request, whose tenant key cannot be made on this file system, too.
        r = post(purl, chat(("user", "hello")), headers={"Authorization": "Bearer sk-a"})
        assert answer(r) == "echo: hello" and "not compacted" in r.headers[WARNING_HEADER]
        with httpx.stream("POST", f"{purl}/v1/chat/completions", json=chat(("user", "hi"), stream=True),
                          timeout=30) as s:
            assert s.status_code == 200 and WARNING_HEADER in s.headers
            assert b"[DONE]" in b"".join(s.iter_raw())
        health = httpx.get(f"{purl}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "degraded" and "data directory" in health.json()["reason"]


@pytest.mark.skipif(not can_mount(), reason="needs unshare -m (mount namespaces) to mount a real file system")
def test_serve_warns_at_startup_of_no_window_and_a_data_dir_it_cannot_write(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    serve = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "ctxfold", "serve", "--upstream",
                                              "http://127.0.0.1:9/v1", "--data-dir", str(root), "--port", "0"])
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro,mode=0700 tmpfs {root} && exec {serve}"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=ctxfold_env(), text=True)
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline() for _ in range(3)]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert "listening on" in lines[0], lines
    assert lines[1].startswith("ctxfold serve: warning: --context-tokens is not set"), lines
    assert lines[2].startswith(f"ctxfold serve: warning: the data directory {root} cannot be written"), lines


@pytest.mark.skipif(not can_mount(), reason="needs unshare -m (mount namespaces) to mount a real file system")
def test_a_disk_that_fills_while_a_request_is_out_loses_nothing(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    """A request that nothing compacts goes upstream before its messages are stored: they are written
    with its answer, once the client has it. When the disk is full by then, the client has its answer,
    /health says why, and the conversation's next request says that the last answer was not stored.
    Once there is room, that request stores the whole history, each message once and in order."""
    _, url = upstream
    root = tmp_path / "fs"
    root.mkdir()
    pids: list[int] = []
    with proxy_process(url, root, mount=f"mount -t tmpfs -o size=256k,mode=0700 tmpfs {root}", pids=pids) as purl:
        turns = [("user", "hello")]
        turns.append(("assistant", answer(post(purl, chat(*turns)))))
        seen = Path(f"/proc/{pids[0]}/root") / root.relative_to("/")  # the proxy's file system, from here
        filler = seen / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):  # to the last byte: ENOSPC ends it
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        more = "more " * 2000  # past the page the log has begun: its append needs a page there is no room for
        turns.append(("user", more))
        r = post(purl, chat(*turns))
        assert answer(r) == f"echo: {more[:200]}" and WARNING_HEADER not in r.headers
        assert eventually(lambda: httpx.get(f"{purl}/health").status_code == 503)
        assert "data directory" in httpx.get(f"{purl}/health").json()["reason"]
        assert 'ctxfold_answers_unstored_total 1.0' in httpx.get(f"{purl}/metrics").text
        filler.unlink()
        turns += [("assistant", f"echo: {more[:200]}"), ("user", "again")]
        r = post(purl, chat(*turns))
        assert answer(r) == "echo: again"
        assert r.headers[WARNING_HEADER].startswith("the last answer of this conversation was not stored (")
        assert r.headers[WARNING_HEADER].endswith("this request carries it again")
        r = post(purl, chat(*turns))  # said once
        assert answer(r) == "echo: again" and WARNING_HEADER not in r.headers
        assert eventually(lambda: len(Session(session_dirs(seen)[0]).restore().messages) == len(turns) + 1)
        assert [m.text for m in Session(session_dirs(seen)[0]).restore().messages] == \
            [t for _, t in turns] + ["echo: again"]


def test_the_tenant_key_comes_from_the_operator_when_given(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ctxfold.errors import ConfigError

    _, url = upstream
    short = tmp_path / "short.key"
    short.write_text("too short")
    with pytest.raises(ConfigError, match="tenant_key_file: cannot read a tenant key from .*at least 16 bytes"):
        ProxyApp(ProxyConfig(upstream=url, data_dir=tmp_path / "d0", tenant_key_file=short))
    with pytest.raises(ConfigError, match="tenant_header: 'X Bad' is not an HTTP header name"):
        ProxyConfig(upstream=url, data_dir=tmp_path / "d0", tenant_header="X Bad")
    # The same key, from a file or the environment, derives the same tenants: no key file is made.
    key = tmp_path / "tenant.secret"
    key.write_text("0123456789abcdef0123456789abcdef\n")
    monkeypatch.setenv("CTXFOLD_TENANT_KEY", "0123456789abcdef0123456789abcdef")
    names = []
    for data, extra in ((tmp_path / "d1", {"tenant_key_file": key}), (tmp_path / "d2", {})):
        app, srv = start_proxy(url, data, **extra)
        try:
            answer(post(srv.url, chat(("user", "hi")), headers={"Authorization": "Bearer sk-x"}))
            settle(app)
        finally:
            srv.close()
        assert not (data / TENANT_KEY_FILE).exists()
        names.append([p.name for p in (data / "tenants").iterdir()])
    assert names[0] == names[1] and len(names[0]) == 1


def test_a_client_editing_every_request_stays_within_the_bounds(
        upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    """Every request edits the last answer: a fork each time, yet loaded sessions and open files stay
    within --max-loaded-sessions, and the conversation goes on from its newest fork."""
    _, url = upstream
    data = tmp_path / "data"
    app, srv = start_proxy(url, data, max_loaded_conversations=3)
    try:
        history = [{"role": "user", "content": "go"}]
        for k in range(10):
            answer(post(srv.url, {"model": "m", "messages": history}))
            settle(app)
            assert eventually(lambda: app.sessions.num_sessions <= 3) and open_fds_under(data) <= 3
            # The store forgets the sessions that left memory: nothing grows with every fork.
            assert isinstance(app.sessions.store, LocalStore) and app.sessions.store.num_remembered <= 3
            history += [{"role": "assistant", "content": f"edited answer {k}"}, {"role": "user", "content": f"next {k}"}]
        assert app.sessions.num_forks == 9
    finally:
        srv.close()
    newest = max(session_dirs(data), key=lambda d: int(d.name))
    assert len(Session(newest).restore().messages) == len(history) - 2 + 1
