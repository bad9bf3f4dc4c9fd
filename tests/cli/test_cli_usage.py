"""What a new user meets at the command line: a failing summarizer is visible, impossible settings
are refused in one line before any work, messages use plain words, and runs over many files go on
past a bad one. Each case checks the exact message and exit code."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxfold.cli import EXIT_INPUT, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from ctxfold.cli.replay_report import trigger_lines
from ctxfold.compaction.config import CompactConfig
from ctxfold.errors import CtxfoldError
from helpers.cli_helpers import ctxfold_process, run_ctxfold, run_main

ctxfold = run_ctxfold  # in this process (see helpers.cli_helpers); serving on a port takes a process


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port nobody listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


# -- a summarizer that fails is visible ---------------------------------------------------------------------

REFUSED = "openai:m: HTTP transport error: ConnectError: All connection attempts failed"


def test_a_failing_summarizer_is_named_on_the_line_in_the_report_and_at_the_end(closed_port: int) -> None:
    proc = ctxfold("replay", "--demo", "--summarizer", f"http://127.0.0.1:{closed_port}/v1", "--model", "m",
                   "--json", "-", "--summary-lines", "0")
    assert proc.returncode == EXIT_OK, proc.stderr
    (entry,) = json.loads(proc.stdout)["conversations"]
    summaries = [e for e in entry["events"] if e["kind"] == "summary" and e["applied"]]
    n = len(summaries)
    assert n >= 3
    assert [e["summary_failure"] for e in summaries] == [REFUSED] * n
    rebuilt = [line for line in proc.stderr.splitlines() if "rebuilding context" in line]
    assert len(rebuilt) == n and all(line.endswith(f"(extractive fallback: {REFUSED})") for line in rebuilt)
    assert (f"ctxfold: warning: {n} of {n} summaries fell back to the extractive summary because the summarizer "
            f"failed: {REFUSED} ({n} times)") in proc.stderr.splitlines()


def test_strict_summarizer_makes_a_fallback_exit_1(closed_port: int) -> None:
    proc = ctxfold("replay", "--demo", "--summarizer", f"http://127.0.0.1:{closed_port}/v1", "--model", "m",
                   "--strict-summarizer", "--quiet")
    assert proc.returncode == EXIT_PROBLEM
    (line,) = proc.stderr.splitlines()
    assert re.fullmatch(r"ctxfold: problem: --strict-summarizer: ([0-9]+) of \1 summaries fell back to the extractive "
                        rf"summary because the summarizer failed: {re.escape(REFUSED)} \(\1 times\)", line), line


def test_strict_summarizer_in_compact(closed_port: int, tmp_path: Path, traces_dir: Path) -> None:
    trace = traces_dir / "deepseek_sample" / "deepseek_reasoner" / "sqlfluff__sqlfluff-2419.traj.json"
    url = f"http://127.0.0.1:{closed_port}/v1"
    lax = ctxfold("compact", str(trace), "-o", str(tmp_path / "a.json"), "--summarizer", url, "--model", "m")
    assert lax.returncode == EXIT_OK, lax.stderr
    # The reason as the summarizer (or its chunks, when the request leaves no room) gave it.
    assert "summary by extractive (fallback: " in lax.stderr and "All connection attempts failed" in lax.stderr
    strict = ctxfold("compact", str(trace), "-o", str(tmp_path / "b.json"), "--summarizer", url, "--model", "m",
                     "--strict-summarizer", "--quiet")
    assert strict.returncode == EXIT_PROBLEM
    (line,) = strict.stderr.splitlines()
    assert re.search(r": the summarizer failed \(.*All connection attempts failed.*\); the extractive summary stood "
                     r"in \(--strict-summarizer\)$", line), line


# -- impossible settings: one line, exit 2, before any work ------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["replay", "--demo", "--ctx", "10"], ("ctxfold: error: --ctx 10: the context window must be at least 512 "
         "tokens; a smaller one cannot hold a prompt and an answer")),
        (["replay", "--demo", "--ctx", "10000000000"], ("ctxfold: error: --ctx 10000000000: the context window must "
         "be at most 16,777,216 tokens (16M); no model has a larger one")),
        (["serve", "--upstream", "http://127.0.0.1:9/v1", "--ctx", "32M"], ("ctxfold: error: --context-tokens "
         "33554432: the context window must be at most 16,777,216 tokens (16M); no model has a larger one")),
        (["replay", "--demo", "--ctx", "-5"], ("ctxfold replay: error: argument --ctx: '-5' must be a positive whole "
         "number (e.g. 16384 or 16k) (see ctxfold replay --help)")),
        (["replay", "--demo", "--ctx", "0"], ("ctxfold replay: error: argument --ctx: '0' must be a positive whole "
         "number (e.g. 16384 or 16k) (see ctxfold replay --help)")),
        (["replay", "--demo", "--reply-reserve", "20000"], ("ctxfold: error: --reply-reserve 20000: the reply "
         "reserve (20000 tokens) must leave at least 256 tokens of the 16384-token window for the prompt, so 0 to "
         "16128; lower it or widen the window with --ctx")),
        (["replay", "--demo", "--reply-reserve", "-1"], ("ctxfold replay: error: argument --reply-reserve: '-1' "
         "must be 0 or a positive whole number (see ctxfold replay --help)")),
        (["replay", "--demo", "--ctx", "1k", "--page-size", "2k"], ("ctxfold: error: --page-size 2048: a KV cache "
         "page cannot be larger than the 1024-token window, so 1 to 1024")),
        (["replay", "--demo", "--strict-summarizer"], ("ctxfold: error: --strict-summarizer: the extractive "
         "summarizer cannot fail; the option is for a model's endpoint (--summarizer URL --model NAME)")),
        (["replay", "--demo", "--plot-only", "demo*"], ("ctxfold: error: --plot-only chooses the conversations of a "
         "plot: add --plot FILE.png")),
        (["compact", "x.json", "-o", "y.json", "--ctx", "100"], ("ctxfold: error: --ctx 100: the context window "
         "must be at least 512 tokens; a smaller one cannot hold a prompt and an answer")),
        (["serve", "--upstream", "http://127.0.0.1:9/v1", "--ctx", "10"], ("ctxfold: error: --context-tokens 10: "
         "the context window must be at least 512 tokens; a smaller one cannot hold a prompt and an answer")),
        (["serve", "--upstream", "http://127.0.0.1:9/v1", "--ctx", "16k", "--reply-reserve-tokens", "20000"],
         ("ctxfold: error: --reply-reserve-tokens 20000: the reply reserve (20000 tokens) must leave at least 256 "
         "tokens of the 16384-token window for the prompt, so 0 to 16128; lower it or widen the window with "
         "--context-tokens")),
        (["serve", "--upstream", "http://127.0.0.1:9/v1", "--ctx", "16k", "--max-output-tokens", "16k"],
         ("ctxfold: error: --max-output-tokens 16384: the reply reserve (16384 tokens) must leave at least 256 "
         "tokens of the 16384-token window for the prompt, so 0 to 16128; lower it or widen the window with "
         "--context-tokens")),
        (["serve", "--upstream", "127.0.0.1:8000"], ("ctxfold serve: error: argument --upstream: '127.0.0.1:8000' is "
         "not an http(s) URL; expected the base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 "
         "(see ctxfold serve --help)")),
        (["serve", "--upstream", "http://127.0.0.1:9/v1", "--port", "99999"], ("ctxfold serve: error: argument "
         "--port: 99999 is outside the port range 0 to 65535 (see ctxfold serve --help)")),
        (["serve", "--upstream", "http://127.0.0.1:9/v1", "--connect-timeout-s", "-1"], ("ctxfold serve: error: "
         "argument --connect-timeout-s: '-1' must be a finite number of seconds above 0 (see ctxfold serve --help)")),
        (["serve", "--upstream", "http://127.0.0.1:9/v1", "--summarizer", "config"], ("ctxfold: error: --summarizer "
         "config: reads the summarizer section of --config FILE; add --config, or choose --summarizer upstream or "
         "extractive")),
    ],
)
def test_impossible_settings_are_one_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                 expected: str) -> None:
    monkeypatch.chdir(tmp_path)  # serve would make its data directory here, were it to start
    code, out, err = run_main(capsys, *argv)
    assert (code, out, err.splitlines()) == (EXIT_USAGE, "", [expected])
    assert not (tmp_path / "ctxfold-data").exists()  # refused before any work


@pytest.mark.parametrize("extra", [[], ["--tokenizer", "estimate:deepseek-v4", "--template", "deepseek-v4"],
                                   ["--tokenizer", "chars4", "--template", "chatml"]])
def test_kv_plan_tokens_names_the_flags_it_needs(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    code, out, err = run_main(capsys, "replay", "--demo", "--kv-plan", "tokens", *extra)
    assert (code, out) == (EXIT_USAGE, "")
    assert err.splitlines() == [
        ("ctxfold: error: --kv-plan tokens: plans over token ids, so it needs a tokenizer.json tokenizer and its chat "
        "template: add --tokenizer deepseek-v4 --template deepseek-v4 (or --tokenizer qwen3 --template chatml), or "
        "use --kv-plan segments")]


def test_a_window_set_in_a_config_file_is_named_by_its_key(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    cfg = tmp_path / "compact.toml"
    cfg.write_text("context_tokens = 300\n")
    code, _, err = run_main(capsys, "replay", "--demo", "--config", str(cfg))
    assert (code, err.splitlines()) == (EXIT_USAGE, [
        (f"ctxfold: error: context_tokens 300 in {cfg}: the context window must be at least 512 tokens; a smaller "
        "one cannot hold a prompt and an answer")])


def test_serve_data_dir_that_is_a_file_is_an_input_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    file = tmp_path / "data"
    file.write_text("")
    code, _, err = run_main(capsys, "serve", "--upstream", "http://127.0.0.1:9/v1", "--data-dir", str(file))
    assert (code, err.splitlines()) == (EXIT_INPUT, [(f"ctxfold: error: --data-dir {file}: exists and is not a "
                                                     "directory")])


def test_serve_on_a_port_in_use_is_an_input_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = ctxfold_process("serve", "--upstream", "http://127.0.0.1:9/v1", "--port", str(port), "--data-dir",
                       str(tmp_path / "data"), timeout=60)
    assert proc.returncode == EXIT_INPUT
    assert proc.stderr.splitlines() == [(f"ctxfold: error: --host 127.0.0.1 --port {port}: cannot listen there "
                                        "(Address already in use); choose another port, or --port 0 for any free one")]


def test_serve_help_documents_every_exit_code_it_uses(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_main(capsys, "serve", "--help")
    assert "4 tokenizer or package (the serve extra) unavailable" in " ".join(out.split())


# -- plain words -----------------------------------------------------------------------------------------------


def test_policy_help_says_what_ds4_and_datus_are(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_main(capsys, "replay", "--help")
    text = " ".join(out.split())
    assert "ds4 (soft and hard triggers, after the ds4 inference engine: summarize near the window's end)" in text
    assert ("datus (archive and summary passes, after the Datus agent framework: old tool outputs go to an "
            "archive first, a summary when that is not enough)") in text


def test_compaction_reasons_use_plain_words() -> None:
    proc = ctxfold("replay", "--demo", "--summary-lines", "0")
    assert proc.returncode == EXIT_OK, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "COMPACTING" in line]
    reasons = {line.split("COMPACTING ", 1)[1].split(":")[0] for line in lines
               if "rebuilding" not in line and "KV plan" not in line and "cost:" not in line}
    # Which passes fire depends on when the minimum-gain rule lets a summary go: the reasons are words all the same.
    assert "mid-turn occupancy over 75% of the window" in reasons
    assert reasons <= {"mid-turn occupancy over 75% of the window", "soft limit before tool continuation",
                       "soft limit before user turn"}
    # No config key (minor.mid_turn_token_threshold, keep_recent_user_turns) and no BOTTOM on any line.
    assert not [line for line in lines if re.search(r"\b[a-z]+[._][a-z_]+\b|BOTTOM", line)]


def test_a_conversation_with_nothing_to_summarize_says_so_plainly(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.json"
    trace.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}))
    proc = ctxfold("compact", str(trace), "-o", str(tmp_path / "out.json"))
    assert proc.returncode == EXIT_PROBLEM
    assert proc.stderr.splitlines() == [("ctxfold: problem: tiny: not compacted (nothing to summarize: what comes "
                                        "before the newest messages is too short or already a summary); written "
                                        "unchanged")]


def test_an_unknown_format_names_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "weather.json"
    bad.write_text('{"weather": "sunny"}')
    code, _, err = run_main(capsys, "count", str(bad))
    assert code == EXIT_INPUT
    assert err.strip().endswith("(choose one: --format NAME on the command line, format= in Python)")


def test_plot_legend_names_the_policies_not_internal_keys() -> None:
    assert list(trigger_lines(CompactConfig.preset("both", context_tokens=16384))) == [
        "soft trigger (ds4 policy)", "summary threshold (datus policy)", "mid-turn archive threshold (datus policy)"]


# -- runs over many files --------------------------------------------------------------------------------------


def test_lenient_replay_skips_a_bad_file_and_goes_on(tmp_path: Path, traces_dir: Path) -> None:
    good = traces_dir / "claude_code_small" / "tool_heavy.jsonl"
    empty = tmp_path / "empty.json"
    empty.write_text("")
    missing = tmp_path / "missing.json"
    proc = ctxfold("replay", str(empty), str(good), str(missing), "--lenient", "--quiet", "--json", "-")
    assert proc.returncode == EXIT_PROBLEM
    assert [e["file"] for e in json.loads(proc.stdout)["conversations"]] == [str(good)]
    assert proc.stderr.splitlines() == [
        f"ctxfold: warning: {empty}: empty input; expected a JSON document or JSON lines; file skipped",
        f"ctxfold: warning: {missing}: no such file; expected a trace file (JSON or JSONL); file skipped",
        f"ctxfold: problem: 2 files skipped (unreadable or no conversation): {empty}, {missing}",
    ]
    strict = ctxfold("replay", str(empty), str(good), "--quiet")
    assert strict.returncode == EXIT_INPUT  # without --lenient the first bad file stops the run
    only_bad = ctxfold("replay", str(empty), "--lenient", "--quiet")
    assert only_bad.returncode == EXIT_INPUT
    assert only_bad.stderr.splitlines()[-1] == "ctxfold: error: no conversation to replay: the file was skipped"


@pytest.mark.slow
def test_calibrate_says_which_corpus_files_it_skipped(tmp_path: Path, traces_dir: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "short.jsonl").write_bytes((traces_dir / "claude_code_small" / "short.jsonl").read_bytes())
    (corpus / "empty.jsonl").write_text("")
    (corpus / "blank.json").write_text('{"messages": []}')
    proc = ctxfold("calibrate", "--tokenizer", "qwen3", "--corpus", str(corpus), "-o", str(tmp_path / "cal.json"))
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stderr.splitlines() == [
        f"ctxfold: warning: {corpus / 'blank.json'}: its conversations hold no text; file skipped",
        f"ctxfold: warning: {corpus / 'empty.jsonl'}: empty file; file skipped",
    ]


def _subagent_file(path: Path) -> Path:
    """A Claude Code subagent's own transcript: sidechain records only."""
    turns = [("user", "find the bug"), ("assistant", "looking"), ("user", "thanks"), ("assistant", "done")]
    path.write_text("".join(json.dumps({"type": role, "isSidechain": True, "agentId": "a1b2", "sessionId": "sess-1",
                                        "uuid": f"u{i}", "message": {"role": role, "content": text}}) + "\n"
                            for i, (role, text) in enumerate(turns)))
    return path


