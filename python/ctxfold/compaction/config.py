"""Compaction configuration: the ``agent.compact`` section of an agent.yml, plus ds4's constants.

Every default comes from one of the two reference designs:

- Datus (``agent.compact``): ``major.*`` and ``minor.*``, same names, same defaults.
- ds4 (``misc/COMPACT.md`` and ``ds4_agent.c``): ``soft.*`` (85 %, 8192 free tokens capped at ctx/4),
  ``tail.*`` (10 % of ctx, capped at 50000 tokens), ``summary.*`` (4096 tokens, 256 tokens of room).

Sources: YAML (an agent.yml with ``agent.compact``, or a bare compact mapping), TOML (``[agent.compact]``,
``[compact]`` or bare tables) or Python (:meth:`CompactConfig.from_mapping`, or the dataclasses directly).
All three go through the same validation, and every error names the key path, the value and what is allowed.

Typing is strict on purpose. Datus coerces quoted numbers and booleans (``"0.9"``, ``"true"``) and falls back
to defaults on a malformed section; that turns a typo into a silently different policy. Here a quoted number
is an error that says to drop the quotes, an integer is accepted where a float is expected (``1`` for
``1.0``), and a boolean is never accepted as a number (Python's ``True == 1`` would otherwise slip through).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from ctxfold.errors import ConfigError
from ctxfold.settings import Check, check_value, did_you_mean, setting, validate_fields

Policy = Literal["ds4", "datus", "both"]
SummarizerKind = Literal["extractive", "openai", "callable"]

POLICIES: tuple[str, ...] = get_args(Policy)
SUMMARIZER_KINDS: tuple[str, ...] = get_args(SummarizerKind)

# Reply reserve = min(max_output_tokens or 8192, 20480) (Datus's rule).
DEFAULT_REPLY_RESERVE_TOKENS = 8192
MAX_REPLY_RESERVE_TOKENS = 20480


# Field checks (ctxfold.settings): each dataclass field carries one in its metadata; the same check runs for
# direct construction and for parsed files, so both give the same messages.


_FRACTION_OPEN = Check(float, 0.0, 1.0, lo_open=True)  # (0, 1]
_POS_INT = Check(int, 1)
_NONNEG_INT = Check(int, 0)


# --------------------------------------------------------------------------------------------------------
# Sections.


@dataclass(frozen=True, slots=True)
class MajorConfig:
    """Datus ``major``: the LLM summary pass near the context limit."""

    _SECTION = "major"
    enabled: bool = setting(True, Check(bool))  # automatic summary passes (manual compaction ignores this)
    token_threshold: float = setting(0.9, _FRACTION_OPEN)  # fraction of ctx at which the summary pass runs
    mid_turn_enabled: bool = setting(True, Check(bool))  # allow the summary stage between requests of a turn

    def __post_init__(self) -> None:
        validate_fields(self, self._SECTION)


@dataclass(frozen=True, slots=True)
class MinorConfig:
    """Datus ``minor``: the rule-based archive pass (no model call)."""

    _SECTION = "minor"
    enabled: bool = setting(True, Check(bool))  # the turn-start archive pass
    keep_recent_user_turns: int = setting(4, _NONNEG_INT)  # turn start: real user turns whose tool I/O is kept
    archive_threshold: int = setting(1000, _NONNEG_INT)  # chars: tool outputs longer than this are archived
    archive_preview_chars: int = setting(1000, _NONNEG_INT)  # chars of preview in the marker (2x for errors)
    mid_turn_enabled: bool = setting(True, Check(bool))  # allow the archive stage between requests of a turn
    mid_turn_token_threshold: float = setting(0.75, _FRACTION_OPEN)  # fraction of ctx for the mid-turn archive
    keep_recent_tool_results: int = setting(5, _NONNEG_INT)  # mid-turn: newest tool outputs never archived

    def __post_init__(self) -> None:
        validate_fields(self, self._SECTION)


@dataclass(frozen=True, slots=True)
class SoftConfig:
    """ds4's soft trigger, checked before a new user turn and before a tool continuation."""

    _SECTION = "soft"
    enabled: bool = setting(True, Check(bool))
    percent: float = setting(85.0, Check(float, 0.0, 100.0, lo_open=True))  # used >= percent of ctx fires
    min_free_tokens: int = setting(8192, _NONNEG_INT)  # free <= min(this, ctx/4) fires

    def __post_init__(self) -> None:
        validate_fields(self, self._SECTION)

    def free_threshold_tokens(self, context_tokens: int) -> int:
        """ds4 caps the free-token threshold at a quarter of ctx so tiny contexts do not compact every turn."""
        return min(self.min_free_tokens, context_tokens // 4)


@dataclass(frozen=True, slots=True)
class HardConfig:
    """ds4's hard trigger: a tool result that does not fit with the reply reserve compacts at once."""

    _SECTION = "hard"
    enabled: bool = setting(True, Check(bool))

    def __post_init__(self) -> None:
        validate_fields(self, self._SECTION)


@dataclass(frozen=True, slots=True)
class TailConfig:
    """The verbatim tail kept after a summary: min(fraction * ctx, cap_tokens)."""

    _SECTION = "tail"
    fraction: float = setting(0.10, Check(float, 0.0, 1.0, hi_open=True))  # ds4: ctx / 10
    cap_tokens: int = setting(50000, _NONNEG_INT)  # ds4: AGENT_COMPACT_TAIL_CAP_TOKENS

    def __post_init__(self) -> None:
        validate_fields(self, self._SECTION)

    def budget_tokens(self, context_tokens: int) -> int:
        """ds4: ``max(1, min(ctx / 10, 50000))``; 0 only when the config asks for no tail."""
        if self.fraction == 0.0 or self.cap_tokens == 0:
            return 0
        return max(1, min(int(context_tokens * self.fraction), self.cap_tokens))


@dataclass(frozen=True, slots=True)
class SummaryConfig:
    """Limits of one summary generation."""

    _SECTION = "summary"
    max_tokens: int = setting(4096, _POS_INT)  # ds4: AGENT_COMPACT_SUMMARY_MAX_TOKENS
    min_room_tokens: int = setting(256, _POS_INT)  # ds4: below this room the summary request is not sent
    # The whole generation, connection to last token.
    timeout_s: float = setting(120.0, Check(float, 0.0, lo_open=True, unit="seconds"))
    chunked: bool = setting(True, Check(bool))  # rolling chunked summary when the request itself does not fit
    # The low-water mark: a summary's rebuilt view is at most this share of the window (where what must
    # stay allows), well below the trigger lines, so a steady conversation compacts every few turns
    # instead of sitting at the line and compacting on every one. Tail and summary budgets derive from it.
    low_water: float = setting(0.6, Check(float, 0.0, 1.0, lo_open=True))
    # The files the agent changed, added to every summary that leaves them out (ctxfold.compaction.trail):
    # the section takes at most this many tokens, and at most a quarter of the summary.
    trail_max_tokens: int = setting(512, _POS_INT)

    def __post_init__(self) -> None:
        validate_fields(self, self._SECTION)
        if self.min_room_tokens > self.max_tokens:
            raise ConfigError(
                f"{self._SECTION}.min_room_tokens: {self.min_room_tokens} exceeds summary.max_tokens "
                f"({self.max_tokens}); the minimum room must not be larger than the cap"
            )


@dataclass(frozen=True, slots=True)
class SummarizerConfig:
    """Which summarizer writes the summary. Unset endpoint fields come from the environment at build time:
    ``OPENAI_BASE_URL``, the variable named by ``api_key_env`` (``OPENAI_API_KEY``), ``CTXFOLD_SUMMARY_MODEL``."""

    _SECTION = "summarizer"
    kind: str = setting("extractive", Check(str, choices=SUMMARIZER_KINDS))  # the default needs no model
    base_url: str | None = setting(None, Check(str, optional=True))  # e.g. http://127.0.0.1:8000/v1
    model: str | None = setting(None, Check(str, optional=True))  # model name sent in the request
    api_key: str | None = setting(None, Check(str, optional=True), repr=False)  # never printed
    api_key_env: str = setting("OPENAI_API_KEY", Check(str))  # environment variable read when api_key is unset
    temperature: float = setting(0.0, Check(float, 0.0, 2.0))  # ds4 samples the summary greedily
    send_tools: bool = setting(True, Check(bool))  # keep the tool definitions so the request is a cached prefix
    connect_timeout_s: float = setting(10.0, Check(float, 0.0, lo_open=True, unit="seconds"))
    extra_body: dict[str, Any] = setting(  # extra JSON fields for the endpoint (e.g. chat_template_kwargs)
        check=Check(dict), default_factory=dict)

    def __post_init__(self) -> None:
        validate_fields(self, self._SECTION)
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{self._SECTION}.base_url: {self.base_url!r} is not an http(s) URL; "
                "expected e.g. http://127.0.0.1:8000/v1"
            )

    def resolved(self, environ: Mapping[str, str] | None = None) -> SummarizerConfig:
        """A copy with the unset endpoint fields filled from the environment."""
        env = os.environ if environ is None else environ
        return replace(
            self,
            base_url=self.base_url or env.get("OPENAI_BASE_URL") or None,
            model=self.model or env.get("CTXFOLD_SUMMARY_MODEL") or None,
            api_key=self.api_key or env.get(self.api_key_env) or None,
        )


