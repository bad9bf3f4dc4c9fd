"""Whether the engine sees what ctxfold counts: a probe at startup and a comparison of the figures the
proxy already has on a sample of answers.

ctxfold counts a request with its tokenizer and chat template (``--tokenizer``, ``--template``). When the
engine renders or tokenizes otherwise (another template; a chat format that silently drops system or tool
messages, as llama-cpp-python's ``gemma`` format does), every count is off and nothing else notices: the
calibration absorbs the difference as a factor, so the window stays safe, but the model never sees the
system prompt, or the accounting is off by a template's worth of tokens.

- **At startup** (``--engine-check startup``, ``sampled`` and ``every``): a few tiny requests with
  ``max_tokens`` 1, each counted by ctxfold and answered with the engine's ``usage.prompt_tokens``: one user
  message; the same with a system message; a turn with a tool call and its result, and the same without
  the result. A system (or tool) message that grows ctxfold's count but not the engine's was dropped by
  the engine; a difference on the one-message request is a different template or tokenizer. Where the
  engine tokenizes plain text for its clients (llama_cpp.server's ``/extras/tokenize/count``, llama.cpp's
  ``/tokenize``), a sample text tells the tokenizer apart from the template. One warning line names
  the likely cause; ``ctxfold_engine_divergences_total{kind}`` counts it. Off the request path: a task of
  its own, started with the server.
- **On answers** (``sampled``: one in ``--engine-check-every`` answers; ``every``: all of them, counting
  each request before it leaves): ctxfold's count of the prompt it sent beside the engine's
  ``usage.prompt_tokens`` (``ctxfold_engine_checks_total{result}``). ``sampled`` compares only figures the
  proxy has already (a request it counted anyway: from about a fifth of the window on), so it adds
  nothing to a request; ``every`` is for tests and benchmarks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ctxfold.chat.messages import Conversation
from ctxfold.serve import DEFAULT_ENGINE_CHECK_EVERY, ENGINE_CHECK_MODES
from ctxfold.serve.metrics import ProxyMetrics
from ctxfold.serve.request import parse_messages
from ctxfold.serve.upstream import UpstreamClient, UpstreamError
from ctxfold.tokens.accounting import count_request
from ctxfold.tokens.counting import TokenCounter

log = logging.getLogger("ctxfold.serve")


_USER = {"role": "user", "content": "Reply with the word OK."}
_SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one word."}
_CALL = {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "list_files", "arguments": '{"path": "."}'}}]}
_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "README.md\nsetup.py\nsrc/\ntests/"}
_FOLLOW = {"role": "user", "content": "Which of these is the readme?"}
# Plain text for the tokenizer alone: words, digits, code, accents, CJK, emoji, runs of spaces.
_SAMPLE_TEXT = ("The quick brown fox jumps over 13 lazy dogs; def f(x):\n    return x ** 2  # 東京 café ünïcödé 🙂\n"
                "  two  spaces\tand a tab.")


@dataclass
class EngineCheckReport:
    """What the startup probe found (``/health`` shows it)."""

    state: str = "pending"  # pending, agree, differ, unavailable (the engine did not answer a probe)
    findings: list[str] = field(default_factory=list)  # one clause per divergence (or why it could not check)
    figures: dict[str, Any] = field(default_factory=dict)  # probe -> {"ctxfold": n, "engine": m}

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "findings": list(self.findings), "figures": dict(self.figures)}


class EngineCheck:
    """The startup probe and the comparison of answers' figures (see the module's docstring)."""

    def __init__(self, *, mode: str, every: int, counter: TokenCounter, template: Any, metrics: ProxyMetrics,
                 client: Callable[[], UpstreamClient], completions_url: str, model: str | None,
                 api_key: str | None) -> None:
        self.mode = mode
        self.every = max(1, every)
        self.counter = counter
        self.template = template
        self.metrics = metrics
        self._client = client
        self._origin_path = urlsplit(completions_url).path.removesuffix("/chat/completions")
        self._model = model
        self._api_key = api_key
        self.report = EngineCheckReport(state="off" if mode == "off" else "pending")
        self._answers = 0
        self._warned_answers = False

    # -- answers -------------------------------------------------------------------------------------
    @property
    def counts_every_request(self) -> bool:
        """Every request is counted before it leaves (mode ``every``), so every answer can be compared."""
        return self.mode == "every"

    def due(self) -> bool:
        """Whether this answer's figures are compared (call once per answer with usage)."""
        if self.mode not in ("sampled", "every"):
            return False
        self._answers += 1
        return self.mode == "every" or self._answers % self.every == 1 or self.every == 1

    def compare(self, predicted: int, reported: int) -> bool:
        """ctxfold counted ``predicted`` prompt tokens for a request the engine counted ``reported``: True
        when they agree. A disagreement is counted, and said once in the log (with the probe's finding)."""
        agree = predicted == reported
        self.metrics.engine_checks.inc("agree" if agree else "differ")
        self.metrics.engine_prompt_tokens_diff.set(float(reported - predicted))
        if not agree and not self._warned_answers:
            self._warned_answers = True
            exact = getattr(self.counter, "exact", False)
            why = ("; the startup probe found: " + "; ".join(self.report.findings)) if self.report.findings else ""
            log.warning("engine check: the upstream counted %d prompt tokens where ctxfold counted %d (%+d; %s)%s; "
                        "the calibration keeps the window safe, this line is said once",
                        reported, predicted, reported - predicted,
                        "an exact counter: the template or the engine's chat format differs" if exact else
                        "ctxfold's counter is an estimate (--tokenizer): exact counts need the model's own", why)
        return agree

    # -- startup probe -------------------------------------------------------------------------------
    async def startup(self) -> EngineCheckReport:
        """Probe the engine once (see the module's docstring); never raises."""
        try:
            await self._probe()
        except Exception as e:  # noqa: BLE001 - a probe must never take the proxy down
            self.report.state = "unavailable"
            self.report.findings.append(f"the probe failed ({type(e).__name__}: {e})")
            log.info("engine check: could not probe the upstream (%s: %s)", type(e).__name__, e)
        return self.report

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    async def _post(self, target: str, body: dict[str, Any]) -> tuple[int, Any]:
        client = self._client()
        payload = json.dumps(body).encode()
        async with client.request("POST", target, payload, list(self._headers().items())) as resp:
            raw = await resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, None

    async def _model_name(self) -> str:
        if self._model:
            return self._model
        try:
            async with self._client().request("GET", f"{self._origin_path}/models", b"",
                                              list(self._headers().items())) as resp:
                data = json.loads(await resp.read())
            first = data["data"][0]["id"]
            if isinstance(first, str):
                return first
        except (UpstreamError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            pass
        return "default"

    async def _engine_count(self, model: str, wire: list[dict[str, Any]]) -> int | str:
        """The engine's prompt tokens for ``wire`` (max_tokens 1), or why there are none."""
        status, data = await self._post(f"{self._origin_path}/chat/completions",
                                        {"model": model, "messages": wire, "max_tokens": 1, "temperature": 0,
                                         "stream": False})
        usage = data.get("usage") if isinstance(data, dict) else None
        n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if status != 200:
            return f"status {status}"
        if not isinstance(n, int):
            return "no usage in the answer"
        return n

    def _ctxfold_count(self, wire: list[dict[str, Any]]) -> int | str:
        system = wire[0]["content"] if wire and wire[0]["role"] == "system" else None
        rest = wire[1:] if system is not None else wire
        try:
            return count_request(self.counter, self.template,
                                 Conversation(messages=parse_messages(rest, 0), system=system))
        except Exception as e:  # noqa: BLE001 - a template may refuse the probe (Gemma 3's refuses tool messages)
            return f"ctxfold's template refused it ({e})"

    async def _tokenizer_probe(self) -> tuple[int, int] | None:
        """(ctxfold, engine) tokens of the sample text, where the engine tokenizes for its clients."""
        ours = self.counter.count(_SAMPLE_TEXT)
        origin = self._origin_path.removesuffix("/v1")
        for target, body, read in (
            (f"{origin}/extras/tokenize/count", {"input": _SAMPLE_TEXT}, lambda d: d.get("count")),  # llama_cpp.server
            (f"{origin}/tokenize", {"content": _SAMPLE_TEXT, "add_special": False},  # llama.cpp's llama-server
             lambda d: len(d["tokens"]) if isinstance(d.get("tokens"), list) else None),
        ):
            try:
                status, data = await self._post(target, body)
                if status != 200 or not isinstance(data, dict):
                    continue
                n = read(data)
                if not isinstance(n, int):
                    continue
                if target.endswith("/count"):  # llama_cpp.server adds the BOS: measure it on an empty text
                    status, empty = await self._post(target, {"input": ""})
                    if status == 200 and isinstance(empty, dict) and isinstance(empty.get("count"), int):
                        n -= empty["count"]
                return ours, n
            except (UpstreamError, TimeoutError, ValueError):
                continue
        return None

    async def _probe(self) -> None:
        r = self.report
        model = await self._model_name()
        probes: dict[str, list[dict[str, Any]]] = {"user": [_USER], "system": [_SYSTEM, _USER], "tool": [_USER, _CALL, _RESULT, _FOLLOW],
                  "tool_call_only": [_USER, _CALL, _FOLLOW]}
        counts: dict[str, tuple[int | str, int | str]] = {}
        for name, wire in probes.items():
            counts[name] = (self._ctxfold_count(wire), await self._engine_count(model, wire))
            r.figures[name] = {"ctxfold": counts[name][0], "engine": counts[name][1]}
        kinds: list[str] = []
        ours, theirs = counts["user"]
        if not isinstance(theirs, int):
            r.state = "unavailable"
            r.findings.append(f"the upstream gave no prompt tokens for a one-message probe ({theirs})")
            log.info("engine check: not possible, the upstream gave no prompt tokens for a probe (%s)", theirs)
            return
        tok = await self._tokenizer_probe()
        if tok is not None:
            r.figures["tokenizer"] = {"ctxfold": tok[0], "engine": tok[1]}
            if tok[0] != tok[1]:
                kinds.append("tokenizer")
                r.findings.append(f"the tokenizer differs: a sample text is {tok[0]} tokens for ctxfold, {tok[1]} "
                                  "for the engine (give --tokenizer the model's own, e.g. gguf:PATH)")
        if isinstance(ours, int) and ours != theirs and "tokenizer" not in kinds:
            kinds.append("template")
            r.findings.append(f"the chat template differs: a one-message request is {ours} tokens for ctxfold, "
                              f"{theirs} for the engine (give --template the engine's own)")

        self._compare_roles(counts, kinds)
        for kind in kinds:
            self.metrics.engine_divergences.inc(kind)
        if kinds:
            r.state = "differ"
            log.warning("engine check: the upstream does not see what ctxfold counts: %s; the calibration keeps "
                        "the window safe, but counts are off", "; ".join(r.findings))
        else:
            r.state = "agree"
            if r.findings:
                log.warning("engine check: the upstream counts what ctxfold counts, but: %s", "; ".join(r.findings))
            log.info("engine check: the upstream counts what ctxfold counts (%s)",
                     ", ".join(f"{k} {v['engine']}" for k, v in r.figures.items()))

    def _compare_roles(self, counts: dict[str, tuple[int | str, int | str]], kinds: list[str]) -> None:
        """What a system message and a tool exchange add, for ctxfold and for the engine (``counts``: each
        probe's pair, from :meth:`_probe`): a role one side drops or renders differently joins ``kinds``
        and the report's findings."""
        r = self.report

        def growth(name: str, base: str) -> tuple[int, int] | None:
            (o1, e1), (o0, e0) = counts[name], counts[base]
            if all(isinstance(v, int) for v in (o1, e1, o0, e0)):
                return int(o1) - int(o0), int(e1) - int(e0)
            return None

        for name, base, what in (("system", "user", "system"), ("tool", "tool_call_only", "tool")):
            o, e = counts[name]
            if not isinstance(e, int):
                kinds.append(f"{what}_refused")
                r.findings.append(f"the engine refused a request with a {what} message ({e})")
                continue
            if not isinstance(o, int):
                r.findings.append(f"{what} messages not checked: {o}")
                continue
            g = growth(name, base)
            if g is None:
                continue
            ours_g, theirs_g = g
            if theirs_g <= 0 < ours_g:
                kinds.append(f"{what}_dropped")
                r.findings.append(f"the engine drops {what} messages: they add {ours_g} tokens for ctxfold and "
                                  f"none for the engine (its chat format ignores them; the model never sees them)")
            elif theirs_g <= 0 and ours_g <= 0:
                # ctxfold's template mirrors the engine's chat format: counts agree, the model still never
                # sees them. Said, counted, but not a divergence of the counts.
                self.metrics.engine_divergences.inc(f"{what}_dropped")
                r.findings.append(f"the engine drops {what} messages, and ctxfold's template too: counts agree, "
                                  f"but the model never sees a {what} message (a client should not rely on them)")
            elif ours_g <= 0 < theirs_g:
                kinds.append(f"{what}_dropped_by_ctxfold")
                r.findings.append(f"ctxfold's template drops {what} messages the engine sees ({theirs_g} tokens)")
            elif ours_g != theirs_g and "template" not in kinds and "tokenizer" not in kinds:
                kinds.append("template")
                r.findings.append(f"{what} messages are rendered differently: {ours_g} tokens for ctxfold, "
                                  f"{theirs_g} for the engine")


__all__ = ["DEFAULT_ENGINE_CHECK_EVERY", "ENGINE_CHECK_MODES", "EngineCheck", "EngineCheckReport"]
