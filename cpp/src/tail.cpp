#include "ctxfold/tail.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ctxfold {

namespace {

[[noreturn]] void Invalid(const std::string& what) { throw std::invalid_argument(what); }

void CheckMinFill(double min_fill) {
  // Written so that NaN fails too.
  if (!(min_fill >= 0.0 && min_fill <= 1.0)) Invalid("min_fill must be in [0, 1], got " + std::to_string(min_fill));
}

void CheckBottomAndBudget(int64_t bottom, int64_t size, int64_t budget_tokens, const char* budget_name) {
  if (bottom < 0 || bottom > size) {
    throw std::out_of_range("bottom must be in [0, " + std::to_string(size) + "], got " + std::to_string(bottom));
  }
  if (budget_tokens < 0) Invalid(std::string(budget_name) + " must be >= 0, got " + std::to_string(budget_tokens));
}

bool IsAssistantKind(uint32_t f) { return (f & (kFlagAssistant | kFlagToolCall | kFlagThinking)) != 0; }

// The candidates one backward scan collects: the oldest legal start of each kind and the tail
// size behind it (-1 = none of that kind within budget).
struct Candidates {
  int64_t user = -1, user_tokens = -1;
  int64_t assistant = -1, assistant_tokens = -1;
  int64_t any = -1, any_tokens = -1;
};

Candidates ScanSegments(std::span<const int64_t> tokens, std::span<const uint32_t> flags,
                        std::span<const int32_t> group_starts, int64_t bottom, int64_t budget_tokens) {
  Candidates c;
  int64_t sum = 0;
  int64_t min_group = bottom;  // smallest group start among segments [i, bottom)
  for (int64_t i = bottom - 1; i >= 0; --i) {
    const auto k = static_cast<size_t>(i);
    const uint32_t f = flags[k];
    if (f & kFlagSystem) break;
    const int64_t t = tokens[k];
    const int32_t g = group_starts[k];
    if (t < 0) Invalid("segment " + std::to_string(i) + ": token count must be >= 0, got " + std::to_string(t));
    if (g < 0 || g > i) {
      Invalid("segment " + std::to_string(i) + ": group_start must be in [0, " + std::to_string(i) + "], got " +
              std::to_string(g));
    }
    if (t > budget_tokens - sum) break;  // compared this way round so the sum never overflows
    sum += t;
    min_group = std::min<int64_t>(min_group, g);
    if (min_group != i || (f & kFlagToolResult)) continue;  // inside a group, or an orphaned result
    c.any = i;
    c.any_tokens = sum;
    if (f & kFlagUserTurn) {
      c.user = i;
      c.user_tokens = sum;
    } else if (IsAssistantKind(f)) {
      c.assistant = i;
      c.assistant_tokens = sum;
    }
  }
  return c;
}

SegmentTail Choose(const Candidates& c, int64_t bottom, double min_fill) {
  if (c.any < 0) return {bottom, 0, TailRule::kNone};
  // Same expression as the Python reference, so both round alike.
  const double want = min_fill * static_cast<double>(c.any_tokens);
  if (c.user >= 0 && static_cast<double>(c.user_tokens) >= want) return {c.user, c.user_tokens, TailRule::kUserTurn};
  if (c.assistant >= 0 && static_cast<double>(c.assistant_tokens) >= want) {
    return {c.assistant, c.assistant_tokens, TailRule::kAssistantTurn};
  }
  return {c.any, c.any_tokens, TailRule::kGroupStart};
}

}  // namespace

