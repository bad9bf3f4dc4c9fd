"""When to compact and how much room a rebuilt view aims for, from a :class:`CompactConfig` and a window:
the trigger lines, the low-water mark, the tail budget and the reply reserve, in one place. The compactor,
:class:`~ctxfold.engine.EngineSequence` and replay's plot all read them here, so a line drawn on the plot is
the line the passes fire at.

A line is the lowest occupancy, in tokens, at which its trigger fires: a trigger given as a fraction of
the window fires at ``used >= fraction * ctx``, so its line is that product rounded up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.cost import CompactionCost, PriceTable


@dataclass(frozen=True, slots=True)
class Policy:
    """The trigger arithmetic of one configuration. Pure: every figure is a function of the config, the
    window and what the caller passes in."""

    config: CompactConfig

    # -- lines --------------------------------------------------------------------------------------
    def soft_line_tokens(self, ctx: int) -> int | None:
        """ds4's soft trigger: ``soft.percent`` of the window reached, or at most
        ``min(soft.min_free_tokens, ctx / 4)`` tokens left free. None when it is off."""
        soft = self.config.soft
        if not soft.enabled:
            return None
        return min(math.ceil(ctx * soft.percent / 100), ctx - soft.free_threshold_tokens(ctx))

    def summary_line_tokens(self, ctx: int) -> int | None:
        """Datus' summary threshold (``major.token_threshold`` of the window). None when it is off."""
        major = self.config.major
        return math.ceil(ctx * major.token_threshold) if major.enabled else None

    def mid_turn_archive_line_tokens(self, ctx: int) -> int | None:
        """Datus' mid-turn archive threshold. None when the mid-turn archive stage is off."""
        minor = self.config.minor
        return math.ceil(ctx * minor.mid_turn_token_threshold) if self.archive_enabled(mid_turn=True) else None

    def trigger_line_tokens(self, ctx: int) -> int:
        """The lowest occupancy at which an automatic summary fires (the window itself when none is on):
        a rebuilt view must stay below it, or the next request compacts again at once."""
        lines = [line for line in (self.soft_line_tokens(ctx), self.summary_line_tokens(ctx)) if line is not None]
        return min([ctx, *lines])

    def quiet_line_tokens(self, ctx: int) -> int:
        """The lowest occupancy at which any token trigger fires, the mid-turn archive included: below
        it, nothing needs counting."""
        archive = self.mid_turn_archive_line_tokens(ctx)
        line = self.trigger_line_tokens(ctx)
        return line if archive is None else min(line, archive)

    def low_water_tokens(self, ctx: int) -> int:
        """The occupancy a summary's rebuilt view aims under: ``summary.low_water`` of the window, and
        never above the lowest trigger line."""
        return min(self.trigger_line_tokens(ctx), int(ctx * self.config.summary.low_water))

    def lines(self, ctx: int) -> dict[str, int]:
        """The lines of the passes that are on, by name, as the replay plot labels them."""
        named = {"soft trigger (ds4 policy)": self.soft_line_tokens(ctx),
                 "summary threshold (datus policy)": self.summary_line_tokens(ctx),
                 "mid-turn archive threshold (datus policy)": self.mid_turn_archive_line_tokens(ctx)}
        return {name: line for name, line in named.items() if line is not None}

    # -- decisions ----------------------------------------------------------------------------------
    def summary_trigger(self, used_tokens: int, ctx: int, *, turn_start: bool) -> tuple[str, str] | None:
        """(trigger, reason) of the automatic summary due at ``used_tokens``, None when none is: the soft
        trigger first, then the summary threshold (mid-turn only where ``major.mid_turn_enabled``)."""
        where = "before user turn" if turn_start else "before tool continuation"
        soft = self.soft_line_tokens(ctx)
        if soft is not None and used_tokens >= soft:
            return "soft", f"soft limit {where}"
        major = self.config.major
        line = self.summary_line_tokens(ctx)
        if line is not None and (turn_start or major.mid_turn_enabled) and used_tokens >= line:
            return (("major" if turn_start else "mid_turn"),
                    f"summary threshold ({major.token_threshold:.0%} of the window) reached {where}")
        return None

    def min_gain_waits(self, cost: CompactionCost, used_tokens: int, ctx: int, growth_tokens: float) -> bool:
        """The minimum-gain rule (``cost.min_gain``): whether an automatic summary due at ``used_tokens``
        waits, because its expected saving over its horizon is below what it invalidates (weighed with the
        configured prices), and waiting is possible: the next request, ``growth_tokens`` larger, still
        fits the window. Only the automatic passes ask; the window guard never does, so a request over
        the window is compacted all the same."""
        if not self.config.cost.min_gain or used_tokens + growth_tokens > ctx:
            return False
        prices = PriceTable.from_config(self.config.cost)
        return cost.saving(prices) < cost.invalidated(prices)

    def archive_enabled(self, *, mid_turn: bool) -> bool:
        """Whether the archive pass runs: at turn starts, and between a turn's requests where allowed."""
        minor = self.config.minor
        return minor.enabled and (minor.mid_turn_enabled or not mid_turn)

    # -- budgets ------------------------------------------------------------------------------------
    def tail_budget_tokens(self, ctx: int | None) -> int:
        """The verbatim tail's budget: ``min(tail.fraction * ctx, tail.cap_tokens)`` (ds4), the cap alone
        without a known window."""
        return self.config.tail.cap_tokens if ctx is None else self.config.tail.budget_tokens(ctx)

    def reply_reserve_tokens(self, ctx: int | None, answer_tokens_sorted: Sequence[int] = (),
                             max_reply_tokens: int | None = None) -> int:
        """Tokens kept free for the model's answer: the largest of the configured reserve, the request's
        own ``max_tokens`` and the 95th percentile of the conversation's answers so far (sorted). The
        percentile is capped at half a known window: one outlier answer must not leave no room for the
        conversation."""
        reserve = self.config.reply_reserve()
        if max_reply_tokens is not None:
            reserve = max(reserve, max_reply_tokens)
        answers = answer_tokens_sorted
        if answers:
            high = answers[min(len(answers) - 1, (95 * len(answers)) // 100)]  # nearest rank
            reserve = max(reserve, high if ctx is None else min(high, ctx // 2))
        return reserve
