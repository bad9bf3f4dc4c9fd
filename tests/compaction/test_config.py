"""CompactConfig: the seeds' defaults, every key's validation, YAML/TOML/dict equivalence, error messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ctxfold.compaction.config import (
    CompactConfig,
    CostConfig,
    HardConfig,
    MajorConfig,
    MinorConfig,
    SoftConfig,
    SummarizerConfig,
    SummaryConfig,
    TailConfig,
    load_config,
)
from ctxfold.errors import ConfigError

# The agent.yml of the Datus documentation (docs: "Context Compaction", agent.yml), verbatim.
DATUS_AGENT_YML = """\
agent:
  compact:
    major:
      enabled: true
      token_threshold: 0.9
      mid_turn_enabled: true
    minor:
      enabled: true
      keep_recent_user_turns: 4
      archive_threshold: 1000
      archive_preview_chars: 1000
      mid_turn_enabled: true
      mid_turn_token_threshold: 0.75
      keep_recent_tool_results: 5
"""


def test_defaults_are_the_seeds() -> None:
    c = CompactConfig()
    # Datus agent.compact (seed table "Parameters").
    assert (c.major.enabled, c.major.token_threshold, c.major.mid_turn_enabled) == (True, 0.9, True)
    assert (c.minor.enabled, c.minor.keep_recent_user_turns, c.minor.archive_threshold) == (True, 4, 1000)
    assert (c.minor.archive_preview_chars, c.minor.mid_turn_enabled) == (1000, True)
    assert (c.minor.mid_turn_token_threshold, c.minor.keep_recent_tool_results) == (0.75, 5)
    # ds4 constants (ds4_agent.c: AGENT_COMPACT_*).
    assert (c.soft.enabled, c.soft.percent, c.soft.min_free_tokens) == (True, 85, 8192)
    assert (c.tail.fraction, c.tail.cap_tokens) == (0.10, 50000)
    assert (c.summary.max_tokens, c.summary.min_room_tokens) == (4096, 256)
    assert c.hard.enabled and c.max_consecutive_failures == 3
    assert c.context_tokens is None and c.policy == "both" and c.summarizer.kind == "extractive"


def test_datus_documented_yaml_equals_defaults(tmp_path: Path) -> None:
    p = tmp_path / "agent.yml"
    p.write_text(DATUS_AGENT_YML)
    assert load_config(p) == CompactConfig()


def test_derived_figures() -> None:
    c = CompactConfig()
    assert c.reply_reserve() == 8192  # min(max_output or 8192, 20480)
    assert CompactConfig(max_output_tokens=32000).reply_reserve() == 20480
    assert CompactConfig(max_output_tokens=2000).reply_reserve() == 2000
    assert CompactConfig(reply_reserve_tokens=100, max_output_tokens=2000).reply_reserve() == 100
    # ds4: free threshold min(8192, ctx/4); at ctx 12000 it is 3000.
    assert c.soft.free_threshold_tokens(12000) == 3000
    assert c.soft.free_threshold_tokens(100000) == 8192
    # ds4: tail budget min(ctx/10, 50000), at least 1.
    assert c.tail.budget_tokens(12000) == 1200
    assert c.tail.budget_tokens(1_000_000) == 50000
    assert c.tail.budget_tokens(5) == 1
    assert c.summary_max_tokens(None) == 4096 and c.summary_max_tokens(300) == 300


def test_presets() -> None:
    ds4 = CompactConfig.preset("ds4")
    assert ds4.soft.enabled and ds4.hard.enabled
    assert not ds4.minor.enabled and not ds4.minor.mid_turn_enabled and not ds4.major.enabled
    datus = CompactConfig.preset("datus")
    assert not datus.soft.enabled and datus.minor.enabled and datus.major.enabled and datus.major.mid_turn_enabled
    both = CompactConfig.preset("both")
    assert both == CompactConfig()
    # Explicit keys win over the preset.
    assert CompactConfig.preset("ds4", minor={"enabled": True}).minor.enabled
    assert CompactConfig.preset("ds4", context_tokens=12000).context_tokens == 12000


SAMPLE: dict[str, Any] = {
    "policy": "datus",
    "context_tokens": 32768,
    "max_output_tokens": 4096,
    "major": {"token_threshold": 0.8},
    "minor": {"keep_recent_user_turns": 2, "archive_threshold": 500},
    "soft": {"percent": 80, "min_free_tokens": 4096},
    "tail": {"fraction": 0.2, "cap_tokens": 20000},
    "summary": {"max_tokens": 2048, "timeout_s": 30},
    "summarizer": {"kind": "openai", "base_url": "http://127.0.0.1:8000/v1", "model": "m",
                   "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
}

SAMPLE_YAML = """\
agent:
  models: {default: whatever}   # other agent.yml sections are ignored
  compact:
    policy: datus
    context_tokens: 32768
    max_output_tokens: 4096
    major: {token_threshold: 0.8}
    minor:
      keep_recent_user_turns: 2
      archive_threshold: 500
    soft: {percent: 80, min_free_tokens: 4096}
    tail: {fraction: 0.2, cap_tokens: 20000}
    summary: {max_tokens: 2048, timeout_s: 30}
    summarizer:
      kind: openai
      base_url: http://127.0.0.1:8000/v1
      model: m
      extra_body: {chat_template_kwargs: {enable_thinking: false}}
