"""The artifact trail: which files the agent created, changed or deleted, and the last change to each.

Every compaction method loses this first (Factory's probe evaluation scored the artifact trail lowest of six
dimensions for every method it tried, at most 2.45 of 5), and it is the one thing a summary can get exactly
without a model: the edits are in the tool calls. This module reads them; the summarizers carry the result
(:mod:`ctxfold.compaction.summarize.postprocess`).

What counts as a change, by the shapes the shared traces record:
- editor tools with a sub-command (``str_replace_editor`` of SWE-agent and OpenHands, Anthropic's text
  editor): ``create``, ``str_replace``, ``insert``, ``undo_edit``, ``write``, ``edit``, ``append``;
- Claude Code's ``Edit``, ``Write``, ``MultiEdit``, ``NotebookEdit``; Codex's ``apply_patch`` envelope;
- SWE-agent's ``create``/``edit``/``insert`` on the file ``open`` or ``create`` made current (function calls,
  or commands in a fenced block for the text-based agent);
- shell commands (any shell tool, or a fenced shell block of mini-swe-agent): ``>``/``>>`` redirects, ``tee``,
  ``sed -i``, ``rm``, ``mv``, ``cp``, ``touch``, ``mkdir``, ``git apply``/``patch`` with the diff inline or
  written by an earlier heredoc;
- any other tool whose name says it writes (write, edit, create, delete, ...) and whose arguments name a path.
An editor call whose result is an error changed nothing and is skipped. What a script writes (``python
fix.py``) cannot be seen and is not guessed. Paths are kept as the agent wrote them.

Pure: a message list in, a list out; no I/O, no clock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from ctxfold.chat.messages import CTXFOLD_SUMMARY_KEY, Message, Role, ToolCall

Kind = Literal["created", "written", "changed", "deleted"]

TRAIL_TITLE = "Files changed (newest first)"
CHANGE_CHARS = 160  # the last change, on one line, at most this long
_PATH_CHARS = 300  # a longer "path" is not one (a heredoc body caught by mistake)

_EDITOR_COMMANDS: dict[str, Kind] = {
    "create": "created", "str_replace": "changed", "insert": "changed", "undo_edit": "changed",
    "write": "written", "edit": "changed", "append": "changed",
}
_PATH_KEYS = ("path", "file_path", "filepath", "filename", "file", "target_file", "notebook_path")
_WRITE_WORDS: tuple[tuple[str, Kind], ...] = (
    ("delete", "deleted"), ("remove", "deleted"), ("create", "created"), ("write", "written"),
    ("edit", "changed"), ("replace", "changed"), ("patch", "changed"), ("insert", "changed"),
    ("append", "changed"), ("rename", "changed"), ("move", "changed"),
)
_SWE_AGENT_COMMANDS = frozenset({"open", "create", "edit", "insert", "goto", "scroll_up", "scroll_down",
                                 "search_file", "search_dir", "find_file", "submit", "str_replace_editor"})
_FENCE_RE = re.compile(r"```([\w-]*)[ \t]*\n(.*?)```", re.DOTALL)
_HEREDOC_RE = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][\w.-]*)\1")
_DIFF_TARGET_RE = re.compile(r"^\+\+\+ (?:b/)?(\S+)", re.MULTILINE)
_DIFF_SOURCE_RE = re.compile(r"^--- (?:a/)?(\S+)\n\+\+\+ /dev/null", re.MULTILINE)
_CODEX_PATCH_RE = re.compile(r"^\*\*\* (Add|Update|Delete) File: (.+)$|^\*\*\* Move to: (.+)$", re.MULTILINE)
_CODEX_KINDS: dict[str, Kind] = {"Add": "created", "Update": "changed", "Delete": "deleted"}
# What a command that writes must hold: a redirect that is not to a descriptor or /dev/null, or a verb that
# writes. One search at C speed: most commands (ls, grep, pytest 2>&1) stop here.
_WRITE_HINT_RE = re.compile(r">>?(?![&>])(?!\s*/dev/null)|\b(?:rm|touch|mkdir|tee|mv|cp|sed|patch|git|apply_patch)\b")
_WORD_RE = re.compile(r"""(?:'[^']*'|"(?:\\.|[^"\\])*"|\\.|[^\s'"<>&|;\\])+|[<>&|;]+""")
_QUOTED_RE = re.compile(r"""'([^']*)'|"((?:\\.|[^"\\])*)"|\\(.)""", re.DOTALL)
_ESCAPED_RE = re.compile(r"\\(.)", re.DOTALL)
_SEPARATOR_RE = re.compile(r"""'[^']*'|"(?:\\.|[^"\\])*"|\\.|[<>]&|&>|(&&|\|\||[;|&\n])""", re.DOTALL)
_REDIRECTS = frozenset({">", ">>", ">|", "&>", "&>>"})
_NOT_FILES = ("/dev/", "&")
_ERROR_OPENINGS = ("ERROR", "Error:", "error:", "<tool_use_error>")
_LINE_RE = re.compile(r"^- (.+) \((created|written|changed|deleted)\): (.*)$")