def test_a_subagent_file_alone_has_no_empty_parent_row(tmp_path: Path) -> None:
    trace = _subagent_file(tmp_path / "agent-a1b2.jsonl")
    proc = ctxfold("replay", str(trace), "--json", "-", "--quiet")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert [(e["label"], e["requests"]) for e in json.loads(proc.stdout)["conversations"]] == [
        ("sess-1_agent-a1b2", 2)]


# -- plots ------------------------------------------------------------------------------------------------------


def test_a_conversation_without_requests_gets_no_panel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = tmp_path / "two.jsonl"
    trace.write_text(json.dumps({"id": "asked", "messages": [{"role": "user", "content": "hello?"}]}) + "\n"
                     + json.dumps({"id": "answered", "messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "hello"}]}) + "\n")
    png = tmp_path / "p.png"
    proc = ctxfold("replay", str(trace), "--plot", str(png))
    assert proc.returncode == EXIT_OK, proc.stderr
    assert f"plot: {png} (1 of 2 conversations; 1 without a model request not drawn)" in proc.stderr.splitlines()
    assert png.stat().st_size > 0


def _entry(label: str, overflows: int) -> dict[str, object]:
    return {"label": label, "occupancy": [1000, 9000, 17000, 5000], "overflows": overflows, "orphans": 3,
            "compactions": {"summary": 1, "archive": 2},
            "events": [{"request": 2, "kind": "summary", "applied": True, "tokens_before": 17000,
                        "tokens_after": 5000}], "peak_occupancy_tokens": 17000}


@pytest.mark.parametrize("num_panels", [1, 2, 6])
def test_long_red_titles_stay_above_their_own_panel(num_panels: int) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.text import Text

    from ctxfold.plot import figure

    label = "491e126e-1e71-469c-ade2-fcc8af567c74_agent-afb92ff-" + "x" * 30
    entries = [_entry(f"{label}{k}", overflows=12) for k in range(num_panels)]
    fig, n = figure(entries, context_tokens=16384)
    assert n == num_panels
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == num_panels
    right_edge = fig.bbox.x1
    for ax in axes:
        (text,) = [c for c in ax.get_children() if isinstance(c, Text) and c.get_text() == ax.get_title(loc="left")]
        assert "[12 over the window; 3 orphans]" in " ".join(text.get_text().split())
        assert text.get_color() == "#b00000"
        title = text.get_window_extent(renderer)
        # Its own column: from the panel's left edge to the next panel's (or the figure's) edge.
        x0 = ax.get_window_extent(renderer).x0
        neighbours = [o.get_window_extent(renderer).x0 for o in axes if o.get_window_extent(renderer).x0 > x0 + 1]
        limit = min(neighbours, default=right_edge)
        assert title.x1 <= limit, (text.get_text(), title.x1, limit)


@pytest.mark.parametrize("num_panels", [1, 3])
def test_the_figure_is_titled_as_asked_not_after_its_last_panel(num_panels: int) -> None:
    pytest.importorskip("matplotlib")
    from ctxfold.plot import figure

    fig, _ = figure([_entry(f"conversation {k}", overflows=0) for k in range(num_panels)], context_tokens=16384,
                    title="ctxfold replay: policy both, ctx 16k")
    assert fig.get_suptitle() == "ctxfold replay: policy both, ctx 16k"


# -- error classes ----------------------------------------------------------------------------------------------


def test_serve_errors_are_ctxfold_errors() -> None:
    pytest.importorskip("httptools")
    from ctxfold.serve.app import BadRequest
    from ctxfold.serve.upstream import UpstreamError, UpstreamTimeout

    assert issubclass(UpstreamError, CtxfoldError) and issubclass(BadRequest, CtxfoldError)
    assert issubclass(UpstreamTimeout, TimeoutError)  # its other base kept
    assert BadRequest(400, "bad", code="x").status == 400