@dataclass(frozen=True, slots=True)
class CostConfig:
    """What a compaction costs (:mod:`ctxfold.compaction.cost`) and the minimum-gain rule: an automatic
    summary whose expected saving over its horizon is below what it invalidates waits, while the next
    request still fits. The window guard never consults it. Prices per million tokens; the defaults are
    relative weights (an uncached input token is 1), the ratios of common hosted pricing."""

    _SECTION = "cost"
    min_gain: bool = setting(True, Check(bool))  # the minimum-gain rule, for automatic summaries only
    # H, the requests a saving is counted over; 0: until the next compaction at the current growth rate.
    horizon_requests: int = setting(0, _NONNEG_INT)
    input_per_mtok: float = setting(1.0, Check(float, 0.0))  # uncached prompt tokens
    cached_input_per_mtok: float = setting(0.1, Check(float, 0.0))  # prompt tokens read from a prefix cache
    # Prompt tokens written to the cache; None: the input price (no write surcharge).
    cache_write_per_mtok: float | None = setting(None, Check(float, 0.0, optional=True))
    output_per_mtok: float = setting(4.0, Check(float, 0.0))  # generated tokens
    currency: str = setting("relative", Check(str))  # "relative": weights, not money

    def __post_init__(self) -> None:
        validate_fields(self, self._SECTION)


