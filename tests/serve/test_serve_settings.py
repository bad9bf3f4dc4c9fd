"""Each setting of ``ctxfold serve`` is spelled once, in its ProxyConfig field: the flag, its default, its
check and the config all come from there. These tests fail when a setting gains a second spelling (a flag
added by hand beside the fields, a default that drifts) or loses one (a field no flag sets)."""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import pytest

from ctxfold.cli import EXIT_USAGE, build_parser
from ctxfold.cli.serve import build_config
from ctxfold.errors import ConfigError
from ctxfold.serve.config import CLI_DATA_DIR, HELP_GROUPS, TTL_BY_STORE, ProxyConfig
from ctxfold.settings import SAME, Check
from helpers.cli_helpers import one_error_line, run_main

UPSTREAM = "http://127.0.0.1:9/v1"
FIELDS = {f.name: f for f in fields(ProxyConfig)}
FLAGGED = [f for f in fields(ProxyConfig) if "flag" in f.metadata]
# The flags of `serve` that set no ProxyConfig field by themselves, each for a reason: how the command
# listens and logs, the compaction settings (CompactConfig's), secrets read from the environment, and an
# alias of a value of --fsync. Adding a setting's flag here instead of to its field fails the test below.
NOT_FIELDS = {"host", "port", "workers", "event_loop", "log_level", "log_format", "config", "context_tokens",
              "max_output_tokens", "reply_reserve_tokens", "summary_timeout_s", "summary_api_key_env",
              "operator_token_env", "debug", "help"}
# Fields whose command-line default is not an embedder's, each with its reason in the field's comment.
CLI_DEFAULTS = {"data_dir": CLI_DATA_DIR, "engine_check": "sampled", "stream_usage": True,
                "session_ttl_s": TTL_BY_STORE}  # 7 days with --store, none with the data directory


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser


def flag(f: Field[Any]) -> str:
    name: str = f.metadata["flag"].names[0]
    return name


def test_every_field_has_one_flag_or_says_what_sets_it() -> None:
    for f in fields(ProxyConfig):
        assert ("flag" in f.metadata) != ("via" in f.metadata), f.name
        assert "check" in f.metadata, f"{f.name}: unchecked"
    options = {opt for a in serve_parser()._actions for opt in a.option_strings}
    for f in fields(ProxyConfig):
        named = f.metadata["flag"].names if "flag" in f.metadata else f.metadata["via"].split(", ")
        assert set(named) <= options, f.name


def test_every_flag_sets_a_field_or_is_listed_as_not_one() -> None:
    dests = [a.dest for a in serve_parser()._actions]
    by_dest = {d: dests.count(d) for d in dests}
    assert set(by_dest) == set(FIELDS).difference({"compact", "summary_api_key", "operator_token"}) | NOT_FIELDS
    # One flag per setting (aliases are one flag's names): only --no-fsync shares its dest, as a shorthand.
    assert {d for d, n in by_dest.items() if n > 1} == {"fsync"}


def test_each_flag_is_listed_in_a_help_section() -> None:
    assert {f.metadata["flag"].group for f in FLAGGED} <= set(HELP_GROUPS)


def test_flag_defaults_are_the_fields_defaults() -> None:
    args = serve_parser().parse_args(["--upstream", UPSTREAM])
    differ = {f.name for f in FLAGGED if f.metadata["flag"].cli_default is not SAME}
    assert differ == set(CLI_DEFAULTS)
    for f in FLAGGED:
        if f.name == "upstream":  # required of both: no default
            assert f.default is MISSING and serve_parser()._option_string_actions["--upstream"].required
            continue
        own = f.default_factory() if f.default_factory is not MISSING else f.default
        expected = CLI_DEFAULTS.get(f.name, own)
        assert getattr(args, f.name) == expected, f.name
    # What the command builds from no flags is what an embedder builds from those values (the data
    # directory's sessions are kept: no TTL).
    assert build_config(args) == ProxyConfig(upstream=UPSTREAM, **{**CLI_DEFAULTS, "session_ttl_s": None})