void CheckSegments(std::span<const int64_t> tokens, std::span<const uint32_t> flags,
                   std::span<const int32_t> group_starts, int64_t bottom) {
  if (flags.size() != tokens.size() || group_starts.size() != tokens.size()) {
    Invalid("tokens, flags and group_starts must have one length, got " + std::to_string(tokens.size()) + ", " +
            std::to_string(flags.size()) + " and " + std::to_string(group_starts.size()));
  }
  CheckBottomAndBudget(bottom, static_cast<int64_t>(tokens.size()), 0, "budget");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) Invalid("tokens[" + std::to_string(i) + "] must be >= 0, got " + std::to_string(tokens[i]));
    if (group_starts[i] < 0 || static_cast<size_t>(group_starts[i]) > i) {
      Invalid("group_starts[" + std::to_string(i) + "] must be in [0, " + std::to_string(i) + "], got " +
              std::to_string(group_starts[i]));
    }
  }
}

SegmentTail SelectSegmentTail(std::span<const int64_t> tokens, std::span<const uint32_t> flags,
                              std::span<const int32_t> group_starts, int64_t bottom, int64_t budget_tokens,
                              double min_fill) {
  if (flags.size() != tokens.size() || group_starts.size() != tokens.size()) {
    Invalid("tokens, flags and group_starts must have one length, got " + std::to_string(tokens.size()) + ", " +
            std::to_string(flags.size()) + " and " + std::to_string(group_starts.size()));
  }
  CheckBottomAndBudget(bottom, static_cast<int64_t>(tokens.size()), budget_tokens, "budget_tokens");
  CheckMinFill(min_fill);
  return Choose(ScanSegments(tokens, flags, group_starts, bottom, budget_tokens), bottom, min_fill);
}

SegmentTail SelectSegmentTail(const Ledger& ledger, int64_t bottom, int64_t budget_tokens, double min_fill) {
  return SelectSegmentTail(ledger.tokens(), ledger.flags(), ledger.group_starts(), bottom, budget_tokens, min_fill);
}

SegmentCut SelectSegmentCut(std::span<const int64_t> tokens, std::span<const uint32_t> flags,
                            std::span<const int32_t> group_starts, int64_t bottom, int64_t min_free_tokens,
                            double min_fill) {
  CheckSegments(tokens, flags, group_starts, bottom);
  CheckMinFill(min_fill);
  if (min_free_tokens < 0) Invalid("min_free_tokens must be >= 0, got " + std::to_string(min_free_tokens));
  // Tokens above the system prefix; freeing N of them leaves a tail of at most total - N.
  int64_t total = 0;
  int64_t floor = bottom;
  while (floor > 0 && !(flags[static_cast<size_t>(floor - 1)] & kFlagSystem)) {
    --floor;
    total += tokens[static_cast<size_t>(floor)];  // CheckSegments bounds each count; the sum is a conversation
  }
  if (total < min_free_tokens) return {false, bottom, total, TailRule::kNone};
  const SegmentTail tail = Choose(ScanSegments(tokens, flags, group_starts, bottom, total - min_free_tokens),
                                  bottom, min_fill);
  return {true, tail.start, total - tail.num_tokens, tail.rule};
}

// ---- token level ------------------------------------------------------------------------------

