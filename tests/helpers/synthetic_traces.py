"""Small synthetic agent traces in every format the importers read, written by code, seeded.

The real traces (../shared/traces) are not part of the project, so a fresh clone tests the same
behaviour on these: files laid out like the real folder, one folder per format, each named by the
importer that must detect it. Every file is rendered from one abstract episode (user turns; per
step optional reasoning, text and one to three tool calls with ids; results, some long, some
errors) into the exact record shapes the real agents write: OpenAI chat (JSON list, JSONL,
``{"messages": ...}`` and JSONL of those), Anthropic messages (JSON and JSONL), Claude Code session
logs (one record per content block, hook progress, file snapshots, queue operations, system
notices, and a subagent relayed in ``agent_progress`` records), tau-bench, SWE-agent ``.traj``,
OpenHands event streams (a JSON list and JSONL of runs) and mini-swe-agent trajectories with the
provider's recorded usage. All text is generated here: nothing is copied from a real trace.

``write_all(root)`` writes the folder and returns, per file, what an importer must read from it
(:class:`Expected`), so a test can tell a dropped or invented message from a correct import.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED = 20260101

# Folder (and importer) name -> file names written there.
SETS = ("openai", "anthropic", "claude_code", "tau_bench", "swe_agent", "openhands", "mini_swe_agent")

_WORDS = [
    "stock", "reservation", "order", "invoice", "ledger", "queue", "worker", "cache", "request",
    "handler", "retry", "timeout", "parser", "schema", "migration", "index", "report", "export",
    "import", "batch", "window", "buffer", "config", "option", "default", "value", "limit", "count",
    "total", "price", "discount", "bundle", "customer", "account", "session", "token", "header",
    "payload", "record", "field"
]
_VERBS = [
    "check", "read", "update", "fix", "add", "remove", "rename", "move", "test", "run", "compare",
    "inspect", "trace"
]
_FILES = ["app/models.py", "app/store.py", "app/pricing.py", "app/api.py", "app/reports.py", "app/importer.py",
          "tests/test_store.py", "tests/test_pricing.py", "docs/usage.md", "setup.cfg"]

TOOLS: tuple[dict[str, Any], ...] = (
    {"name": "bash", "description": "Run a shell command and return its output and exit code.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "read_file", "description": "Read a file, optionally a range of lines.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                                     "end": {"type": "integer"}}, "required": ["path"]}},
    {"name": "edit_file", "description": "Replace one exact snippet of a file with another.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                     "new": {"type": "string"}},
                    "required": ["path", "old", "new"]}},
)


# ---- the abstract episode ---------------------------------------------------------------------------------


@dataclass
class Call:
    id: str
    name: str
    arguments: dict[str, Any]
    output: str
    is_error: bool = False


@dataclass
class Step:
    reasoning: str | None
    text: str
    calls: list[Call]
    # Recorded by the provider for the request that produced this step (prompt, completion, cache hits).
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Turn:
    user: str
    steps: list[Step]
    final: str


@dataclass
class Episode:
    system: str
    turns: list[Turn]

    @property
    def num_messages(self) -> int:
        """Messages an importer makes of it: user, each step and its results, the final answer."""
        return sum(2 + sum(1 + len(s.calls) for s in t.steps) for t in self.turns)

    @property
    def num_calls(self) -> int:
        return sum(len(s.calls) for t in self.turns for s in t.steps)


@dataclass(frozen=True)
class Expected:
    """What the importer must read from one file: its format and, per conversation, the message and
    tool-pair counts."""

    format: str
    conversations: tuple[tuple[int, int], ...]


def _sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    return (" ".join(words)).capitalize() + "."


def _paragraph(rng: random.Random, n_sentences: int) -> str:
    return " ".join(_sentence(rng, rng.randint(6, 14)) for _ in range(n_sentences))


def _source(rng: random.Random, path: str, num_lines: int) -> str:
    lines = [f'"""{path}: generated for the tests."""', "", "from __future__ import annotations", ""]
    while len(lines) < num_lines:
        fn = f"{rng.choice(_VERBS)}_{rng.choice(_WORDS)}_{len(lines)}"
        lines += [f"def {fn}(key: str, amount: int = {rng.randint(1, 99)}) -> int:",
                  f'    """{_sentence(rng, 6)}"""',
                  f"    if amount > {rng.randint(100, 999)}:",
                  '        raise ValueError(f"{key}: amount {amount} over the limit")',
                  f"    return amount * {rng.randint(2, 9)}", ""]
    return "\n".join(f"{k + 1:5d}  {line}" for k, line in enumerate(lines[:num_lines]))


def _test_log(rng: random.Random, num_tests: int, failures: int) -> str:
    out = ["============================= test session starts ==============================",
           f"collected {num_tests} items", ""]
    for k in range(num_tests):
        status = "FAILED" if k < failures else "PASSED"
        out.append(f"tests/test_{rng.choice(_WORDS)}.py::test_{rng.choice(_VERBS)}_{rng.choice(_WORDS)}_{k} {status}")
    for k in range(failures):
        out += ["", f"____ test_case_{k} ____", "Traceback (most recent call last):",
                f'  File "app/{rng.choice(_WORDS)}.py", line {rng.randint(10, 400)}, in {rng.choice(_VERBS)}',
                f"AssertionError: expected {rng.randint(0, 99)}, got {rng.randint(100, 199)}"]
    out.append(f"==== {failures} failed, {num_tests - failures} passed in {rng.uniform(0.5, 9):.2f}s ====")
    return "\n".join(out)


def _call_id(rng: random.Random, style: str) -> str:
    alphabet = string.ascii_letters + string.digits
    if style == "anthropic":
        return "toolu_" + "".join(rng.choice(alphabet) for _ in range(24))
    return "call_" + "".join(rng.choice(alphabet) for _ in range(24))


def _call(rng: random.Random, style: str, long_output: bool, huge_output: bool) -> Call:
    cid = _call_id(rng, style)
    kind = rng.choice(["read", "bash", "bash", "edit"])
    path = rng.choice(_FILES)
    if kind == "read":
        lines = 2000 if huge_output else rng.randint(120, 260) if long_output else rng.randint(8, 30)
        return Call(cid, "read_file", {"path": path, "start": 1, "end": lines}, _source(rng, path, lines))
    if kind == "edit":
        old, new = f"return amount * {rng.randint(2, 9)}", f"return amount * {rng.randint(2, 9)}"
        return Call(cid, "edit_file", {"path": path, "old": old, "new": new}, f"Edited {path}: 1 replacement.")
    if long_output or huge_output:
        n = 1500 if huge_output else rng.randint(40, 90)
        failures = rng.randint(0, 3)
        return Call(cid, "bash", {"command": f"python -m pytest -q tests/{path.rsplit('/', 1)[-1]}"},
                    _test_log(rng, n, failures), is_error=failures > 0 and rng.random() < 0.5)
    if rng.random() < 0.15:
        return Call(cid, "bash", {"command": f"python {path}"},
                    f"Traceback (most recent call last):\n  File \"{path}\", line {rng.randint(1, 99)}\n"
                    f"NameError: name '{rng.choice(_WORDS)}' is not defined", is_error=True)
    cmd = rng.choice([f"grep -n {rng.choice(_WORDS)} {path}", f"git diff {path}", f"wc -l {path}", "git status"])
    return Call(cid, "bash", {"command": cmd},
                "\n".join(f"{path}:{rng.randint(1, 400)}: {_sentence(rng, 7)}" for _ in range(rng.randint(1, 8))))


def episode(rng: random.Random, *, turns: int, steps: tuple[int, int] = (2, 4), style: str = "openai",
            reasoning: bool = True, parallel: bool = True, huge: bool = False) -> Episode:
    """A coding-agent conversation: ``turns`` user turns of tool-using steps, then a final answer each.
    About one call in five has a long output; with ``huge`` one output is larger than a small window."""
    out: list[Turn] = []
    prompt = 600
    huge_left = huge
    for _ in range(turns):
        step_list: list[Step] = []
        for _ in range(rng.randint(*steps)):
            n_calls = rng.choice([1, 1, 2, 3]) if parallel else 1
            calls = []
            for _ in range(n_calls):
                make_huge = huge_left and rng.random() < 0.2
                huge_left = huge_left and not make_huge
                calls.append(_call(rng, style, long_output=rng.random() < 0.2, huge_output=make_huge))
            think = _paragraph(rng, rng.randint(1, 3)) if reasoning and rng.random() < 0.7 else None
            text = _sentence(rng, rng.randint(5, 12)) if rng.random() < 0.6 else ""
            completion = (len(text) + len(think or "") + sum(len(json.dumps(c.arguments)) for c in calls)) // 4 + 5
            cached = prompt - prompt % 64
            step_list.append(Step(think, text, calls, prompt, completion, cached))
            prompt += completion + sum(len(c.output) // 4 + 15 for c in calls)
        out.append(Turn(f"Please {rng.choice(_VERBS)} the {rng.choice(_WORDS)} {rng.choice(_WORDS)}: "
                        + _paragraph(rng, rng.randint(1, 2)), step_list, _paragraph(rng, rng.randint(1, 2))))
        prompt += 200
    return Episode("You are a careful software engineer working in a repository through tools. "
                   + _paragraph(rng, 4), out)


# ---- OpenAI chat ---------------------------------------------------------------------------------------------


def _openai_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": dict(t)} for t in TOOLS]


def openai_messages(ep: Episode, *, tool_names: bool = False, usage: bool = False) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": ep.system}]
    for turn in ep.turns:
        msgs.append({"role": "user", "content": turn.user})
        for s in turn.steps:
            m: dict[str, Any] = {
                "role": "assistant", "content": s.text or None,
                "tool_calls": [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                               for c in s.calls]}
            if s.reasoning is not None:
                m["reasoning_content"] = s.reasoning
            if usage:
                m["usage"] = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                              "total_tokens": s.prompt_tokens + s.completion_tokens,
                              "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}
            msgs.append(m)
            for c in s.calls:
                r: dict[str, Any] = {"role": "tool", "tool_call_id": c.id, "content": c.output}
                if tool_names:
                    r["name"] = c.name
                msgs.append(r)
        msgs.append({"role": "assistant", "content": turn.final})
    return msgs


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_jsonl(path: Path, values: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(v, ensure_ascii=False) + "\n" for v in values), encoding="utf-8")


def write_openai(folder: Path, rng: random.Random) -> dict[Path, Expected]:
    out: dict[Path, Expected] = {}
    ep = episode(rng, turns=6)
    _write_json(folder / "chat.json", openai_messages(ep))
    out[folder / "chat.json"] = Expected("openai", ((ep.num_messages, ep.num_calls),))
    ep = episode(rng, turns=3, reasoning=False)
    _write_jsonl(folder / "chat.jsonl", openai_messages(ep, tool_names=True))
    out[folder / "chat.jsonl"] = Expected("openai", ((ep.num_messages, ep.num_calls),))
    ep = episode(rng, turns=5)
    _write_json(folder / "request.json", {"model": "example-model", "messages": openai_messages(ep, usage=True),
                                          "tools": _openai_tools()})
    out[folder / "request.json"] = Expected("openai", ((ep.num_messages, ep.num_calls),))
    eps = [episode(rng, turns=rng.randint(1, 3)) for _ in range(3)]
    _write_jsonl(folder / "requests.jsonl", [{"messages": openai_messages(e), "tools": _openai_tools()} for e in eps])
    out[folder / "requests.jsonl"] = Expected("openai", tuple((e.num_messages, e.num_calls) for e in eps))
    return out


# ---- Anthropic messages ----------------------------------------------------------------------------------------


def _signature(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits + "+/") for _ in range(64))


def _anthropic_usage(s: Step) -> dict[str, Any]:
    fresh = s.prompt_tokens - s.cached_tokens
    return {"input_tokens": fresh // 2, "cache_creation_input_tokens": fresh - fresh // 2,
            "cache_read_input_tokens": s.cached_tokens, "output_tokens": s.completion_tokens}


def _assistant_blocks(s: Step, rng: random.Random) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if s.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": s.reasoning, "signature": _signature(rng)})
    if s.text:
        blocks.append({"type": "text", "text": s.text})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in s.calls]
    return blocks


def _result_block(c: Call) -> dict[str, Any]:
    b: dict[str, Any] = {"type": "tool_result", "tool_use_id": c.id, "content": c.output}
    if c.is_error:
        b["is_error"] = True
    return b


def anthropic_messages(ep: Episode, rng: random.Random) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for turn in ep.turns:
        msgs.append({"role": "user", "content": turn.user})
        for s in turn.steps:
            msgs.append({"role": "assistant", "content": _assistant_blocks(s, rng), "usage": _anthropic_usage(s)})
            msgs.append({"role": "user", "content": [_result_block(c) for c in s.calls]})
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": turn.final}]})
    return msgs


def write_anthropic(folder: Path, rng: random.Random) -> dict[Path, Expected]:
    ep = episode(rng, turns=6, style="anthropic")
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
    _write_json(folder / "messages.json", {"model": "example-model", "max_tokens": 8192, "system": ep.system,
                                           "tools": tools, "messages": anthropic_messages(ep, rng)})
    ep2 = episode(rng, turns=3, style="anthropic")
    _write_jsonl(folder / "messages.jsonl", anthropic_messages(ep2, rng))
    return {folder / "messages.json": Expected("anthropic", ((ep.num_messages, ep.num_calls),)),
            folder / "messages.jsonl": Expected("anthropic", ((ep2.num_messages, ep2.num_calls),))}


# ---- Claude Code session logs ----------------------------------------------------------------------------------


def _session_id(rng: random.Random) -> str:
    h = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _ClaudeLog:
    """Records of one Claude Code session file, with the bookkeeping fields every record carries."""

    def __init__(self, rng: random.Random, session_id: str) -> None:
        self.rng = rng
        self.session_id = session_id
        self.records: list[dict[str, Any]] = []
        self.parent: str | None = None
        self.clock = 0

    def uuid(self) -> str:
        return _session_id(self.rng)  # the same shape: a random UUID

    def timestamp(self) -> str:
        self.clock += self.rng.randint(1, 20)
        return f"2026-01-01T10:{self.clock // 60 % 60:02d}:{self.clock % 60:02d}.000Z"

    def base(self, kind: str, *, advance: bool = True) -> dict[str, Any]:
        uid = self.uuid()
        rec = {"parentUuid": self.parent, "isSidechain": False, "userType": "external", "cwd": "/home/dev/project",
               "sessionId": self.session_id, "version": "2.0.0", "gitBranch": "main", "type": kind, "uuid": uid,
               "timestamp": self.timestamp()}
        if advance:
            self.parent = uid
        return rec

    def user(self, content: Any, **extra: Any) -> dict[str, Any]:
        rec = {**self.base("user"), "message": {"role": "user", "content": content}, **extra}
        self.records.append(rec)
        return rec

    def response(self, s: Step) -> list[dict[str, Any]]:
        """One API response written as one record per content block, as Claude Code does."""
        msg_id = "msg_" + "".join(self.rng.choice(string.ascii_letters + string.digits) for _ in range(24))
        out = []
        for block in _assistant_blocks(s, self.rng):
            rec = {**self.base("assistant"), "requestId": "req_" + msg_id[4:],
                   "message": {"model": "example-model", "id": msg_id, "type": "message", "role": "assistant",
                               "content": [block], "stop_reason": None, "stop_sequence": None,
                               "usage": _anthropic_usage(s)}}
            out.append(rec)
        self.records += out
        return out

    def results(self, s: Step) -> None:
        for c in s.calls:
            self.user([_result_block(c)], toolUseResult={"stdout": c.output[:200], "interrupted": False})

    def noise(self) -> None:
        """Records that are not conversation: a hook's progress, a file snapshot, a queued message."""
        kind = self.rng.choice(["progress", "file-history-snapshot", "queue-operation", "system"])
        if kind == "progress":
            rec = self.base("progress", advance=False)
            rec["data"] = {"type": "hook_progress", "hookEvent": "PostToolUse", "hookName": "PostToolUse:Bash",
                           "command": "echo checked"}
            rec["parentToolUseID"] = rec["toolUseID"] = "toolu_hook"
        elif kind == "file-history-snapshot":
            mid = self.uuid()
            rec = {"type": kind, "messageId": mid, "snapshot": {"messageId": mid, "trackedFileBackups": {},
                                                                "timestamp": self.timestamp()},
                   "isSnapshotUpdate": False}
        elif kind == "queue-operation":
            rec = {"type": kind, "operation": "enqueue", "timestamp": self.timestamp(), "sessionId": self.session_id,
                   "content": _sentence(self.rng, 6)}
        else:
            rec = {**self.base("system", advance=False), "subtype": "stop_hook_summary", "hookCount": 1,
                   "hookInfos": [{"command": "echo done"}], "hookErrors": [], "preventedContinuation": False,
                   "stopReason": "", "hasOutput": False, "level": "suggestion"}
        self.records.append(rec)

    def turn(self, t: Turn) -> None:
        self.user(t.user)
        for s in t.steps:
            self.response(s)
            if self.rng.random() < 0.5:
                self.noise()
            self.results(s)
        self.response(Step(None, t.final, [], 0, 0, 0))


