"""The window guard: no request leaves over the window while a fit exists, whatever the policy, the
breaker and the summarizer do; where none exists, NoFitError before the request.

The property test drives random agent conversations (huge tool results, huge answers, parallel call
groups, queued messages, another agent's compaction summary, resumes from the session at random
points, summarizers that fail, breaker states) at windows from 2k to 200k, and checks every request
with an exact count (the DeepSeek V4 tokenizer and chat template, counted afresh, not by the
compactor's incremental accounting): within the window, no orphan, and the session restores the
conversation byte for byte. The step tests build, for each step of the cascade, a conversation that
only that step makes fit: take the step out and its test fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ctxfold.chat.codec import encode_message
from ctxfold.chat.integrity import count_orphans
from ctxfold.chat.messages import (
    Conversation,
    Message,
    Role,
    ToolCall,
    is_agent_feedback,
    is_imported_summary,
)
from ctxfold.compaction.compactor import GUARD_STEPS, Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session
from ctxfold.compaction.summarize import CallableSummarizer, SummaryRequest
from ctxfold.errors import NoFitError
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import TokenCounter, load_counter
from ctxfold.tokens.templates import ChatTemplate, get_template

WORDS = ("the", "engine", "keeps", "cache", "pages", "prefill", "token", "result", "file", "error", "line",
         "value", "index", "test", "patch", "function", "return", "import", "class", "module")


@pytest.fixture(scope="module")
def exact() -> TokenCounter:
    return load_counter("deepseek-v4")


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return get_template("deepseek-v3.2")


def text_of(num_words: int, seed: int) -> str:
    """About ``num_words`` tokens of text, different for every seed."""
    out = [WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(num_words)]
    for i in range(0, len(out), 12):
        out[i] = f"{out[i]}{seed + i}\n"
    return " ".join(out)


def failing_summarizer(kind: str) -> CallableSummarizer:
    """A model summarizer that fails: raises, answers nothing, or loops."""
    def generate(request: SummaryRequest) -> Iterable[str]:
        if kind == "raise":
            raise ConnectionError("connection refused")
        if kind == "empty":
            return iter(())
        return iter(["the same line again\n"] * 400)
    return CallableSummarizer(generate, name=f"model-{kind}")


def guard_only(ctx: int) -> CompactConfig:
    """Every automatic pass off (no soft trigger, no hard trigger, no archive, no major): the guard alone."""
    cfg = CompactConfig.preset("ds4", context_tokens=ctx)
    return replace(cfg, soft=replace(cfg.soft, enabled=False), hard=replace(cfg.hard, enabled=False))


class Run:
    """Feeds a conversation to a compactor the way an agent loop does, and checks every request."""

    def __init__(self, ctx: int, exact: TokenCounter, template: ChatTemplate, session_dir: Path, *,
                 policy: str = "both", summarizer: str | None = None, system_words: int = 40,
                 tools: bool = True) -> None:
        self.ctx, self.exact, self.template, self.dir = ctx, exact, template, session_dir
        self.config = guard_only(ctx) if policy == "off" else CompactConfig.preset(policy, context_tokens=ctx)
        self.summarizer = summarizer
        tool_specs = ()
        if tools:
            from ctxfold.chat.messages import ToolSpec
            tool_specs = (ToolSpec("bash", "Run a shell command.", {"type": "object", "properties": {
                "command": {"type": "string"}}, "required": ["command"]}),)
        self.header = Conversation([], id="guard", system=text_of(system_words, 1), tools=tool_specs)
        self.fed: list[Message] = []
        self.compactor = self._open()
        self.verifier = RequestAccounting(exact, template)
        self.verifier.reset(self.header, [])
        self.requests = 0
        self.unfittable = 0
        self.steps: list[str] = []
        self._n = 0

    def _open(self) -> Compactor:
        summarizer = failing_summarizer(self.summarizer) if self.summarizer else None
        return Compactor(self.header, config=self.config, counter=self.exact, template=self.template,
                         summarizer=summarizer, session_dir=self.dir, durable=False)

    def resume(self) -> None:
        self.compactor.close()
        self.compactor = self._open()

    def _id(self, kind: str) -> str:
        self._n += 1
        return f"{kind}{self._n}"

    def user(self, words: int, *, imported_summary: bool = False, feedback: bool = False) -> None:
        if imported_summary:
            text = ("This session is being continued from a previous conversation that ran out of context. "
                    "The conversation is summarized below:\n" + text_of(words, self._n + 3))
        elif feedback:
            text = "Tool call error:\n\n<error>\nNo tool calls found in the response.\n</error>\n"
        else:
            text = text_of(words, self._n + 5)
        self._append(Message(Role.USER, text, id=self._id("u")))

    def request(self, queued_words: tuple[int, ...] = (), max_reply_tokens: int | None = None) -> bool:
        """One model request; False when the compactor said no fit exists (then nothing is sent)."""
        c = self.compactor
        queued = [Message(Role.USER, text_of(w, self._n + 11), id=self._id("q"), queued=True) for w in queued_words]
        events_before = len(c.events)
        try:
            c.before_request(queued, max_reply_tokens=max_reply_tokens)
        except NoFitError as exc:
            # Only where the floor itself is over the window: never a case the cascade failed to cover.
            assert "please report" not in str(exc), str(exc)
            assert exc.needed_tokens > self.ctx
            self.unfittable += 1
            return False
        self.fed.extend(queued)
        self.steps += [e.guard_step for e in c.events[events_before:] if e.applied and e.guard_step]
        self.requests += 1
        # The truth: the request as sent, counted with the exact tokenizer and template by an accountant
        # of its own (not the compactor's).
        self.verifier.reset(c.header, c.view)
        sent = self.verifier.total_tokens + c.reply_reserve_tokens()
        assert sent <= self.ctx, f"request {self.requests} is {sent} tokens, over the {self.ctx}-token window"
        assert count_orphans(c.view) == 0
        return True

    def answer(self, words: int, calls: int = 0, call_words: int = 8) -> list[Message]:
        tool_calls = tuple(ToolCall(self._id("call"), "bash", json.dumps({"command": text_of(call_words, self._n)}))
                           for _ in range(calls))
        m = Message(Role.ASSISTANT, text_of(words, self._n + 7), id=self._id("a"), tool_calls=tool_calls)
        self._append(m)
        return [Message(Role.TOOL, "", tool_call_id=tc.id, name="bash") for tc in tool_calls]

    def results(self, pending: list[Message], words: Iterable[int], *, together: bool = False) -> None:
        """The results of the newest calls, one by one through the hard trigger, or ``together`` in one
        append (as a framework that collects a parallel group does, or the proxy's request)."""
        got = [Message(Role.TOOL, text_of(w, self._n + 13 + k), id=self._id("r"), tool_call_id=r.tool_call_id,
                       name="bash") for k, (r, w) in enumerate(zip(pending, words, strict=True))]
        self.fed.extend(got)
        if together:
            self.compactor.append(*got)
        else:
            for m in got:
                self.compactor.append_tool_result(m)

    def _append(self, m: Message) -> None:
        self.fed.append(m)
        self.compactor.append(m)

    def check_restore(self) -> None:
        self.compactor.close()
        restored = Session(self.dir).restore().messages
        assert [encode_message(m) for m in restored] == [encode_message(m) for m in self.fed]


# -- the property -----------------------------------------------------------------------------------------

# Small windows most often: that is where the steps are needed. Sizes are shares of the window, so a
# 200k window sees messages of hundreds of thousands of tokens (slow to tokenize: drawn rarely).
WINDOWS = (2048, 2048, 3000, 4096, 4096, 8192, 16384, 32768, 200_000)


@st.composite
def conversations(draw: st.DrawFn) -> dict[str, Any]:
    ctx = draw(st.sampled_from(WINDOWS))
    frac = st.floats(min_value=0.001, max_value=0.9)  # sizes as a share of the window
    turns = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["plain", "plain", "imported_summary", "huge_paste"]))
        steps = []
        for _ in range(draw(st.integers(0, 6))):
            n = draw(st.integers(1, 4))
            steps.append({
                "calls": n,
                "answer": draw(st.one_of(st.floats(0.0, 0.02), frac)),
                "call": draw(st.one_of(st.floats(0.0, 0.01), st.floats(0.0, 0.3))),
                "results": [draw(st.one_of(st.floats(0.0, 0.05), frac)) for _ in range(n)],
                "queued": draw(st.lists(st.floats(0.0, 0.1), max_size=2)),
                "feedback": draw(st.booleans()) and draw(st.booleans()),
                "together": draw(st.booleans()),
                "resume": draw(st.booleans()) and draw(st.booleans()),
            })
        turns.append({"kind": kind, "size": draw(st.one_of(st.floats(0.0, 0.05), frac)), "steps": steps,
                      "final": draw(st.one_of(st.floats(0.0, 0.05), frac))})
    return {"ctx": ctx, "turns": turns, "policy": draw(st.sampled_from(["both", "ds4", "datus", "off"])),
            "summarizer": draw(st.sampled_from([None, None, "raise", "empty", "loop"]))}