"""

SAMPLE_TOML = """\
[agent.compact]
policy = "datus"
context_tokens = 32768
max_output_tokens = 4096

[agent.compact.major]
token_threshold = 0.8

[agent.compact.minor]
keep_recent_user_turns = 2
archive_threshold = 500

[agent.compact.soft]
percent = 80
min_free_tokens = 4096

[agent.compact.tail]
fraction = 0.2
cap_tokens = 20000

[agent.compact.summary]
max_tokens = 2048
timeout_s = 30

[agent.compact.summarizer]
kind = "openai"
base_url = "http://127.0.0.1:8000/v1"
model = "m"
extra_body = { chat_template_kwargs = { enable_thinking = false } }
"""


def test_yaml_toml_dict_equivalence(tmp_path: Path) -> None:
    y = tmp_path / "agent.yml"
    y.write_text(SAMPLE_YAML)
    t = tmp_path / "ctxfold.toml"
    t.write_text(SAMPLE_TOML)
    bare = tmp_path / "compact.yaml"  # a bare compact mapping
    bare.write_text("\n".join(line[4:] for line in SAMPLE_YAML.splitlines()[3:]) + "\n")
    from_dict = CompactConfig.from_mapping(SAMPLE)
    assert load_config(y) == from_dict
    assert load_config(t) == from_dict
    assert load_config(bare) == from_dict
    assert from_dict.major.token_threshold == 0.8 and from_dict.soft.percent == 80.0
    assert not from_dict.soft.enabled  # the datus preset, not overridden
    assert CompactConfig.from_mapping(from_dict.to_mapping()) == from_dict


def test_load_overrides_and_empty_sections(tmp_path: Path) -> None:
    p = tmp_path / "agent.yml"
    p.write_text("agent:\n  compact:\n    major:\n    minor:\n")
    assert load_config(p) == CompactConfig()
    assert load_config(p, context_tokens=12000).context_tokens == 12000
    empty = tmp_path / "empty.yml"
    empty.write_text("")
    assert load_config(empty) == CompactConfig()


# (section class, key, bad value, expected message fragment) for every key.
BAD_VALUES: list[tuple[str, Any, str]] = [
    ("major.enabled", "yes", "'yes' is not a boolean; expected true or false"),
    ("major.enabled", 1, "1 is not a boolean"),
    ("major.token_threshold", 1.5, "1.5 is out of range (0, 1]"),
    ("major.token_threshold", 0, "0.0 is out of range (0, 1]"),
    ("major.token_threshold", "0.9", "'0.9' is a quoted string, expected a number in (0, 1]; write the number"),
    ("major.token_threshold", True, "True is not a number in (0, 1]"),
    ("major.token_threshold", float("nan"), "nan is not a number"),
    ("major.mid_turn_enabled", None, "null is not allowed; expected true or false"),
    ("minor.enabled", "false", "'false' is not a boolean"),
    ("minor.keep_recent_user_turns", -1, "-1 is out of range [0, inf)"),
    ("minor.keep_recent_user_turns", 2.5, "2.5 is not an integer in [0, inf)"),
    ("minor.archive_threshold", "1000", "'1000' is a quoted string, expected an integer"),
    ("minor.archive_preview_chars", -5, "-5 is out of range [0, inf)"),
    ("minor.mid_turn_enabled", 0, "0 is not a boolean"),
    ("minor.mid_turn_token_threshold", 1.01, "1.01 is out of range (0, 1]"),
    ("minor.keep_recent_tool_results", [5], "[5] is not an integer"),
    ("soft.enabled", "on", "'on' is not a boolean"),
    ("soft.percent", 0, "0.0 is out of range (0, 100]"),
    ("soft.percent", 101, "101.0 is out of range (0, 100]"),
    ("soft.min_free_tokens", -1, "-1 is out of range [0, inf)"),
    ("hard.enabled", "true", "'true' is not a boolean"),
    ("tail.fraction", 1.0, "1.0 is out of range [0, 1)"),
    ("tail.cap_tokens", -1, "-1 is out of range [0, inf)"),
    ("summary.max_tokens", 0, "0 is out of range [1, inf)"),
    ("summary.min_room_tokens", 0, "0 is out of range [1, inf)"),
    ("summary.trail_max_tokens", 0, "0 is out of range [1, inf)"),
    ("summary.timeout_s", 0, "0.0 is out of range (0, inf)"),
    ("summary.low_water", 0, "0.0 is out of range (0, 1]"),
    ("summary.chunked", "no", "'no' is not a boolean"),
    ("summarizer.kind", "openia", "'openia' is not one of extractive, openai, callable; did you mean 'openai'?"),
    ("summarizer.base_url", "localhost:8000", "'localhost:8000' is not an http(s) URL"),
    ("summarizer.model", 7, "7 is not a string"),
    ("summarizer.api_key", 7, "7 is not a string"),
    ("summarizer.api_key_env", None, "null is not allowed"),
    ("summarizer.temperature", 3, "3.0 is out of range [0, 2]"),
    ("summarizer.send_tools", "y", "'y' is not a boolean"),
    ("summarizer.connect_timeout_s", -1, "-1.0 is out of range (0, inf)"),
    ("summarizer.extra_body", "x", "'x' is not a mapping"),
    ("cost.min_gain", "on", "'on' is not a boolean"),
    ("cost.horizon_requests", -1, "-1 is out of range [0, inf)"),
    ("cost.input_per_mtok", -1, "-1.0 is out of range [0, inf)"),
    ("cost.cached_input_per_mtok", "0.1", "'0.1' is a quoted string"),
    ("cost.cache_write_per_mtok", True, "True is not a number"),
    ("cost.output_per_mtok", float("inf"), "inf is not a number"),
    ("cost.currency", 3, "3 is not a string"),
    ("policy", "claude", "'claude' is not one of ds4, datus, both"),
    ("context_tokens", 0, "0 is out of range [1, inf)"),
    ("context_tokens", "128k", "'128k' is not an integer in [1, inf)"),
    ("max_output_tokens", -1, "-1 is out of range [1, inf)"),
    ("reply_reserve_tokens", -1, "-1 is out of range [0, inf)"),
    ("max_consecutive_failures", 0, "0 is out of range [1, inf)"),
]


def _nested(key: str, value: Any) -> dict[str, Any]:
    head, _, rest = key.partition(".")
    return {head: _nested(rest, value)} if rest else {head: value}


@pytest.mark.parametrize(("key", "value", "fragment"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_every_key_is_validated(key: str, value: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        CompactConfig.from_mapping(_nested(key, value), path="agent.compact")
    msg = str(e.value)
    assert msg.startswith(f"agent.compact.{key}: "), msg
    assert fragment in msg, msg


def test_every_field_has_a_bad_value_case() -> None:
    from dataclasses import fields

    covered = {k for k, _, _ in BAD_VALUES}
    sections = {"major": MajorConfig, "minor": MinorConfig, "soft": SoftConfig, "hard": HardConfig,
                "tail": TailConfig, "summary": SummaryConfig, "summarizer": SummarizerConfig, "cost": CostConfig}
    expected = {f"{s}.{f.name}" for s, cls in sections.items() for f in fields(cls)}
    expected |= {f.name for f in fields(CompactConfig) if f.name not in sections}
    assert expected - covered == set()


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"^major.token_threshold: 2.0 is out of range \(0, 1\]$"):
        MajorConfig(token_threshold=2.0)
    with pytest.raises(ConfigError, match="summary.min_room_tokens: 5000 exceeds summary.max_tokens"):
        SummaryConfig(min_room_tokens=5000)
    with pytest.raises(ConfigError, match=r"^context_tokens: -3 is out of range"):
        CompactConfig(context_tokens=-3)
    assert MajorConfig(token_threshold=1).token_threshold == 1.0  # an int where a float goes is fine


def test_unknown_keys_suggest_the_right_one() -> None:
    with pytest.raises(ConfigError) as e:
        CompactConfig.from_mapping({"major": {"token_treshold": 0.8}}, path="agent.compact")
    assert str(e.value) == ("agent.compact.major.token_treshold: unknown key; did you mean 'token_threshold'? "
                            "(allowed: enabled, token_threshold, mid_turn_enabled)")
    with pytest.raises(ConfigError, match=r"^minr: unknown key; did you mean 'minor'\?"):
        CompactConfig.from_mapping({"minr": {}})
    with pytest.raises(ConfigError, match=r"^colour: unknown key \(allowed: policy,"):
        CompactConfig.from_mapping({"colour": 1})


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match="agent.compact.minor.mid_turn_token_threshold: 0.95 exceeds "
                                          r"major.token_threshold \(0.9\)"):
        CompactConfig.from_mapping({"minor": {"mid_turn_token_threshold": 0.95}}, path="agent.compact")
    # With the summary stage off there is nothing to order against.
    CompactConfig.from_mapping({"major": {"enabled": False}, "minor": {"mid_turn_token_threshold": 0.95}})


def test_sections_must_be_mappings() -> None:
    with pytest.raises(ConfigError, match=r"^agent.compact.major: expected a mapping of settings, got 0.9$"):
        CompactConfig.from_mapping({"major": 0.9}, path="agent.compact")
    with pytest.raises(ConfigError, match="expected a mapping of settings"):
        CompactConfig.from_mapping([1, 2])  # type: ignore[arg-type]


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "agent.yml"
    p.write_text("agent:\n  compact:\n    major:\n      token_threshold: 1.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: agent.compact.major.token_threshold: 1.5 is out of range (0, 1]"
    p.write_text("agent: [\n")
    with pytest.raises(ConfigError, match=r"agent.yml: not valid YML"):
        load_config(p)
    t = tmp_path / "c.toml"
    t.write_text("[compact.major]\ntoken_threshold = '0.9'\n")
    with pytest.raises(ConfigError, match=r"c.toml: compact.major.token_threshold: '0.9' is a quoted string"):
        load_config(t)
    with pytest.raises(ConfigError, match="cannot read the configuration file"):
        load_config(tmp_path / "missing.yml")
    j = tmp_path / "c.json"
    j.write_text("{}")
    with pytest.raises(ConfigError, match=r"unknown configuration format '.json'"):
        load_config(j)


def test_summarizer_environment_and_secret() -> None:
    sc = SummarizerConfig(kind="openai", api_key="sk-secret")
    assert "sk-secret" not in repr(sc) and "sk-secret" not in repr(CompactConfig(summarizer=sc))
    env = {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "k", "CTXFOLD_SUMMARY_MODEL": "m"}
    r = SummarizerConfig(kind="openai").resolved(env)
    assert (r.base_url, r.api_key, r.model) == ("http://127.0.0.1:9/v1", "k", "m")
    # Config values win over the environment; api_key_env picks the variable.
    r = SummarizerConfig(kind="openai", model="mine", api_key_env="MY_KEY").resolved({**env, "MY_KEY": "x"})
    assert (r.model, r.api_key) == ("mine", "x")
    assert "api_key" not in CompactConfig(summarizer=sc).to_mapping()["summarizer"]
