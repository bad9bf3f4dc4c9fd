"""ctxfold's LangChain middleware beside LangChain's own SummarizationMiddleware, on every shared trace.

    python bench/bench_langchain.py [--ctx 8192,16384,32768] [--json build/bench/langchain.json]

Each recorded conversation is played as an agent loop would run it (one model call per recorded assistant
message; the recorded answer joins the agent's state after it), through both middlewares' message
transformations, in the same run, at each window:

- ``CtxfoldMiddleware.compact_messages`` (what its ``wrap_model_call`` sends the model), the policy "both",
  the estimate counter (``estimate:deepseek-v4``), the reply reserve of the replay tests
  (``replay.default_reply_reserve``);
- ``SummarizationMiddleware.before_model`` (the state rewrite it applies before the model node) with its
  own defaults (``count_tokens_approximately``, the 4000-token trim of what it summarizes) and
  ``trigger=("tokens", window - reply reserve - system prompt and tools)``: it summarizes as late as its
  own count allows. Three times: with its default ``keep=("messages", 20)``; with ``keep=("tokens",
  window // 10)``, the verbatim tail ctxfold keeps (``tail.fraction``); and the same counting with the
  judge's counter instead of its own (``token_counter=``), so that its decisions and the judgement agree.

Both write their summaries with one deterministic fake chat model (``SummaryModel``: 150 words drawn from a
digest of the prompt; tests/helpers/langchain_helpers.py), so neither waits on a model and the summaries are the same
size. Every request either sends is counted by one counter, the same for both (the estimate counter with the
default template: system prompt, tools and messages, read_archive always counted among ctxfold's tools):
over the window when that count plus the reply reserve exceeds the window. Orphaned tool results:
``integrity.count_orphans`` over each request. Tokens summarized: for each summary, the request's tokens
before it minus after it (ctxfold: its events' figures; LangChain: the state counted before and after, by the
same counter). Time per call: the middleware's own time for one model call (the fake summaries included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from langchain.agents.middleware import SummarizationMiddleware
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage
from langchain_core.messages.utils import count_tokens_approximately
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from ctxfold.chat.formats import load
from ctxfold.chat.integrity import count_orphans
from ctxfold.chat.messages import Conversation, Message, ToolSpec
from ctxfold.compaction.config import CompactConfig
from ctxfold.integrations.langchain import CtxfoldMiddleware, from_ctxfold, to_ctxfold, tool_spec
from ctxfold.replay import default_reply_reserve
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import load_counter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.langchain_helpers import SummaryModel  # the tests' fake models: one definition

WINDOWS = (8192, 16384, 32768)
COUNTER = "estimate:deepseek-v4"
# The SummarizationMiddleware settings compared, by label: its keep= at a window, and whether it counts
# with the judge's counter (else its default, count_tokens_approximately).
KEEPS: dict[str, tuple[Callable[[int], Any], bool]] = {
    'SummarizationMiddleware keep=("messages", 20)': (lambda window: ("messages", 20), False),
    'SummarizationMiddleware keep=("tokens", window/10)': (lambda window: ("tokens", window // 10), False),
    'SummarizationMiddleware keep=("tokens", window/10), ctxfold\'s counter':
        (lambda window: ("tokens", window // 10), True),
}


@dataclass(slots=True)
class Row:
    """One middleware at one window, over every conversation."""

    window_tokens: int
    middleware: str  # "ctxfold", or SummarizationMiddleware and its keep setting
    conversations: int = 0
    requests: int = 0
    over_window: int = 0  # requests whose count plus the reply reserve exceeds the window
    orphans: int = 0  # tool results without their call, summed over every request
    summaries: int = 0
    tokens_summarized: int = 0
    passed_through: int = 0  # ctxfold only: requests sent uncompacted (input it could not read)
    seconds_per_call: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(self.seconds_per_call) if self.seconds_per_call else 0.0

    @property
    def p95_ms(self) -> float:
        s = sorted(self.seconds_per_call)
        return 1000 * s[min(len(s) - 1, int(0.95 * len(s)))] if s else 0.0


def conversations(traces_dir: Path) -> list[Conversation]:
    return [c for path in sorted(traces_dir.rglob("*")) if path.is_file()
            and path.suffix in (".json", ".jsonl", ".traj") for c in load(path)]


def as_langchain(conv: Conversation) -> list[BaseMessage]:
    """The recording as an agent's state would hold it: one LangChain message each, ids made unique."""
    out = []
    for i, m in enumerate(conv.messages):
        lc = from_ctxfold(m)
        kwargs: dict[str, Any] = {"reasoning_content": m.reasoning} if m.reasoning else {}
        out.append(lc.model_copy(update={"id": f"m{i}", "additional_kwargs": kwargs}))
    return out


def openai_tools(specs: Iterable[ToolSpec]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": dict(t.parameters) or {"type": "object"}}}
            for t in specs]