@dataclass(frozen=True, slots=True)
class FileChange:
    """One file of the trail: its state and the last change made to it."""

    path: str  # as the agent wrote it
    kind: Kind  # created (new), written (whole file, may have existed), changed (edited), deleted
    change: str  # the last change, one line of at most CHANGE_CHARS ("str_replace: ...", "`sed -i ...`")
    index: int  # message index of the last change (a carried entry: its summary's index)


@dataclass(slots=True)
class _Reader:
    """What reading the calls in order needs to remember."""

    open_file: str | None = None  # SWE-agent's current file (``open``/``create``), which ``edit`` changes
    written: dict[str, str] = field(default_factory=dict)  # path -> heredoc body (a patch applied later)


def one_line(text: str, limit: int = CHANGE_CHARS) -> str:
    s = " ".join(text[: 4 * limit + 64].split())
    return s if len(s) <= limit else s[: max(0, limit - 1)].rstrip() + "…"


def artifact_trail(messages: Sequence[Message], *, max_files: int | None = None) -> list[FileChange]:
    """The files changed in ``messages``, newest change first, each path once, at most ``max_files``.

    An earlier compaction summary contributes the trail section it carries (at its own position, so
    repeated compactions keep the files changed before the first one)."""
    failed = _failed_call_ids(messages)
    reader = _Reader()
    ops: list[tuple[int, str, Kind, str]] = []  # (index, path, kind, change), oldest first
    for i, m in enumerate(messages):
        if m.role is Role.USER and m.is_summary:
            inner = m.extra.get(CTXFOLD_SUMMARY_KEY)
            carried = parse_trail(inner if isinstance(inner, str) else m.text)
            ops.extend((i, e.path, e.kind, e.change) for e in reversed(carried))
        elif m.role is Role.ASSISTANT:
            for c in m.tool_calls:
                ops.extend((i, p, k, ch) for p, k, ch in _call_changes(c, reader, refused=c.id in failed))
            if not m.tool_calls and "```" in m.text:
                blocks = _FENCE_RE.findall(m.text)
                if blocks:  # a text-based agent runs the last block of its answer
                    ops.extend((i, p, k, ch) for p, k, ch in _text_command_changes(blocks[-1][1], reader))
    return _fold(ops, max_files)


def _fold(ops: list[tuple[int, str, Kind, str]], max_files: int | None) -> list[FileChange]:
    last: dict[str, FileChange] = {}
    for index, path, kind, change in ops:
        prev = last.pop(path, None)  # popped: re-inserted at the end, so dict order is change order
        if prev is not None and kind in ("changed", "written") and prev.kind == "created":
            kind = "created"  # still a file the agent made
        last[path] = FileChange(path, kind, change, index)
    trail = list(reversed(last.values()))
    return trail if max_files is None else trail[:max(0, max_files)]


