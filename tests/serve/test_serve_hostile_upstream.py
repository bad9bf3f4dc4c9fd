"""An upstream that answers with what no model sends: an event of 48 MB, a JSON answer of 96 MB, a body
nested 200,000 deep, gzip although asked for identity, bytes that are not HTTP. The proxy (a real
`ctxfold serve` process) bounds what it holds, answers with an error whose code says what happened, and
keeps answering /health meanwhile; its peak resident memory is read from /proc."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold.serve.sse import SseEventTooLarge, SseReader
from helpers.subprocess_env import ctxfold_env

MiB = 1 << 20
# The proxy's peak resident memory while it relays a hostile answer: its own baseline (an interpreter
# with aiohttp, the tokenizer and the compactor loaded, about 90 MB) plus what the bounds let it hold.
MAX_PROXY_RSS_BYTES = 200 * MiB


class HostileUpstream:
    """An HTTP/1.1 server on loopback, in a thread, that answers every request as ``mode`` says,
    writing its huge bodies piece by piece (it never holds them)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.headers_seen: list[bytes] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        self._ready.set()
        self._loop.run_forever()
        # Stopped: close the listening socket, the connections still open and the loop's own sockets,
        # which the garbage collector would otherwise report in whichever test runs next.
        server.close()
        self._loop.run_until_complete(server.wait_closed())
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            self.headers_seen.append(head)
            await getattr(self, f"_{self.mode}")(writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _completion(text: str) -> bytes:
        return json.dumps({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}).encode()

    async def _ok(self, writer: asyncio.StreamWriter) -> None:
        body = self._completion("fine")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        await writer.drain()

    async def _huge_event(self, writer: asyncio.StreamWriter) -> None:
        """A stream whose second event is one 48 MB data line, sent 64 kB at a time."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        first = {"choices": [{"index": 0, "delta": {"content": "hello"}}]}
        writer.write(b"data: " + json.dumps(first).encode() + b"\n\n" + b'data: {"choices": [{"delta": {"content": "')
        for _ in range(48 * 16):
            writer.write(b"x" * (64 << 10))
            await writer.drain()
        writer.write(b'"}}]}\n\ndata: [DONE]\n\n')
        await writer.drain()

    async def _huge_json(self, writer: asyncio.StreamWriter) -> None:
        """A 96 MB JSON answer, with its length given up front."""
        start, end = b'{"choices": [{"message": {"role": "assistant", "content": "', b'"}}]}'
        size = 96 * MiB
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size + start)
        left = size - len(start) - len(end)
        while left > 0:
            n = min(left, 64 << 10)
            writer.write(b"y" * n)
            left -= n
            await writer.drain()
        writer.write(end)
        await writer.drain()

    async def _deep(self, writer: asyncio.StreamWriter) -> None:
        body = b'{"choices": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        await writer.drain()

    async def _gzip_stream(self, writer: asyncio.StreamWriter) -> None:
        events = b"".join(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": w}}]}).encode()
                          + b"\n\n" for w in ("zipped ", "answer"))
        events += b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
        body = gzip.compress(events)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async def _brotli(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: br\r\n"
                     b"Content-Length: 4\r\n\r\n\x0b\x02\x80\x00")
        await writer.drain()

    async def _garbage(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    up = HostileUpstream()
    yield up
    up.close()


@pytest.fixture(scope="module")
def proxy(hostile: HostileUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """`ctxfold serve` in front of the hostile upstream, with its default bounds: (URL, pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxfold", "serve", "--upstream", hostile.url, "--port", "0", "--data-dir",
         str(tmp_path_factory.mktemp("data")), "--context-tokens", "8192", "--template", "none", "--tokenizer",
         "chars4", "--engine-check", "off", "--no-fsync"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ctxfold_env())
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"listening on (\S+),", line)
        assert m is not None, line + proc.stderr.read()[-2000:]
        yield m.group(1), proc.pid
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def peak_rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def ask(url: str, *, stream: bool) -> httpx.Response:
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def health_answers_while(url: str, work: threading.Thread) -> list[float]:
    """Seconds each /health took while ``work`` ran."""
    took = []
    while work.is_alive():
        t0 = time.monotonic()
        httpx.get(url + "/health", timeout=30)
        took.append(time.monotonic() - t0)
        time.sleep(0.05)
    return took


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads peak memory from /proc (Linux)")
@pytest.mark.parametrize(("mode", "stream", "code"), [
    ("huge_event", True, "upstream_event_too_large"),
    ("huge_json", False, "upstream_answer_too_large"),
])
def test_an_answer_past_its_bounds_ends_in_an_error_and_memory_stays_bounded(
        hostile: HostileUpstream, proxy: tuple[str, int], mode: str, stream: bool, code: str) -> None:
    url, pid = proxy
    hostile.mode = mode
    result: dict[str, httpx.Response] = {}
    work = threading.Thread(target=lambda: result.setdefault("r", ask(url, stream=stream)))
    work.start()
    took = health_answers_while(url, work)
    work.join()
    resp = result["r"]
    if stream:  # the head went out with the first event: the stream ends with an error event
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        assert events[0]["choices"][0]["delta"]["content"] == "hello"
        assert events[-1]["error"]["code"] == code and "[DONE]" not in resp.text
    else:
        assert resp.status_code == 502 and resp.json()["error"]["code"] == code
    assert peak_rss_bytes(pid) < MAX_PROXY_RSS_BYTES, peak_rss_bytes(pid)
    assert took and max(took) < 5.0  # a safety net: /health is answered while the answer is relayed
    hostile.mode = "ok"
    assert ask(url, stream=False).json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.parametrize(("mode", "code"), [
    ("deep", "bad_upstream_body"),
    ("garbage", "upstream_protocol_error"),
    ("brotli", "upstream_protocol_error"),
])
def test_an_answer_that_cannot_be_read_is_a_502_that_says_why(
        hostile: HostileUpstream, proxy: tuple[str, int], mode: str, code: str) -> None:
    url, _ = proxy
    hostile.mode = mode
    resp = ask(url, stream=False)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == code, resp.text


