#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "check.hpp"
#include "ctxfold/kvplan.hpp"

using namespace ctxfold;

CTXFOLD_TEST(common_prefix_at_chunk_edges) {
  std::vector<int32_t> a(3000);
  std::iota(a.begin(), a.end(), 0);
  for (size_t k : {size_t{0}, size_t{1}, size_t{1023}, size_t{1024}, size_t{1025}, size_t{2999}}) {
    auto b = a;
    b[k] = -1;
    CHECK(CommonPrefix(a, b) == static_cast<int64_t>(k));
  }
  CHECK(CommonPrefix(a, a) == 3000);
  CHECK(CommonPrefix(std::span<const int32_t>(a).first(10), a) == 10);
  CHECK(CommonPrefix(std::span<const int32_t>(), a) == 0);
}

CTXFOLD_TEST(plan_summary_then_verbatim_tail) {
  std::vector<int32_t> old_ids, new_ids;
  for (int32_t i = 0; i < 40; ++i) old_ids.push_back(100 + i);       // system
  for (int32_t i = 0; i < 600; ++i) old_ids.push_back(1000 + i);     // history
  new_ids.assign(old_ids.begin(), old_ids.begin() + 40);
  for (int32_t i = 0; i < 30; ++i) new_ids.push_back(5000 + i);      // summary
  new_ids.insert(new_ids.end(), old_ids.end() - 150, old_ids.end());  // verbatim tail
  const KvPlan p = PlanKvResync(old_ids, new_ids, 16, 32);
  CHECK(p.common_prefix_tokens == 40 && p.reuse_tokens == 32 && p.pages_kept == 2 && p.cached_pages == 40);
  CHECK(p.prefill_tokens == 188);
  CHECK(p.shifts.size() == 1);
  if (p.shifts.size() == 1) {
    CHECK(p.shifts[0].old_begin == 490 && p.shifts[0].new_begin == 70 && p.shifts[0].num_tokens == 150);
    CHECK(p.shifts[0].delta() == -420);
  }
  CHECK(p.prefill_tokens_with_shift == 38);
  CHECK(p.prefill_ranges_with_shift.size() == 1 && p.prefill_ranges_with_shift[0].first == 32 &&
        p.prefill_ranges_with_shift[0].second == 70);
}

CTXFOLD_TEST(plan_edges_and_errors) {
  const std::vector<int32_t> a = {1, 2, 3, 4, 5};
  const std::vector<int32_t> empty;
  KvPlan p = PlanKvResync(a, a, 1, 0);
  CHECK(p.reuse_tokens == 4 && p.prefill_tokens == 1);
  p = PlanKvResync(empty, empty, 16, 4);
  CHECK(p.prefill_tokens == 0 && p.shifts.empty() && p.prefill_ranges_with_shift.empty());
  p = PlanKvResync(a, empty, 2, 4);
  CHECK(p.cached_pages == 3 && p.prefill_tokens == 0);
  // Constant buffers: every k-gram is the same; the search must stay linear and correct.
  const std::vector<int32_t> zeros(20000, 0);
  std::vector<int32_t> shifted = {7};
  shifted.insert(shifted.end(), zeros.begin(), zeros.end());
  p = PlanKvResync(zeros, shifted, 1, 8);
  CHECK(p.shifts.size() == 1 && p.shifted_tokens == 20000 && p.prefill_tokens_with_shift == 1);
  CHECK_THROWS(PlanKvResync(a, a, 0, 0), std::invalid_argument);
  CHECK_THROWS(PlanKvResync(a, a, 1, 3), std::invalid_argument);
  CHECK_THROWS(PlanKvResync(a, a, 1, -1), std::invalid_argument);
}