def _failed_call_ids(messages: Sequence[Message]) -> set[str]:
    """Ids of calls whose result reports an error (an editor that refused changed nothing)."""
    out = set()
    for m in messages:
        if m.role is Role.TOOL and m.tool_call_id and (m.is_error or m.text[:64].lstrip().startswith(_ERROR_OPENINGS)):
            out.add(m.tool_call_id)
    return out


def _lines(body: str) -> str:
    n = len(body.splitlines())
    return "1 line" if n == 1 else f"{n} lines"


def _args(call: ToolCall) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments) if call.arguments else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _text(args: dict[str, Any], *keys: str) -> str | None:
    for k in keys:
        v = args.get(k)
        if isinstance(v, str) and v.strip():
            return v
    return None


def _quoted(text: str | None, limit: int) -> str:
    return '""' if text is None else json.dumps(one_line(text, limit), ensure_ascii=False)


def _replacement(old: str | None, new: str | None) -> str:
    return f"{_quoted(old, 50)} -> {_quoted(new, 70)}"


def _call_changes(call: ToolCall, reader: _Reader, *, refused: bool) -> list[tuple[str, Kind, str]]:
    """The files one call changed. ``refused``: its result is an error, which from an editor means nothing
    changed; a shell command's error says nothing about what it wrote before it failed."""
    args = _args(call)
    name = call.name or ""
    lname = name.lower()
    path = _text(args, *_PATH_KEYS)
    sub = args.get("command")
    cmd = _text(args, "command", "cmd", "script")
    shell = cmd is not None and not path and cmd not in (*_EDITOR_COMMANDS, "view")
    if refused and not shell:
        return []
    if isinstance(sub, str) and sub in (*_EDITOR_COMMANDS, "view") and path:
        return _editor_changes(name, sub, path, args)
    if name in ("Edit", "MultiEdit", "Write", "NotebookEdit") and path:
        return [(path, *_claude_change(name, args))]
    if lname == "apply_patch":
        return _codex_patch(_text(args, "input", "patch", "command") or "")
    if lname in ("open", "create", "edit", "insert") and "command" not in args:
        return _swe_agent_call(lname, args, reader)
    if shell and cmd is not None:
        return shell_changes(cmd, reader)
    if path:
        for word, kind in _WRITE_WORDS:
            if word in lname:
                return [(path, kind, one_line(f"{name} {path}"))]
    return []


def _editor_changes(name: str, sub: str, path: str, args: dict[str, Any]) -> list[tuple[str, Kind, str]]:
    if sub == "view":
        return []
    if sub == "create":
        body = _text(args, "file_text", "content") or ""
        return [(path, "created", f"{name} create ({_lines(body)})")]
    if sub == "str_replace":
        return [(path, "changed", one_line(f"{name} str_replace: "
                                           f"{_replacement(_text(args, 'old_str'), _text(args, 'new_str'))}"))]
    if sub == "insert":
        at = args.get("insert_line")
        return [(path, "changed", one_line(f"{name} insert at line {at}: {_quoted(_text(args, 'new_str'), 100)}"))]
    return [(path, _EDITOR_COMMANDS[sub], f"{name} {sub}")]


def _claude_change(name: str, args: dict[str, Any]) -> tuple[Kind, str]:
    if name == "Write":
        body = _text(args, "content") or ""
        return "written", f"Write ({_lines(body)})"
    if name == "Edit":
        return "changed", one_line(f"Edit: {_replacement(_text(args, 'old_string'), _text(args, 'new_string'))}")
    if name == "MultiEdit":
        edits = [e for e in args.get("edits") or () if isinstance(e, dict)]
        last = edits[-1] if edits else {}
        return "changed", one_line(f"MultiEdit ({len(edits)} edits), last: "
                                   f"{_replacement(_text(last, 'old_string'), _text(last, 'new_string'))}")
    mode = args.get("edit_mode") or "replace"
    return "changed", one_line(f"NotebookEdit {mode} cell {args.get('cell_id') or ''}".rstrip())


