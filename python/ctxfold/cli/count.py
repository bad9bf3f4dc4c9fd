"""ctxfold count: tokens per message, by role and per request, beside what the provider recorded."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxfold.chat.formats.header import FILLED_IN, SUPPLIED
from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.cli import EXIT_OK
from ctxfold.cli._common import (
    FORMATTER,
    Loaded,
    add_counting_options,
    add_format_option,
    load_counter,
    load_template,
    load_traces,
    table,
    tokens,
    unique_labels,
    warn,
    wrap,
    write_output,
)

EPILOG = """examples:
  ctxfold count session.jsonl                           estimator, by role
  ctxfold count run.traj.json --tokenizer deepseek-v4 --requests
  ctxfold count run.json --tokenizer path/to/tokenizer.json --messages
  ctxfold count airline.json --json counts.json
  ctxfold count session.jsonl --system prompt.txt --tools tools.json

A request is one assistant turn: the prompt the model was sent for it is everything before it.
Where the trace records the provider's usage (prompt_tokens), the predicted prompt tokens are
shown beside it with the difference; with the model's own tokenizer and chat template the two
should agree, and the gap measures how far an estimator or a template-less count is off.

Many traces do not record the system prompt or the tool definitions the agent sent with every
request (Claude Code transcripts record neither); count then says what is missing and how much
of the gap it explains. --system FILE and --tools FILE supply them. mini-swe-agent trajectories
get the bash tool mini-swe-agent 2 sends filled in, and count says so.