def test_help_shows_the_default_the_flag_has(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_main(capsys, "serve", "--help")
    text = " ".join(out.split())
    for name, shown in (("max_body_bytes", "33554432"), ("connect_timeout_s", "10"), ("read_timeout_s", "600"),
                        ("client_timeout_s", "60"), ("store_url", None)):
        f = FIELDS[name]
        assert flag(f) in text
        if shown is not None:
            assert f"(default {shown})" in f.metadata["flag"].help.replace("{default}", shown)
            assert f"(default {shown}" in text
    assert "{default}" not in text


def _below(check: Check) -> float:
    """A value just outside the lower bound."""
    assert check.lo is not None
    if check.lo_open:
        return check.lo
    return check.lo - (1 if check.kind is int else 0.5)


def _at(check: Check) -> float:
    """The value at the lower bound (just above it when the bound is open)."""
    assert check.lo is not None
    return check.lo + 0.5 if check.lo_open else check.lo


NUMERIC = [f for f in FLAGGED if f.metadata["check"].kind in (int, float)]


def _text(value: float, kind: type) -> str:
    return str(int(value)) if kind is int else repr(float(value))


@pytest.mark.parametrize("f", NUMERIC, ids=lambda f: f.name)
def test_a_number_past_its_bound_is_a_usage_error_naming_the_flag(capsys: pytest.CaptureFixture[str],
                                                                   f: Field[Any]) -> None:
    check: Check = f.metadata["check"]
    code, out, err = run_main(capsys, "serve", "--upstream", UPSTREAM, f"{flag(f)}={_text(_below(check), check.kind)}")
    line = one_error_line(err)
    assert (code, out) == (EXIT_USAGE, "")
    assert line.startswith(f"ctxfold serve: error: argument {'/'.join(f.metadata['flag'].names)}: "), line
    assert f.name not in line  # the flag, not the field
    # The same bound, for an embedder: a ConfigError naming the field.
    with pytest.raises(ConfigError, match=f"^{f.name}: .* out of range"):
        ProxyConfig(upstream=UPSTREAM, data_dir=Path("d"), **{f.name: _below(check)})


@pytest.mark.parametrize("f", NUMERIC, ids=lambda f: f.name)
def test_the_bound_itself_is_taken_by_the_flag_and_the_field_alike(f: Field[Any]) -> None:
    check: Check = f.metadata["check"]
    args = serve_parser().parse_args(["--upstream", UPSTREAM, f"{flag(f)}={_text(_at(check), check.kind)}"])
    assert getattr(args, f.name) == _at(check)
    assert getattr(ProxyConfig(upstream=UPSTREAM, data_dir=Path("d"), **{f.name: _at(check)}), f.name) == _at(check)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-connections", "0"], "argument --max-connections: '0' must be a positive whole number (e.g. 16384 or 16k)"),
    (["--store-lease-ms", "99"], "argument --store-lease-ms: '99' must be a whole number of at least 100"),
    (["--max-recall-rounds", "-1"], "argument --max-recall-rounds: '-1' must be 0 or a positive whole number"),
    (["--read-timeout-s", "0"], "argument --read-timeout-s: '0' must be a finite number of seconds above 0"),
    (["--client-timeout-s", "inf"], "argument --client-timeout-s: 'inf' must be a finite number of seconds above 0"),
    (["--connect-timeout-s", "soon"], "argument --connect-timeout-s: 'soon' is not a number of seconds"),
    (["--fsync", "sometimes"], ("argument --fsync: invalid choice: 'sometimes' (choose from 'compactions', 'always', "
     "'never')")),
    (["--data-dir", ""], "argument --data-dir: '' is not a path; expected the name of a file or directory"),
    (["--tenant-key-file", ""], ("argument --tenant-key-file: '' is not a path; expected the name of a file or "
     "directory")),
    (["--tenant-header", "X Bad"], "argument --tenant-header: 'X Bad' is not an HTTP header name"),
    (["--store", "/var/sessions"], ("argument --store: '/var/sessions' is not a redis://, rediss://, unix:// or "
     "valkey:// URL")),
    (["--summary-timeout-s", "0"], "argument --summary-timeout-s: '0' must be a finite number of seconds above 0"),
])
def test_a_bad_value_of_each_kind_names_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                  message: str) -> None:
    code, out, err = run_main(capsys, "serve", "--upstream", UPSTREAM, *argv)
    assert (code, out) == (EXIT_USAGE, "")
    assert one_error_line(err).startswith(f"ctxfold serve: error: {message}")


@pytest.mark.parametrize(("name", "value", "message"), [
    ("max_connections", 0, r"max_connections: 0 is out of range \[1, inf\)"),
    ("read_timeout_s", math.nan, r"read_timeout_s: nan is not a number in \(0, inf\)"),
    ("fsync", "sometimes", "fsync: 'sometimes' is not one of compactions, always, never"),
    ("data_dir", "", "data_dir: '' is not a path"),
    ("tenant_key_file", 3, "tenant_key_file: 3 is not a path"),
    ("stream_usage", "yes", "stream_usage: 'yes' is not a boolean"),
    ("compact", {}, r"compact: \{\} is not a CompactConfig"),
    ("summary_model", 7, "summary_model: 7 is not a string"),
])
def test_an_embedder_gets_a_config_error_naming_the_field(name: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        ProxyConfig(**{"upstream": UPSTREAM, "data_dir": Path("d"), name: value})


def test_a_path_given_as_text_becomes_a_path() -> None:
    cfg = ProxyConfig(upstream=UPSTREAM, data_dir="d", tenant_key_file="k")  # type: ignore[arg-type]
    assert (cfg.data_dir, cfg.tenant_key_file) == (Path("d"), Path("k"))


def test_a_short_operator_token_names_its_flag_and_not_the_secret(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXFOLD_TEST_OPERATOR_TOKEN", "hunter2")
    code, _, err = run_main(capsys, "serve", "--upstream", UPSTREAM, "--operator-token-env",
                            "CTXFOLD_TEST_OPERATOR_TOKEN")
    assert code == EXIT_USAGE
    assert one_error_line(err) == ("ctxfold: error: --operator-token-env CTXFOLD_TEST_OPERATOR_TOKEN: at least 16 "
                                   "characters (it guards every tenant's figures)")
    assert "hunter2" not in err


def test_template_none_is_no_template() -> None:
    args = serve_parser().parse_args(["--upstream", UPSTREAM, "--template", "none"])
    assert args.template is None
