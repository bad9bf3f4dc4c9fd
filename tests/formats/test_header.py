"""What a trace lacks for exact counting: the system prompt and the tool definitions.

- mini-swe-agent trajectories do not record the ``bash`` tool the agent sends; the importer fills it
  in, and ``count --tokenizer deepseek-v4 --template deepseek-v3.2`` then predicts every recorded
  prompt of the DeepSeek sample runs exactly;
- ``--tools FILE`` and ``--system FILE`` supply them for ``count``, ``replay`` and ``compact``; a bad
  file is exit 3 in one line naming it; a file that replaces what the trace records says so;
- ``count`` says what a trace lacks (Claude Code: its system prompt and tools) and how far that
  explains the gap to the recorded usage;
- the hosted DeepSeek API counts one token fewer after a user message that directly follows tool
  results: the ``deepseek-v3.2-api`` preset.

These run ``ctxfold.cli.main(argv)`` in process.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat import formats
from ctxfold.chat.formats.header import (
    FILLED_IN,
    MINI_SWE_AGENT_BASH,
    fill_known_defaults,
    read_system,
    tools_from_value,
)
from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.cli import EXIT_INPUT, EXIT_OK
from ctxfold.errors import FormatError
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import load_counter
from ctxfold.tokens.templates import DEEPSEEK_V32, DEEPSEEK_V32_API, Renderer, RenderOptions, get_template
from helpers.cli_helpers import run_main

BASH_OPENAI = {"type": "function", "function": {"name": "bash", "description": "Execute a bash command",
                                                "parameters": dict(MINI_SWE_AGENT_BASH.parameters)}}
BASH_ANTHROPIC = {"name": "bash", "description": "Execute a bash command",
                  "input_schema": dict(MINI_SWE_AGENT_BASH.parameters)}


def count_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, Any], str]:
    code, out, err = run_main(capsys, "count", *argv, "--json", "-")
    assert code == EXIT_OK, err
    return json.loads(out), err


def mini_swe_agent_runs(traces_dir: Path) -> list[Path]:
    runs = sorted((traces_dir / "deepseek_sample").glob("*/*.traj.json"))
    assert len(runs) == 4
    return runs


# -- mini-swe-agent: the bash tool is filled in --------------------------------------------------------------


@pytest.mark.parametrize("template", ["deepseek-v3.2", "deepseek-v3.2-api"])
def test_count_predicts_every_recorded_deepseek_prompt_exactly(capsys: pytest.CaptureFixture[str], traces_dir: Path,
                                                               template: str) -> None:
    requests = exact = 0
    for path in mini_swe_agent_runs(traces_dir):
        doc, _ = count_json(capsys, str(path), "--tokenizer", "deepseek-v4", "--template", template)
        (c,) = doc["conversations"]
        assert c["header"] == {"system": "recorded", "tools": "filled in"}
        pairs = [(r["predicted_prompt_tokens"], r["recorded_prompt_tokens"]) for r in c["requests"]]
        assert all(rec is not None for _, rec in pairs), path
        requests += len(pairs)
        exact += sum(p == rec for p, rec in pairs)
        assert doc["notes"] == [("filled in tools: the bash tool mini-swe-agent 2.2.7 sends with every request "
                                "(the trajectory does not record it); --tools FILE gives others")]
    assert (requests, exact) == (217, 217)


def test_without_the_tool_every_request_is_300_tokens_short(capsys: pytest.CaptureFixture[str],
                                                             traces_dir: Path) -> None:
    """Read as a plain OpenAI file (the final 'exit' record skipped), the run has no tool definitions:
    count names what is missing, the steady gap, and --tools closes it."""
    path = traces_dir / "deepseek_sample" / "deepseek_chat" / "pydicom__pydicom-1256.traj.json"
    argv = (str(path), "--tokenizer", "deepseek-v4", "--template", "deepseek-v3.2", "--format", "openai", "--lenient")
    doc, _ = count_json(capsys, *argv)
    (c,) = doc["conversations"]
    assert c["header"] == {"system": "recorded", "tools": "missing"} and c["tools_called"] == ["bash"]
    assert {r["recorded_prompt_tokens"] - r["predicted_prompt_tokens"] for r in c["requests"]} == {300}
    assert doc["notes"] == [("the trace records no tool definitions (tools called here: bash); recorded usage is "
                            "300 tokens above the count (median of 49 requests) and steady, as tool definitions "
                            "of that size would leave it; --tools FILE supplies them")]
    code, out, _ = run_main(capsys, "count", *argv)
    assert code == EXIT_OK and "\nnote: the trace records no tool definitions" in out


@pytest.mark.parametrize("shape", ["openai list", "openai object", "openai flat", "anthropic"])
def test_tools_file_in_either_shape_makes_the_count_exact(capsys: pytest.CaptureFixture[str], traces_dir: Path,
                                                           tmp_path: Path, shape: str) -> None:
    flat = {"type": "function", **BASH_OPENAI["function"]}  # type: ignore[dict-item]
    value = {"openai list": [BASH_OPENAI], "openai object": {"tools": [BASH_OPENAI]}, "openai flat": [flat],
             "anthropic": {"tools": [BASH_ANTHROPIC]}}[shape]
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(value))
    path = traces_dir / "deepseek_sample" / "deepseek_reasoner" / "sqlfluff__sqlfluff-2419.traj.json"
    doc, err = count_json(capsys, str(path), "--tokenizer", "deepseek-v4", "--template", "deepseek-v3.2",
                          "--format", "openai", "--lenient", "--tools", str(tools))
    (c,) = doc["conversations"]
    assert c["header"]["tools"] == f"from {tools}"
    assert len(c["requests"]) == 55
    assert all(r["predicted_prompt_tokens"] == r["recorded_prompt_tokens"] for r in c["requests"])
    assert doc["notes"] == []
    assert "replaces" not in err  # the trace had no tools of its own: nothing to say


def test_tools_file_over_a_filled_in_default(capsys: pytest.CaptureFixture[str], traces_dir: Path,
                                             tmp_path: Path) -> None:
    """The user's file wins over the default, silently (the trace itself recorded nothing)."""
    path = traces_dir / "deepseek_sample" / "deepseek_chat" / "pydicom__pydicom-1256.traj.json"
    none = tmp_path / "none.json"
    none.write_text("[]")
    doc, err = count_json(capsys, str(path), "--tokenizer", "deepseek-v4", "--template", "deepseek-v3.2",
                          "--tools", str(none))
    (c,) = doc["conversations"]
    assert c["header"]["tools"] == f"from {none}" and doc["notes"] == []
    assert {r["recorded_prompt_tokens"] - r["predicted_prompt_tokens"] for r in c["requests"]} == {300}
    assert err == ""


