"""ctxfold count: tokens per message, by role and per request, beside what the provider recorded."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
from ctxfold.messages import Conversation, Message, Role

EPILOG = """examples:
  ctxfold count session.jsonl                           estimator, by role
  ctxfold count run.traj.json --tokenizer deepseek-v4 --requests
  ctxfold count run.json --tokenizer path/to/tokenizer.json --messages
  ctxfold count airline.json --json counts.json

A request is one assistant turn: the prompt the model was sent for it is everything before it.
Where the trace records the provider's usage (prompt_tokens), the predicted prompt tokens are
shown beside it with the difference; with the model's own tokenizer and chat template the two
should agree, and the gap measures how far an estimator or a template-less count is off.

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
    from ctxfold.accounting import RequestAccounting

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
        previews=[_preview_text(m) for m in conv.messages], requests=requests)


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
        if requests:
            out.append(f"\n{r.label}: requests\n")
            out.append(table(["request", "message", "predicted", "recorded", "diff", "diff %"],
                             [[k, i, p, "-" if rec is None else rec, *_diff(p, rec)]
                              for k, (i, p, rec) in enumerate(r.requests)], align="rrrrrr"))
    return "".join(out)


def run(args: argparse.Namespace) -> int:
    loaded: list[Loaded] = load_traces([args.file], args.format, lenient=args.lenient, warn=warn)
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
               "conversations": [r.to_json() for r in reports]}
        write_output(args.json, json.dumps(doc, indent=1) + "\n")
    return EXIT_OK
