"""What a compaction costs (ctxfold.compaction.cost): the model on hand-computed cases, the figures on the
events, replay's JSON and flags, the engine's figures, and the minimum-gain rule, which never lets a
request leave over the window (the guard's property, with the rule drawn on and at its most patient)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_window_guard import Run, conversations, words

from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig, CostConfig
from ctxfold.compaction.cost import (
    DEFAULT_HORIZON_REQUESTS,
    MAX_AUTO_HORIZON_REQUESTS,
    CompactionCost,
    PriceTable,
    RequestTokens,
    horizon_requests,
    page_down,
    request_before,
    summary_prompt,
)
from ctxfold.compaction.policy import Policy
from ctxfold.compaction.summarize import CallableSummarizer, SummaryRequest
from ctxfold.engine import EngineSequence, SegmentKind
from ctxfold.errors import ConfigError
from ctxfold.replay import replay_conversation
from ctxfold.tokens.counting import TokenCounter, load_counter
from ctxfold.tokens.templates import ChatTemplate, get_template
from helpers.cli_helpers import one_error_line, run_main

PRICES = PriceTable(input_per_mtok=1.0, cached_input_per_mtok=0.1, cache_write_per_mtok=1.25, output_per_mtok=4.0)
CASE = CompactionCost(before=RequestTokens(1000, 100), after=RequestTokens(200, 500), summary_prompt_tokens=1000,
                      summary_cached_tokens=960, summary_output_tokens=100, summary_model_call=True,
                      horizon_requests=5)


# -- the model, by hand -------------------------------------------------------------------------------------


def test_token_figures_by_hand() -> None:
    # Four later requests each read 1100 - 700 = 400 cached tokens fewer.
    assert CASE.saving_tokens == 4 * 400
    # The rewrite writes 500 where the next request would have written 100; the summary 40 uncached.
    assert CASE.cache_tokens_written == 400 + 40
    assert CASE.before.total_tokens == 1100 and CASE.after.total_tokens == 700


def test_money_by_hand() -> None:
    assert CASE.before.price(PRICES) == pytest.approx((1000 * 0.1 + 100 * 1.25) / 1e6)  # 225e-6
    assert CASE.after.price(PRICES) == pytest.approx((200 * 0.1 + 500 * 1.25) / 1e6)  # 645e-6
    assert CASE.summary_price(PRICES) == pytest.approx((960 * 0.1 + 40 * 1.0 + 100 * 4.0) / 1e6)  # 536e-6
    assert CASE.invalidated(PRICES) == pytest.approx((645 - 225 + 536) / 1e6)
    assert CASE.saving(PRICES) == pytest.approx(1600 * 0.1 / 1e6)
    money = CASE.money(PRICES)
    assert money["net"] == pytest.approx((160 - 956) / 1e6)
    assert CASE.to_json(PRICES)["money"] == money
    assert CASE.to_json()["saving_tokens"] == 1600 and "money" not in CASE.to_json()


def test_a_view_that_grew_saves_nothing() -> None:
    grew = replace(CASE, after=RequestTokens(1000, 300))
    assert grew.saving_tokens == 0
    one = replace(CASE, horizon_requests=1)
    assert one.saving_tokens == 0  # the horizon is the rewrite's own request: nothing later to save on


def test_horizon() -> None:
    fixed = CostConfig(horizon_requests=7)
    auto = CostConfig()
    assert horizon_requests(fixed, after_tokens=0, line_tokens=5000, growth_tokens=1) == 7
    assert horizon_requests(auto, after_tokens=1000, line_tokens=5000, growth_tokens=300) == 14  # ceil(4000 / 300)
    assert horizon_requests(auto, after_tokens=1000, line_tokens=5000, growth_tokens=0) == MAX_AUTO_HORIZON_REQUESTS
    assert horizon_requests(auto, after_tokens=1000, line_tokens=5000, growth_tokens=1) == MAX_AUTO_HORIZON_REQUESTS
    assert horizon_requests(auto, after_tokens=6000, line_tokens=5000, growth_tokens=300) == 1
    assert horizon_requests(auto, after_tokens=1000, line_tokens=None, growth_tokens=300) == DEFAULT_HORIZON_REQUESTS


def test_page_down() -> None:
    assert [page_down(n, 16) for n in (0, 15, 16, 33)] == [0, 0, 16, 32]


def test_the_rule_by_hand() -> None:
    policy = Policy(CompactConfig(context_tokens=10_000))
    # The default weights (input 1, cached 0.1, write 1, output 4): CASE invalidates 520 - 200 + 536 = 856
    # units a million and saves 4 * 400 * 0.1 = 160; over 100 requests it would save 99 * 40 = 3960.
    worth = replace(CASE, horizon_requests=100)
    assert policy.min_gain_waits(CASE, 8000, 10_000, growth_tokens=500)
    assert not policy.min_gain_waits(worth, 8000, 10_000, growth_tokens=500)
    assert not policy.min_gain_waits(CASE, 9600, 10_000, growth_tokens=500)  # the next request would not fit
    off = Policy(CompactConfig(context_tokens=10_000, cost=CostConfig(min_gain=False)))
    assert not off.min_gain_waits(CASE, 8000, 10_000, growth_tokens=500)


# -- prices -----------------------------------------------------------------------------------------------


def test_price_table_from_text_and_files(tmp_path: Path) -> None:
    t = PriceTable.parse("input=3,cached=0.3,write=3.75,output=15")
    assert (t.input_per_mtok, t.cached_input_per_mtok, t.cache_write_per_mtok, t.output_per_mtok) == (3, 0.3, 3.75, 15)
    assert t.currency == "USD"
    plain = PriceTable.parse("input=2, output=8, currency=EUR")
    assert plain.cached_input_per_mtok == plain.cache_write_per_mtok == 2 and plain.currency == "EUR"
    (tmp_path / "p.json").write_text(json.dumps({"input": 3, "cached": 0.3, "output": 15}))
    assert PriceTable.load(tmp_path / "p.json").cached_input_per_mtok == 0.3
    (tmp_path / "p.toml").write_text("[prices]\ninput = 1\noutput = 2\nwrite = 1.25\n")
    assert PriceTable.load(tmp_path / "p.toml").cache_write_per_mtok == 1.25
    assert PriceTable.from_config(CostConfig()).cache_write_per_mtok == 1.0  # none given: the input price


@pytest.mark.parametrize(("spec", "fragment"), [
    ("input=x,output=1", "input='x' is not a number"),
    ("inptu=1,output=1", "unknown price 'inptu'"),
    ("input=1", "missing price: output"),
    ("input=-1,output=1", "-1.0 is not a price"),
    ("input=1,output=nan", "nan is not a price"),
    ("input 1", "'input 1' is not KEY=PRICE"),
])
def test_bad_price_text(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        PriceTable.parse(spec)


@pytest.mark.parametrize(("argv", "fragment"), [
    (("--price", "input=3,cachd=0.3,output=15"), "--price input=3,cachd=0.3,output=15: unknown price 'cachd'"),
    (("--price", "input=three,output=15"), "--price input=three,output=15: input='three' is not a number"),
    (("--prices", "/no/such/prices.json"), "--prices /no/such/prices.json: cannot read the price file"),
    (("--prices", ""), "--prices '': an empty path; give a JSON or TOML price file"),
    (("--price", "input=1,output=1", "--prices", "x.json"), "give --prices FILE or --price"),
])
def test_bad_price_flag_is_one_line_naming_the_flag(argv: tuple[str, ...], fragment: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "replay", "--demo", "--quiet", *argv)
    assert code == 2
    line = one_error_line(err)
    assert fragment in line, line


def test_bad_price_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.json"
    bad.write_text('{"input": 3}')
    code, _, err = run_main(capsys, "replay", "--demo", "--quiet", "--prices", str(bad))
    assert code == 2
    assert f"--prices {bad}: missing price: output" in one_error_line(err)


# -- on a compactor's events ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def estimate_counter() -> TokenCounter:
    return load_counter("estimate:deepseek-v4")


@pytest.fixture(scope="module")
def exact() -> TokenCounter:
    return load_counter("deepseek-v4")


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return get_template("deepseek-v3.2")


def model_summarizer() -> CallableSummarizer:
    def generate(request: SummaryRequest) -> Iterable[str]:
        return iter(["The task so far: the engine keeps pages; the tests pass.\n"])
    return CallableSummarizer(generate, name="model")


def conversation(turns: int) -> Conversation:
    msgs: list[Message] = []
    for t in range(turns):
        msgs.append(Message(Role.USER, f"turn {t}: " + "please look at the cache pages again " * 40, id=f"u{t}"))
        msgs.append(Message(Role.ASSISTANT, f"answer {t}: " + "the prefill of the token pages " * 40, id=f"a{t}"))
    return Conversation(msgs, id="cost", system="You are a careful agent. " * 20)


def test_an_applied_summary_carries_its_cost(estimate_counter: TokenCounter) -> None:
    cfg = CompactConfig(context_tokens=100_000, cost=CostConfig(horizon_requests=4))
    c = Compactor(conversation(12), config=cfg, counter=estimate_counter, summarizer=model_summarizer(),
                  page_size_tokens=16)
    c.append(Message(Role.USER, "and now the next step", id="next"))
    acc = c.accounting
    unseen = c.state.unseen_start()
    seen = acc.prefix_tokens + int(acc.tokens()[:unseen].sum())
    before = request_before(c)
    assert before.cached_tokens == seen - seen % 16
    assert before.total_tokens == acc.total_tokens
    # The summary request over view[:unseen] shares all of it that is in whole pages with the last request.
    prompt, cached = summary_prompt(c, unseen, 30)
    assert (prompt, cached) == (seen + 30, seen - seen % 16)
    event = c.compact_now()
    assert event.applied and event.cost is not None and event.kv is not None
    cost = event.cost
    assert cost.before == before
    assert (cost.after.cached_tokens, cost.after.written_tokens) == (event.kv.tokens_reused, event.kv.tokens_to_prefill)
    assert cost.summary_model_call and cost.summary_output_tokens > 0
    assert cost.summary_cached_tokens == seen - seen % 16 and cost.summary_prompt_tokens > seen
    assert cost.horizon_requests == 4
    assert cost.saving_tokens == 3 * (cost.before.total_tokens - cost.after.total_tokens) > 0


def test_the_extractive_summary_asks_no_model(estimate_counter: TokenCounter) -> None:
    c = Compactor(conversation(12), config=CompactConfig(context_tokens=100_000), counter=estimate_counter)
    event = c.compact_now()
    assert event.cost is not None and not event.cost.summary_model_call
    assert event.cost.summary_prompt_tokens == event.cost.summary_output_tokens == 0


def test_the_rule_waits_and_the_guard_does_not(estimate_counter: TokenCounter) -> None:
    """At its most patient (a horizon of one request saves nothing), the rule puts every automatic summary
    off while the next request fits, and the conversation still never leaves over the window."""
    conv = conversation(40)
    base = CompactConfig(context_tokens=8192, cost=CostConfig(horizon_requests=1))
    off = replace(base, cost=CostConfig(min_gain=False))
    on_report = replay_conversation(conv, config=base, counter=estimate_counter)
    off_report = replay_conversation(conv, config=off, counter=estimate_counter)
    assert on_report.min_gain_waits > 0 and off_report.min_gain_waits == 0
    assert on_report.overflows == off_report.overflows == 0
    assert sum(on_report.compactions.values()) <= sum(off_report.compactions.values())


# -- replay's JSON -----------------------------------------------------------------------------------------------


def test_replay_json_has_the_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code, stdout, _ = run_main(capsys, "replay", "--demo", "--quiet", "--ctx", "8k", "--json", str(out),
                               "--price", "input=3,cached=0.3,write=3.75,output=15")
    assert code == 0
    assert "cache-written" in stdout and "saving" in stdout
    doc = json.loads(out.read_text())
    assert doc["settings"]["prices"]["currency"] == "USD" and doc["settings"]["min_gain"] is True
    total = doc["total"]
    for key in ("cache_tokens_written", "saving_tokens", "summary_prompt_tokens", "min_gain_waits"):
        assert isinstance(total[key], int)
    assert set(total["money"]) == {"currency", "invalidated", "saving", "net"}
    conv = doc["conversations"][0]
    summaries = [e for e in conv["events"] if e["kind"] == "summary" and e["applied"]]
    assert summaries, "the demo at 8k compacts"
    figures = summaries[0]["cost"]
    assert figures["after_cached_tokens"] == summaries[0]["kv_tokens_reused"]
    assert figures["after_written_tokens"] == summaries[0]["kv_tokens_prefilled"]
    assert figures["money"]["currency"] == "USD"
    assert conv["cache_tokens_written"] == sum(e["cost"]["cache_tokens_written"] for e in summaries)


# -- the engine ---------------------------------------------------------------------------------------------


def test_engine_sequence_cost_by_hand() -> None:
    seq = EngineSequence("s", context_tokens=4096, page_size_tokens=16,
                         config=CompactConfig(context_tokens=4096, cost=CostConfig(horizon_requests=3)))
    seq.append(np.arange(100, dtype=np.int32), SegmentKind.SYSTEM)
    for k in range(10):
        seq.append(np.full(200, 1000 + k, dtype=np.int32), SegmentKind.USER if k % 2 == 0 else SegmentKind.ASSISTANT)
    bottom = seq.num_tokens  # 2100
    rebuild = seq.rebuild(np.full(50, 7, dtype=np.int32), bottom=bottom, tail=seq.tail(400, bottom=bottom))
    cost = seq.compaction_cost(rebuild, bottom=bottom, instruction_tokens=20)
    assert cost.before == RequestTokens(2100, 0)  # the engine's cache holds the whole old buffer
    assert cost.after == RequestTokens(rebuild.kv.reuse_tokens, rebuild.kv.prefill_tokens)
    assert cost.after.total_tokens == len(rebuild.ids)
    assert (cost.summary_prompt_tokens, cost.summary_cached_tokens, cost.summary_output_tokens) == (2120, 2100, 50)
    assert cost.saving_tokens == 2 * (2100 - len(rebuild.ids))
    with pytest.raises(IndexError):
        seq.compaction_cost(rebuild, bottom=5000)


# -- the property: the rule never lets a request leave over the window ------------------------------------------


class CostRun(Run):
    """The guard's property run, with the cost section given."""

    def __init__(self, *args: Any, cost: CostConfig, **kwargs: Any) -> None:
        self.cost = cost
        super().__init__(*args, **kwargs)

    def _open(self) -> Compactor:
        self.config = replace(self.config, cost=self.cost)
        return super()._open()