def write_claude_code(folder: Path, rng: random.Random) -> dict[Path, Expected]:
    out: dict[Path, Expected] = {}
    ep = episode(rng, turns=6, style="anthropic")
    log = _ClaudeLog(rng, _session_id(rng))
    log.noise()
    for t in ep.turns:
        log.turn(t)
    _write_jsonl(folder / "session.jsonl", log.records)
    out[folder / "session.jsonl"] = Expected("claude_code", ((ep.num_messages, ep.num_calls),))

    # A session whose second step runs a subagent (the Task tool); the subagent's own messages are
    # relayed in agent_progress records between the Task call and its result.
    main = episode(rng, turns=2, style="anthropic")
    sub = episode(rng, turns=1, steps=(3, 4), style="anthropic")
    task = main.turns[0].steps[0]
    task_call = Call(_call_id(rng, "anthropic"), "Task", {"description": "Survey the code",
                                                          "prompt": sub.turns[0].user}, sub.turns[0].final)
    task.calls = [task_call]
    log = _ClaudeLog(rng, _session_id(rng))
    agent = _ClaudeLog(rng, log.session_id)
    agent_id = "".join(rng.choice("0123456789abcdef") for _ in range(7))
    agent.turn(sub.turns[0])
    for k, t in enumerate(main.turns):
        log.user(t.user)
        for j, s in enumerate(t.steps):
            log.response(s)
            if k == 0 and j == 0:
                for inner in (r for r in agent.records if r["type"] in ("user", "assistant")):
                    rec = log.base("progress", advance=False)
                    rec["data"] = {"message": {"type": inner["type"], "message": inner["message"],
                                               "uuid": inner["uuid"], "timestamp": inner["timestamp"]},
                                   "normalizedMessages": [], "type": "agent_progress", "prompt": sub.turns[0].user,
                                   "agentId": agent_id}
                    rec["toolUseID"] = "agent_msg_" + inner["uuid"][:8]
                    rec["parentToolUseID"] = task_call.id
                    log.records.append(rec)
            log.results(s)
        log.response(Step(None, t.final, [], 0, 0, 0))
    _write_jsonl(folder / "subagent.jsonl", log.records)
    out[folder / "subagent.jsonl"] = Expected("claude_code", ((main.num_messages, main.num_calls),
                                                              (sub.num_messages, sub.num_calls)))
    return out


