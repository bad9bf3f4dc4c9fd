"""What a compaction costs and what it keeps, in tokens and, given a :class:`PriceTable`, in money.

One model, read by the summary pass (the figures on :class:`~ctxfold.compaction.events.CompactionEvent`),
the policy's minimum-gain rule (:meth:`~ctxfold.compaction.policy.Policy.min_gain_waits`), replay's table
and JSON, and :meth:`ctxfold.engine.EngineSequence.compaction_cost`. For one compaction:

- the next request without the rewrite (``before``) and with it (``after``): the tokens a prefix cache
  serves (the common prefix with what the cache holds, page-aligned) and the tokens prefilled, i.e.
  written to the cache. Without the rewrite the cache holds the whole conversation as the model last saw
  it (its answer included, as a local engine's cache does); with it, ``KvPlanFigures.tokens_reused``;
- the summary request's own prompt: it is built from the same system prompt, tools and messages up to
  BOTTOM, so the prefix it shares with the last request is read from the cache; its answer is output;
- the saving over a horizon of H requests: each later request reads the smaller view from the cache
  instead of the larger one, ``(H - 1) * (before.total - after.total)`` cached tokens (the first request
  of the horizon is the rewrite's own, counted in what the compaction invalidates).

In money: what it invalidates is the first request's extra cost plus the summary request's; what it saves
is the cheaper cached reads of the later ones. Growth after the compaction adds the same tokens to both
paths and cancels out.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxfold.chat.messages import Message, Role
from ctxfold.compaction.config import CostConfig
from ctxfold.compaction.summarize import ExtractiveSummarizer
from ctxfold.errors import ConfigError

if TYPE_CHECKING:
    from ctxfold.compaction.compactor import Compactor

PER_MILLION = 1_000_000
MAX_AUTO_HORIZON_REQUESTS = 100  # an automatic horizon never counts on more requests than this
DEFAULT_HORIZON_REQUESTS = 10  # the automatic horizon without a known window (no line to grow to)

# The names a price file and --price accept for each field of a PriceTable (the short ones first).
PRICE_KEYS: dict[str, str] = {
    "input": "input_per_mtok", "cached": "cached_input_per_mtok", "write": "cache_write_per_mtok",
    "output": "output_per_mtok", "input_per_mtok": "input_per_mtok", "cached_input_per_mtok": "cached_input_per_mtok",
    "cache_write_per_mtok": "cache_write_per_mtok", "output_per_mtok": "output_per_mtok",
}


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Prices per million tokens. ``currency`` "relative" means weights, not money (the defaults of
    :class:`~ctxfold.compaction.config.CostConfig`: an uncached input token is 1)."""

    input_per_mtok: float  # prompt tokens neither read from nor written to a cache (the summary's instruction)
    cached_input_per_mtok: float  # prompt tokens read from a prefix cache
    cache_write_per_mtok: float  # prompt tokens prefilled and written to the cache (= input where not billed apart)
    output_per_mtok: float  # generated tokens
    currency: str = "relative"

    def __post_init__(self) -> None:
        for name in ("input_per_mtok", "cached_input_per_mtok", "cache_write_per_mtok", "output_per_mtok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name}: {value!r} is not a price; expected a number >= 0 (per million tokens)")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.currency, str) or not self.currency:
            raise ConfigError(f"currency: {self.currency!r} is not a currency name")

    @classmethod
    def from_config(cls, cost: CostConfig) -> PriceTable:
        write = cost.input_per_mtok if cost.cache_write_per_mtok is None else cost.cache_write_per_mtok
        return cls(cost.input_per_mtok, cost.cached_input_per_mtok, write, cost.output_per_mtok, cost.currency)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> PriceTable:
        """From ``{"input": 3, "cached": 0.3, "write": 3.75, "output": 15, "currency": "USD"}`` (or the
        field names). ``input`` and ``output`` are required; ``cached`` defaults to ``input`` (no cache
        discount), ``write`` to ``input`` (no write surcharge); ``currency`` to "USD"."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping of prices, got {data!r}")
        values: dict[str, Any] = {}
        currency = "USD"
        for key, value in data.items():
            if key == "currency":
                currency = value
                continue
            name = PRICE_KEYS.get(str(key))
            if name is None:
                raise ConfigError(f"unknown price {key!r}; expected input, cached, write, output (per million "
                                  "tokens) and currency")
            values[name] = value
        missing = [k for k, name in (("input", "input_per_mtok"), ("output", "output_per_mtok")) if name not in values]
        if missing:
            raise ConfigError(f"missing price{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")
        values.setdefault("cached_input_per_mtok", values["input_per_mtok"])
        values.setdefault("cache_write_per_mtok", values["input_per_mtok"])
        return cls(**values, currency=currency)

    @classmethod
    def parse(cls, spec: str) -> PriceTable:
        """From ``input=3,cached=0.3,write=3.75,output=15[,currency=EUR]`` (per million tokens)."""
        data: dict[str, Any] = {}
        for part in spec.split(","):
            key, sep, text = part.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"{part.strip()!r} is not KEY=PRICE; expected e.g. input=3,cached=0.3,write=3.75,"
                                  "output=15")
            if key == "currency":
                data[key] = text.strip()
                continue
            try:
                data[key] = float(text)
            except ValueError:
                raise ConfigError(f"{key}={text.strip()!r} is not a number") from None
        return cls.from_mapping(data)

    @classmethod
    def load(cls, path: str | Path) -> PriceTable:
        """From a JSON or TOML file holding the mapping of :meth:`from_mapping` (TOML: top level or a
        ``[prices]`` table)."""
        if not str(path).strip():  # Path("") is the current directory: say what is wrong instead
            raise ConfigError(f"{str(path)!r}: an empty path; give a JSON or TOML price file")
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read the price file ({exc.strerror or exc})") from None
        try:
            if p.suffix.lower() == ".toml":
                doc: Any = tomllib.loads(raw.decode("utf-8"))
            else:
                import json

                doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: not valid {'TOML' if p.suffix.lower() == '.toml' else 'JSON'}: {exc}") from None
        if isinstance(doc, Mapping) and isinstance(doc.get("prices"), Mapping):
            doc = doc["prices"]
        try:
            return cls.from_mapping(doc)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None

    @classmethod
    def read(cls, text: str) -> PriceTable:
        """From a flag's text: the name of a price file (:meth:`load`) or ``KEY=PRICE`` pairs (:meth:`parse`).
        Text with ``=`` in it that names no file is pairs; anything else is a file."""
        if "=" in text and not Path(text).is_file():
            return cls.parse(text)
        return cls.load(text)

    @property
    def money(self) -> bool:
        """Whether these are prices in a currency, not the relative weights of the defaults."""
        return self.currency != "relative"

    def to_json(self) -> dict[str, Any]:
        return {"input_per_mtok": self.input_per_mtok, "cached_input_per_mtok": self.cached_input_per_mtok,
                "cache_write_per_mtok": self.cache_write_per_mtok, "output_per_mtok": self.output_per_mtok,
                "currency": self.currency}


def priced(cost: CostConfig, table: PriceTable) -> CostConfig:
    """The cost section with ``table``'s prices: what the minimum-gain rule weighs with, and the cost
    figures are priced with (``--prices``/``--price`` of replay and of the proxy)."""
    return replace(cost, input_per_mtok=table.input_per_mtok, cached_input_per_mtok=table.cached_input_per_mtok,
                   cache_write_per_mtok=table.cache_write_per_mtok, output_per_mtok=table.output_per_mtok,
                   currency=table.currency)


@dataclass(frozen=True, slots=True)
class RequestTokens:
    """One request's prompt as a prefix cache sees it."""

    cached_tokens: int  # read from the cache (the common prefix with what it holds, page-aligned)
    written_tokens: int  # prefilled: computed and written to the cache

    @property
    def total_tokens(self) -> int:
        return self.cached_tokens + self.written_tokens

    def price(self, prices: PriceTable) -> float:
        return (self.cached_tokens * prices.cached_input_per_mtok
                + self.written_tokens * prices.cache_write_per_mtok) / PER_MILLION