void CheckTokenTailArgs(std::span<const int32_t> ids, int64_t bottom, int64_t floor, int64_t budget_tokens,
                        std::span<const int32_t> boundary_ids, std::span<const uint8_t> cut_after,
                        std::span<const int64_t> no_entry, double min_fill) {
  CheckBottomAndBudget(bottom, static_cast<int64_t>(ids.size()), budget_tokens, "budget_tokens");
  if (floor < 0 || floor > bottom) {
    throw std::out_of_range("floor must be in [0, bottom=" + std::to_string(bottom) + "], got " +
                            std::to_string(floor));
  }
  if (boundary_ids.empty() || boundary_ids.size() > static_cast<size_t>(kMaxBoundaryKinds)) {
    Invalid("boundary_ids must hold 1 to " + std::to_string(kMaxBoundaryKinds) + " ids, got " +
            std::to_string(boundary_ids.size()));
  }
  if (cut_after.size() != boundary_ids.size()) {
    Invalid("cut_after must have one entry per boundary id (" + std::to_string(boundary_ids.size()) + "), got " +
            std::to_string(cut_after.size()));
  }
  for (size_t r = 0; r < cut_after.size(); ++r) {
    if (cut_after[r] > 1) Invalid("cut_after[" + std::to_string(r) + "] must be 0 or 1");
  }
  CheckMinFill(min_fill);
  if (no_entry.size() % 2 != 0) {
    Invalid("no_entry must hold [begin, end) pairs, got an odd number of values: " + std::to_string(no_entry.size()));
  }
  int64_t prev_end = 0;
  for (size_t s = 0; s < no_entry.size(); s += 2) {
    const int64_t b = no_entry[s], e = no_entry[s + 1];
    if (b < 0 || e < b) {
      Invalid("no_entry span " + std::to_string(s / 2) + " = [" + std::to_string(b) + ", " + std::to_string(e) +
              "): need 0 <= begin <= end");
    }
    if (b < prev_end) {
      Invalid("no_entry span " + std::to_string(s / 2) + " begins at " + std::to_string(b) +
              " before the previous span ends (" + std::to_string(prev_end) + "): spans must be sorted and disjoint");
    }
    if (e > static_cast<int64_t>(ids.size())) {
      throw std::out_of_range("no_entry span " + std::to_string(s / 2) + " ends at " + std::to_string(e) +
                              ", past the end of ids (" + std::to_string(ids.size()) + ")");
    }
    prev_end = e;
  }
}

namespace {

// Whether any of n tokens equals one of the markers (4 * num_groups of them). One pass with four
// compares per token and no branch, so the compiler vectorises it; on x86-64 an AVX2 clone is
// chosen at load time when the CPU has it (the default build targets baseline SSE2).
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)  // ifunc: glibc only
__attribute__((target_clones("avx2", "default")))
#endif
bool BlockHasMarker(const int32_t* tokens, int64_t n, const int32_t* markers4, int num_groups) {
  int hits = 0;
  for (int g = 0; g < num_groups; ++g) {
    const int32_t a = markers4[4 * g], b = markers4[4 * g + 1], c = markers4[4 * g + 2], d = markers4[4 * g + 3];
    for (int64_t p = 0; p < n; ++p) {
      const int32_t x = tokens[p];
      hits |= static_cast<int>(x == a) | static_cast<int>(x == b) | static_cast<int>(x == c) | static_cast<int>(x == d);
    }
  }
  return hits != 0;
}

// The no-entry span that could contain a cut: the last one whose begin < c. Spans are sorted and
// disjoint, so it is the only candidate. Cuts must be visited in non-decreasing order.
class SpanCursor {
 public:
  SpanCursor(std::span<const int64_t> no_entry, int64_t c) : spans_(no_entry), n_(static_cast<int64_t>(no_entry.size() / 2)) {
    // Binary search for the number of spans with begin < c.
    int64_t lo = 0, hi = n_;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (Begin(mid) < c) lo = mid + 1; else hi = mid;
    }
    j_ = lo - 1;
  }
  bool Inside(int64_t c) {
    while (j_ + 1 < n_ && Begin(j_ + 1) < c) ++j_;
    return j_ >= 0 && c < End(j_);
  }
  // For a raw cut: the end of the span that strictly contains c, or c.
  int64_t MoveOut(int64_t c) { return Inside(c) ? End(j_) : c; }

 private:
  int64_t Begin(int64_t s) const { return spans_[static_cast<size_t>(2 * s)]; }
  int64_t End(int64_t s) const { return spans_[static_cast<size_t>(2 * s + 1)]; }
  std::span<const int64_t> spans_;
  int64_t n_;
  int64_t j_;
};

}  // namespace

