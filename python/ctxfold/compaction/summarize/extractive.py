"""The deterministic extractive summary: no model, built from the conversation itself.

It is the default summarizer and the fallback of every other one, so compaction never deadlocks: it must not
fail on any input, and it must be fast (a 2,000-message conversation in milliseconds). What it keeps follows
the summary contract, as far as rules can find it:

- earlier summaries (repeated compactions keep their lineage);
- the user's goals: the real user turns, trimmed (the first one, the task statement, gets the most room);
- the files the agent changed, with the last change to each (:mod:`ctxfold.compaction.trail`), sized first;
- files inspected (paths in tool-call arguments and shell commands), then files mentioned in outputs;
- commands run with their exit codes (mini-swe-agent ``<returncode>``, OpenHands ``exit code``, ...) and
  other tool calls with the head of their result;
- errors seen (the exception line of a traceback, ``error:`` lines, failed exit codes);
- recent assistant notes, and what is pending (calls without results, an unanswered user turn).

The text is fitted to the token cap: every section gets a share, unused shares go to the others, and each
section keeps its most important items (goals: first and latest; commands and errors: most recent).
Large outputs are scanned only at their head and tail (where exit codes, errors and paths are), which is what
keeps the cost linear in the number of messages rather than in the bytes of tool output.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxfold.chat.messages import Message, Role, ToolCall
from ctxfold.compaction.summarize.base import (
    SummaryResult,
    TokenCallback,
    TokenCounter,
    count_tokens,
    failed,
    no_room,
)
from ctxfold.compaction.summarize.postprocess import (
    TRAIL_MAX_TOKENS,
    append_section,
    trail_section,
    trim_to_tokens,
)
from ctxfold.compaction.summarize.request import (
    INTERNAL_KEY,
    SUMMARY_TEXT_KEY,
    SummaryRequest,
    build_summary_request,
)
from ctxfold.compaction.trail import TRAIL_TITLE, artifact_trail, parse_trail

_HEADER_OPENING = "Summary of the earlier conversation ("  # this module's own summaries start so
_SCAN_CHARS = 2000  # chars scanned at each end of a large text
_GOAL_FIRST_CHARS = 1500  # the first user turn is usually the task statement
_GOAL_CHARS = 400
_NOTE_CHARS = 300
_CMD_CHARS = 200
_ERROR_CHARS = 200
_RESULT_HEAD_CHARS = 120
_MAX_MENTIONED = 30

_EXT = (
    "py|pyi|pyx|c|h|cc|cpp|hpp|cxx|cu|rs|go|java|kt|js|jsx|mjs|ts|tsx|rb|php|cs|swift|scala|lua|pl|r|jl|sh|"
    "bash|zsh|ps1|md|rst|txt|json|jsonl|yaml|yml|toml|ini|cfg|conf|xml|html|css|scss|sql|proto|lock|csv|tsv|"
    "ipynb|gradle|cmake|mk|tf|env|log|diff|patch"
)
# Paths: find the extensions (a regex that starts with a literal, which the engine scans for quickly), then
# walk back over path characters. A path regex tried at every position cost ten times more on real outputs,
# and an unbounded `[\w.]+` in it backtracked quadratically over long word runs (base64 blobs).
_EXT_RE = re.compile(rf"(?:\.(?:{_EXT})|Makefile|Dockerfile)(?![\w\-/])")
_PATH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./@+-~")
_MAX_PATH_CHARS = 512


def _find_paths(text: str) -> list[str]:
    out = []
    for m in _EXT_RE.finditer(text):
        start = m.start()
        floor = max(0, start - _MAX_PATH_CHARS)
        while start > floor and (text[start - 1] in _PATH_CHARS or text[start - 1].isalnum()):
            start -= 1
        tok = text[start:m.end()]
        if tok.startswith("//"):  # the rest of a URL ("https://host/a.html")
            continue
        stem = tok[: len(tok) - len(m.group())]
        if m.group()[0] == "." and (not stem or stem[-1] in "/." or stem.strip("./") == ""):
            continue  # ".py" alone, "dir/.py", "...py": an extension without a name
        out.append(tok)
    return out


# Each exit-code pattern with a literal that must be present: a substring test in C skips the regex for the
# great majority of outputs (the scan of 2,000 real messages went from ~45 ms of regex work to a few ms).
_EXIT_RES = (
    ("<returncode>", re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")),
    ("[command finished", re.compile(r"\[Command finished with exit code (-?\d+)\]")),
    ("exit", re.compile(r"\bexit(?:ed)?(?: with)?[ _](?:code|status)[\s:=]*(-?\d+)", re.IGNORECASE)),
    ('"exit_code"', re.compile(r'"exit_code"\s*:\s*(-?\d+)')),
)
# Error lines are found with str.find on the lowered text (C speed): an alternation regex over these tried at
# every position cost ~65 us per 4 KB scan, the largest part of a summary.
_ERROR_HINTS = ("error:", "error]", "failed", "fatal:", "command not found", "no such file or directory",
                "permission denied", "traceback (most recent call last)", "panicked at", "segmentation fault")
_EXC_WORDS = ("Error", "Exception", "Exit", "Interrupt")
_EXC_LINE_RE = re.compile(r"\s{0,32}(?:[\w.]{1,128}\.)?\w{0,64}(?:Error|Exception|Exit|Interrupt)\b(?::|$)")
# User messages that are client chatter, not goals (Claude Code's interrupt notes and local slash commands).
_NOT_A_GOAL_RE = re.compile(r"\s*(?:\[Request interrupted by user|<local-command-|<command-name>|<command-message>)")
_OBSERVATION_RE = re.compile(r"^\s*(?:<returncode>|OBSERVATION:|Observation:|\[Command finished|EXECUTION RESULT)")
_FENCE_RE = re.compile(r"```(bash|sh|shell|console)?[ \t]*\n(.*?)```", re.DOTALL)
_WS_RE = re.compile(r"\s+")

_SHELL_TOOLS = frozenset({
    "bash", "shell", "sh", "execute_bash", "run", "terminal", "execute_command", "run_command", "cmd", "exec",
    "execute", "run_shell_command", "shell_exec", "run_terminal_cmd", "bash_tool", "local_shell",
})
_EDITOR_COMMANDS = frozenset({"create", "str_replace", "insert", "undo_edit", "write", "edit", "append", "view"})
_PATH_KEYS = ("path", "file_path", "filepath", "filename", "file", "target_file", "notebook_path", "dir",
              "directory")
_PATH_LIST_KEYS = ("paths", "files", "file_paths")
_CMD_KEYS = ("command", "cmd", "script", "code")

def _one_line(text: str, limit: int) -> str:
    s = _WS_RE.sub(" ", text[: 4 * limit + 64]).strip()  # only what can be shown is normalised
    return s if len(s) <= limit else s[: max(0, limit - 1)].rstrip() + "…"


def _ends(text: str) -> str:
    """Head and tail of a large text: where exit codes, errors and the paths that matter are."""
    if len(text) <= 2 * _SCAN_CHARS:
        return text
    return text[:_SCAN_CHARS] + "\n" + text[-_SCAN_CHARS:]


def _might_be_error(lowered: str) -> bool:
    return any(h in lowered for h in _ERROR_HINTS)


def _exit_code(text: str, lowered: str) -> int | None:
    for literal, rx in _EXIT_RES:
        if literal not in lowered:
            continue
        m = rx.search(text)
        if m is not None:
            try:
                return int(m.group(1))
            except ValueError:
                return None
    return None


def _error_line(text: str) -> str | None:
    """The most telling error line: the exception line of a traceback (last), else the first error line."""
    tail = text[-_SCAN_CHARS * 2:]
    if any(w in tail for w in _EXC_WORDS):
        for line in reversed(tail.splitlines()):
            if _EXC_LINE_RE.match(line):
                return line.strip()
    scan = _ends(text)
    lowered = scan.lower()
    hits = [k for k in (lowered.find(h) for h in _ERROR_HINTS) if k >= 0]
    if not hits:
        return None
    at = min(hits)
    start = scan.rfind("\n", 0, at) + 1
    end = scan.find("\n", at)
    found = scan[start:end if end >= 0 else len(scan)].strip()
    if len(found) < 24 and end >= 0:  # "ERROR:" alone: the message is on the next line
        found += " " + next((x.strip() for x in scan[end + 1:].splitlines() if x.strip()), "")
    return found.strip()


def _parsed_args(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments) if call.arguments else {}
    except (ValueError, RecursionError):
        return call.arguments


def _str_field(args: Any, keys: Sequence[str]) -> str | None:
    if isinstance(args, dict):
        for k in keys:
            v = args.get(k)
            if isinstance(v, str) and v.strip():
                return v
    return None


@dataclass(slots=True)
class _Facts:
    goals: list[str] = field(default_factory=list)
    earlier: list[str] = field(default_factory=list)
    inspected: dict[str, int] = field(default_factory=dict)  # path -> last message index
    mentioned: Counter[str] = field(default_factory=Counter)
    commands: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)


def _is_observation(m: Message) -> bool:
    return m.role is Role.USER and bool(_OBSERVATION_RE.match(m.text[:200]))


def _carry(summary: str, f: _Facts) -> None:
    """Carry an earlier summary into the facts of the next one.

    A summary in this module's own format is merged section by section (its goals before the new
    goals, so the task statement stays first; its files, commands and errors before the new ones),
    so repeated compactions keep the durable state without nesting summaries inside summaries.
    Stale notes and pending steps are dropped: the conversation since has superseded them. Any other
    summary (a model's prose, headings or not) is kept whole, but for its trail section (the trail reads it)."""
    if (at := summary.find(f"## {TRAIL_TITLE}")) >= 0:
        summary = summary[:at]
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in summary.strip().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip().lower(), [])
        elif line.startswith("- ") and current is not None:
            current.append(line[2:].strip())
    if not sections or not summary.startswith(_HEADER_OPENING):
        if summary.strip():  # the acknowledgement that pairs a summary (Compactor) carries nothing
            f.earlier.append(summary.strip())
        return
    f.earlier.extend(sections.get("earlier summary", ()))
    f.goals.extend(sections.get("user goals and constraints", ()))
    for item in sections.get("files", ()):
        kind, _, path = item.partition(": ")
        if kind == "inspected":
            f.inspected.setdefault(path, -1)
        elif path:
            f.mentioned[path] += 1
    f.commands.extend(sections.get("commands and tool calls (most recent last)", ()))
    f.errors.extend(sections.get("errors seen", ()))


