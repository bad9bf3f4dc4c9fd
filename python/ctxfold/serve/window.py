"""The window a conversation is compacted to: the upstream's window (``--context-tokens``) divided by
the conversation's calibration factor (the upstream's prompt tokens over ctxfold's estimate, with 2%
in hand). Moved by the upstream's usage figures after each answer (:func:`calibrate`) and by an
upstream that refused a prompt as too long (:func:`lower_after_refusal`): one factor for both."""

from __future__ import annotations

import logging
from dataclasses import replace

from ctxfold.compaction.config import CompactConfig
from ctxfold.serve.routing import ProxySession

log = logging.getLogger("ctxfold.serve")

# The smoothing of the calibration factor: new = old + ALPHA * (observed - old).
CALIBRATION_ALPHA = 0.5
CALIBRATION_RANGE = (0.5, 2.0)
CALIBRATION_MARGIN = 1.02  # keep 2% in hand: the factor is measured on the previous request
# A refusal that names no figures: the window is taken this much lower (the engine's overshoot unknown).
REFUSAL_SHRINK = 1.25
# The factor a refusal may set at most: an engine that counts eight times what ctxfold counts is reading
# something else (another template, another tokenizer), which no window shrinking makes right.
MAX_REFUSAL_FACTOR = 8.0
# The smallest window a conversation is compacted to: room for a system prompt, a short request and a
# reply. Figures that would put it lower (an engine's odd usage, a refusal's) are held here, with a log line.
MIN_WINDOW_TOKENS = 256


def _apply(session: ProxySession, base: CompactConfig, window_tokens: int) -> None:
    effective = int(window_tokens / (session.calibration * CALIBRATION_MARGIN))
    floor = min(window_tokens, MIN_WINDOW_TOKENS)
    if effective < floor:
        log.warning("conversation %s: the upstream's figures (a factor of %.3g over ctxfold's count, a window of "
                    "%d tokens) would leave a window of %d tokens; compacting to %d instead", session.key,
                    session.calibration, window_tokens, effective, floor)
        effective = floor
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
                        limit_tokens: int | None, sent_tokens: int) -> bool:
    """The upstream refused a request that ctxfold counted at ``sent_tokens`` (its prompt, without the
    reply reserve) as ``prompt_tokens`` over its window of ``limit_tokens`` (either may be unknown).
    Aim lower at once, not smoothed: the factor becomes at least the engine's count over ctxfold's
    (or grows by REFUSAL_SHRINK when the engine named no figures), and the window is the smaller of
    the configured one and the engine's. False when neither window is known: nothing to aim at."""
    windows = [w for w in (base.context_tokens, limit_tokens) if w is not None and w > 0]
    if not windows:
        return False
    window = min(windows)
    if prompt_tokens is not None and prompt_tokens > 0 and sent_tokens > 0:
        factor = max(session.calibration, prompt_tokens / sent_tokens)
    else:
        factor = session.calibration * REFUSAL_SHRINK
    if window == base.context_tokens and factor <= session.calibration:
        factor = session.calibration * REFUSAL_SHRINK  # the same aim again would be refused again
    session.calibration = min(factor, MAX_REFUSAL_FACTOR)
    if base.context_tokens != window:  # the engine's window, from now on, for this conversation
        base = replace(base, context_tokens=window)
    _apply(session, base, window)
    return True