@dataclass(frozen=True, slots=True)
class CompactionCost:
    """The cost of one compaction and what it saves (see the module docstring). Token figures; money
    through :meth:`money`."""

    before: RequestTokens  # the next request without the rewrite
    after: RequestTokens  # the next request with it (the KV plan's reuse and prefill)
    summary_prompt_tokens: int  # the summary request's prompt (0 when no model was asked)
    summary_cached_tokens: int  # of which its prefix shared with the last request (page-aligned)
    summary_output_tokens: int  # the summary the model wrote (0 when no model was asked, or it failed)
    summary_model_call: bool  # a model was asked (the extractive summary and the guard's ask none)
    horizon_requests: int  # H: the requests the saving is counted over, the rewrite's own first
    estimated: bool = False  # an estimate made before the pass ran (the minimum-gain rule's)

    @property
    def saving_tokens(self) -> int:
        """Cached tokens the later requests of the horizon no longer read: (H - 1) * the smaller view."""
        return max(0, self.horizon_requests - 1) * max(0, self.before.total_tokens - self.after.total_tokens)

    @property
    def cache_tokens_written(self) -> int:
        """Prompt tokens the compaction made someone prefill that would not have been otherwise: the
        rewrite's prefill beyond what the next request would have written anyway, and the summary
        request's uncached prompt."""
        extra = max(0, self.after.written_tokens - self.before.written_tokens)
        return extra + self.summary_prompt_tokens - self.summary_cached_tokens

    def summary_price(self, prices: PriceTable) -> float:
        uncached = self.summary_prompt_tokens - self.summary_cached_tokens
        return (self.summary_cached_tokens * prices.cached_input_per_mtok + uncached * prices.input_per_mtok
                + self.summary_output_tokens * prices.output_per_mtok) / PER_MILLION

    def invalidated(self, prices: PriceTable) -> float:
        """What the compaction costs up front: the first request's extra (cache lost, view written
        again) and the summary request."""
        return self.after.price(prices) - self.before.price(prices) + self.summary_price(prices)

    def saving(self, prices: PriceTable) -> float:
        """What the later requests of the horizon save: cached reads of the smaller view."""
        return self.saving_tokens * prices.cached_input_per_mtok / PER_MILLION

    def money(self, prices: PriceTable) -> dict[str, Any]:
        """The money figures, rounded for a report."""
        inval, save = self.invalidated(prices), self.saving(prices)
        return {"currency": prices.currency, "before_request": round(self.before.price(prices), 6),
                "after_request": round(self.after.price(prices), 6),
                "summary_request": round(self.summary_price(prices), 6), "invalidated": round(inval, 6),
                "saving": round(save, 6), "net": round(save - inval, 6)}

    def to_json(self, prices: PriceTable | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "before_cached_tokens": self.before.cached_tokens, "before_written_tokens": self.before.written_tokens,
            "after_cached_tokens": self.after.cached_tokens, "after_written_tokens": self.after.written_tokens,
            "summary_prompt_tokens": self.summary_prompt_tokens, "summary_cached_tokens": self.summary_cached_tokens,
            "summary_output_tokens": self.summary_output_tokens, "summary_model_call": self.summary_model_call,
            "horizon_requests": self.horizon_requests, "saving_tokens": self.saving_tokens,
            "cache_tokens_written": self.cache_tokens_written, "estimated": self.estimated,
        }
        if prices is not None:
            out["money"] = self.money(prices)
        return out