def _collect(messages: Sequence[Message]) -> _Facts:
    f = _Facts()
    calls: dict[str, tuple[str, int]] = {}  # call id -> (rendered call, index into f.commands)
    waiting: OrderedDict[str, None] = OrderedDict()  # ids of calls without a result, oldest first
    last_text_command: int | None = None  # f.commands index of a fenced command awaiting its observation

    for i, m in enumerate(messages):
        if m.extra.get(INTERNAL_KEY):
            continue
        text = m.text
        if m.is_summary:  # ctxfold's own, or another agent's: durable state, carried as it is
            inner = m.extra.get(SUMMARY_TEXT_KEY)
            _carry(inner if isinstance(inner, str) else text, f)
            continue
        if m.role is Role.USER and not _is_observation(m):
            if m.is_user_turn and text.strip() and not _NOT_A_GOAL_RE.match(text):
                f.goals.append(text.strip())
            continue
        if m.role is Role.SYSTEM:
            continue
        if m.role is Role.ASSISTANT:
            fenced = _note_assistant(f, m, i, calls, waiting)
            if fenced is not None:
                last_text_command = fenced
            continue
        # A tool result, or a user message that is an observation.
        _note_observation(f, m, calls, waiting, last_text_command)
        last_text_command = None

    _note_pending(f, messages, calls, waiting)
    return f


