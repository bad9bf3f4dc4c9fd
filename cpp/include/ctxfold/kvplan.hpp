// KV re-sync plan between a cached token sequence (what the engine's KV holds) and the rebuilt
// one (system prefix + summary + verbatim tail): what to keep, free, prefill again, or shift.
//
// Thread safety: pure functions over caller-owned views; call them from any thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ctxfold {

// Length of the longest common prefix of a and b. O(prefix), memcmp-speed, no allocation.
int64_t CommonPrefix(std::span<const int32_t> a, std::span<const int32_t> b) noexcept;

// A run of the old sequence that reappears verbatim in the new one. Its KV can be moved by
// `delta` positions (llama.cpp seq_add, a RoPE re-rotation) instead of recomputed; always
// approximate: deeper layers still carry attention to the tokens that were removed before it.
struct ShiftSpan {
  int64_t old_begin = 0;   // first token in the cached sequence
  int64_t new_begin = 0;   // first token in the rebuilt sequence
  int64_t num_tokens = 0;  // length of the run
  int64_t delta() const noexcept { return new_begin - old_begin; }
};

struct KvPlan {
  int64_t common_prefix_tokens = 0;  // exact longest common prefix of cached and rebuilt ids
  int64_t reuse_tokens = 0;          // KV kept in place: the prefix, capped at rebuilt - 1 (the last
                                     // token is always computed to yield logits), rounded down to a page
  int64_t page_size_tokens = 1;      // engine KV page (block) size used for the rounding
  int64_t pages_kept = 0;            // logical pages [0, pages_kept) keep their blocks
  int64_t cached_pages = 0;          // pages the cached sequence occupies: ceil(cached / page)
  int64_t prefill_tokens = 0;        // rebuilt - reuse: what an exact-prefix engine computes again
  std::vector<ShiftSpan> shifts;     // verbatim runs after the reuse point, in increasing old and
                                     // new order, none shorter than the minimum asked for
  int64_t shifted_tokens = 0;        // sum of shifts[i].num_tokens
  int64_t prefill_tokens_with_shift = 0;  // prefill_tokens - shifted_tokens
  // [begin, end) ranges of the rebuilt sequence still to compute when the shifts are applied, in order.
  std::vector<std::pair<int64_t, int64_t>> prefill_ranges_with_shift;
};

// Plans the re-sync. page_size_tokens >= 1 (1 for llama.cpp, 16 for vLLM's default blocks).
// min_shift_tokens: shortest verbatim run worth shifting (llama.cpp --cache-reuse N); 0 disables
// the search. The search hashes every min_shift_tokens-gram of the cached suffix once (rolling
// hash into a table keyed by the full hash), walks the rebuilt suffix with the same rolling hash,
// verifies each hit token by token and extends it greedily: O(cached + rebuilt) expected, never
// quadratic. At each rebuilt position the oldest cached match after the previous span is taken. Throws std::invalid_argument on page_size_tokens < 1 or min_shift_tokens < 0 or 1 to 3
// (runs that short match by chance and cost more to shift than to compute).
KvPlan PlanKvResync(std::span<const int32_t> cached, std::span<const int32_t> rebuilt, int64_t page_size_tokens,
                    int64_t min_shift_tokens);

}  // namespace ctxfold
