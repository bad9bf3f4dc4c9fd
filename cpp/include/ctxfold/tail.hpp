// Tail selection: where the verbatim tail of a compacted conversation starts, over segments (the
// ledger) and over raw int32 token ids (the way an engine holds them).
//
// Both scans walk backward from BOTTOM and stop as soon as the budget is spent, so they cost
// O(segments or tokens inside the budget), allocate nothing and never throw once the inputs have
// been checked (the Check* functions below, or the documented preconditions).
// Thread safety: pure functions over caller-owned views; call them from any thread.
#pragma once

#include <cstdint>
#include <span>

#include "ctxfold/ledger.hpp"

namespace ctxfold {

// Which rule chose a segment-level cut. Shared with Python (ctxfold.tail.TailRule).
enum class TailRule : int32_t {
  kNone = 0,           // nothing fits: no tail (never a raw cut)
  kUserTurn = 1,       // the start of a real user turn
  kAssistantTurn = 2,  // the start of an assistant turn (text, tool calls or thinking)
  kGroupStart = 3,     // any other segment that starts an atomic group (queued input, summary, ...)
};

struct SegmentTail {
  int64_t start = 0;       // first segment of the tail; == bottom when rule == kNone
  int64_t num_tokens = 0;  // tokens in segments [start, bottom)
  TailRule rule = TailRule::kNone;
};

struct SegmentCut {
  bool found = false;        // false: even dropping everything above the system prefix frees too little
  int64_t cut = 0;           // segments [floor, cut) are dropped; [cut, bottom) stay; == bottom: all dropped
  int64_t freed_tokens = 0;  // tokens in [floor, cut), where floor is the end of the system prefix
  TailRule rule = TailRule::kNone;  // kind of segment at `cut`; kNone when cut == bottom
};

// Throws std::invalid_argument unless the three arrays share one length, counts are >= 0,
// group_starts[i] is in [0, i], 0 <= bottom <= size, budget >= 0 and 0 <= min_fill <= 1.
// O(n); the scans below only check what they touch.
void CheckSegments(std::span<const int64_t> tokens, std::span<const uint32_t> flags,
                   std::span<const int32_t> group_starts, int64_t bottom);

// The verbatim tail ending at `bottom` (exclusive) within `budget_tokens`.
//
// A legal start i: not a system segment, not a tool result, group_starts[i] == i, and no segment in
// [i, bottom) belongs to a group that starts before i (so no call is split from its results and no
// thinking block is entered); every segment in [i, bottom) is above the system prefix.
// Among legal starts whose tail fits the budget, let best = the largest tail. The oldest user-turn
// start is chosen if its tail holds >= min_fill * best tokens; else the oldest assistant-turn start
// under the same test; else the oldest legal start (best itself). min_fill = 0 is the strict order
// (a user turn whenever one fits); a positive min_fill refuses to waste more than (1 - min_fill)
// of what a legal cut could keep just to start on a preferred kind (the trim_messages 4% cliff).
// Preconditions as CheckSegments (bounds on scanned segments are re-checked and throw
// std::invalid_argument). O(segments inside the budget).
SegmentTail SelectSegmentTail(std::span<const int64_t> tokens, std::span<const uint32_t> flags,
                              std::span<const int32_t> group_starts, int64_t bottom, int64_t budget_tokens,
                              double min_fill);
SegmentTail SelectSegmentTail(const Ledger& ledger, int64_t bottom, int64_t budget_tokens, double min_fill);

// The reverse question: the newest legal cut that frees at least `min_free_tokens` above the system
// prefix (the smallest prefix to drop or summarize), with the same rule order and min_fill as
// SelectSegmentTail applied to the tail that remains. O(bottom).
SegmentCut SelectSegmentCut(std::span<const int64_t> tokens, std::span<const uint32_t> flags,
                            std::span<const int32_t> group_starts, int64_t bottom, int64_t min_free_tokens,
                            double min_fill);

// ---- token level ------------------------------------------------------------------------------

// Most boundary kinds one scan ranks (user, assistant, EOS, end of thinking, ...).
inline constexpr int kMaxBoundaryKinds = 16;

struct TokenTail {
  int64_t start = 0;       // first token of the tail; == bottom when rule == kNoTail
  int64_t num_tokens = 0;  // bottom - start
  int32_t rule = 0;        // >= 0: rank of the boundary kind that chose the cut; kRawCut; kNoTail
};
inline constexpr int32_t kRawCut = -1;  // no boundary within budget: oldest cut outside no-entry spans
inline constexpr int32_t kNoTail = -2;  // not even a raw cut fits (budget 0, or one span covers it all)

// Throws std::invalid_argument unless 0 <= floor <= bottom <= ids.size(), budget >= 0,
// 1 <= boundary_ids.size() <= kMaxBoundaryKinds, cut_after has the same size with 0/1 entries,
// 0 <= min_fill <= 1, and no_entry holds [begin, end) pairs with begin <= end, sorted by begin
// and not overlapping. O(no_entry.size()).
void CheckTokenTailArgs(std::span<const int32_t> ids, int64_t bottom, int64_t floor, int64_t budget_tokens,
                        std::span<const int32_t> boundary_ids, std::span<const uint8_t> cut_after,
                        std::span<const int64_t> no_entry, double min_fill);

// The verbatim tail of ids[floor, bottom) within `budget_tokens`: the cuts considered are those a
// backward scan from bottom meets before the budget is spent. A cut c (tail = ids[c, bottom)) is a
// boundary of kind r when ids[c] == boundary_ids[r] (cut_after[r] == 0: the tail starts with the
// marker, e.g. <|User|>) or ids[c-1] == boundary_ids[r] (cut_after[r] == 1: the tail starts after
// it, e.g. EOS); it must lie in [floor, bottom) and not strictly inside a no-entry span
// (begin < c < end). Ranks are ordered by preference; among cuts in budget, best = the oldest of
// any kind, and the most preferred kind whose oldest cut keeps >= min_fill * best tokens wins.
// Only when no boundary fits is a raw cut returned: bottom - budget (or floor), moved forward out
// of any no-entry span. Preconditions as CheckTokenTailArgs.
// Cost: the window is read oldest first in blocks that a vectorised compare skips when they hold
// no marker, and the read stops at the first most-preferred cut or once no later cut can keep
// min_fill of the best: O(window) at worst, usually far less; no allocation.
TokenTail SelectTokenTail(std::span<const int32_t> ids, int64_t bottom, int64_t floor, int64_t budget_tokens,
                          std::span<const int32_t> boundary_ids, std::span<const uint8_t> cut_after,
                          std::span<const int64_t> no_entry, double min_fill);

// Rounds a reuse point down to a multiple of the engine's KV page size (vLLM blocks are 16 tokens).
// Throws std::invalid_argument on pos < 0 or page_size_tokens < 1.
int64_t AlignDownToPage(int64_t pos, int64_t page_size_tokens);

}  // namespace ctxfold