def _note_assistant(f: _Facts, m: Message, i: int, calls: dict[str, tuple[str, int]],
                    waiting: OrderedDict[str, None]) -> int | None:
    """An assistant message's note and calls, as ``_collect`` keeps them; the ``f.commands`` index of a
    fenced shell command it wrote (a text-based agent's), which awaits its observation, or None."""
    text = m.text
    if text.strip():
        f.notes.append(text.strip())
    for c in m.tool_calls:
        rendered = _note_call(f, c, i)
        f.commands.append(rendered)
        calls[c.id] = (rendered, len(f.commands) - 1)
        waiting[c.id] = None
    if not m.tool_calls and text:
        # Text-based agents (mini-swe-agent, SWE-agent without function calling): a fenced shell block.
        blocks = _FENCE_RE.findall(_ends(text))
        if blocks:
            cmd = blocks[-1][1].strip()
            if cmd:
                f.commands.append(f"`{_one_line(cmd, _CMD_CHARS)}`")
                fenced = len(f.commands) - 1
                _note_shell_paths(f, cmd, i)
                return fenced
    return None


def _note_observation(f: _Facts, m: Message, calls: dict[str, tuple[str, int]], waiting: OrderedDict[str, None],
                      last_text_command: int | None) -> None:
    """A tool result (or a user message that is an observation): its exit code or first line joins the
    command it answers, its error line the errors, the paths it names the mentioned ones."""
    text = m.text
    scan = _ends(text)
    lowered = scan.lower()
    code = _exit_code(scan, lowered)
    err = _error_line(text) if (m.is_error or (code is not None and code != 0) or
                                _might_be_error(lowered)) else None
    slot: int | None = None
    if m.role is Role.TOOL:
        cid = m.tool_call_id
        if cid not in waiting:
            # No usable id (some recorders drop it): pair with the oldest call still waiting.
            cid = next(iter(waiting), None)
        if cid is not None:
            del waiting[cid]
            slot = calls[cid][1]
    elif m.role is Role.USER and last_text_command is not None:
        slot = last_text_command
    if slot is not None:
        if code is not None:
            f.commands[slot] += f" -> exit {code}"
        elif f.commands[slot].startswith("`"):
            pass  # a command without a visible exit code
        else:
            head = _one_line(text, _RESULT_HEAD_CHARS)
            if head:
                f.commands[slot] += f" -> {head}"
        if m.is_error and code is None:
            f.commands[slot] += " (error)"
    if err is not None or m.is_error:
        who = f"{m.name}: " if m.name else ""
        line = err if err is not None else _one_line(text, _ERROR_CHARS)
        f.errors.append(who + _one_line(line, _ERROR_CHARS))
    for p in _find_paths(scan):
        f.mentioned[p] += 1


