"""The window a conversation is compacted to: the upstream's window (``--context-tokens``) divided by
the conversation's calibration factor (the upstream's prompt tokens over ctxfold's estimate, with 2%
in hand). Moved by the upstream's usage figures after each answer (:func:`calibrate`) and by an
upstream that refused a prompt as too long (:func:`lower_after_refusal`): one factor for both."""

from __future__ import annotations

from dataclasses import replace

from ctxfold.config import CompactConfig
from ctxfold.serve.sessions import ProxySession

# The smoothing of the calibration factor: new = old + ALPHA * (observed - old).
CALIBRATION_ALPHA = 0.5
CALIBRATION_RANGE = (0.5, 2.0)
CALIBRATION_MARGIN = 1.02  # keep 2% in hand: the factor is measured on the previous request
# A refusal that names no figures: the window is taken this much lower (the engine's overshoot unknown).
REFUSAL_SHRINK = 1.25


def _apply(session: ProxySession, base: CompactConfig, window_tokens: int) -> None:
    effective = int(window_tokens / (session.calibration * CALIBRATION_MARGIN))
    c = session.compactor
    if c.config.context_tokens != effective:
        c.config = replace(base, context_tokens=effective)


def calibrate(session: ProxySession, base: CompactConfig, reported: int, estimate: int) -> None:
    """Fold one observation (the upstream counted ``reported`` prompt tokens where ctxfold estimated
    ``estimate``) into the session's factor, and set its compactor's window from it."""
    ctx = base.context_tokens
    if ctx is None or estimate <= 0 or reported <= 0:
        return
    lo, hi = CALIBRATION_RANGE
    observed = min(max(reported / estimate, lo), hi)
    session.calibration += CALIBRATION_ALPHA * (observed - session.calibration)
    _apply(session, base, ctx)


def lower_after_refusal(session: ProxySession, base: CompactConfig, prompt_tokens: int | None,
                        limit_tokens: int | None) -> bool:
    """The upstream refused the request as ``prompt_tokens`` over its window of ``limit_tokens``
    (either may be unknown): raise the session's factor by that overshoot (or by REFUSAL_SHRINK), at
    once, not smoothed, so the next compaction aims that much lower. The window is the configured
    one, else the engine's. False when neither is known: nothing to aim at."""
    window = base.context_tokens or limit_tokens
    if window is None:
        return False
    if prompt_tokens is not None and limit_tokens is not None and prompt_tokens > limit_tokens > 0:
        overshoot = prompt_tokens / limit_tokens
    else:
        overshoot = REFUSAL_SHRINK
    session.calibration = min(session.calibration * overshoot, CALIBRATION_RANGE[1] * REFUSAL_SHRINK)
    if base.context_tokens is None:  # the engine's window, from now on, for this conversation
        base = replace(base, context_tokens=window)
    _apply(session, base, window)
    return True