def play(plan: dict[str, Any], cost: CostConfig, exact: TokenCounter, template: ChatTemplate, session_dir: Path,
         ctx: int) -> str | None:
    """test_window_guard's property run of ``plan`` (every request counted exactly, by an accountant of its
    own, and asserted within the window) with ``cost``; the guard's "please report" NoFitError when the
    cascade found no fit where one may exist (a gap of the guard, not of the rule), else None."""
    policy = plan["policy"] if plan["policy"] != "off" else "both"
    run = CostRun(ctx, exact, template, session_dir, policy=policy, summarizer=plan["summarizer"],
                  system_words=min(60, ctx // 40), cost=cost)
    try:
        for turn in plan["turns"]:
            size = turn["size"] if turn["kind"] != "plain" else min(turn["size"], 0.05)
            run.user(words(size, ctx), imported_summary=turn["kind"] == "imported_summary")
            for step in turn["steps"]:
                if not run.request():
                    return None
                pending = run.answer(words(step["answer"], ctx), calls=step["calls"],
                                     call_words=words(step["call"], ctx))
                run.results(pending, [words(w, ctx) for w in step["results"]], together=step["together"])
                if not run.request(tuple(words(w, ctx) for w in step["queued"])):
                    return None
                run.answer(words(0.005, ctx))
            if not run.request():
                return None
            run.answer(words(turn["final"], ctx))
    except AssertionError as exc:
        if "please report" in str(exc):
            return str(exc).split("\n")[0]
        raise
    assert run.unfittable == 0
    return None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan=conversations(), horizon=st.sampled_from([0, 1, 2, 50]))
def test_the_rule_never_lets_a_request_over_the_window(plan: dict[str, Any], horizon: int, exact: TokenCounter,
                                                        template: ChatTemplate, tmp_path_factory: Any) -> None:
    """With the rule on (a horizon of 1 saves nothing, so it waits wherever it may), no request leaves over
    the window; where the guard's cascade finds no fit, it finds none with the rule off either."""
    ctx = min(plan["ctx"], 8192)  # the small windows, where the rule and the guard meet
    gap = play(plan, CostConfig(min_gain=True, horizon_requests=horizon), exact, template,
               tmp_path_factory.mktemp("s") / "session", ctx)
    if gap is not None:
        without = play(plan, CostConfig(min_gain=False), exact, template, tmp_path_factory.mktemp("s") / "session", ctx)
        assert without is not None, f"only with the rule: {gap}"


def test_queued_messages_the_cascade_cannot_fit_are_refused_plainly(exact: TokenCounter, template: ChatTemplate,
                                                                     tmp_path: Path) -> None:
    """Found by the property test above: after queued messages at a 2k window with a 1k reply reserve, the
    messages a mid-turn rewrite keeps ahead of the summary and the new queued ones leave no fit once the
    steps have run, and the guard said "please report". It measures the smallest request again after the
    steps and refuses plainly, naming the parts (the run counts it as unfittable, not over the window)."""
    z: dict[str, Any] = {"calls": 1, "answer": 0.0, "call": 0.0, "results": [0.0], "queued": [], "together": False}
    steps = [z, {**z, "calls": 4, "answer": 0.5, "results": [0.0] * 4}, z, {**z, "queued": [0.0, 0.0625]},
             {**z, "queued": [0.0625, 0.0625]}]
    plan = {"policy": "both", "summarizer": None,
            "turns": [{"kind": "plain", "size": 0.0, "final": 0.0, "steps": steps}]}
    assert play(plan, CostConfig(min_gain=False), exact, template, tmp_path / "s", 2048) is None