def test_an_encoded_stream_reaches_the_client_decoded_and_identity_is_asked_for(
        hostile: HostileUpstream, proxy: tuple[str, int]) -> None:
    url, _ = proxy
    hostile.mode = "gzip_stream"
    resp = ask(url, stream=True)
    assert resp.status_code == 200 and "content-encoding" not in resp.headers
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in resp.text.splitlines() if line.startswith("data: {"))
    assert text == "zipped answer"
    assert b"accept-encoding: identity" in hostile.headers_seen[-1].lower()


# -- the SSE reader itself ------------------------------------------------------------------------------

_events = st.lists(st.one_of(
    st.builds(lambda t: b"data: " + t.encode() + b"\n\n", st.text(alphabet=st.characters(codec="utf-8",
                                                                                           exclude_characters="\r\n"),
                                                                    max_size=50)),
    st.just(b": keep-alive\n\n"), st.just(b"event: x\r\ndata: a\r\ndata: b\r\n\r\n"), st.just(b"data: [DONE]\n\n")),
    max_size=10)


@settings(max_examples=200, deadline=None)
@given(events=_events, tail=st.binary(max_size=20).filter(lambda b: b"\n" not in b), cuts=st.lists(st.integers(0, 400)))
def test_the_reader_gives_the_same_events_however_the_bytes_are_cut(events: list[bytes], tail: bytes,
                                                                     cuts: list[int]) -> None:
    data = b"".join(events) + tail
    whole = SseReader()
    expected = whole.feed(data)
    reader = SseReader()
    got = []
    points = sorted({min(c, len(data)) for c in cuts})
    for a, b in zip([0, *points], [*points, len(data)], strict=True):
        got += reader.feed(data[a:b])
    assert got == expected
    assert b"".join(raw for raw, _ in got) + reader.rest() == data


def test_an_event_past_the_bound_is_refused_and_a_long_line_costs_linear_time() -> None:
    reader = SseReader(max_event_bytes=1 << 20)
    reader.feed(b"data: small\n\n" * 1000)  # many events, each small: the bound is per event
    with pytest.raises(SseEventTooLarge, match="over 1,048,576 bytes"):
        for _ in range(64):
            reader.feed(b"x" * (32 << 10))
    # 32 MB of one line in 4 kB pieces: 8,192 feeds. Rescanning the buffer from its start on every feed
    # (as before) copies and searches about 130 GB; linear, it is 32 MB. A generous safety net, not a speed test.
    unbounded = SseReader()
    t0 = time.monotonic()
    for _ in range(8192):
        unbounded.feed(b"y" * 4096)
    assert len(unbounded.feed(b"\n\n")) == 1 and time.monotonic() - t0 < 30
