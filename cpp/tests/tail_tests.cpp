#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "check.hpp"
#include "ctxfold/ledger.hpp"
#include "ctxfold/tail.hpp"

using namespace ctxfold;

namespace {
constexpr uint32_t S = kFlagSystem, U = kFlagUser | kFlagUserTurn, A = kFlagAssistant,
                   C = kFlagAssistant | kFlagToolCall, R = kFlagToolResult, T = kFlagThinking,
                   Q = kFlagUser | kFlagQueued;
}  // namespace

CTXFOLD_TEST(segment_tail_prefers_user_turns_without_wasting_budget) {
  const std::vector<int64_t> t = {100, 10, 5, 50, 50, 20, 10, 30, 5, 5};
  const std::vector<uint32_t> f = {S, U, C, R, R, A, U, T, C, R};
  const std::vector<int32_t> g = {0, 1, 2, 2, 2, 5, 6, 7, 7, 7};
  auto r = SelectSegmentTail(t, f, g, 10, 10000, 0.9);
  CHECK(r.start == 1 && r.num_tokens == 185 && r.rule == TailRule::kUserTurn);
  r = SelectSegmentTail(t, f, g, 10, 175, 0.9);
  CHECK(r.start == 2 && r.num_tokens == 175 && r.rule == TailRule::kAssistantTurn);
  r = SelectSegmentTail(t, f, g, 10, 175, 0.0);
  CHECK(r.start == 6 && r.rule == TailRule::kUserTurn);
  r = SelectSegmentTail(t, f, g, 10, 20, 0.9);  // only inside the thinking group: no tail
  CHECK(r.start == 10 && r.num_tokens == 0 && r.rule == TailRule::kNone);
  r = SelectSegmentTail(t, f, g, 5, 1000, 0.9);  // BOTTOM before the last turn
  CHECK(r.start == 1 && r.num_tokens == 115);
}

CTXFOLD_TEST(segment_tail_never_splits_an_interleaved_group) {
  // A queued user message lands between a call (1) and its result (3): starting at 2 would orphan 3.
  const std::vector<int64_t> t = {5, 5, 5, 5};
  const std::vector<uint32_t> f = {U, C, Q, R};
  const std::vector<int32_t> g = {0, 1, 2, 1};
  auto r = SelectSegmentTail(t, f, g, 4, 10, 0.9);
  CHECK(r.rule == TailRule::kNone);
  r = SelectSegmentTail(t, f, g, 4, 15, 0.9);
  CHECK(r.start == 1 && r.rule == TailRule::kAssistantTurn);
  // An orphan result upstream (its own group) is never a start.
  const std::vector<uint32_t> f2 = {U, R, A, A};
  const std::vector<int32_t> g2 = {0, 1, 2, 3};
  r = SelectSegmentTail(t, f2, g2, 4, 15, 1.0);
  CHECK(r.start == 2);
}

CTXFOLD_TEST(segment_tail_edges_and_errors) {
  const std::vector<int64_t> none_t;
  const std::vector<uint32_t> none_f;
  const std::vector<int32_t> none_g;
  CHECK(SelectSegmentTail(none_t, none_f, none_g, 0, 0, 0.9).rule == TailRule::kNone);
  const std::vector<int64_t> t = {std::numeric_limits<int64_t>::max(), 3};
  const std::vector<uint32_t> f = {U, A};
  const std::vector<int32_t> g = {0, 1};
  // A huge count must not overflow the running sum.
  auto r = SelectSegmentTail(t, f, g, 2, std::numeric_limits<int64_t>::max(), 0.9);
  CHECK(r.start == 1 && r.num_tokens == 3);
  CHECK_THROWS(SelectSegmentTail(t, f, g, 3, 5, 0.9), std::out_of_range);
  CHECK_THROWS(SelectSegmentTail(t, f, g, -1, 5, 0.9), std::out_of_range);
  CHECK_THROWS(SelectSegmentTail(t, f, g, 2, -5, 0.9), std::invalid_argument);
  CHECK_THROWS(SelectSegmentTail(t, f, g, 2, 5, 1.5), std::invalid_argument);
  const std::vector<int32_t> bad_g = {0, 2};
  CHECK_THROWS(SelectSegmentTail(t, f, bad_g, 2, 5, 0.9), std::invalid_argument);
  const std::vector<int64_t> neg = {1, -1};
  CHECK_THROWS(SelectSegmentTail(neg, f, g, 2, 5, 0.9), std::invalid_argument);
  const std::vector<uint32_t> short_f = {U};
  CHECK_THROWS(SelectSegmentTail(t, short_f, g, 2, 5, 0.9), std::invalid_argument);
}

CTXFOLD_TEST(segment_tail_over_a_ledger) {
  Ledger l;
  l.Append(1, 100, S, 0);
  l.Append(2, 10, U, 1);
  l.Append(3, 20, C, 2);
  l.Append(4, 30, R, 2);
  auto r = SelectSegmentTail(l, l.size(), 55, 0.9);
  CHECK(r.start == 2 && r.num_tokens == 50 && r.rule == TailRule::kAssistantTurn);
}