_SECTIONS: dict[str, type[Any]] = {
    "major": MajorConfig,
    "minor": MinorConfig,
    "soft": SoftConfig,
    "hard": HardConfig,
    "tail": TailConfig,
    "summary": SummaryConfig,
    "summarizer": SummarizerConfig,
    "cost": CostConfig,
}

# Top-level scalar keys of the compact mapping, with their checks.
_TOP_CHECKS: dict[str, Check] = {
    "policy": Check(str, choices=POLICIES),
    "context_tokens": Check(int, 1, optional=True),
    "max_output_tokens": Check(int, 1, optional=True),
    "reply_reserve_tokens": Check(int, 0, optional=True),
    "max_consecutive_failures": Check(int, 1),
}

# What each policy switches on before explicit keys are applied. ds4 has no archive and no Datus
# thresholds; Datus has no soft trigger (it relies on major.token_threshold) and no tail (the summary
# replaces the whole history, but ctxfold keeps a tail for both: the tail is a rebuild detail, not a trigger).
_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "ds4": {"minor": {"enabled": False, "mid_turn_enabled": False}, "major": {"enabled": False,
            "mid_turn_enabled": False}, "soft": {"enabled": True}, "hard": {"enabled": True}},
    "datus": {"soft": {"enabled": False}, "hard": {"enabled": True}},
    "both": {},
}