def _codex_patch(patch: str) -> list[tuple[str, Kind, str]]:
    out: list[tuple[str, Kind, str]] = []
    for m in _CODEX_PATCH_RE.finditer(patch):
        if m.group(3):
            out.append((m.group(3).strip(), "written", "apply_patch (moved here)"))
        else:
            out.append((m.group(2).strip(), _CODEX_KINDS[m.group(1)], f"apply_patch {m.group(1).lower()}"))
    return out


def _swe_agent_call(name: str, args: dict[str, Any], reader: _Reader) -> list[tuple[str, Kind, str]]:
    path = _text(args, *_PATH_KEYS)
    if name == "open":
        reader.open_file = path or reader.open_file
        return []
    if name == "create":
        if path is None:
            return []
        reader.open_file = path
        return [(path, "created", "create")]
    if reader.open_file is None:
        return []
    if name == "edit":
        return [(reader.open_file, "changed",
                 one_line(f"edit: {_replacement(_text(args, 'search'), _text(args, 'replace'))}"))]
    return [(reader.open_file, "changed", one_line(f"insert: {_quoted(_text(args, 'text'), 100)}"))]


def _text_command_changes(block: str, reader: _Reader) -> list[tuple[str, Kind, str]]:
    """A fenced block of a text-based agent: a SWE-agent command, else shell."""
    first, _, rest = block.strip().partition("\n")
    words = first.split()
    if not words or words[0] not in _SWE_AGENT_COMMANDS:
        return shell_changes(block, reader)
    verb, target = words[0], (words[1] if len(words) > 1 else None)
    if verb == "open" and target:
        reader.open_file = target.strip("\"'")
    elif verb == "create" and target:
        reader.open_file = target.strip("\"'")
        return [(reader.open_file, "created", "create")]
    elif verb == "edit" and reader.open_file is not None:
        lines = [ln for ln in rest.splitlines() if ln.strip() and ln.strip() != "end_of_edit"]
        return [(reader.open_file, "changed",
                 one_line(f"edit {target or ''}: {_quoted(lines[0] if lines else None, 100)}"))]
    elif verb == "str_replace_editor" and len(words) >= 3 and words[1] in _EDITOR_COMMANDS:
        return [(words[2], _EDITOR_COMMANDS[words[1]], one_line(first))]
    return []


# ----------------------------------------------------------------------------------------------------------
# Shell commands.


def shell_changes(command: str, reader: _Reader | None = None) -> list[tuple[str, Kind, str]]:
    """The files a shell command writes, in order: (path, kind, the simple command that wrote it)."""
    if not _WRITE_HINT_RE.search(command):
        return []
    reader = reader if reader is not None else _Reader()
    out: list[tuple[str, Kind, str]] = []
    for segment, body in _simple_commands(command):
        out.extend(_segment_changes(segment, body, reader))
    return out


def _simple_commands(command: str) -> list[tuple[str, str]]:
    """The simple commands of a script as written, split at unquoted ``&&``, ``||``, ``;``, ``|``, ``&`` and
    newlines, each with the heredoc body it reads ("" if none): a body is data, not commands, and a quoted
    string may span lines. The separators are found by one regular expression that steps over quoted
    strings (a loop over characters cost more than the rest of the trail)."""
    out: list[tuple[str, str]] = []
    start = line_start = pos = 0
    while (m := _SEPARATOR_RE.search(command, pos)) is not None:
        pos = m.end()
        if m.group(1) is None:
            continue  # a quoted string, an escape or a redirect to a descriptor
        if command[start:m.start()].strip():
            out.append((command[start:m.start()].strip(), ""))
        if m.group(1) == "\n":
            pos = _skip_heredocs(command, line_start, m.start(), out)
            line_start = pos
        start = pos
    if command[start:].strip():
        out.append((command[start:].strip(), ""))
    _skip_heredocs(command, line_start, len(command), out)
    return out