@dataclass(frozen=True, slots=True)
class PendingCost:
    """The figures of a summary's :class:`CompactionCost` that must be read before its rewrite (the
    request the cache holds, the summary request, the growth rate), completed by :meth:`complete` with
    the rewrite's KV plan and the occupancy after it."""

    before: RequestTokens
    summary_prompt_tokens: int
    summary_cached_tokens: int
    summary_output_tokens: int
    summary_model_call: bool
    growth_tokens: float  # the conversation's growth a request, before the rewrite
    line_tokens: int | None  # the policy's trigger line (None: the window is not known)

    def complete(self, cost: CostConfig, *, reused_tokens: int, prefill_tokens: int,
                 after_tokens: int) -> CompactionCost:
        horizon = horizon_requests(cost, after_tokens=after_tokens, line_tokens=self.line_tokens,
                                   growth_tokens=self.growth_tokens)
        return CompactionCost(self.before, RequestTokens(reused_tokens, prefill_tokens), self.summary_prompt_tokens,
                              self.summary_cached_tokens, self.summary_output_tokens, self.summary_model_call,
                              horizon)


def page_down(num_tokens: int, page_size_tokens: int) -> int:
    """``num_tokens`` rounded down to whole cache pages: a prefix cache reuses whole pages only."""
    return num_tokens - num_tokens % page_size_tokens


def horizon_requests(cost: CostConfig, *, after_tokens: int, line_tokens: int | None, growth_tokens: float) -> int:
    """H: the configured horizon, or (``cost.horizon_requests == 0``) the requests until the next
    compaction is due at the current growth rate: from ``after_tokens`` up to the trigger line
    ``line_tokens`` at ``growth_tokens`` a request; at least 1, at most MAX_AUTO_HORIZON_REQUESTS
    (DEFAULT_HORIZON_REQUESTS without a known window)."""
    if cost.horizon_requests > 0:
        return cost.horizon_requests
    if line_tokens is None:
        return DEFAULT_HORIZON_REQUESTS
    if growth_tokens <= 0:
        return MAX_AUTO_HORIZON_REQUESTS
    return max(1, min(MAX_AUTO_HORIZON_REQUESTS, math.ceil((line_tokens - after_tokens) / growth_tokens)))