def _note_pending(f: _Facts, messages: Sequence[Message], calls: dict[str, tuple[str, int]],
                  waiting: OrderedDict[str, None]) -> None:
    """Pending: calls without results, an unanswered user turn, the last assistant intent."""
    for cid in waiting:
        f.pending.append(f"call without a result yet: {calls[cid][0]}")
    last = next((m for m in reversed(messages) if not m.extra.get(INTERNAL_KEY)), None)
    if last is not None:
        if last.is_user_turn and not _is_observation(last) and last.text.strip() and not _NOT_A_GOAL_RE.match(
                last.text):
            f.pending.append("unanswered user message: " + _one_line(last.text, _GOAL_CHARS))
        last_assistant = next((m for m in reversed(messages) if m.role is Role.ASSISTANT and m.text.strip()), None)
        if last_assistant is not None:
            f.pending.append("last assistant note: " + _one_line(last_assistant.text, _NOTE_CHARS))


def _note_call(f: _Facts, c: ToolCall, i: int) -> str:
    args = _parsed_args(c)
    name = c.name or "tool"
    lname = name.lower()
    cmd = _str_field(args, _CMD_KEYS)
    path = _str_field(args, _PATH_KEYS)
    paths = [path] if path else []
    if isinstance(args, dict):
        for k in _PATH_LIST_KEYS:
            v = args.get(k)
            if isinstance(v, list):
                paths.extend(x for x in v if isinstance(x, str))
    sub = cmd if cmd in _EDITOR_COMMANDS else None  # str_replace_editor's "command"
    for p in paths:  # the ones it changed are the trail's (and leave the inspected list there)
        f.inspected[p.strip()] = i
    if cmd is not None and sub is None and (lname in _SHELL_TOOLS or not paths):
        _note_shell_paths(f, cmd, i)
        return f"`{_one_line(cmd, _CMD_CHARS)}`"
    if sub is not None:
        return f"{name} {sub} {paths[0] if paths else ''}".rstrip()
    shown = c.arguments if isinstance(args, str) else json.dumps(args, ensure_ascii=False, sort_keys=True)
    return f"{name}({_one_line(shown, _CMD_CHARS - len(name))})"


def _note_shell_paths(f: _Facts, cmd: str, i: int) -> None:
    # A heredoc can carry a whole file: the paths that matter are at its start.
    f.inspected.update(dict.fromkeys(_find_paths(cmd[: _SCAN_CHARS * 2]), i))


# ------------------------------------------------------------------------------------------------------
# Fitting the sections to the budget.


@dataclass(slots=True)
class _Section:
    title: str
    items: list[str]  # in display order
    order: list[int]  # indices into items, most important first
    weight: float  # share of the budget


def _recent_first(n: int) -> list[int]:
    return list(range(n - 1, -1, -1))


def _first_then_recent(n: int) -> list[int]:
    return ([0] if n else []) + list(range(n - 1, 0, -1))