def test_filled_in_only_where_the_agent_sent_it(traces_dir: Path) -> None:
    path = traces_dir / "deepseek_sample" / "deepseek_chat" / "pydicom__pydicom-1256.traj.json"
    (conv,) = formats.load(path)
    assert conv.tools == (MINI_SWE_AGENT_BASH,)
    assert "mini-swe-agent 2.2.7" in conv.meta[FILLED_IN]["tools"]
    raw = json.loads(path.read_text())

    def loaded(**info: Any) -> Conversation:
        doc = {**raw, "info": {**raw["info"], **info}}
        (c,) = formats.loads(json.dumps(doc))
        return c

    assert loaded().tools == (MINI_SWE_AGENT_BASH,)
    assert loaded(mini_version="1.17.5").tools == ()  # 1.x parsed commands from text: no tools sent
    config = {**raw["info"]["config"], "model_type": "minisweagent.models.litellm_textbased_model.LitellmTextbasedModel"}
    assert loaded(config=config).tools == ()
    assert FILLED_IN not in loaded(mini_version="1.17.5").meta
    # Recorded tools are kept; a run that never calls bash gets nothing.
    own = ToolSpec(name="bash", description="mine")
    kept = fill_known_defaults(replace(conv, tools=(own,), meta={k: v for k, v in conv.meta.items() if k != FILLED_IN}))
    assert kept.tools == (own,) and FILLED_IN not in kept.meta
    quiet = Conversation(messages=[m for m in conv.messages if not m.tool_calls and m.role is not Role.TOOL],
                         source_format="mini_swe_agent", meta={"mini_swe_agent": conv.meta["mini_swe_agent"]})
    assert fill_known_defaults(quiet).tools == ()