def words(share: float, ctx: int) -> int:
    # A huge message is up to 1.5 windows: the guard must archive it, not send it.
    return max(1, int(share * ctx * 1.6))


@pytest.mark.slow  # every request of 25 long conversations counted exactly: about two minutes on 2 cores
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan=conversations())
def test_no_request_over_the_window_while_a_fit_exists(plan: dict[str, Any], exact: TokenCounter,
                                                       template: ChatTemplate, tmp_path_factory: Any) -> None:
    ctx = plan["ctx"]
    run = Run(ctx, exact, template, tmp_path_factory.mktemp("s") / "session", policy=plan["policy"],
              summarizer=plan["summarizer"], system_words=min(60, ctx // 40))
    for turn in plan["turns"]:
        size = turn["size"] if turn["kind"] != "plain" else min(turn["size"], 0.05)
        run.user(words(size, ctx), imported_summary=turn["kind"] == "imported_summary")
        for step in turn["steps"]:
            if not run.request():
                return  # no fit can exist (checked by the floor): nothing more to test in this plan
            pending = run.answer(words(step["answer"], ctx), calls=step["calls"],
                                 call_words=words(step["call"], ctx))
            run.results(pending, [words(w, ctx) for w in step["results"]], together=step["together"])
            if step["feedback"]:
                run.user(0, feedback=True)
            if step["resume"]:
                run.resume()
            queued = tuple(words(w, ctx) for w in step["queued"])
            if not run.request(queued):
                return
            run.answer(words(0.005, ctx))
        if not run.request():
            return
        run.answer(words(turn["final"], ctx))
    assert run.unfittable == 0
    for step in sorted(set(run.steps)):  # what the examples exercised (--hypothesis-show-statistics)
        event(f"guard step {step}")
    event(f"{'some' if run.steps else 'no'} guard step at {ctx // 1024}k")
    run.check_restore()


# -- each step of the cascade is needed ---------------------------------------------------------------------

def breaker_set(run: Run) -> None:
    """A turn whose policy summary could not help: the breaker stops the policy for the rest of it."""
    run.compactor.state.turn.gave_up = True


def test_archive_all_makes_a_parallel_group_fit(exact: TokenCounter, template: ChatTemplate, tmp_path: Path) -> None:
    """The newest results, together over the window, fit as markers: step one."""
    run = Run(8192, exact, template, tmp_path / "s")
    run.user(30)
    assert run.request()
    pending = run.answer(10, calls=3)
    breaker_set(run)
    run.results(pending, [2500, 2500, 2500], together=True)
    assert run.request()
    assert run.steps == ["archive_all"]
    run.check_restore()


def test_extractive_summary_when_the_breaker_is_set(exact: TokenCounter, template: ChatTemplate,
                                                    tmp_path: Path) -> None:
    """A long agent turn with the breaker set: the extractive summary makes it fit, no model asked."""
    run = Run(8192, exact, template, tmp_path / "s", summarizer="raise")
    run.user(30)
    assert run.request()
    for _ in range(12):
        pending = run.answer(400, calls=1)  # long answers: nothing to archive, much to summarize
        breaker_set(run)
        run.results(pending, [20], together=True)
        assert run.request()
    assert "extractive_summary" in run.steps and "archive_all" not in run.steps
    run.check_restore()


def test_shorter_tail_when_the_configured_tail_leaves_no_room(exact: TokenCounter, template: ChatTemplate,
                                                              tmp_path: Path) -> None:
    """A pasted file (a user message: no archive pass touches it) takes most of the window, with the
    policy's passes off: the summary with the configured tail is still over it, a shorter tail fits."""
    run = Run(8192, exact, template, tmp_path / "s", policy="off")
    for _ in range(4):
        run.user(20)
        assert run.request()
        run.answer(450)
    run.user(4000)
    assert run.request()
    assert run.steps[-1] == "shorter_tail"
    run.check_restore()


def test_oversized_message_archives_another_agents_summary(exact: TokenCounter, template: ChatTemplate,
                                                           tmp_path: Path) -> None:
    """Another agent's summary, bigger than the window, is the turn's request: archived behind a
    head-and-tail marker the model can read back."""
    run = Run(4096, exact, template, tmp_path / "s")
    run.user(6000, imported_summary=True)
    assert run.request()
    assert run.steps == ["oversized_message"]
    view = run.compactor.view
    assert view[-1].text.startswith("[ctxfold archived id=") and " [...] " in view[-1].text
    run.check_restore()


def test_fold_newest_when_the_newest_call_alone_is_too_big(exact: TokenCounter, template: ChatTemplate,
                                                           tmp_path: Path) -> None:
    """The model's newest call (a file it wrote, 60% of the window) and the reserve do not fit
    together with anything else: the call and its result are folded into the summary."""
    run = Run(4096, exact, template, tmp_path / "s")
    run.user(20)
    assert run.request()
    pending = run.answer(5, calls=1, call_words=2600)
    run.results(pending, [10])
    assert run.request(max_reply_tokens=1500)
    assert run.steps[-1] == "fold_newest"
    run.check_restore()


@pytest.mark.parametrize("step", GUARD_STEPS)
def test_without_any_one_step_some_conversation_does_not_fit(step: str, exact: TokenCounter, template: ChatTemplate,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo one step: the conversation that needs it is refused (NoFitError) or sent over the window."""
    from ctxfold.compaction import events

    monkeypatch.setattr(events, "GUARD_STEPS", tuple(s for s in GUARD_STEPS if s != step))
    tests = {
        "archive_all": test_archive_all_makes_a_parallel_group_fit,
        "extractive_summary": test_extractive_summary_when_the_breaker_is_set,
        "shorter_tail": test_shorter_tail_when_the_configured_tail_leaves_no_room,
        "oversized_message": test_oversized_message_archives_another_agents_summary,
        "fold_newest": test_fold_newest_when_the_newest_call_alone_is_too_big,
    }
    with pytest.raises(AssertionError):
        tests[step](exact, template, tmp_path)


# -- where no fit exists ----------------------------------------------------------------------------------

def test_no_fit_is_one_clear_error_before_the_request(exact: TokenCounter, template: ChatTemplate,
                                                      tmp_path: Path) -> None:
    run = Run(2048, exact, template, tmp_path / "s", system_words=3000)
    run.user(10)
    with pytest.raises(NoFitError) as err:
        run.compactor.before_request()
    message = str(err.value)
    assert message.startswith("the request cannot fit the 2,048-token context window: system prompt and tools ")
    assert "reply reserve" in message and err.value.needed_tokens > 2048


def test_a_request_max_tokens_over_the_window_is_no_fit(exact: TokenCounter, template: ChatTemplate,
                                                        tmp_path: Path) -> None:
    run = Run(4096, exact, template, tmp_path / "s")
    run.user(10)
    with pytest.raises(NoFitError, match="reply reserve 5,000"):
        run.compactor.before_request(max_reply_tokens=5000)
    assert run.request(max_reply_tokens=1000)  # the next request asks for less: it goes


# -- the reply reserve --------------------------------------------------------------------------------------

def test_reply_reserve_follows_the_request_and_the_answers(exact: TokenCounter, tmp_path: Path) -> None:
    c = Compactor(Conversation([]), config=CompactConfig.preset("both", context_tokens=32768, max_output_tokens=512),
                  counter=exact)
    assert c.reply_reserve_tokens() == 512
    c.append(Message(Role.USER, "hi", id="u"))
    c.before_request(max_reply_tokens=2000)
    assert c.reply_reserve_tokens() == 2000
    c.expect_reply(None)
    assert c.reply_reserve_tokens() == 512
    long_answer = text_of(3000, 1)
    c.append(Message(Role.ASSISTANT, long_answer, id="a"))  # one long answer
    assert c.reply_reserve_tokens() == exact.count(long_answer)
    c.append(Message(Role.ASSISTANT, text_of(40000, 2), id="b"))  # an outlier: capped at half the window
    assert c.reply_reserve_tokens() == 32768 // 2
    with pytest.raises(ValueError, match="max_tokens must be a whole number"):
        c.expect_reply(-1)


# -- what starts a turn ---------------------------------------------------------------------------------------

def test_another_agents_summary_starts_a_turn_and_feedback_does_not() -> None:
    summary = Message(Role.USER, "This session is being continued from a previous conversation that ran out of "
                      "context. The conversation is summarized below: ...")
    assert is_imported_summary(summary) and summary.is_user_turn and summary.is_summary
    feedback = Message(Role.USER, "Tool call error:\n\n<error>\nNo tool calls found\n</error>")
    assert is_agent_feedback(feedback) and not feedback.is_user_turn
    quoted = Message(Role.USER, "Why did it say 'Tool call error:' there?")
    assert quoted.is_user_turn and not is_agent_feedback(quoted)
    ours = Message(Role.USER, "[ctxfold compacted ...]", summary=True)
    assert ours.is_summary and not ours.is_user_turn and not is_imported_summary(ours)


def test_the_breaker_resets_at_an_imported_summary(exact: TokenCounter, template: ChatTemplate,
                                                   tmp_path: Path) -> None:
    run = Run(8192, exact, template, tmp_path / "s")
    run.user(20)
    assert run.request()
    breaker_set(run)
    run.answer(20)
    run.user(300, imported_summary=True)
    assert run.request()
    assert not run.compactor.state.turn.gave_up