def _sections(f: _Facts, changed: set[str]) -> list[_Section]:
    # Unique: a carried summary and the transcript after it can both hold a goal (the summary also
    # covered the verbatim tail it was kept with).
    goals = [_one_line(g, _GOAL_FIRST_CHARS if k == 0 else _GOAL_CHARS) for k, g in enumerate(dict.fromkeys(f.goals))]
    earlier = [e if len(e) <= 4000 else e[:4000] + " …" for e in f.earlier]
    files: list[str] = []
    inspected = sorted((p for p in f.inspected if p not in changed), key=lambda p: -f.inspected[p])
    known = changed | set(f.inspected)
    mentioned = [p for p, _ in f.mentioned.most_common() if p not in known][:_MAX_MENTIONED]
    files += [f"inspected: {p}" for p in inspected]
    files += [f"mentioned in output: {p}" for p in mentioned]
    commands = _dedupe_runs(f.commands)
    errors = list(dict.fromkeys(f.errors))  # unique, first occurrence order
    notes = [_one_line(n, _NOTE_CHARS) for n in f.notes[-3:]]
    return [
        _Section("Earlier summary", earlier, _recent_first(len(earlier)), 0.20),
        _Section("User goals and constraints", goals, _first_then_recent(len(goals)), 0.25),
        _Section("Files", files, list(range(len(files))), 0.10),
        _Section("Commands and tool calls (most recent last)", commands, _recent_first(len(commands)), 0.20),
        _Section("Errors seen", errors, _recent_first(len(errors)), 0.10),
        _Section("Recent assistant notes", notes, _recent_first(len(notes)), 0.07),
        _Section("Pending / next steps", f.pending, list(range(len(f.pending))), 0.08),
    ]


def _dedupe_runs(items: list[str]) -> list[str]:
    out: list[str] = []
    for s in items:
        if out and (out[-1] == s or out[-1].startswith(s + " (x")):
            last = out[-1]
            n = int(last.rsplit("(x", 1)[1].rstrip(")")) + 1 if last.endswith(")") and " (x" in last else 2
            out[-1] = f"{s} (x{n})"
        else:
            out.append(s)
    return out


def _render(sections: list[_Section], budget_chars: int, header: str) -> tuple[str, int]:
    """The fitted text, and how many items the budget left out or shortened."""
    omitted = 0
    need = [sum(len(s.items[i]) + 3 for i in s.order) + len(s.title) + 6 if s.items else 0 for s in sections]
    body_budget = max(0, budget_chars - len(header))
    alloc = [0] * len(sections)
    remaining = body_budget
    active = [k for k, n in enumerate(need) if n > 0]
    # Water-filling: each active section gets its weighted share; what a section does not need goes back.
    while remaining > 0 and active:
        total_w = sum(sections[k].weight for k in active)
        give = {k: int(remaining * sections[k].weight / total_w) for k in active}
        if all(v == 0 for v in give.values()):
            break
        remaining = 0
        still = []
        for k in active:
            alloc[k] += give[k]
            if alloc[k] >= need[k]:
                remaining += alloc[k] - need[k]
                alloc[k] = need[k]
            else:
                still.append(k)
        active = still
    out = [header]
    for s, a in zip(sections, alloc, strict=True):
        if not s.items or a <= len(s.title) + 6:
            omitted += len(s.items)
            continue
        room = a - len(s.title) - 6
        keep: set[int] = set()
        for i in s.order:
            cost = len(s.items[i]) + 3
            if cost <= room:
                keep.add(i)
                room -= cost
            elif room > 40 and not keep:  # one item truncated beats an empty section
                keep.add(i)
                s.items[i] = s.items[i][: room - 4] + " …"
                room = 0
                omitted += 1
        dropped = len(s.items) - len(keep)
        omitted += dropped
        if not keep:
            continue
        out.append(f"\n## {s.title}")
        out.extend(f"- {s.items[i]}" for i in sorted(keep))
        if dropped:
            out.append(f"- ({dropped} more omitted)")
    return "\n".join(out).strip() + "\n", omitted


def extractive_summary(messages: Sequence[Message], max_tokens: int, *, counter: TokenCounter | None = None,
                       trail_max_tokens: int = TRAIL_MAX_TOKENS) -> str:
    """The extractive summary of ``messages`` in at most ``max_tokens`` tokens (``counter``, else chars/4), its
    trail section in at most min(``trail_max_tokens``, ``max_tokens`` / 4). Never raises on message content:
    the rules only read text. The result may be shorter than the cap; it is never longer."""
    return _extract(messages, max_tokens, counter, trail_max_tokens)[0]


