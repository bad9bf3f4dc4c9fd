"""What an engine's KV cache keeps across a rewrite (:class:`KvPlanFigures` of a compaction): from per-message
counts (free, the default) or from the token ids of both requests (``kv_plan="tokens"``: exact, with the spans
a position-shifting engine could move)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ctxfold.chat.messages import Message
from ctxfold.compaction.events import KvPlanFigures
from ctxfold.core.kvplan import plan_kv_resync

if TYPE_CHECKING:
    from ctxfold.compaction.compactor import Compactor

MIN_SHIFT_TOKENS = 16  # the shortest verbatim run worth moving instead of recomputing (llama.cpp --cache-reuse)


def kv_figures(c: Compactor, old: Sequence[Message], new: Sequence[Message]) -> KvPlanFigures:
    """Reuse of the engine's KV cache across a rewrite: the exact common prefix (page-aligned),
    what must be prefilled again, and what a position-shifting engine could move instead
    (verbatim spans found again after the divergence: approximate)."""
    if c.kv_plan == "tokens":
        plan = plan_kv_resync(request_ids(c, old), request_ids(c, new),
                              page_size_tokens=c.page_size_tokens, min_shift_tokens=MIN_SHIFT_TOKENS)
        return KvPlanFigures(tokens_reused=plan.reuse_tokens, tokens_to_prefill=plan.prefill_tokens,
                             tokens_shift_reusable=plan.shifted_tokens, exact=True)
    new_tokens = c.accounting.tokens()
    k = 0
    while k < min(len(old), len(new)) and old[k] is new[k]:
        k += 1
    common = c.accounting.prefix_tokens + int(new_tokens[:k].sum())
    reused = common - common % c.page_size_tokens
    old_ids = {id(m) for m in old[k:]}
    shiftable = int(sum(int(new_tokens[i]) for i in range(k, len(new)) if id(new[i]) in old_ids))
    return KvPlanFigures(tokens_reused=reused, tokens_to_prefill=c.accounting.total_tokens - reused,
                         tokens_shift_reusable=shiftable)

def request_ids(c: Compactor, messages: Sequence[Message]) -> npt.NDArray[np.int32]:
    """The token ids of the request for ``messages``, as a server would tokenize the prompt."""
    rendered = c.accounting.renderer.render(replace(c.header, messages=list(messages)),
                                               c.accounting.options)
    tokenizer = c.counter.tokenizer  # type: ignore[attr-defined]
    return np.asarray(tokenizer.encode(rendered.text(), add_special_tokens=False).ids, dtype=np.int32)