def _skip_heredocs(command: str, line_start: int, newline: int, out: list[tuple[str, str]]) -> int:
    """After the line ``command[line_start:newline]``: the bodies of its heredocs, given to the last command
    of that line that reads one; the index where the next line starts."""
    k = newline + 1
    bodies: list[str] = []
    for m in _HEREDOC_RE.finditer(command, line_start, newline):
        end = k
        while end < len(command):
            stop = command.find("\n", end)
            stop = len(command) if stop < 0 else stop
            if command[end:stop].strip() == m.group(2):
                bodies.append(command[k:end])
                k = stop + 1
                break
            end = stop + 1
        else:
            bodies.append(command[k:])
            k = len(command)
    if bodies:
        for j in range(len(out) - 1, -1, -1):
            if "<<" in out[j][0]:
                out[j] = (out[j][0], "".join(bodies).rstrip("\n"))
                break
    return k


def _words(segment: str) -> list[str]:
    """The words of a simple command with quotes removed, and its operators (``>``, ``2``, ``>&``, ``1``):
    shlex's reading in a regular expression (shlex itself cost most of a summary's time on real traces).
    An unbalanced quote is skipped, which leaves the plain words as the best reading."""
    return [w if w[0] in "<>&|;" else _QUOTED_RE.sub(_unquote, w) for w in _WORD_RE.findall(segment)]


def _unquote(m: re.Match[str]) -> str:
    if m.group(1) is not None:
        return m.group(1)
    if m.group(2) is not None:
        return _ESCAPED_RE.sub(r"\1", m.group(2))
    return m.group(3)


def _is_path(word: str) -> bool:
    return (0 < len(word) <= _PATH_CHARS and not word.startswith(("-", *_NOT_FILES)) and "\n" not in word
            and not any(c in word for c in "*?$`{}"))


def _segment_changes(segment: str, body: str, reader: _Reader) -> list[tuple[str, Kind, str]]:
    if not _WRITE_HINT_RE.search(segment):
        return []  # a command that only reads, beside one that writes
    words = _words(segment)
    change = one_line(f"`{segment}`" + (f" ({_lines(body)})" if body else ""))
    out: list[tuple[str, Kind, str]] = []
    argv: list[str] = []
    stdin: list[str] = []  # files read with `<` (a patch applied from a file)
    k = 0
    while k < len(words):
        w = words[k]
        if w in _REDIRECTS and k + 1 < len(words):
            target = words[k + 1]
            if _is_path(target):
                out.append((target, "changed" if ">>" in w else "written", change))
                if body:
                    reader.written[target] = body
            k += 2
            continue
        if w == "<" and k + 1 < len(words):
            stdin.append(words[k + 1])
        if w in ("<", "<<", "<<<", "<<-", ">&", "<&") or (w.isdigit() and k + 1 < len(words)
                                                            and words[k + 1] in (*_REDIRECTS, ">&")):
            k += 2 if w in ("<", "<<<", ">&", "<&") else 1
            continue
        argv.append(w)
        k += 1
    while argv and ("=" in argv[0].split("/")[0] or argv[0] in ("sudo", "command", "exec", "time", "env")):
        argv.pop(0)  # `X=1 cmd`, `sudo cmd`: the command is what follows
    if argv:
        out.extend((p, kind, change) for p, kind in _argv_changes(argv, stdin, body, reader))
    return out