def _extract(messages: Sequence[Message], max_tokens: int, counter: TokenCounter | None,
             trail_max_tokens: int = TRAIL_MAX_TOKENS) -> tuple[str, bool]:
    """The summary, and whether the cap made it leave something out."""
    if max_tokens < 1:
        return "", True
    header = f"{_HEADER_OPENING}{len(messages)} messages), extracted without a model."
    facts = _collect(messages)
    trail = artifact_trail(messages)
    # The trail is sized first: it is what every other summary loses, and the rest fits around it.
    section = trail_section(trail, min(trail_max_tokens, max_tokens // 4), counter)
    body_tokens = max_tokens - (count_tokens(counter, section) + 1 if section else 0)
    budget_chars = body_tokens * 4  # chars/4 is the first guess; a real counter corrects it below
    for _ in range(4):
        text, omitted = _render(_sections(facts, {c.path for c in trail}), budget_chars, header)
        n = count_tokens(counter, text)
        if n <= body_tokens:
            break
        budget_chars = int(budget_chars * body_tokens / n * 0.95)
    else:
        text, omitted = trim_to_tokens(text, body_tokens, counter), 1
    joined, cut = append_section(text, section, max_tokens, counter)
    return joined, omitted > 0 or cut or len(parse_trail(section)) < len(trail)


def safe_extractive_summary(messages: Sequence[Message], max_tokens: int, *, counter: TokenCounter | None = None,
                            trail_max_tokens: int = TRAIL_MAX_TOKENS) -> tuple[str, bool]:
    """:func:`extractive_summary`, and if a rule ever trips on input nobody foresaw, a minimal summary (the
    user turns) instead of an exception: this is the last line of the fallback chain."""
    try:
        return _extract(messages, max_tokens, counter, trail_max_tokens)
    except Exception:  # noqa: BLE001 - the fallback of the fallback must not raise
        goals = [_one_line(m.text, _GOAL_CHARS) for m in messages if m.role is Role.USER and isinstance(m.text, str)]
        text = f"Summary of the earlier conversation ({len(messages)} messages).\n" + "\n".join(
            f"- user: {g}" for g in goals[-20:])
        return trim_to_tokens(text, max_tokens, counter), True


class ExtractiveSummarizer:
    """The summarizer without a model. Stateless and thread-safe; ``on_token`` gets the whole text at once."""

    def __init__(self, *, counter: TokenCounter | None = None, trail_max_tokens: int = TRAIL_MAX_TOKENS) -> None:
        self._counter = counter
        self._trail_max_tokens = trail_max_tokens

    @property
    def name(self) -> str:
        return "extractive"

    def summarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        del timeout_s  # milliseconds of work: a deadline cannot pass in the middle of it
        return self._run(request, on_token, cancel)

    async def asummarize(
        self,
        request: SummaryRequest,
        *,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | asyncio.Event | None = None,
        timeout_s: float | None = None,
    ) -> SummaryResult:
        del timeout_s
        return self._run(request, on_token, cancel)

    def summarize_messages(self, messages: Sequence[Message], max_tokens: int) -> SummaryResult:
        """The same without a request object (the fallback path uses it)."""
        t0 = time.perf_counter()
        text, capped = safe_extractive_summary(messages, max_tokens, counter=self._counter,
                                               trail_max_tokens=self._trail_max_tokens)
        return self._result(text, capped, t0, build_summary_request(messages, cap_tokens=max(1, max_tokens)))

    def _run(self, request: SummaryRequest, on_token: TokenCallback | None,
             cancel: threading.Event | asyncio.Event | None) -> SummaryResult:
        t0 = time.perf_counter()
        if cancel is not None and cancel.is_set():
            return failed(self.name, "cancelled", 0.0)
        if (refused := no_room(self.name, request)) is not None:
            return refused
        text, capped = safe_extractive_summary(request.transcript, request.max_tokens, counter=self._counter,
                                               trail_max_tokens=self._trail_max_tokens)
        result = self._result(text, capped, t0, request)
        if result.ok and on_token is not None:
            on_token(result.text)
        return result

    def _result(self, text: str, capped: bool, t0: float, request: SummaryRequest) -> SummaryResult:
        n = count_tokens(self._counter, text)
        if not text.strip():
            return failed(self.name, "no room left for a summary", time.perf_counter() - t0)
        # Marked as cut by the cap (or the room) when fitting it left facts out; "none" when all of them fit.
        return SummaryResult(text=text, ok=True, failure=None,
                             cut_reason=request.limit_reason if capped else "none", num_tokens=n,
                             seconds=time.perf_counter() - t0, summarizer=self.name,
                             detail=f"{n} of {request.max_tokens} tokens")
