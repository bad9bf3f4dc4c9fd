"""The built-in demo conversation: a coding agent working on a small inventory service.

Written for ctxfold (not recorded from anywhere): deterministic, about 190 messages over ten user
turns, with the shape real agent traces have: tool calls and results in pairs, bulky file reads
and test logs, an error output, a question asked while a turn was running. It is long enough that
a replay at a small context window exercises every pass (archive, summary, mid-turn, hard trigger).
"""

from __future__ import annotations

import json
import random

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec

SYSTEM_PROMPT = (
    "You are a careful software engineer working in a repository through tools. "
    "Read before you edit, run the tests after every change, and explain what you did in one short paragraph. "
    "Never invent file contents: read them."
)

TOOLS = (
    ToolSpec("bash", "Run a shell command in the repository and return its output and exit code.",
             {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}),
    ToolSpec("read_file", "Read a file, optionally a range of lines.",
             {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                               "end": {"type": "integer"}}, "required": ["path"]}),
    ToolSpec("edit_file", "Replace one exact snippet of a file with another.",
             {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                               "new": {"type": "string"}}, "required": ["path", "old", "new"]}),
)

_MODULES = ["inventory/models.py", "inventory/store.py", "inventory/pricing.py", "inventory/api.py",
            "inventory/reports.py", "inventory/importer.py", "tests/test_store.py", "tests/test_pricing.py"]

_USER_TURNS = [
    "The nightly job reports negative stock for some SKUs. Find out why and fix it.",
    "Good. Can you also make the reservation expiry configurable instead of the hard-coded 15 minutes?",
    "The pricing tests fail on the CI machine but not locally. Please investigate.",
    "Add a CSV export of the low-stock report, same columns as the JSON one.",
    "What did we decide about the rounding of discounted prices earlier? Apply the same rule to bundles.",
    "The importer chokes on files with a BOM. Fix it and add a test.",
    "Run the whole test suite and summarise what is still failing.",
    "Please refactor store.py so reservations and stock moves live in separate classes.",
    "Double-check the negative stock fix still holds after the refactor.",
    "Write a short changelog entry for everything we did today.",
]


def _source_file(rng: random.Random, path: str, num_lines: int) -> str:
    name = path.rsplit("/", 1)[-1].removesuffix(".py")
    lines = [f'"""{name}: part of the inventory service."""', "", "from __future__ import annotations", ""]
    for k in range(num_lines // 8):
        fn = f"{rng.choice(['get', 'set', 'apply', 'reserve', 'release', 'compute', 'load'])}_{name}_{k}"
        lines += [
            f"def {fn}(sku: str, quantity: int = {rng.randint(1, 50)}) -> int:",
            f'    """{rng.choice(["Reserve", "Release", "Price", "Count", "Move"])} stock for one SKU."""',
            f"    current = _levels.get(sku, {rng.randint(0, 9)})",
            f"    if quantity > {rng.randint(100, 999)}:",
            "        raise ValueError(f\"{sku}: quantity {quantity} over the limit\")",
            f"    _levels[sku] = current - quantity  # line {len(lines) + 6}",
            "    return _levels[sku]",
            "",
        ]
    return "\n".join(f"{i + 1:4d}  {line}" for i, line in enumerate(lines))


def _test_log(rng: random.Random, failing: int) -> str:
    out = ["============================= test session starts ==============================",
           "platform linux -- Python 3.11.7, pytest-8.3.2", "collected 148 items", ""]
    for path in _MODULES[-2:] + ["tests/test_api.py", "tests/test_reports.py"]:
        out.append(f"{path} " + "".join(rng.choice("....F") if failing else "." for _ in range(37)))
    out.append("")
    for k in range(failing):
        out += [f"___________________ test_case_{k} ___________________",
                "    def test_reserve_then_expire(store):",
                f"        store.reserve('SKU-{rng.randint(1000, 9999)}', {rng.randint(1, 9)})",
                ">       assert store.level('SKU-1042') >= 0",
                f"E       AssertionError: assert -{rng.randint(1, 9)} >= 0",
                "tests/test_store.py:88: AssertionError"]
    out.append(f"===== {failing} failed, {148 - failing} passed in {rng.uniform(2, 9):.2f}s =====")
    return "\n".join(out)


def _grep(rng: random.Random, pattern: str) -> str:
    return "\n".join(f"{rng.choice(_MODULES)}:{rng.randint(1, 300)}:    {pattern}(sku, quantity)"
                     for _ in range(rng.randint(8, 40)))


def demo_conversation() -> Conversation:
    """The demo conversation, identical on every call."""
    rng = random.Random(20261130)
    msgs: list[Message] = []
    call_no = 0

    def call(name: str, args: dict[str, object], output: str, *, error: bool = False,
             thought: str = "") -> None:
        nonlocal call_no
        call_no += 1
        cid = f"call_{call_no:03d}"
        msgs.append(Message(Role.ASSISTANT, thought, id=f"m{len(msgs):03d}",
                            tool_calls=(ToolCall(cid, name, json.dumps(args)),)))
        msgs.append(Message(Role.TOOL, output, id=f"m{len(msgs):03d}", tool_call_id=cid, name=name,
                            is_error=error))

    for turn, text in enumerate(_USER_TURNS):
        msgs.append(Message(Role.USER, text, id=f"m{len(msgs):03d}"))
        for step in range(rng.randint(6, 10)):
            path = rng.choice(_MODULES)
            kind = rng.random()
            if kind < 0.4:
                call("read_file", {"path": path}, _source_file(rng, path, rng.randint(40, 260)),
                     thought=f"Let me read {path} first.")
            elif kind < 0.6:
                failing = rng.randint(0, 3)
                call("bash", {"command": "python -m pytest -q"}, _test_log(rng, failing) + f"\n[exit code {int(failing > 0)}]",
                     thought="Running the tests.")
            elif kind < 0.75:
                word = rng.choice(["reserve", "release_stock", "apply_discount", "round_price"])
                call("bash", {"command": f"grep -rn '{word}' inventory tests"}, _grep(rng, word) + "\n[exit code 0]")
            elif kind < 0.85:
                call("bash", {"command": f"python -m inventory.importer data/batch_{turn}.csv"},
                     "Traceback (most recent call last):\n  File \"inventory/importer.py\", line 41, in load\n"
                     "    header = next(reader)\nUnicodeDecodeError: 'utf-8' codec can't decode byte 0xef\n[exit code 1]",
                     error=True, thought="Trying the importer on the sample batch.")
            else:
                call("edit_file", {"path": path, "old": "current - quantity", "new": "max(0, current - quantity)"},
                     f"Edited {path}: 1 replacement.")
            if turn == 4 and step == 2:
                msgs.append(Message(Role.USER, "(also keep the old rounding for gift cards)", id=f"m{len(msgs):03d}",
                                    queued=True))
        msgs.append(Message(Role.ASSISTANT,
                            f"Done with step {turn + 1}: " + rng.choice([
                                "the stock level was decremented twice when a reservation expired; fixed and tested.",
                                "the change is in place and the tests pass.",
                                "I found the cause and left a regression test next to the fix.",
                            ]), id=f"m{len(msgs):03d}"))
    return Conversation(msgs, id="demo", system=SYSTEM_PROMPT, tools=TOOLS, source_format="builtin",
                        source="ctxfold.demo")