# ---- tau-bench -----------------------------------------------------------------------------------------------


def write_tau_bench(folder: Path, rng: random.Random) -> dict[Path, Expected]:
    runs, expected = [], []
    for task_id in range(4):
        ep = episode(rng, turns=rng.randint(3, 6), steps=(1, 2), reasoning=False, parallel=task_id % 2 == 0)
        for t in ep.turns:  # a customer-service agent's tools answer in JSON
            for s in t.steps:
                for c in s.calls:
                    c.output = json.dumps({"status": "ok", "record": c.arguments, "notes": c.output[:1500]})
        traj = openai_messages(ep, tool_names=True)
        runs.append({"task_id": task_id, "trial": 0, "reward": float(task_id % 2),
                     "info": {"task": {"user_id": f"user_{task_id}", "instruction": ep.turns[0].user}},
                     "traj": traj})
        expected.append((ep.num_messages, ep.num_calls))
    _write_json(folder / "airline.json", runs)
    return {folder / "airline.json": Expected("tau_bench", tuple(expected))}


# ---- SWE-agent ---------------------------------------------------------------------------------------------------


def write_swe_agent(folder: Path, rng: random.Random) -> dict[Path, Expected]:
    ep = episode(rng, turns=1, steps=(14, 18), reasoning=False, parallel=False, huge=True)
    # SWE-agent's user turn is the task; the final answer is the submission step's text.
    history: list[dict[str, Any]] = [
        {"role": "system", "content": ep.system, "agent": "main", "message_type": "system_prompt"}]
    trajectory: list[dict[str, Any]] = []
    for t in ep.turns:
        history.append({"role": "user", "content": t.user, "agent": "main", "message_type": "observation"})
        for s in t.steps:
            (c,) = s.calls
            thought = s.text or _sentence(rng, 8)
            action = c.arguments.get("command") or f"{c.name} {json.dumps(c.arguments)}"
            history.append({"role": "assistant", "content": thought, "thought": thought, "action": action,
                            "agent": "main", "message_type": "action",
                            "tool_calls": [{"function": {"arguments": json.dumps(c.arguments), "name": c.name},
                                            "id": c.id, "type": "function"}]})
            history.append({"role": "tool", "content": c.output, "agent": "main", "message_type": "observation",
                            "tool_call_ids": [c.id]})
            trajectory.append({"action": action, "observation": c.output, "response": thought, "thought": thought,
                               "execution_time": round(rng.uniform(0.01, 3), 3), "state": {"working_dir": "/repo"}})
        history.append({"role": "assistant", "content": t.final, "thought": t.final, "action": "submit",
                        "agent": "main", "message_type": "action"})
    doc = {"environment": "swe_main", "trajectory": trajectory, "history": history,
           "info": {"exit_status": "submitted", "submission": "diff --git a/app/store.py b/app/store.py\n"},
           "replay_config": "{}"}
    _write_json(folder / "task.traj", doc)
    return {folder / "task.traj": Expected("swe_agent", ((ep.num_messages, ep.num_calls),))}