class Judge:
    """Counts every request of both middlewares the same way (one counter, one template)."""

    def __init__(self, conv: Conversation, window_tokens: int, reserve_tokens: int,
                 recall: Sequence[ToolSpec]) -> None:
        self.window_tokens = window_tokens
        self.reserve_tokens = reserve_tokens
        self.accounting = RequestAccounting(load_counter(COUNTER), None)
        self.headers = {False: Conversation([], system=conv.system, tools=conv.tools),
                        True: Conversation([], system=conv.system, tools=(*conv.tools, *recall))}

    def tokens(self, who: str, messages: Sequence[BaseMessage]) -> tuple[int, list[Message]]:
        view = [to_ctxfold(m, i) for i, m in enumerate(messages)]
        return self.accounting.count_view(self.headers[who == "ctxfold"], view), view

    def judge(self, row: Row, messages: Sequence[BaseMessage]) -> None:
        tokens, view = self.tokens(row.middleware, messages)
        row.requests += 1
        row.over_window += tokens + self.reserve_tokens > self.window_tokens
        row.orphans += count_orphans(view)


def play(conv: Conversation, window_tokens: int, ours: Row, theirs: Sequence[Row]) -> None:
    """One conversation through ctxfold's middleware and each SummarizationMiddleware at one window."""
    counter = load_counter(COUNTER)
    reserve = default_reply_reserve(conv, counter.count, window_tokens)
    config = CompactConfig.preset("both", context_tokens=window_tokens, reply_reserve_tokens=reserve)
    mw = CtxfoldMiddleware(config=config, counter=counter, summarizer=SummaryModel())
    system = SystemMessage(conv.system) if conv.system else None
    tools = openai_tools(conv.tools)
    judge = Judge(conv, window_tokens, reserve, [tool_spec(t) for t in mw.recall_tools])
    header_tokens = judge.tokens("", [])[0]  # system prompt and tools, by the judge's counter

    def same_count(messages: Iterable[Any]) -> int:
        return judge.tokens("", list(messages))[0] - header_tokens

    sms = []
    for row in theirs:
        keep, same_counter = KEEPS[row.middleware]
        fixed = header_tokens if same_counter else count_tokens_approximately([system] if system else [], tools=tools)
        sms.append(SummarizationMiddleware(SummaryModel(), trigger=("tokens", max(1, window_tokens - reserve - fixed)),
                                           keep=keep(window_tokens),
                                           token_counter=same_count if same_counter else count_tokens_approximately))
    ours_state: list[BaseMessage] = []
    states: list[list[BaseMessage]] = [[] for _ in theirs]
    for m in as_langchain(conv):
        if isinstance(m, AIMessage):
            t0 = time.perf_counter()
            sent = mw.compact_messages(ours_state, system=system, tools=tools, thread_id=conv.id or "c")
            ours.seconds_per_call.append(time.perf_counter() - t0)
            judge.judge(ours, sent)

            for sm, row, k in zip(sms, theirs, range(len(sms)), strict=True):
                t0 = time.perf_counter()
                update = sm.before_model({"messages": states[k]}, None)  # type: ignore[arg-type]
                row.seconds_per_call.append(time.perf_counter() - t0)
                if update is not None:
                    before = judge.tokens(row.middleware, states[k])[0]
                    rewritten = update["messages"]
                    assert getattr(rewritten[0], "id", None) == REMOVE_ALL_MESSAGES
                    states[k] = list(rewritten[1:])
                    row.summaries += 1
                    row.tokens_summarized += before - judge.tokens(row.middleware, states[k])[0]
                judge.judge(row, states[k])
        ours_state.append(m)
        for state in states:
            state.append(m)
    new = mw.events
    ours.summaries += sum(e.applied and e.kind == "summary" for e in new)
    ours.tokens_summarized += sum(e.tokens_before - e.tokens_after for e in new if e.applied and e.kind == "summary")
    ours.passed_through += sum(mw.passed_through.values())
    for row in (ours, *theirs):
        row.conversations += 1
    mw.close()


def side_by_side(traces_dir: Path, windows: Sequence[int] = WINDOWS) -> list[Row]:
    convs = [c for c in conversations(traces_dir) if any(m.role.value == "assistant" for m in c.messages)]
    rows = []
    for window in windows:
        ours, theirs = Row(window, "ctxfold"), [Row(window, label) for label in KEEPS]
        for conv in convs:
            play(conv, window, ours, theirs)
        rows += [ours, *theirs]
    return rows


def table(rows: Sequence[Row]) -> str:
    head = ("| window | middleware | conversations | requests | over the window | orphaned tool results | summaries "
            "| tokens summarized | median ms/call | p95 ms/call |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [f"| {r.window_tokens // 1024}k | {r.middleware} | {r.conversations} | {r.requests} | {r.over_window} | "
             f"{r.orphans} | {r.summaries} | {r.tokens_summarized:,} | {r.median_ms:.2f} | {r.p95_ms:.2f} |"
             for r in rows]
    return "\n".join([head, *lines])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--traces", type=Path, default=Path(__file__).resolve().parent.parent.parent / "shared" / "traces")
    ap.add_argument("--ctx", default=",".join(map(str, WINDOWS)), help="windows in tokens, comma-separated")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    if not args.traces.is_dir():
        print(f"bench_langchain: no traces at {args.traces} (pass --traces)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = side_by_side(args.traces, [int(x) for x in args.ctx.split(",")])
    print(table(rows))
    print(f"\n{time.perf_counter() - t0:.0f} s in all", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{**asdict(r), "seconds_per_call": None, "median_ms": r.median_ms,
                                          "p95_ms": r.p95_ms} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
