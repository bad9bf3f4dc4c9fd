"""The KV re-sync plan: from the token ids the engine's KV cache holds to the rebuilt ids.

Exact-prefix engines (vLLM, SGLang) keep the common prefix, rounded down to their page (block)
size, and prefill the rest. Engines that can shift positions (llama.cpp ``--cache-reuse``) can
also move verbatim runs of the old sequence (the tail kept after a summary) into their new place;
that reuse is approximate, because deeper layers still carry attention to the removed tokens, and
the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxfold import _core
from ctxfold.core._arrays import as_view


@dataclass(frozen=True, slots=True)
class ShiftSpan:
    """A verbatim run of the cached sequence found again in the rebuilt one."""

    old_begin: int  # first token in the cached sequence
    new_begin: int  # first token in the rebuilt sequence
    num_tokens: int  # length of the run
    # Always True: its KV was computed after tokens that are gone, so moving it is not exact.
    approximate: bool = True

    @property
    def delta(self) -> int:
        """Position shift to apply to the run's KV (llama.cpp ``seq_add``)."""
        return self.new_begin - self.old_begin


@dataclass(frozen=True, slots=True)
class KvPlan:
    """What the engine keeps, frees, shifts and prefills to go from cached to rebuilt ids."""

    common_prefix_tokens: int  # exact longest common prefix
    reuse_tokens: int  # KV kept in place: the prefix capped at len(rebuilt) - 1, rounded down to a page
    page_size_tokens: int  # the engine's KV page size used for the rounding
    pages_kept: int  # logical pages [0, pages_kept) keep their physical blocks
    cached_pages: int  # pages the cached sequence occupies: ceil(len(cached) / page)
    prefill_tokens: int  # len(rebuilt) - reuse_tokens: what an exact-prefix engine computes
    prefill_ranges: tuple[tuple[int, int], ...]  # [begin, end) of rebuilt to prefill, no shifting
    shifts: tuple[ShiftSpan, ...]  # verbatim runs a shifting engine can move instead (approximate)
    shifted_tokens: int  # sum of the shifts' lengths
    prefill_tokens_with_shift: int  # prefill_tokens - shifted_tokens
    prefill_ranges_with_shift: tuple[tuple[int, int], ...]  # [begin, end) still to compute with shifts
    # Views into the caller's block table (int32 physical block per logical page), or None.
    kept_blocks: npt.NDArray[np.int32] | None = field(default=None, compare=False)
    freed_blocks: npt.NDArray[np.int32] | None = field(default=None, compare=False)

    @property
    def reused_tokens_with_shift(self) -> int:
        """Tokens whose KV survives when shifting is used (in place plus moved)."""
        return self.reuse_tokens + self.shifted_tokens


def common_prefix(a: Any, b: Any) -> int:
    """Length of the longest common prefix of two int32[n] id buffers (numpy or CPU tensors)."""
    return _core.common_prefix(as_view(a, np.int32, "a"), as_view(b, np.int32, "b"))


def plan_kv_resync(
    cached: Any,
    rebuilt: Any,
    *,
    page_size_tokens: int = 1,
    min_shift_tokens: int = 0,
    block_table: Any = None,
) -> KvPlan:
    """Plan the KV re-sync from ``cached`` (int32[n]) to ``rebuilt`` (int32[m]) ids.

    page_size_tokens: 1 for llama.cpp, 16 for vLLM's default blocks. min_shift_tokens: the
    shortest verbatim run worth shifting (llama.cpp ``--cache-reuse``); 0 disables the search,
    else >= 4. block_table: int32[>= cached_pages] physical block ids per logical page of the
    cached sequence; the plan then carries views of the blocks kept and freed.
    O(n + m); the shift search holds a hash table over the cached suffix.
    """
    c = as_view(cached, np.int32, "cached")
    r = as_view(rebuilt, np.int32, "rebuilt")
    plan = _core.plan_kv_resync(c, r, page_size_tokens, min_shift_tokens)
    kept, cached_pages, reuse = plan.pages_kept, plan.cached_pages, plan.reuse_tokens
    kept_blocks = freed_blocks = None
    if block_table is not None:
        table = as_view(block_table, np.int32, "block_table")
        if table.dtype != np.int32 or table.ndim != 1:
            raise ValueError(f"block_table: expected int32[pages], got {table.dtype}{list(table.shape)}")
        if len(table) < cached_pages:
            raise ValueError(
                f"block_table: {len(table)} entries cannot map the {cached_pages} pages of {len(c)} cached "
                f"tokens at {page_size_tokens} tokens a page"
            )
        if len(table) and int(table[:cached_pages].min(initial=0)) < 0:
            bad = int(np.flatnonzero(table[:cached_pages] < 0)[0])
            raise ValueError(f"block_table[{bad}] = {int(table[bad])}: physical block ids must be >= 0")
        kept_blocks, freed_blocks = table[:kept], table[kept:]
    return KvPlan(
        common_prefix_tokens=plan.common_prefix_tokens,
        reuse_tokens=reuse,
        page_size_tokens=plan.page_size_tokens,
        pages_kept=kept,
        cached_pages=cached_pages,
        prefill_tokens=plan.prefill_tokens,
        prefill_ranges=((reuse, len(r)),) if reuse < len(r) else (),
        shifts=tuple(ShiftSpan(o, n, k) for o, n, k in plan.shifts.tolist()),
        shifted_tokens=plan.shifted_tokens,
        prefill_tokens_with_shift=plan.prefill_tokens_with_shift,
        prefill_ranges_with_shift=tuple((b, e) for b, e in plan.prefill_ranges_with_shift.tolist()),
        kept_blocks=kept_blocks,
        freed_blocks=freed_blocks,
    )