TokenTail SelectTokenTail(std::span<const int32_t> ids, int64_t bottom, int64_t floor, int64_t budget_tokens,
                          std::span<const int32_t> boundary_ids, std::span<const uint8_t> cut_after,
                          std::span<const int64_t> no_entry, double min_fill) {
  CheckTokenTailArgs(ids, bottom, floor, budget_tokens, boundary_ids, cut_after, no_entry, min_fill);
  const int kinds = static_cast<int>(boundary_ids.size());
  const int64_t lowest = std::max(floor, bottom - budget_tokens);  // oldest cut within budget
  if (lowest >= bottom) return {bottom, 0, kNoTail};
  // The answer is the oldest cut of some kind, so the window is scanned oldest first (the result
  // is the backward scan's): the first boundary found is the best one; from there only cuts that
  // still keep min_fill of it can win, and the scan stops at the first most-preferred one.
  // A marker at token p yields the cut p (the tail starts with it) or p + 1 (cut_after), so the
  // tokens that matter start at lowest - 1. A branch-free compare of each small block against
  // every boundary id (vectorised by the compiler) skips blocks without a marker.
  int64_t first[kMaxBoundaryKinds];
  std::fill(first, first + kMaxBoundaryKinds, int64_t{-1});
  int64_t best = -1;
  double want = 0.0;
  bool done = false;
  SpanCursor cursor(no_entry, lowest);
  const auto visit = [&](int64_t cut, int r) {
    if (cut < lowest || cut >= bottom || done) return;
    if (best >= 0 && static_cast<double>(bottom - cut) < want) {
      done = true;  // this and every later cut keep too little
      return;
    }
    if (first[r] >= 0 || cursor.Inside(cut)) return;
    first[r] = cut;
    if (best < 0) {
      best = cut;
      want = min_fill * static_cast<double>(bottom - best);  // same expression as the reference
    }
    if (r == 0) done = true;
  };
  const int32_t* data = ids.data();
  // Boundary ids padded to a multiple of 4 by repeating the first one, for BlockHasMarker.
  int32_t markers4[kMaxBoundaryKinds];
  const int num_groups = (kinds + 3) / 4;
  for (int r = 0; r < 4 * num_groups; ++r) markers4[r] = boundary_ids[static_cast<size_t>(r < kinds ? r : 0)];
  constexpr int64_t kBlock = 256;
  for (int64_t block_begin = std::max<int64_t>(lowest - 1, 0); block_begin < bottom && !done; block_begin += kBlock) {
    const int64_t block_end = std::min(bottom, block_begin + kBlock);
    if (best >= 0 && static_cast<double>(bottom - block_begin) < want) break;
    if (!BlockHasMarker(data + block_begin, block_end - block_begin, markers4, num_groups)) continue;
    for (int64_t p = block_begin; p < block_end && !done; ++p) {
      const int32_t id = data[p];
      // Cuts in increasing order (the span cursor only moves forward): p, then p + 1.
      for (int r = 0; r < kinds; ++r) {
        const auto k = static_cast<size_t>(r);
        if (!cut_after[k] && boundary_ids[k] == id) visit(p, r);
      }
      for (int r = 0; r < kinds; ++r) {
        const auto k = static_cast<size_t>(r);
        if (cut_after[k] && boundary_ids[k] == id) visit(p + 1, r);
      }
    }
  }
  for (int r = 0; r < kinds; ++r) {
    if (first[r] >= 0) return {first[r], bottom - first[r], r};
  }
  // No boundary in budget: a raw cut, never inside a no-entry span (moved forward, so still in budget).
  SpanCursor raw_cursor(no_entry, lowest);
  const int64_t raw = std::min(raw_cursor.MoveOut(lowest), bottom);
  if (raw >= bottom) return {bottom, 0, kNoTail};
  return {raw, bottom - raw, kRawCut};
}

int64_t AlignDownToPage(int64_t pos, int64_t page_size_tokens) {
  if (page_size_tokens < 1) Invalid("page_size_tokens must be >= 1, got " + std::to_string(page_size_tokens));
  if (pos < 0) Invalid("position must be >= 0, got " + std::to_string(pos));
  return pos - pos % page_size_tokens;
}

}  // namespace ctxfold