CTXFOLD_TEST(segment_cut_frees_at_least_n) {
  const std::vector<int64_t> t = {100, 10, 5, 50, 50, 20, 10, 30, 5, 5};
  const std::vector<uint32_t> f = {S, U, C, R, R, A, U, T, C, R};
  const std::vector<int32_t> g = {0, 1, 2, 2, 2, 5, 6, 7, 7, 7};
  auto c = SelectSegmentCut(t, f, g, 10, 60, 0.9);
  CHECK(c.found && c.cut == 5 && c.freed_tokens == 115);
  c = SelectSegmentCut(t, f, g, 10, 0, 0.9);
  CHECK(c.found && c.cut == 1 && c.freed_tokens == 0);
  c = SelectSegmentCut(t, f, g, 10, 185, 0.9);  // everything above the system prompt
  CHECK(c.found && c.cut == 10 && c.freed_tokens == 185 && c.rule == TailRule::kNone);
  c = SelectSegmentCut(t, f, g, 10, 186, 0.9);
  CHECK(!c.found);
  CHECK_THROWS(SelectSegmentCut(t, f, g, 10, -1, 0.9), std::invalid_argument);
}

CTXFOLD_TEST(token_tail_boundaries_spans_and_raw_fallback) {
  constexpr int32_t kU = 128803, kA = 128804, kE = 1;
  const std::vector<int32_t> ids = {0, 5, 5, kU, 7, 7, kA, 8, 8, kE, kU, 9, kA, 3, 3, 3, kE};
  const int64_t n = static_cast<int64_t>(ids.size());
  const std::vector<int32_t> kinds = {kU, kA, kE};
  const std::vector<uint8_t> after = {0, 0, 1};
  const std::vector<int64_t> no_spans;
  auto r = SelectTokenTail(ids, n, 3, 14, kinds, after, no_spans, 0.9);
  CHECK(r.start == 3 && r.rule == 0);
  r = SelectTokenTail(ids, n, 0, 6, kinds, after, no_spans, 0.9);
  CHECK(r.start == 12 && r.rule == 1);
  r = SelectTokenTail(ids, n, 0, 3, kinds, after, no_spans, 0.9);
  CHECK(r.start == 14 && r.rule == kRawCut);
  const std::vector<int64_t> spans = {13, 16};
  r = SelectTokenTail(ids, n, 0, 3, kinds, after, spans, 0.9);
  CHECK(r.start == 16 && r.rule == kRawCut);
  r = SelectTokenTail(ids, n, 0, 0, kinds, after, no_spans, 0.9);
  CHECK(r.start == n && r.rule == kNoTail);
  const std::vector<int64_t> cover = {10, 17};  // one span covers the whole budget window
  r = SelectTokenTail(ids, n, 0, 5, kinds, after, cover, 0.9);
  CHECK(r.start == n && r.rule == kNoTail);
  // Boundary ids at the ends of the int32 range: the range test must not overflow.
  const std::vector<int32_t> extreme = {std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
  const std::vector<int32_t> ids2 = {extreme[1], 4, extreme[0], 4};
  const std::vector<uint8_t> after2 = {0, 0};
  r = SelectTokenTail(ids2, 4, 0, 4, extreme, after2, no_spans, 0.0);
  CHECK(r.start == 2 && r.rule == 0);
  r = SelectTokenTail(ids2, 4, 0, 4, extreme, after2, no_spans, 1.0);
  CHECK(r.start == 0 && r.rule == 1);
}

CTXFOLD_TEST(token_tail_rejects_bad_arguments) {
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  const std::vector<int32_t> kinds = {3};
  const std::vector<uint8_t> after = {0};
  const std::vector<int64_t> none;
  CHECK_THROWS(SelectTokenTail(ids, 5, 0, 2, kinds, after, none, 0.9), std::out_of_range);
  CHECK_THROWS(SelectTokenTail(ids, 4, 5, 2, kinds, after, none, 0.9), std::out_of_range);
  CHECK_THROWS(SelectTokenTail(ids, 4, 0, -2, kinds, after, none, 0.9), std::invalid_argument);
  const std::vector<int32_t> no_kinds;
  const std::vector<uint8_t> no_after;
  CHECK_THROWS(SelectTokenTail(ids, 4, 0, 2, no_kinds, no_after, none, 0.9), std::invalid_argument);
  const std::vector<uint8_t> bad_after = {2};
  CHECK_THROWS(SelectTokenTail(ids, 4, 0, 2, kinds, bad_after, none, 0.9), std::invalid_argument);
  const std::vector<int64_t> odd = {1};
  CHECK_THROWS(SelectTokenTail(ids, 4, 0, 2, kinds, after, odd, 0.9), std::invalid_argument);
  const std::vector<int64_t> overlap = {0, 3, 2, 4};
  CHECK_THROWS(SelectTokenTail(ids, 4, 0, 2, kinds, after, overlap, 0.9), std::invalid_argument);
  const std::vector<int64_t> past_end = {1, 9};
  CHECK_THROWS(SelectTokenTail(ids, 4, 0, 2, kinds, after, past_end, 0.9), std::out_of_range);
  CHECK(AlignDownToPage(33, 16) == 32);
  CHECK_THROWS(AlignDownToPage(3, 0), std::invalid_argument);
  CHECK_THROWS(AlignDownToPage(-3, 16), std::invalid_argument);
}