# -- Claude Code: count names what the transcript lacks ----------------------------------------------------------


def test_count_names_what_a_claude_code_transcript_lacks(capsys: pytest.CaptureFixture[str], traces_dir: Path) -> None:
    files = sorted((traces_dir / "claude_code_small").glob("*.jsonl"))
    assert len(files) == 3
    for path in files:
        doc, _ = count_json(capsys, str(path))
        for c in doc["conversations"]:
            assert c["header"] == {"system": "missing", "tools": "missing"}
        (note,) = doc["notes"]
        assert note.startswith("the trace lacks the system prompt and tool definitions Claude Code sends with every "
                               "request (tools called here: "), note
        gaps = sorted(r["recorded_prompt_tokens"] - r["predicted_prompt_tokens"]
                      for c in doc["conversations"] for r in c["requests"])
        median = gaps[len(gaps) // 2] if len(gaps) % 2 else (gaps[len(gaps) // 2 - 1] + gaps[len(gaps) // 2]) // 2
        assert median > 15000
        assert f"{median / 1000:.1f}k tokens above the count" in note, note
        assert note.endswith("--system FILE and --tools FILE supply them")
        code, out, _ = run_main(capsys, "count", str(path))
        assert code == EXIT_OK and out.count("\nnote: the trace lacks the system prompt and tool definitions") == 1


def test_system_and_tools_files_fill_a_claude_code_transcript(capsys: pytest.CaptureFixture[str], traces_dir: Path,
                                                             tmp_path: Path) -> None:
    path = traces_dir / "claude_code_small" / "short.jsonl"
    system, tools = tmp_path / "system.txt", tmp_path / "tools.json"
    system.write_text("You are Claude Code.\n")
    tools.write_text(json.dumps([{"name": "Bash", "description": "Run a command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}}}]))
    before, _ = count_json(capsys, str(path))
    after, err = count_json(capsys, str(path), "--system", str(system), "--tools", str(tools))
    (b,), (a,) = before["conversations"], after["conversations"]
    assert a["header"] == {"system": f"from {system}", "tools": f"from {tools}"}
    assert after["notes"] == [] and err == ""
    assert a["fixed_tokens"] > b["fixed_tokens"]
    assert [m["tokens"] for m in a["messages"]] == [m["tokens"] for m in b["messages"]]
    assert read_system(system) == "You are Claude Code."  # the editor's final newline is not the prompt's


# -- the files: shared by count, replay and compact ---------------------------------------------------------------


def _small_trace(tmp_path: Path) -> Path:
    """A recorded system prompt and tool, and turns enough for a compaction to have something to do."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(8):
        msgs += [
            {"role": "user", "content": f"Step {i}: list the files of directory d{i} and say what is in them."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                "name": "bash", "arguments": json.dumps({"command": f"ls -l d{i}"})}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "\n".join(f"file{k}.txt" for k in range(60))},
            {"role": "assistant", "content": f"Directory d{i} holds sixty text files, file0 to file59."}]
    trace = tmp_path / "chat.json"
    trace.write_text(json.dumps({"messages": msgs, "tools": [BASH_OPENAI]}))
    return trace


def test_a_file_that_replaces_what_the_trace_records_says_so(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    trace = _small_trace(tmp_path)
    system, tools = tmp_path / "system.txt", tmp_path / "tools.json"
    system.write_text("Be thorough.")
    tools.write_text(json.dumps([BASH_ANTHROPIC, {"name": "python", "input_schema": {"type": "object"}}]))
    doc, err = count_json(capsys, str(trace), "--system", str(system), "--tools", str(tools))
    (line,) = err.strip().splitlines()
    assert line == (f"ctxfold: warning: {trace}: --system replaces the system prompt the trace records; "
                    "--tools replaces the tool definitions the trace records")
    assert doc["conversations"][0]["header"] == {"system": f"from {system}", "tools": f"from {tools}"}


@pytest.mark.parametrize("command", ["count", "replay", "compact"])
def test_the_three_commands_take_the_files_alike(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  command: str) -> None:
    trace = _small_trace(tmp_path)
    system = tmp_path / "system.txt"
    system.write_text("Be thorough.\n")
    extra = {"count": [], "replay": ["--quiet", "--json", str(tmp_path / "r.json")],
             "compact": ["-o", str(tmp_path / "out.json"), "--quiet", "--ctx", "2k"]}[command]
    code, _, err = run_main(capsys, command, str(trace), "--system", str(system), *extra)
    assert code == EXIT_OK, err
    assert err.strip().splitlines() == [(f"ctxfold: warning: {trace}: --system replaces the system prompt the "
                                        "trace records")]
    if command == "compact":
        (out,) = formats.load(tmp_path / "out.json")
        assert out.system == "Be thorough."
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    code, _, err = run_main(capsys, command, str(trace), "--tools", str(bad), *extra)
    assert code == EXIT_INPUT
    (line,) = err.strip().splitlines()
    assert line.startswith(f"ctxfold: error: {bad}: not JSON (line 1, column 2")


@pytest.mark.parametrize(("option", "content", "expected"), [
    ("--tools", None, "no such file; expected a JSON file of tool definitions"),
    ("--tools", "dir", "is a directory; expected a JSON file of tool definitions"),
    ("--tools", '"bash"', "document is a JSON string; expected a JSON list of tool definitions"),
    ("--tools", '{"functions": []}', "an object without a 'tools' key; expected a JSON list"),
    ("--tools", '{"tools": {"name": "bash"}}', "'tools' is a JSON object; expected a JSON list"),
    ("--tools", '[{"type": "function", "function": {"description": "x"}}]',
     "'tools'[0].function.name is a JSON null; expected a string"),
    ("--tools", '[{"input_schema": {}}]', "'tools'[0].name is a JSON null; expected a string"),
    ("--tools", '[42]', "'tools'[0] is a JSON number; expected an object"),
    ("--tools", '[{"name": "a"}, {"name": "a"}]', "tool 'a' is defined twice"),
    ("--tools", b"\xff\xfe[]", "not UTF-8 text (byte 0); expected a JSON file of tool definitions"),
    ("--system", "", "is empty; expected the system prompt as text"),
    ("--system", "\n", "is empty; expected the system prompt as text"),
    ("--system", b"caf\xe9", "not UTF-8 text (byte 3); expected a text file holding the system prompt"),
])
def test_a_bad_file_is_exit_3_in_one_line_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str,
                                                   content: str | bytes | None, expected: str) -> None:
    trace = _small_trace(tmp_path)
    f = tmp_path / "header"
    if content == "dir":
        f.mkdir()
    elif isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content)
    code, out, err = run_main(capsys, "count", str(trace), option, str(f))
    assert code == EXIT_INPUT and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"ctxfold: error: {f}: {expected}"), lines[0]


def test_both_tool_shapes_become_the_same_definition() -> None:
    flat = {"type": "function", **BASH_OPENAI["function"]}  # type: ignore[dict-item]
    got = [tools_from_value(v) for v in ([BASH_OPENAI], [flat], {"tools": [BASH_ANTHROPIC]})]
    for (t,) in got:
        assert (t.name, t.description, dict(t.parameters)) == ("bash", MINI_SWE_AGENT_BASH.description,
                                                               dict(MINI_SWE_AGENT_BASH.parameters))
    r = Renderer(DEEPSEEK_V32)
    assert {r.render(Conversation([], tools=t)).text() for t in got} == {
        r.render(Conversation([], tools=(MINI_SWE_AGENT_BASH,))).text()}
    assert tools_from_value([]) == ()
    with pytest.raises(FormatError, match="expected a JSON list"):
        tools_from_value(None)


# -- the hosted DeepSeek API: one token fewer after a user message that follows tool results ----------------------


def _call(i: int) -> ToolCall:
    return ToolCall(id=f"c{i}", name="bash", arguments=json.dumps({"command": f"ls /tmp/{i}"}))


def _user_after_results() -> list[Message]:
    """A run whose user interjects right after tool results (twice), as an agent with a user in the
    loop would send it; none of the shared DeepSeek traces has this shape."""
    return [
        Message(Role.USER, "Find the config file.", id="u0"),
        Message(Role.ASSISTANT, "Looking.", id="a0", tool_calls=(_call(0), _call(1))),
        Message(Role.TOOL, "config.yml", id="t0", tool_call_id="c0"),
        Message(Role.TOOL, "", id="t1", tool_call_id="c1"),
        Message(Role.USER, "It is in /etc, not /tmp.", id="u1"),  # directly after tool results
        Message(Role.ASSISTANT, "Checking /etc.", id="a1", tool_calls=(_call(2),)),
        Message(Role.TOOL, "ctxfold.yml", id="t2", tool_call_id="c2"),
        Message(Role.ASSISTANT, "Found /etc/ctxfold.yml.", id="a2"),
        Message(Role.USER, "Open it.", id="u2"),  # after an assistant answer: no difference
        Message(Role.ASSISTANT, "Opening.", id="a3", tool_calls=(_call(3),)),
        Message(Role.TOOL, "key: value", id="t3", tool_call_id="c3"),
        Message(Role.USER, "Thanks, that is all.", id="u3"),  # directly after a tool result again
    ]


def _after_results(msgs: list[Message], i: int) -> bool:
    return msgs[i].role is Role.USER and i > 0 and msgs[i - 1].role is Role.TOOL


@pytest.mark.parametrize("thinking", [False, True])
def test_hosted_api_counts_one_fewer_from_a_user_message_after_tool_results(thinking: bool) -> None:
    counter = load_counter("deepseek-v4")
    msgs = _user_after_results()
    opts = RenderOptions(thinking=thinking)
    header = Conversation([], system="You are a helpful assistant.", tools=(MINI_SWE_AGENT_BASH,))
    own = RequestAccounting(counter, DEEPSEEK_V32, options=opts)
    api = RequestAccounting(counter, DEEPSEEK_V32_API, options=opts)
    own.reset(header)
    api.reset(header)
    seen = 0
    for i, m in enumerate(msgs):
        seen += _after_results(msgs, i)
        own.append(m)
        api.append(m)
        # Every request from that message on is `seen` tokens fewer (one per such message); before, the same.
        assert api.total_tokens == own.total_tokens - seen, i
        # The incremental count is the count of the whole rendered prompt.
        view = Conversation(msgs[: i + 1], system=header.system, tools=header.tools)
        assert api.total_tokens == counter.count(Renderer(DEEPSEEK_V32_API).render(view, opts).text()), i
    assert seen == 2
    text = Renderer(DEEPSEEK_V32_API).render(Conversation(msgs), opts).text()
    assert "</function_results>\n\n<｜User｜>It is in /etc" in text
    assert "</function_results>\n\n</think><｜DSML｜" not in text and "</result>\n</function_results>\n\n" in text
    assert get_template("deepseek-v3.2-api") is DEEPSEEK_V32_API


def test_no_shared_deepseek_trace_has_a_user_message_after_tool_results(traces_dir: Path) -> None:
    """Why the rule is shown on a constructed conversation: on the shared runs both presets agree."""
    for path in mini_swe_agent_runs(traces_dir):
        (conv,) = formats.load(path)
        assert not any(_after_results(conv.messages, i) for i in range(len(conv.messages))), path
