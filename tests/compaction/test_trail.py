"""The artifact trail: the files an agent changed, read from its tool calls, and carried by every summary.

Property tests draw random sequences of edits in the shapes real agents send (OpenHands' and SWE-agent's
``str_replace_editor``, Claude Code's ``Edit``/``Write``, shell commands of mini-swe-agent) and hold the trail
to a plain reference: the last change of each file, newest first, each file once. The shared traces hold it to
what the agents really did.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxfold.chat import formats
from ctxfold.chat.messages import CTXFOLD_SUMMARY_KEY, Message, Role, ToolCall
from ctxfold.compaction.summarize import CallableSummarizer, trim_to_tokens, with_trail
from ctxfold.compaction.summarize.extractive import extractive_summary
from ctxfold.compaction.trail import (
    TRAIL_TITLE,
    FileChange,
    artifact_trail,
    mentions,
    parse_trail,
    render_trail,
    shell_changes,
)
from ctxfold.tokens.counting import TokenCounter, load_counter

_NOT_TRACES = {"LICENSE", "LICENSE.md", "SOURCE.txt", "README.md"}


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return load_counter("deepseek-v4")


def _call(cid: str, name: str, **args: Any) -> Message:
    return Message(Role.ASSISTANT, "", tool_calls=(ToolCall(cid, name, json.dumps(args)),))


def _result(cid: str, text: str = "ok", *, error: bool = False) -> Message:
    return Message(Role.TOOL, text, tool_call_id=cid, is_error=error)


# -- random edit sequences against a reference ---------------------------------------------------------------

PATHS = ("src/app.py", "/workspace/lib/util.c", "tests/test_app.py", "README.md", "a.py")
# (shape, kind the trail reports for it on its own)
SHAPES = ("oh_create", "oh_replace", "oh_insert", "cc_edit", "cc_write", "sed", "redirect", "append", "rm", "touch")


def _edit(shape: str, cid: str, path: str, token: str) -> Message:
    if shape == "oh_create":
        return _call(cid, "str_replace_editor", command="create", path=path, file_text=f"{token}\n")
    if shape == "oh_replace":
        return _call(cid, "str_replace_editor", command="str_replace", path=path, old_str="x", new_str=token)
    if shape == "oh_insert":
        return _call(cid, "str_replace_editor", command="insert", path=path, insert_line=3, new_str=token)
    if shape == "cc_edit":
        return _call(cid, "Edit", file_path=path, old_string="x", new_string=token)
    if shape == "cc_write":
        return _call(cid, "Write", file_path=path, content=token)
    command = {"sed": f"sed -i 's/x/{token}/' {path}", "redirect": f"cd /repo && echo {token} > {path} && ls",
               "append": f"echo {token} >> {path} 2>/dev/null", "rm": f"rm -f {path}", "touch": f"touch {path}"}[shape]
    return _call(cid, "bash", command=command)


_EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("edit"), st.sampled_from(SHAPES), st.sampled_from(PATHS), st.booleans()),
        st.tuples(st.just("read"), st.sampled_from(("cat -n {p} | sed -n '1,20p'", "grep -n x {p} 2>&1",
                                                    "python -m pytest {p} 2>/dev/null")),
                  st.sampled_from(PATHS), st.just(False)),
        st.tuples(st.just("user"), st.just(""), st.just(""), st.just(False)),
    ),
    max_size=40,
)


def _conversation(events: list[tuple[str, str, str, bool]]) -> tuple[list[Message], dict[str, tuple[int, str]]]:
    """The messages, and the reference: path -> (message index, token) of its last change that took."""
    messages: list[Message] = [Message(Role.USER, "fix the bug")]
    expected: dict[str, tuple[int, str]] = {}
    for k, (what, shape, path, fails) in enumerate(events):
        cid = f"c{k}"
        if what == "user":
            messages.append(Message(Role.USER, f"and then step {k}"))
            continue
        if what == "read":
            messages.append(_call(cid, "bash", command=shape.format(p=path)))
            messages.append(_result(cid, "1  x = 1"))
            continue
        token = f"tok{k}"
        messages.append(_edit(shape, cid, path, token))
        # An editor that refuses changed nothing; a shell command's exit code says nothing of what it wrote.
        editor = shape.startswith(("oh_", "cc_"))
        messages.append(_result(cid, "ERROR: No replacement was performed" if fails else "ok",
                                error=fails and shape.startswith("cc_")))
        if not (fails and editor):
            expected.pop(path, None)
            expected[path] = (len(messages) - 2, token)
    return messages, expected


@settings(max_examples=150, deadline=None)
@given(_EVENTS, st.integers(1, 6))
def test_the_trail_is_the_last_change_of_each_file_newest_first(events: list[tuple[str, str, str, bool]],
                                                                 max_files: int) -> None:
    messages, expected = _conversation(events)
    trail = artifact_trail(messages)
    assert [c.path for c in trail] == list(reversed(expected))  # newest first, each file once
    assert len({c.path for c in trail}) == len(trail)
    assert [c.index for c in trail] == sorted((c.index for c in trail), reverse=True)
    for c in trail:
        index, token = expected[c.path]
        assert c.index == index and len(c.change) <= 160
        shape = next(e[1] for k, e in enumerate(events) if f"tok{k}" == token)
        assert (c.kind == "deleted") == (shape == "rm")
        # The change shows what was written (a whole file: how long it is).
        assert shape in ("rm", "touch", "oh_create", "cc_write") or token in c.change
    assert artifact_trail(messages, max_files=max_files) == trail[:max_files]  # bounded: the newest kept


@settings(max_examples=150, deadline=None)
@given(_EVENTS, st.integers(0, 900))
def test_the_section_is_bounded_and_keeps_the_newest(events: list[tuple[str, str, str, bool]],
                                                     max_chars: int) -> None:
    trail = artifact_trail(_conversation(events)[0])
    section = render_trail(trail, max_chars=max_chars)
    assert len(section) <= max_chars
    shown = parse_trail(section)
    assert [c.path for c in shown] == [c.path for c in trail[: len(shown)]]  # a prefix: the newest
    if trail and section:
        more = len(trail) - len(shown)
        assert (f"- ({more} older files not shown)" in section) == (more > 0)
    # A summary carrying the section hands the same trail on to the next one.
    carried = Message(Role.USER, "framed", summary=True, extra={CTXFOLD_SUMMARY_KEY: "notes\n\n" + section})
    assert [(c.path, c.kind, c.change) for c in artifact_trail([carried])] == [
        (c.path, c.kind, c.change) for c in shown]


# -- shell commands, SWE-agent commands, failures --------------------------------------------------------------


@pytest.mark.parametrize(("command", "expected"), [
    ("cat -n a.py | sed -n '1,20p'", []),
    ("find . -name '*.py' 2>/dev/null | head; pytest -x 2>&1 | tail", []),
    ("cd /testbed && echo 'x > y; rm z.py' > out.txt", [("out.txt", "written")]),
    ("cat > fix.py << 'EOF'\nopen('a.py', 'w').write('rm b.py > c.py')\nEOF\npython fix.py && rm fix.py",
     [("fix.py", "written"), ("fix.py", "deleted")]),
    ('git commit -m "first line\nrm -rf src > log.txt"', []),
    ("sed -i -e 's/a/b/' -e 's/c/d/' x.c y.c", [("x.c", "changed"), ("y.c", "changed")]),
    ("sed -i.bak 's/[0-9]*/N/g' nums.txt", [("nums.txt", "changed")]),
    ("mv old.py new.py && cp new.py copy.py", [("old.py", "deleted"), ("new.py", "written"), ("copy.py", "written")]),
    ("mkdir -p build/out && touch build/out/.keep", [("build/out", "created"), ("build/out/.keep", "created")]),
    ("python gen.py | tee -a log.txt", [("log.txt", "changed")]),
    ("git apply <<'EOF'\n--- a/s.py\n+++ b/s.py\n@@ -1 +1 @@\n-x\n+y\n--- a/gone.py\n+++ /dev/null\nEOF",
     [("s.py", "changed"), ("gone.py", "deleted")]),
    ("cat > p.diff <<EOF\n--- a/q.py\n+++ b/q.py\nEOF\npatch -p1 < p.diff", [("p.diff", "written"), ("q.py", "changed")]),
    ("apply_patch <<'EOF'\n*** Begin Patch\n*** Add File: n.py\n+x\n*** Delete File: o.py\n*** End Patch\nEOF",
     [("n.py", "created"), ("o.py", "deleted")]),
    ("rm -rf $TMP/*.o build/*", []),  # no path that can be named
])
def test_shell_commands_that_write(command: str, expected: list[tuple[str, str]]) -> None:
    assert [(p, k) for p, k, _ in shell_changes(command)] == expected


def test_swe_agent_edits_the_file_it_opened() -> None:
    fenced = [Message(Role.ASSISTANT, f"Now.\n```\n{cmd}\n```") for cmd in (
        "open src/fields.py 293", "edit 287:295\n    return round(x)\nend_of_edit", "create repro.py",
        "edit 1:1\nprint(1)\nend_of_edit", "python repro.py", "rm repro.py")]
    trail = artifact_trail(fenced)
    assert [(c.path, c.kind) for c in trail] == [("repro.py", "deleted"), ("src/fields.py", "changed")]
    assert 'edit 287:295: "return round(x)"' == trail[1].change
    calls = [_call("1", "open", path="a.py"), _call("2", "edit", search="x = 1", replace="x = 2"),
             _call("3", "create", filename="r.py"), _call("4", "insert", text="import os")]
    assert [(c.path, c.kind, c.change) for c in artifact_trail(calls)] == [
        ("r.py", "created", 'insert: "import os"'), ("a.py", "changed", 'edit: "x = 1" -> "x = 2"')]


def test_a_refused_edit_is_not_a_change_and_a_view_is_not_one() -> None:
    messages = [_call("1", "str_replace_editor", command="view", path="/w/a.py"), _result("1", "1 x"),
                _call("2", "str_replace_editor", command="str_replace", path="/w/a.py", old_str="q", new_str="r"),
                _result("2", "ERROR:\nNo replacement was performed, old_str `q` did not appear verbatim"),
                _call("3", "Edit", file_path="/w/b.py", old_string="q", new_string="r"),
                _result("3", "<tool_use_error>String to replace not found</tool_use_error>", error=True)]
    assert artifact_trail(messages) == []


def test_mentions_are_whole_paths() -> None:
    assert mentions("edited src/a.py: fixed", "src/a.py") and mentions("`a.py`.", "a.py")
    assert not mentions("data.py and a.pyc", "a.py") and mentions("see x.py", "./x.py")


# -- every summary carries it ----------------------------------------------------------------------------------

EDITS = [Message(Role.USER, "Fix the timedelta rounding."),
         _call("1", "str_replace_editor", command="str_replace", path="/repo/src/fields.py",
               old_str="return int(value)", new_str="return int(round(value))"),
         _result("1", "The file /repo/src/fields.py has been edited."),
         _call("2", "bash", command="cat > /repo/repro.py <<'EOF'\nprint(1)\nEOF"), _result("2", ""),
         _call("3", "bash", command="rm /repo/old_test.py"), _result("3", "")]


def test_a_model_summary_that_leaves_the_files_out_gets_them(counter: TokenCounter) -> None:
    text = "The user wants the rounding fixed. The fix is in and the reproduction passes. Next: run the tests."
    out, cut = with_trail(text, EDITS, max_tokens=400, counter=counter)
    assert out.startswith(text) and not cut
    assert parse_trail(out) == [
        FileChange("/repo/old_test.py", "deleted", "`rm /repo/old_test.py`", -1),
        FileChange("/repo/repro.py", "written", "`cat > /repo/repro.py <<'EOF'` (1 line)", -1),
        FileChange("/repo/src/fields.py", "changed",
                   'str_replace_editor str_replace: "return int(value)" -> "return int(round(value))"', -1)]
    assert with_trail(out, EDITS, max_tokens=400, counter=counter) == (out, False)  # nothing added twice


def test_a_model_summary_that_names_the_files_is_left_alone(counter: TokenCounter) -> None:
    text = ("Edited /repo/src/fields.py to round; wrote /repo/repro.py; deleted /repo/old_test.py.")
    assert with_trail(text, EDITS, max_tokens=400, counter=counter) == (text, False)
    # Only what it leaves out is added.
    partial = "Edited /repo/src/fields.py to round."
    out, _ = with_trail(partial, EDITS, max_tokens=400, counter=counter)
    assert [c.path for c in parse_trail(out)] == ["/repo/old_test.py", "/repo/repro.py"]
    assert out.count("/repo/src/fields.py") == 1


@pytest.mark.parametrize("max_tokens", [40, 60, 100, 400])
def test_the_summary_with_its_trail_stays_within_the_cap(counter: TokenCounter, max_tokens: int) -> None:
    many = [Message(Role.USER, "go")] + [m for k in range(40) for m in (
        _call(f"c{k}", "Write", file_path=f"/repo/pkg/module_{k}.py", content="x"), _result(f"c{k}"))]
    text = trim_to_tokens("A model summary that uses its whole cap. " * 40, max_tokens, counter)
    out, cut = with_trail(text, many, max_tokens=max_tokens, counter=counter)
    assert counter.count(out) <= max_tokens
    shown = parse_trail(out)
    assert cut == bool(shown)  # the summary's own text made room for the section
    assert counter.count(render_trail(shown, max_chars=10**6)) <= max(1, max_tokens // 4) + 12
    if shown:  # the newest first, then how many were left out
        assert shown[0].path == "/repo/pkg/module_39.py" and f"({40 - len(shown)} older files not shown)" in out


def test_the_extractive_summary_carries_the_trail_and_repeats_it_on_the_next_compaction(
        counter: TokenCounter) -> None:
    first = extractive_summary(EDITS, 400, counter=counter)
    assert counter.count(first) <= 400
    assert [c.path for c in parse_trail(first)] == ["/repo/old_test.py", "/repo/repro.py", "/repo/src/fields.py"]
    assert "inspected: /repo/src/fields.py" not in first  # a changed file is listed once, in the trail
    # The next compaction sees the summary, then one more edit: the trail keeps the older files after it.
    summary = Message(Role.USER, "[frame]", summary=True, extra={CTXFOLD_SUMMARY_KEY: first})
    later = [summary, _call("9", "Edit", file_path="/repo/README.md", old_string="a", new_string="b"), _result("9")]
    second = extractive_summary(later, 800, counter=counter)
    assert [c.path for c in parse_trail(second)] == [
        "/repo/README.md", "/repo/old_test.py", "/repo/repro.py", "/repo/src/fields.py"]
    assert second.count(f"## {TRAIL_TITLE}") == 1


def test_a_compaction_with_a_model_summary_adds_the_files_it_left_out(counter: TokenCounter) -> None:
    from ctxfold.chat.messages import Conversation
    from ctxfold.compaction.compactor import Compactor
    from ctxfold.compaction.config import CompactConfig

    said = "The user wants rounding fixed; it is fixed and verified. Next: the full test run."
    streamed: list[str] = []

    class Ui:
        def compaction_started(self, reason: str, kind: str) -> None: ...
        def summary_token(self, text: str) -> None:
            streamed.append(text)
        def compaction_finished(self, event: object) -> None: ...
        def prefill_progress(self, done_tokens: int, total_tokens: int) -> None: ...

    c = Compactor(Conversation([], id="t", system="You fix bugs."), counter=counter, observer=Ui(),
                  config=CompactConfig.preset("both", context_tokens=100_000),
                  summarizer=CallableSummarizer(lambda request: iter([said]), name="model"))
    for m in EDITS + [Message(Role.ASSISTANT, "Done. " + "Checked every case. " * 60), Message(Role.USER, "ok")]:
        c.append(m)
    event = c.compact_now("manual")
    assert event.applied and not event.summary_fallback and event.summary is not None
    assert event.summary.startswith(said)
    assert [x.path for x in parse_trail(event.summary)] == ["/repo/old_test.py", "/repo/repro.py",
                                                            "/repo/src/fields.py"]
    assert "".join(streamed) == event.summary  # the UI saw the added section too


# -- the shared traces -----------------------------------------------------------------------------------------

CODING_RUNS = ("deepseek_sample/", "openhands/multi_swe_bench_output.jsonl", "openhands/trajs_basic.json",
               "openhands/trajs_basic_gui_mode.json", "openhands/trajs_wrong_initial_state.json", "swe_agent/")


def _what_the_agent_sent(messages: list[Message]) -> str:
    """Every tool call's arguments (decoded, so escapes read as the agent meant them) and assistant text."""
    parts = []
    for m in messages:
        if m.role is Role.ASSISTANT:
            parts.append(m.text)
            for c in m.tool_calls:
                parts.append(c.arguments)
                try:
                    parts.append(json.dumps(json.loads(c.arguments), ensure_ascii=False))
                    parts.extend(str(v) for v in json.loads(c.arguments).values())
                except (ValueError, AttributeError):
                    pass
    return "\n".join(parts)


def test_the_trail_of_every_shared_trace(traces_dir: Path) -> None:
    seen_coding = 0
    for path in sorted(p for p in traces_dir.rglob("*") if p.is_file() and p.name not in _NOT_TRACES):
        rel = str(path.relative_to(traces_dir))
        for conv in formats.load(path):
            trail = artifact_trail(conv.messages)
            sent = _what_the_agent_sent(conv.messages)
            for c in trail:  # every file found is one the agent named in a call
                assert c.path in sent, (rel, c)
                assert re.fullmatch(r"[^\s`\"']+(?: [^\s`\"']+)*", c.path), (rel, c)
            assert len({c.path for c in trail}) == len(trail)
            if rel.startswith(CODING_RUNS) and "/agent-" not in conv.id:
                assert trail, f"{rel}:{conv.id}: a coding run with no changed file found"
                seen_coding += 1
            if rel.startswith("tau_bench/"):
                assert trail == [], rel  # booking flights changes no file
    assert seen_coding >= 12