# -- over a compactor's state ---------------------------------------------------------------------------


def growth_per_request_tokens(c: Compactor) -> float:
    """The conversation's growth rate, in tokens a request: what the view holds after its newest summary
    (all of it before the first), over the requests (the model's answers) since."""
    view = c.view
    since = next((i + 1 for i in range(len(view) - 1, -1, -1) if view[i].summary), 0)
    answers = sum(1 for m in view[since:] if m.role is Role.ASSISTANT)
    return float(c.accounting.tokens()[since:].sum()) / max(1, answers)


def request_before(c: Compactor, queued_tokens: int = 0) -> RequestTokens:
    """The next request without a rewrite: the cache holds the request the model last saw (its answer
    included); what arrived since, and ``queued_tokens``, are written."""
    acc = c.accounting
    seen = acc.prefix_tokens + int(acc.tokens()[:c.state.unseen_start()].sum())
    cached = page_down(seen, c.page_size_tokens)
    return RequestTokens(cached, acc.total_tokens + queued_tokens - cached)


def summary_prompt(c: Compactor, bottom: int, contract_tokens: int) -> tuple[int, int]:
    """(prompt tokens, of which cached) of the summary request over ``view[:bottom]``: the same system
    prompt, tools and messages as the last request, then the instruction. Without the tools
    (``summarizer.send_tools`` off) it shares no prefix a cache would find."""
    acc = c.accounting
    shared = acc.prefix_tokens + int(acc.tokens()[:bottom].sum())
    prompt = shared + contract_tokens
    if c.header.tools and not c.config.summarizer.send_tools:
        return prompt, 0
    return prompt, page_down(min(shared, acc.prefix_tokens + int(acc.tokens()[:c.state.unseen_start()].sum())),
                             c.page_size_tokens)


def estimate(c: Compactor, ctx: int, *, queued_tokens: int = 0) -> CompactionCost:
    """The cost of a policy summary due now, estimated before anything runs (the minimum-gain rule): the
    rebuilt view as system prompt and tools (still cached), the summary at its cap, the tail's budget and
    what the model has not seen, at most the low-water mark the pass aims under; and a summary request
    over what the model has seen, answered at the summary's cap by a model (no request when the
    summarizer is the extractive one)."""
    policy = c.policy
    reserve = c.reply_reserve_tokens()
    before = request_before(c, queued_tokens)
    acc = c.accounting
    model = not isinstance(c.summarizer, ExtractiveSummarizer)
    # The rebuilt view: system and tools, the summary at its cap, the tail's budget and what the model
    # has not seen; never above the low-water mark the pass aims under.
    summary_cap = c.config.summary.max_tokens if model else max(64, min(c.config.summary.max_tokens, ctx // 8))
    unseen = int(acc.tokens()[c.state.unseen_start():].sum()) + queued_tokens
    rebuilt = acc.fixed_tokens + summary_cap + policy.tail_budget_tokens(ctx) + unseen
    after_total = min(before.total_tokens, rebuilt, max(0, policy.low_water_tokens(ctx) - reserve))
    after_cached = min(page_down(acc.prefix_tokens, c.page_size_tokens), after_total)
    prompt = cached = output = 0
    if model:
        prompt, cached = summary_prompt(c, c.state.unseen_start(), 0)
        output = c.config.summary.max_tokens
    horizon = horizon_requests(c.config.cost, after_tokens=after_total + reserve,
                               line_tokens=policy.trigger_line_tokens(ctx), growth_tokens=growth_per_request_tokens(c))
    return CompactionCost(before, RequestTokens(after_cached, after_total - after_cached), prompt, cached, output,
                          model, horizon, estimated=True)


def waits(c: Compactor, used_tokens: int, ctx: int, queued: Sequence[Message] = ()) -> bool:
    """Whether the automatic summary due at ``used_tokens`` waits under the policy's minimum-gain rule
    (:meth:`~ctxfold.compaction.policy.Policy.min_gain_waits`), estimated before anything runs; counted
    in ``c.min_gain_waits`` when it does."""
    if not c.config.cost.min_gain:
        return False
    queued_tokens = sum(c.accounting.message_tokens(m) for m in queued)
    wait = c.policy.min_gain_waits(estimate(c, ctx, queued_tokens=queued_tokens), used_tokens, ctx,
                                   growth_per_request_tokens(c))
    c.min_gain_waits += int(wait)
    return wait
