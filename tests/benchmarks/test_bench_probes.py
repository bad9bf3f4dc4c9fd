"""The probe benchmark (bench/probes.py) on a tiny hand-made conversation: which probes its rules build,
and that a probe is answered exactly when its key text is in the view (or, with recall, in the archive)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType

import pytest

from ctxfold.chat.messages import Message, Role, ToolCall
from ctxfold.compaction.archive import ArchiveStore, MemoryBackend, make_marker
from helpers.bench_modules import bench_module

NEW_LINE = "    return load_yaml(path) or DEFAULT_CONFIG"


@pytest.fixture(scope="module")
def probes() -> Iterator[ModuleType]:
    with bench_module("probes.py") as module:
        yield module


def call(i: int, name: str, **arguments: object) -> Message:
    return Message(Role.ASSISTANT, "", id=f"a{i}", tool_calls=[ToolCall(f"c{i}", name, json.dumps(arguments))])


def result(i: int, text: str, *, is_error: bool = False) -> Message:
    return Message(Role.TOOL, text, id=f"t{i}", tool_call_id=f"c{i}", is_error=is_error)


def conversation() -> list[Message]:
    return [
        Message(Role.USER, "Please fix the crash in parse_config in src/app/config.py (issue #42). Thanks!", id="u0"),
        call(1, "str_replace_editor", command="str_replace", path="src/app/config.py",
             old_str="    return load_yaml(path)", new_str=f"    # fall back\n{NEW_LINE}\n"),
        result(1, "The file src/app/config.py has been edited."),
        call(2, "str_replace_editor", command="str_replace", path="src/app/missing.py", old_str="x", new_str="y = 1"),
        result(2, "ERROR: no such file src/app/missing.py", is_error=True),
        call(3, "bash", command="pytest tests/test_config.py"),
        result(3, "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad key 'port'"),
        call(4, "bash", command="pytest tests/test_config.py -x\necho done"),
        result(4, "collected 3 items\n3 passed in 0.12s"),
    ]


def test_probes_follow_the_rules(probes: ModuleType) -> None:
    got = {(p.kind, p.key) for p in probes.build_probes(conversation())}
    assert ("file changed", "src/app/config.py") in got
    assert ("last change to file", NEW_LINE.strip()) in got  # the longest line of the new string
    assert ("file changed", "src/app/missing.py") not in got  # the edit failed: nothing changed
    assert ("last error", "ValueError: bad key 'port'") in got
    assert ("error fixed", "collected 3 items") in got
    assert {k for kind, k in got if kind == "command run"} == {"pytest tests/test_config.py",
                                                                "pytest tests/test_config.py -x"}
    assert {"parse_config", "src/app/config.py", "#42"} <= {k for kind, k in got if kind == "user identifier"}
    assert ("open task", "Please fix the crash in parse_config in src/app/config.py (issue #42).") in got
    assert all(p.trail == (p.kind in {"file changed", "last change to file"}) for p in probes.build_probes(conversation()))


def test_a_shell_heredoc_is_a_change(probes: ModuleType) -> None:
    msgs = [call(1, "bash", command="cat > notes/plan.txt <<'EOF'\nstep one: reproduce the bug\nEOF"),
            result(1, ""), call(2, "bash", command="rm -f old.log"), result(2, "")]
    assert probes.file_changes(msgs) == {"notes/plan.txt": "step one: reproduce the bug", "old.log": None}


def test_a_probe_is_answered_only_where_its_key_is(probes: ModuleType) -> None:
    msgs = conversation()
    results = probes.Results()
    store = ArchiveStore(MemoryBackend())
    # The view keeps the user's message and the last two steps; the edit went to the archive.
    edit_text = probes.view_text(msgs[1:3])
    store.put(edit_text)
    view = [msgs[0], Message(Role.USER, make_marker(store.put(edit_text), edit_text, 0), id="m"), *msgs[5:]]
    probes.probe_point(msgs, view, store, probes.Counter(), results)
    tally = results.every
    assert tally["ctxfold"]["last change to file"] == [0, 1]  # not in the view
    assert tally["ctxfold + recall"]["last change to file"] == [1, 1]  # one search, one read
    assert tally["ctxfold"]["open task"] == [1, 1]
    assert tally["ctxfold"]["last error"] == [1, 1]
    # The tail of the same size drops the user's message first.
    assert tally["verbatim tail"]["open task"] == [0, 1]
    assert results.points == 1 and results.summary_points == 0 and not results.summarized
    assert 0 < results.fill["verbatim tail"][0] <= 1  # never over ctxfold's size


def test_an_error_is_a_line_that_starts_with_one(probes: ModuleType) -> None:
    listing = result(1, "212\t    raise KeyError(fmt.format(tag))\n213\t    return value")
    assert not probes._looks_error(listing)  # source code that names an error is not one
    assert probes._looks_error(result(2, "collected 1 item\nE   KeyError: 'port'"))
    assert probes._looks_error(result(3, "make: *** [Makefile:192: build] Error 2"))


def test_recall_needs_the_exact_key(probes: ModuleType) -> None:
    store = ArchiveStore(MemoryBackend())
    store.put("def parse_config(path):\n    return load_yaml(path)\n")
    assert probes.recalled(store, "return load_yaml(path)")
    assert not probes.recalled(store, "return LOAD_YAML(path)")  # the search ignores case; the probe does not
    assert not probes.recalled(store, "never archived")


def test_masking_replaces_old_outputs_only(probes: ModuleType) -> None:
    msgs = [m for i in range(probes.MASK_KEEP_OUTPUTS + 2) for m in (call(i, "bash", command=f"ls {i}"),
                                                                     result(i, f"output {i}"))]
    out = probes.masked(msgs)
    texts = [m.text for m in out if m.role is Role.TOOL]
    assert texts[:2] == [probes.MASK_PLACEHOLDER] * 2
    assert texts[2:] == [f"output {i}" for i in range(2, probes.MASK_KEEP_OUTPUTS + 2)]