def _argv_changes(argv: list[str], stdin: list[str], body: str, reader: _Reader) -> list[tuple[str, Kind]]:
    verb, args = argv[0].rsplit("/", 1)[-1], argv[1:]
    operands = [a for a in args if a and not a.startswith("-")]
    paths = [a for a in operands if _is_path(a)]
    if verb == "rm":
        return [(p, "deleted") for p in paths]
    if verb in ("touch", "mkdir"):
        return [(p, "created") for p in paths]
    if verb == "tee":
        return [(p, "changed" if "-a" in args else "written") for p in paths]
    if verb in ("mv", "cp") and len(operands) >= 2:
        dest = operands[-1]
        moved: list[tuple[str, Kind]] = [(p, "deleted") for p in operands[:-1] if verb == "mv" and _is_path(p)]
        return moved + ([(dest, "written")] if _is_path(dest) else [])
    if verb == "sed" and any(a == "-i" or a.startswith(("-i", "--in-place")) for a in args):
        return [(p, "changed") for p in _sed_files(args)]
    if verb == "apply_patch":  # Codex's patch format, given on stdin
        return [(p, kind) for p, kind, _ in _codex_patch(body)]
    if verb == "patch" or (verb == "git" and args[:1] == ["apply"]):
        diff = body or "".join(reader.written.get(p, "") for p in [*paths, *stdin])
        return _diff_changes(diff)
    return []


def _sed_files(args: list[str]) -> list[str]:
    """The files of ``sed -i``: the operands after the script (the first operand, unless -e or -f gave it)."""
    operands: list[str] = []
    scripted = False
    k = 0
    while k < len(args):
        a = args[k]
        if a in ("-e", "-f", "--expression", "--file"):
            scripted, k = True, k + 2
            continue
        scripted = scripted or a.startswith(("--expression=", "--file="))
        if a and not a.startswith("-"):
            operands.append(a)
        k += 1
    return [p for p in (operands if scripted else operands[1:]) if _is_path(p)]


def _diff_changes(diff: str) -> list[tuple[str, Kind]]:
    deleted = set(_DIFF_SOURCE_RE.findall(diff))
    out: list[tuple[str, Kind]] = [(p, "changed") for p in _DIFF_TARGET_RE.findall(diff) if p != "/dev/null"]
    return out + [(p, "deleted") for p in sorted(deleted)]


# ----------------------------------------------------------------------------------------------------------
# The section a summary carries.


def trail_line(change: FileChange) -> str:
    return f"- {change.path} ({change.kind}): {change.change}"


def render_trail(trail: Sequence[FileChange], *, max_chars: int) -> str:
    """The trail as a summary section of at most ``max_chars`` characters: the newest changes that fit,
    then how many older ones were left out. "" when not even the title and one file fit."""
    title = f"## {TRAIL_TITLE}"
    lines = [title]
    used = len(title)
    for k, change in enumerate(trail):
        line = trail_line(change)
        left = len(trail) - k - 1
        more = len(f"\n- ({left} older files not shown)") if left else 0
        if used + 1 + len(line) + more > max_chars:
            break
        lines.append(line)
        used += 1 + len(line)
    shown = len(lines) - 1
    if shown == 0:
        return ""
    if shown < len(trail):
        lines.append(f"- ({len(trail) - shown} older files not shown)")
    return "\n".join(lines)


def parse_trail(text: str) -> list[FileChange]:
    """The entries of the trail section in a summary's text (newest first), [] when it has none."""
    at = text.find(f"## {TRAIL_TITLE}")
    if at < 0:
        return []
    out = []
    for line in text[at:].splitlines()[1:]:
        if not line.startswith("- "):
            break
        m = _LINE_RE.match(line)
        if m is not None:
            out.append(FileChange(m.group(1), cast(Kind, m.group(2)), m.group(3), -1))  # the regex admits the kinds
    return out


def mentions(text: str, path: str) -> bool:
    """Whether a summary names ``path`` (as written, or without a leading ``./``) as a whole path: "a.py"
    inside "data.py" or "a.pyc" is not a mention."""
    for p in (path, path[2:]) if path.startswith("./") else (path,):
        if p and re.search(rf"(?<![\w./-]){re.escape(p)}(?![\w/-])", text):
            return True
    return False