@dataclass(frozen=True, slots=True)
class CompactConfig:
    """The whole compaction configuration. Frozen and validated at construction.

    ``context_tokens=None`` means the window is unknown: token triggers are skipped, manual compaction
    still works (Datus's rule).
    """

    policy: str = setting("both", _TOP_CHECKS["policy"])  # the preset the sections started from (informative)
    major: MajorConfig = field(default_factory=MajorConfig)
    minor: MinorConfig = field(default_factory=MinorConfig)
    soft: SoftConfig = field(default_factory=SoftConfig)
    hard: HardConfig = field(default_factory=HardConfig)
    tail: TailConfig = field(default_factory=TailConfig)
    summary: SummaryConfig = field(default_factory=SummaryConfig)
    summarizer: SummarizerConfig = field(default_factory=SummarizerConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    context_tokens: int | None = setting(None, _TOP_CHECKS["context_tokens"])  # the model's window
    max_output_tokens: int | None = setting(None, _TOP_CHECKS["max_output_tokens"])  # the model's reply cap
    reply_reserve_tokens: int | None = setting(None, _TOP_CHECKS["reply_reserve_tokens"])  # None: the rule
    max_consecutive_failures: int = setting(3, _TOP_CHECKS["max_consecutive_failures"])  # the breaker

    def __post_init__(self) -> None:
        validate_fields(self, "")
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not a {cls.__name__}")
        if self.major.enabled and self.minor.enabled and self.minor.mid_turn_enabled and (
            self.minor.mid_turn_token_threshold > self.major.token_threshold
        ):
            raise ConfigError(
                f"minor.mid_turn_token_threshold: {self.minor.mid_turn_token_threshold} exceeds "
                f"major.token_threshold ({self.major.token_threshold}); the archive stage must come before "
                "the summary stage"
            )

    # ---- derived figures --------------------------------------------------------------------------

    def reply_reserve(self) -> int:
        """Tokens kept free for the model's answer: the explicit value, else min(max_output or 8192, 20480),
        and without an explicit max_output at most a quarter of a known window (as ds4 caps its free-token
        line), so a small window is not all reserve."""
        if self.reply_reserve_tokens is not None:
            return self.reply_reserve_tokens
        reserve = min(self.max_output_tokens or DEFAULT_REPLY_RESERVE_TOKENS, MAX_REPLY_RESERVE_TOKENS)
        if self.max_output_tokens is None and self.context_tokens is not None:
            reserve = min(reserve, self.context_tokens // 4)
        return reserve

    def summary_max_tokens(self, room_tokens: int | None) -> int:
        """ds4: ``min(room, summary.max_tokens)``; room None means unknown (the cap alone applies)."""
        if room_tokens is None:
            return self.summary.max_tokens
        return max(0, min(room_tokens, self.summary.max_tokens))

    # ---- construction -----------------------------------------------------------------------------

    @classmethod
    def preset(cls, policy: str, **overrides: Any) -> CompactConfig:
        """A preset ("ds4", "datus", "both") with keyword overrides in mapping form
        (``CompactConfig.preset("ds4", context_tokens=12000, soft={"percent": 80})``)."""
        return cls.from_mapping({"policy": policy, **overrides})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, path: str = "") -> CompactConfig:
        """Build from a compact mapping (what sits under ``agent.compact``). ``path`` prefixes key names in
        error messages. Unknown keys are errors; missing keys take the policy's defaults."""
        where = path or "compact"
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping of settings, got {data!r}")

        def key(name: str) -> str:
            return f"{path}.{name}" if path else name

        allowed = list(_TOP_CHECKS) + list(_SECTIONS)
        for k in data:
            if not isinstance(k, str):
                raise ConfigError(f"{where}: key {k!r} is not a string")
            if k not in allowed:
                raise ConfigError(
                    f"{key(k)}: unknown key{did_you_mean(k, allowed)} (allowed: {', '.join(allowed)})"
                )
        policy = check_value(key("policy"), data.get("policy", "both"), _TOP_CHECKS["policy"])
        kwargs: dict[str, Any] = {"policy": policy}
        for name, top_check in _TOP_CHECKS.items():
            if name != "policy" and name in data:
                kwargs[name] = check_value(key(name), data[name], top_check)
        for name, section_cls in _SECTIONS.items():
            raw = data.get(name, {})
            if raw is None:  # an empty YAML section ("major:") means defaults
                raw = {}
            if not isinstance(raw, Mapping):
                raise ConfigError(f"{key(name)}: expected a mapping of settings, got {raw!r}")
            names = [f.name for f in fields(section_cls)]
            values: dict[str, Any] = dict(_PRESETS[policy].get(name, {}))
            for k, v in raw.items():
                if k not in names:
                    raise ConfigError(
                        f"{key(name)}.{k}: unknown key{did_you_mean(str(k), names)} "
                        f"(allowed: {', '.join(names)})"
                    )
                check = next(f for f in fields(section_cls) if f.name == k).metadata["check"]
                values[k] = check_value(f"{key(name)}.{k}", v, check)
            try:
                kwargs[name] = section_cls(**values)
            except ConfigError as e:  # cross-field checks name the section relative to the root
                raise ConfigError(f"{path}.{e}" if path else str(e)) from None
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{path}.{e}" if path else str(e)) from None

    def to_mapping(self) -> dict[str, Any]:
        """The configuration as a plain mapping (from_mapping(to_mapping()) == self); the API key is left out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _SECTIONS:
                out[f.name] = {g.name: getattr(v, g.name) for g in fields(v) if g.name != "api_key"}
            else:
                out[f.name] = v
        return out


def _compact_section(doc: Any, source: str) -> tuple[Mapping[str, Any], str]:
    """Find the compact mapping in a loaded document: ``agent.compact``, ``compact``, or the document itself."""
    if doc is None:
        return {}, ""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(doc).__name__}")
    if "agent" in doc:
        agent = doc["agent"]
        if not isinstance(agent, Mapping):
            raise ConfigError(f"{source}: agent: expected a mapping, got {agent!r}")
        compact = agent.get("compact", {})
        return ({} if compact is None else compact), "agent.compact"
    if "compact" in doc:
        compact = doc["compact"]
        return ({} if compact is None else compact), "compact"
    return doc, ""


def load_config(path: str | os.PathLike[str], **overrides: Any) -> CompactConfig:
    """Load a configuration file: ``.yml``/``.yaml`` or ``.toml``. The compact settings are read from
    ``agent.compact`` (an agent.yml), else ``compact``, else the whole document. Other sections of an agent.yml
    are ignored. ``overrides`` (top-level keys such as ``context_tokens``) take precedence over the file.

    Raises :class:`ConfigError` naming the file and the key path."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the configuration file ({e.strerror or e})") from None
    suffix = p.suffix.lower()
    try:
        if suffix in (".yml", ".yaml"):
            doc = yaml.safe_load(raw.decode("utf-8"))
        elif suffix == ".toml":
            doc = tomllib.loads(raw.decode("utf-8"))
        else:
            raise ConfigError(f"{p}: unknown configuration format {suffix!r}; expected .yml, .yaml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid {suffix[1:].upper()}: {e}") from None
    section, prefix = _compact_section(doc, str(p))
    if not isinstance(section, Mapping):
        raise ConfigError(f"{p}: {prefix or 'compact'}: expected a mapping of settings, got {section!r}")
    merged = {**section, **overrides}
    try:
        return CompactConfig.from_mapping(merged, path=prefix)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
