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

// The no-entry span that could contain a cut moving backward: the last one whose begin < c.
// Spans are sorted and disjoint, so it is the only candidate.
class SpanCursor {
 public:
  SpanCursor(std::span<const int64_t> no_entry, int64_t c) : spans_(no_entry) {
    // Binary search for the number of spans with begin < c.
    int64_t lo = 0, hi = static_cast<int64_t>(no_entry.size() / 2);
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (Begin(mid) < c) lo = mid + 1; else hi = mid;
    }
    j_ = lo - 1;
  }
  // Cuts must be visited in non-increasing order.
  bool Inside(int64_t c) {
    while (j_ >= 0 && Begin(j_) >= c) --j_;
    return j_ >= 0 && c < End(j_);
  }
  // For a raw cut: the end of the span that strictly contains c, or c.
  int64_t MoveOut(int64_t c) { return Inside(c) ? End(j_) : c; }

 private:
  int64_t Begin(int64_t s) const { return spans_[static_cast<size_t>(2 * s)]; }
  int64_t End(int64_t s) const { return spans_[static_cast<size_t>(2 * s + 1)]; }
  std::span<const int64_t> spans_;
  int64_t j_;
};

}  // namespace

TokenTail SelectTokenTail(std::span<const int32_t> ids, int64_t bottom, int64_t floor, int64_t budget_tokens,
                          std::span<const int32_t> boundary_ids, std::span<const uint8_t> cut_after,
                          std::span<const int64_t> no_entry, double min_fill) {
  CheckTokenTailArgs(ids, bottom, floor, budget_tokens, boundary_ids, cut_after, no_entry, min_fill);
  const int kinds = static_cast<int>(boundary_ids.size());
  // Boundary ids are special tokens at the top of the vocabulary: one range test rejects almost
  // every ordinary token before the per-kind compares.
  const auto [lo_it, hi_it] = std::minmax_element(boundary_ids.begin(), boundary_ids.end());
  const int32_t lo_id = *lo_it, hi_id = *hi_it;
  int64_t oldest[kMaxBoundaryKinds];
  std::fill(oldest, oldest + kMaxBoundaryKinds, int64_t{-1});
  const int64_t lowest = std::max(floor, bottom - budget_tokens);  // oldest cut within budget
  SpanCursor cursor(no_entry, bottom);
  for (int64_t c = bottom - 1; c >= lowest; --c) {
    const int32_t here = ids[static_cast<size_t>(c)];
    const bool has_before = c > 0;
    const int32_t before = has_before ? ids[static_cast<size_t>(c - 1)] : here;
    const bool maybe_here = here >= lo_id && here <= hi_id;
    const bool maybe_before = has_before && before >= lo_id && before <= hi_id;
    if (!maybe_here && !maybe_before) continue;
    bool checked_span = false, inside = false;
    for (int r = 0; r < kinds; ++r) {
      const auto k = static_cast<size_t>(r);
      const bool hit = cut_after[k] ? (maybe_before && before == boundary_ids[k])
                                    : (maybe_here && here == boundary_ids[k]);
      if (!hit) continue;
      if (!checked_span) {
        inside = cursor.Inside(c);
        checked_span = true;
      }
      if (inside) break;
      oldest[r] = c;
    }
  }
  int64_t best = -1;
  for (int r = 0; r < kinds; ++r) {
    if (oldest[r] >= 0 && (best < 0 || oldest[r] < best)) best = oldest[r];
  }
  if (best >= 0) {
    const double want = min_fill * static_cast<double>(bottom - best);
    for (int r = 0; r < kinds; ++r) {
      if (oldest[r] >= 0 && static_cast<double>(bottom - oldest[r]) >= want) {
        return {oldest[r], bottom - oldest[r], r};
      }
    }
  }
  // No boundary in budget: a raw cut, never inside a no-entry span (moved forward, so still in budget).
  if (lowest >= bottom) return {bottom, 0, kNoTail};
  SpanCursor raw_cursor(no_entry, lowest + 1);
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