# ---- OpenHands -----------------------------------------------------------------------------------------------------


def _openhands_events(ep: Episode, rng: random.Random) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    def add(e: dict[str, Any]) -> dict[str, Any]:
        e = {"id": len(events), "timestamp": f"2026-01-01T10:00:{len(events) % 60:02d}.000000", **e}
        events.append(e)
        return e

    add({"source": "agent", "action": "system", "message": ep.system[:40],
         "args": {"content": ep.system, "tools": _openai_tools(), "openhands_version": "0.0"}})
    for turn in ep.turns:
        add({"source": "user", "action": "message", "message": turn.user,
             "args": {"content": turn.user, "image_urls": None, "wait_for_response": False}})
        add({"source": "environment", "observation": "agent_state_changed", "content": "",
             "extras": {"agent_state": "running"}, "message": ""})
        for s in turn.steps:
            rid = "chatcmpl-" + "".join(rng.choice(string.hexdigits.lower()) for _ in range(24))
            response = {"id": rid, "model": "example-model", "object": "chat.completion",
                        "choices": [{"finish_reason": "tool_calls", "index": 0, "message": {
                            "content": s.text, "role": "assistant",
                            "tool_calls": [{"id": c.id, "type": "function", "function": {
                                "name": c.name, "arguments": json.dumps(c.arguments)}} for c in s.calls]}}],
                        "usage": {"completion_tokens": s.completion_tokens, "prompt_tokens": s.prompt_tokens,
                                  "total_tokens": s.prompt_tokens + s.completion_tokens,
                                  "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}}
            for c in s.calls:  # OpenHands writes each call of a response as its own action, then its result
                meta = {"function_name": c.name, "tool_call_id": c.id, "model_response": response,
                        "total_calls_in_response": len(s.calls)}
                action = "run" if c.name == "bash" else "read" if c.name == "read_file" else "edit"
                act = add({"source": "agent", "action": action, "message": f"Running {c.name}",
                           "tool_call_metadata": meta, "args": {**c.arguments, "thought": s.reasoning or ""},
                           "timeout": 120})
                add({"source": "agent", "cause": act["id"], "observation": "error" if c.is_error else action,
                     "tool_call_metadata": meta, "content": c.output, "message": f"Ran {c.name}",
                     "extras": {"metadata": {"exit_code": 1 if c.is_error else 0}}})
        add({"source": "agent", "action": "message", "message": turn.final,
             "args": {"content": turn.final, "image_urls": None, "wait_for_response": True}})
        add({"source": "environment", "observation": "null", "content": "", "extras": {}, "message": ""})
    return events


def write_openhands(folder: Path, rng: random.Random) -> dict[Path, Expected]:
    ep = episode(rng, turns=5, reasoning=False)
    _write_json(folder / "events.json", _openhands_events(ep, rng))
    eps = [episode(rng, turns=rng.randint(1, 2), steps=(4, 8), reasoning=False) for _ in range(2)]
    runs = [{"instance_id": f"example__project-{100 + k}", "instruction": e.turns[0].user,
             "metadata": {"agent_class": "CodeActAgent", "max_iterations": 50},
             "history": _openhands_events(e, rng), "metrics": {"accumulated_cost": 0.0}} for k, e in enumerate(eps)]
    _write_jsonl(folder / "runs.jsonl", runs)
    return {folder / "events.json": Expected("openhands", ((ep.num_messages, ep.num_calls),)),
            folder / "runs.jsonl": Expected("openhands", tuple((e.num_messages, e.num_calls) for e in eps))}


# ---- mini-swe-agent --------------------------------------------------------------------------------------------------


def mini_swe_agent_doc(ep: Episode, rng: random.Random, instance_id: str) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": ep.system}]
    for t in ep.turns:
        msgs.append({"role": "user", "content": t.user})
        for s in t.steps:
            (c,) = s.calls
            call = {"index": 0, "function": {"arguments": json.dumps({"command": _command(c)}), "name": "bash"},
                    "id": c.id, "type": "function"}
            usage = {"completion_tokens": s.completion_tokens, "prompt_tokens": s.prompt_tokens,
                     "total_tokens": s.prompt_tokens + s.completion_tokens,
                     "completion_tokens_details": {"reasoning_tokens": len(s.reasoning or "") // 4},
                     "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
                     "prompt_cache_hit_tokens": s.cached_tokens,
                     "prompt_cache_miss_tokens": s.prompt_tokens - s.cached_tokens}
            m: dict[str, Any] = {"content": s.text, "role": "assistant", "tool_calls": [call], "function_call": None}
            if s.reasoning is not None:
                m["reasoning_content"] = s.reasoning
                m["provider_specific_fields"] = {"reasoning_content": s.reasoning}
            m["extra"] = {"actions": [{"command": _command(c), "tool_call_id": c.id}],
                          "response": {"id": f"resp-{rng.getrandbits(64):016x}", "model": "example-model",
                                       "object": "chat.completion", "usage": usage},
                          "cost": 0.0, "timestamp": 1767261600.0 + len(msgs)}
            msgs.append(m)
            code = 1 if c.is_error else 0
            msgs.append({"content": f"<returncode>{code}</returncode>\n<output>\n{c.output}\n</output>",
                         "extra": {"raw_output": c.output, "returncode": code, "timestamp": 1767261600.0,
                                   "exception_info": ""}, "tool_call_id": c.id, "role": "tool"})
        msgs.append({"role": "assistant", "content": t.final})
    submission = "diff --git a/app/store.py b/app/store.py\n"
    msgs.append({"role": "exit", "content": submission, "extra": {"exit_status": "Submitted",
                                                                  "submission": submission}})
    return {"info": {"model_stats": {"instance_cost": 0.0, "api_calls": sum(len(t.steps) for t in ep.turns)},
                     "config": {"model": {"model_name": "example-model"}}, "mini_version": "1.0.0",
                     "exit_status": "Submitted", "submission": submission},
            "messages": msgs, "trajectory_format": "mini-swe-agent-1.1", "instance_id": instance_id}


def _command(c: Call) -> str:
    cmd = c.arguments.get("command")
    return cmd if isinstance(cmd, str) else f"cat {c.arguments.get('path', 'README')}"


def write_mini_swe_agent(folder: Path, rng: random.Random) -> dict[Path, Expected]:
    out: dict[Path, Expected] = {}
    for sub, reasoning in (("chat", False), ("reasoner", True)):
        ep = episode(rng, turns=1, steps=(18, 24), reasoning=reasoning, parallel=False, huge=True)
        path = folder / sub / f"example__project-{len(out) + 1}.traj.json"
        _write_json(path, mini_swe_agent_doc(ep, rng, path.name.removesuffix(".traj.json")))
        out[path] = Expected("mini_swe_agent", ((ep.num_messages, ep.num_calls),))
    return out


_WRITERS = {"openai": write_openai, "anthropic": write_anthropic, "claude_code": write_claude_code,
            "tau_bench": write_tau_bench, "swe_agent": write_swe_agent, "openhands": write_openhands,
            "mini_swe_agent": write_mini_swe_agent}


def write_all(root: Path, seed: int = SEED) -> dict[Path, Expected]:
    """Every set under ``root/<format>/``; the same seed writes the same bytes."""
    out: dict[Path, Expected] = {}
    for name in SETS:
        out.update(_WRITERS[name](root / name, random.Random(f"{seed}:{name}")))
    return out