exit codes: 0 success, 2 usage error, 3 input error (missing or malformed file),
4 tokenizer unavailable, 5 internal error."""

_ROLES = ("system", "user", "assistant", "tool")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "count", help="count tokens of a trace: per message, by role, per request against the recorded usage",
        description=wrap("Count the tokens of every conversation in a trace file: by role and in total, and for "
        "each model request (each assistant turn) the predicted prompt tokens beside the provider's own "
        "figure where the trace records one."),
        epilog=EPILOG, formatter_class=FORMATTER)
    p.add_argument("file", metavar="FILE", help="a trace file in any format the importers read")
    add_format_option(p)
    add_counting_options(p)
    p.add_argument("--messages", action="store_true", help="also list every message with its tokens")
    p.add_argument("--requests", action="store_true", help="also list every request: predicted and recorded "
                   "prompt tokens")
    p.add_argument("--json", metavar="FILE", help="write everything (per message, by role, per request) as "
                   "JSON; '-' for stdout, which then gets no table")
    return p


@dataclass(slots=True)
class CountReport:
    """Token counts of one conversation, under one counter and template."""

    label: str
    conversation: str
    source: str
    format: str
    fixed_tokens: int  # tokens outside any message: BOS, system prompt, tool definitions, generation prompt
    message_tokens: list[int] = field(default_factory=list)  # per message, as the request renders it
    roles: list[str] = field(default_factory=list)  # per message
    ids: list[str] = field(default_factory=list)  # per message
    previews: list[str] = field(default_factory=list)  # per message: the start of its text, for the listing
    requests: list[tuple[int, int, int | None]] = field(default_factory=list)  # (message index, predicted, recorded)
    # Where the system prompt and the tool definitions came from, each "recorded" (in the trace),
    # "filled in" (the agent's known default), "from FILE" (--system, --tools) or "missing".
    header: dict[str, str] = field(default_factory=dict)
    filled_in: dict[str, str] = field(default_factory=dict)  # what was filled in, and why (for the note)
    tools_called: tuple[str, ...] = ()  # names of the tools the messages call, in order of first call

    @property
    def total_tokens(self) -> int:
        return self.fixed_tokens + sum(self.message_tokens)

    def by_role(self) -> dict[str, dict[str, int]]:
        out = {r: {"messages": 0, "tokens": 0} for r in _ROLES}
        out["system"]["tokens"] = self.fixed_tokens  # the system prompt and the tools travel together
        for role, n in zip(self.roles, self.message_tokens, strict=True):
            out[role]["messages"] += 1
            out[role]["tokens"] += n
        return out

    def compared(self) -> list[tuple[int, int]]:
        return [(p, r) for _, p, r in self.requests if r is not None]

    def to_json(self) -> dict[str, Any]:
        cmp = self.compared()
        return {
            "label": self.label, "conversation": self.conversation, "source": self.source, "format": self.format,
            "fixed_tokens": self.fixed_tokens, "total_tokens": self.total_tokens, "by_role": self.by_role(),
            "messages": [{"index": i, "id": mid, "role": role, "tokens": n} for i, (mid, role, n)
                         in enumerate(zip(self.ids, self.roles, self.message_tokens, strict=True))],
            "requests": [{"index": k, "message_index": i, "predicted_prompt_tokens": p, "recorded_prompt_tokens": r}
                         for k, (i, p, r) in enumerate(self.requests)],
            "recorded_requests": len(cmp),
            "mean_abs_error_pct": _mean_abs_pct(cmp),
            "header": self.header, "tools_called": list(self.tools_called),
        }


def _mean_abs_pct(pairs: Sequence[tuple[int, int]]) -> float | None:
    pairs = [(p, r) for p, r in pairs if r > 0]
    if not pairs:
        return None
    return round(100 * sum(abs(p - r) / r for p, r in pairs) / len(pairs), 3)


def count_conversation(conv: Conversation, counter: Any, template: Any, *, label: str = "",
                       format: str = "") -> CountReport:
    """Counts through the request accounting the compactor uses (so a count and a replay agree). Each
    request's prompt is counted when it is sent; per-message tokens as the final request renders them
    (a message's framing can depend on what follows it)."""
    from ctxfold.tokens.accounting import RequestAccounting

    accounting = RequestAccounting(counter, template)
    accounting.reset(Conversation([], id=conv.id, system=conv.system, tools=conv.tools))
    requests = []
    for i, m in enumerate(conv.messages):
        if m.role is Role.ASSISTANT:
            recorded = m.usage.prompt_tokens if m.usage is not None else None
            requests.append((i, accounting.total_tokens, recorded))
        accounting.append(m)
    return CountReport(
        label=label or conv.id, conversation=conv.id, source=conv.source, format=format,
        fixed_tokens=accounting.fixed_tokens, message_tokens=[int(n) for n in accounting.tokens()],
        roles=[m.role.value for m in conv.messages], ids=[m.id for m in conv.messages],
        previews=[_preview_text(m) for m in conv.messages], requests=requests,
        header=header_status(conv), filled_in=dict(conv.meta.get(FILLED_IN, {})),
        tools_called=tuple(dict.fromkeys(c.name for m in conv.messages for c in m.tool_calls)))


def header_status(conv: Conversation) -> dict[str, str]:
    """Where ``conv``'s system prompt and tool definitions came from (see ``CountReport.header``)."""
    filled, supplied = conv.meta.get(FILLED_IN, {}), conv.meta.get(SUPPLIED, {})
    out = {}
    for part, present in (("system", conv.system is not None), ("tools", bool(conv.tools))):
        if part in supplied:
            out[part] = f"from {supplied[part]}"
        elif part in filled:
            out[part] = "filled in"
        else:
            out[part] = "recorded" if present else "missing"
    return out


# What an agent sends besides the messages, for the note on a trace that lacks it.
_AGENTS = {"claude_code": "Claude Code", "mini_swe_agent": "mini-swe-agent", "openhands": "OpenHands",
           "swe_agent": "SWE-agent", "tau_bench": "tau-bench"}


def _steady(gaps: Sequence[int]) -> bool:
    """True when a conversation's gaps are one fixed cost: they vary by at most 32 tokens or 10%."""
    mid = statistics.median(gaps)
    return max(gaps) - min(gaps) <= max(32, abs(mid) // 10)


def trace_header_notes(convs: Sequence[tuple[str, str, Conversation]], counter: Any, template: Any) -> list[str]:
    """:func:`header_notes` for the conversations (label, format, conversation) whose system prompt or
    tools were filled in or are missing: what replay and compact say before they run, as count does.
    Only those are counted (the gap to the recorded usage needs a count of each request)."""
    incomplete = [(label, fmt, c) for label, fmt, c in convs
                  if c.meta.get(FILLED_IN) or "missing" in header_status(c).values()]
    return header_notes([count_conversation(c, counter, template, label=label, format=fmt)
                         for label, fmt, c in incomplete])


def header_notes(reports: Sequence[CountReport]) -> list[str]:
    """One line for the header parts that were filled in, and one for those the trace lacks, with
    how far the lack explains the gap between the count and the recorded usage."""
    notes: list[str] = []
    filled: dict[str, int] = {}
    for r in reports:
        for part, why in r.filled_in.items():
            key = f"{'tools' if part == 'tools' else 'system prompt'}: {why}"
            filled[key] = filled.get(key, 0) + 1
    for key, n in filled.items():
        option = "--tools" if key.startswith("tools") else "--system"
        many = f" ({n} conversations)" if len(reports) > 1 else ""
        notes.append(f"filled in {key}{many}; {option} FILE gives others")
    # A trace that calls tools sent their definitions; one without a system prompt may have sent none,
    # so that part is named only when the recorded usage says something is missing.
    lacking = []
    for r in reports:
        no_system = r.header.get("system") == "missing"
        no_tools = r.header.get("tools") == "missing" and bool(r.tools_called)
        if no_system or no_tools:
            lacking.append((r, no_system, no_tools))
    if not lacking:
        return notes
    per_conv = [[rec - p for p, rec in r.compared()] for r, _, _ in lacking]
    gaps = [g for conv_gaps in per_conv for g in conv_gaps]
    no_system = any(s for _, s, _ in lacking)
    no_tools = any(t for _, _, t in lacking)
    if not no_tools and (not gaps or statistics.median(gaps) <= 0):
        return notes  # no system prompt, and nothing says one was sent
    called = list(dict.fromkeys(name for r, _, _ in lacking for name in r.tools_called))
    calls = f" (tools called here: {', '.join(called[:4])}{', ...' if len(called) > 4 else ''})" if called else ""
    parts = [*(["system prompt"] if no_system else []), *(["tool definitions"] if no_tools else [])]
    agents = {r.format for r, _, _ in lacking}
    agent = _AGENTS.get(agents.pop()) if len(agents) == 1 else None
    if agent is not None:
        what = f"the trace lacks the {' and '.join(parts)} {agent} sends with every request{calls}"
    else:
        what = f"the trace records no {' and no '.join(parts)}{calls}"
    options = [*(["--system FILE"] if no_system else []), *(["--tools FILE"] if no_tools else [])]
    them = "it" if parts == ["system prompt"] else "them"
    supply = f"{' and '.join(options)} {'supply' if len(options) > 1 else 'supplies'} {them}"
    if not gaps:
        notes.append(f"{what}, so the count leaves {them} out; {supply}")
        return notes
    mid = int(statistics.median(gaps))
    size = {"system prompt": "a system prompt", "tool definitions": "tool definitions"}[parts[0]] \
        if len(parts) == 1 else "a system prompt and tools"
    if mid <= 0:
        how = (f"yet recorded usage is not above the count (median gap {tokens(mid)} tokens), so little or "
               "nothing was left out")
    elif len(gaps) == 1:
        how = f"recorded usage is {tokens(mid)} tokens above the count, about what {size} of that size take"
    elif all(_steady(g) for g in per_conv if g):
        how = (f"recorded usage is {tokens(mid)} tokens above the count (median of {len(gaps)} requests) and "
               f"steady, as {size} of that size would leave it")
    else:
        how = (f"recorded usage is a median {tokens(mid)} tokens above the count, from {tokens(min(gaps))} to "
               f"{tokens(max(gaps))}: what the trace lacks explains a fixed part, at most {tokens(min(gaps))}; "
               "the part that grows with the conversation means the counter or the template is not the model's")
    notes.append(f"{what}; {how}; {supply}")
    return notes


def _preview_text(m: Message) -> str:
    if m.text:
        return m.text[:200]
    if m.tool_calls:
        return f"[{len(m.tool_calls)} tool call(s): {', '.join(c.name for c in m.tool_calls)}]"
    return ""


def _preview(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _diff(p: int, r: int | None) -> tuple[str, str]:
    if r is None:
        return "-", "-"
    pct = f"{100 * (p - r) / r:+.2f}%" if r else "-"
    return f"{p - r:+d}", pct


def render(reports: Sequence[CountReport], counter_name: str, exact: bool, template: str | None,
           messages: bool, requests: bool) -> str:
    out = [f"counter {counter_name} ({'exact' if exact else 'estimate'}), template {template or 'none'}\n"]
    if len(reports) > 1:
        rows = []
        for r in reports:
            roles = r.by_role()
            err = _mean_abs_pct(r.compared())
            rows.append([r.label, len(r.message_tokens), tokens(roles["system"]["tokens"]),
                         tokens(roles["user"]["tokens"]), tokens(roles["assistant"]["tokens"]),
                         tokens(roles["tool"]["tokens"]), r.total_tokens, len(r.requests), len(r.compared()),
                         "-" if err is None else f"{err:.2f}%"])
        tot_cmp = [pr for r in reports for pr in r.compared()]
        err = _mean_abs_pct(tot_cmp)
        total = [f"total ({len(reports)})", sum(len(r.message_tokens) for r in reports),
                 *(tokens(sum(r.by_role()[role]["tokens"] for r in reports)) for role in _ROLES),
                 sum(r.total_tokens for r in reports), sum(len(r.requests) for r in reports), len(tot_cmp),
                 "-" if err is None else f"{err:.2f}%"]
        out.append(table(["conversation", "messages", "system+tools", "user", "assistant", "tool", "total tokens",
                          "requests", "recorded", "mean |error|"], rows, total=total))
        out.extend(f"note: {n}\n" for n in header_notes(reports))
    for r in reports:
        if len(reports) == 1:
            roles = r.by_role()
            out.append(f"{r.label} ({r.format}, {len(r.message_tokens)} messages, {len(r.requests)} requests)\n")
            # The system prompt and tools are the conversation's header, not messages.
            rows = [[role + (" + tools" if role == "system" else ""),
                     "-" if role == "system" else roles[role]["messages"], roles[role]["tokens"]] for role in _ROLES]
            out.append(table(["role", "messages", "tokens"], rows,
                             total=["total", len(r.message_tokens), r.total_tokens]))
            cmp = r.compared()
            if cmp:
                err = _mean_abs_pct(cmp)
                worst = max(cmp, key=lambda pr: abs(pr[0] - pr[1]))
                out.append(f"\npredicted vs recorded prompt tokens: {len(cmp)} of {len(r.requests)} requests "
                           f"recorded; mean |error| {err:.2f}%, largest gap {worst[0] - worst[1]:+d} tokens"
                           f"{'' if requests else ' (--requests lists them)'}\n")
        if messages:
            out.append(f"\n{r.label}: messages\n")
            out.append(table(["#", "role", "id", "tokens", "text"],
                             [[i, role, mid, n, _preview(text)] for i, (mid, role, n, text) in
                              enumerate(zip(r.ids, r.roles, r.message_tokens, r.previews, strict=True))],
                             align="rllrl"))
        if len(reports) == 1:
            out.extend(f"note: {n}\n" for n in header_notes(reports))
        if requests:
            out.append(f"\n{r.label}: requests\n")
            out.append(table(["request", "message", "predicted", "recorded", "diff", "diff %"],
                             [[k, i, p, "-" if rec is None else rec, *_diff(p, rec)]
                              for k, (i, p, rec) in enumerate(r.requests)], align="rrrrrr"))
    return "".join(out)


def run(args: argparse.Namespace) -> int:
    loaded: list[Loaded] = load_traces([args.file], args.format, lenient=args.lenient, warn=warn,
                                     system_file=args.system, tools_file=args.tools)
    counter = load_counter(args.tokenizer)
    template = load_template(args.template)
    convs = [c for f in loaded for c in f.conversations]
    labels = unique_labels(convs)
    reports = [count_conversation(c, counter, template, label=label, format=loaded[0].format)
               for label, c in zip(labels, convs, strict=True)]
    name = str(getattr(counter, "name", args.tokenizer))
    exact = bool(getattr(counter, "exact", False))
    if args.json != "-":
        print(render(reports, name, exact, args.template, args.messages, args.requests), end="")
    if args.json is not None:
        all_cmp = [pr for r in reports for pr in r.compared()]
        doc = {"file": args.file, "tokenizer": name, "exact": exact, "template": args.template,
               "total_tokens": sum(r.total_tokens for r in reports), "requests": sum(len(r.requests) for r in reports),
               "recorded_requests": len(all_cmp), "mean_abs_error_pct": _mean_abs_pct(all_cmp),
               "notes": header_notes(reports), "conversations": [r.to_json() for r in reports]}
        write_output(args.json, json.dumps(doc, indent=1) + "\n")
    return EXIT_OK
