#include "ctxfold/kvplan.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ctxfold/tail.hpp"

namespace ctxfold {

int64_t CommonPrefix(std::span<const int32_t> a, std::span<const int32_t> b) noexcept {
  const size_t n = std::min(a.size(), b.size());
  // memcmp over large chunks runs at memory bandwidth (vectorised by libc); the exact position is
  // then found inside the first chunk that differs.
  constexpr size_t kChunk = 1024;  // tokens
  size_t i = 0;
  while (i + kChunk <= n && std::memcmp(a.data() + i, b.data() + i, kChunk * sizeof(int32_t)) == 0) i += kChunk;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

namespace {

constexpr uint64_t kBase = 0x9E3779B97F4A7C15ull;  // odd multiplier for the polynomial rolling hash

// kBase * kBaseInverse == 1 (mod 2^64): rolling the hash backward divides by kBase. Newton's
// iteration doubles the correct low bits each step (3 -> 6 -> ... -> 96 >= 64).
constexpr uint64_t InverseOdd(uint64_t a) {
  uint64_t x = a;  // correct to 3 bits for any odd a
  for (int i = 0; i < 5; ++i) x *= 2 - a * x;
  return x;
}
constexpr uint64_t kBaseInverse = InverseOdd(kBase);
static_assert(kBase * kBaseInverse == 1);

uint64_t Mix(int32_t token) {
  // Spread token ids so neighbouring ids do not land in neighbouring buckets.
  uint64_t x = static_cast<uint32_t>(token);
  x ^= x >> 16;
  x *= 0x7FEB352Dull;
  x ^= x >> 15;
  return x + 1;
}

uint64_t Power(uint64_t base, int64_t exp) {
  uint64_t r = 1;
  while (exp > 0) {
    if (exp & 1) r *= base;
    base *= base;
    exp >>= 1;
  }
  return r;
}

// Rolling hash of k consecutive tokens: h = sum Mix(t_i) * kBase^(k-1-i) (mod 2^64).
uint64_t HashAt(const int32_t* p, int64_t k) {
  uint64_t h = 0;
  for (int64_t i = 0; i < k; ++i) h = h * kBase + Mix(p[i]);
  return h;
}

// Open-addressing table from a k-gram's 64-bit hash to the chain of cached positions holding it,
// oldest first. Keyed by the full hash, so a chain holds one k-gram (barring a 2^-64 collision,
// which the token-by-token check below catches): the first entry at or after the last span's end
// is the match, and entries before it are popped for good, because that bound only grows.
class GramIndex {
 public:
  GramIndex(std::span<const int32_t> cached, int64_t start, int64_t k) : start_(start) {
    const auto old_n = static_cast<int64_t>(cached.size());
    const int64_t num_grams = old_n - start - k + 1;
    const int bits = std::max(4, static_cast<int>(std::bit_width(static_cast<uint64_t>(num_grams))) + 1);
    mask_ = (uint64_t{1} << bits) - 1;  // load factor <= 1/2
    keys_.assign(static_cast<size_t>(mask_ + 1), 0);
    heads_.assign(static_cast<size_t>(mask_ + 1), -1);
    next_.assign(static_cast<size_t>(num_grams), -1);
    const uint64_t top = Power(kBase, k - 1);
    // Newest first, so every chain ends up oldest-first.
    uint64_t h = HashAt(cached.data() + (old_n - k), k);
    for (int64_t p = old_n - k;; --p) {
      const size_t slot = Slot(h);
      if (heads_[slot] < 0) keys_[slot] = h;
      next_[static_cast<size_t>(p - start_)] = heads_[slot];
      heads_[slot] = p;
      if (p == start_) break;
      // Roll one token back: drop cached[p + k - 1], prepend cached[p - 1].
      h = (h - Mix(cached[static_cast<size_t>(p + k - 1)])) * kBaseInverse + Mix(cached[static_cast<size_t>(p - 1)]) * top;
    }
  }

  // Oldest cached position >= min_old whose k-gram hashes to h and equals `gram`; -1 if none.
  int64_t Find(uint64_t h, int64_t min_old, std::span<const int32_t> cached, const int32_t* gram, int64_t k) {
    const size_t slot = Slot(h);
    int64_t& head = heads_[slot];
    while (head >= 0 && head < min_old) head = next_[static_cast<size_t>(head - start_)];
    for (int64_t p = head; p >= 0; p = next_[static_cast<size_t>(p - start_)]) {
      if (std::memcmp(cached.data() + p, gram, static_cast<size_t>(k) * sizeof(int32_t)) == 0) return p;
    }
    return -1;
  }

 private:
  // The slot holding h, or the empty slot where it would go (linear probing).
  size_t Slot(uint64_t h) const {
    size_t i = static_cast<size_t>((h ^ (h >> 29)) & mask_);
    while (heads_[i] >= 0 && keys_[i] != h) i = (i + 1) & static_cast<size_t>(mask_);
    return i;
  }

  int64_t start_;
  uint64_t mask_ = 0;
  std::vector<uint64_t> keys_;
  std::vector<int64_t> heads_;  // -1: empty slot (a popped-empty chain keeps its key, harmlessly)
  std::vector<int64_t> next_;   // indexed by position - start
};

void FindShifts(std::span<const int32_t> cached, std::span<const int32_t> rebuilt, int64_t start, int64_t k,
                KvPlan& plan) {
  const auto old_n = static_cast<int64_t>(cached.size());
  const auto new_n = static_cast<int64_t>(rebuilt.size());
  int64_t gap_begin = start;
  if (old_n - start >= k && new_n - start >= k) {
    GramIndex index(cached, start, k);
    const uint64_t top = Power(kBase, k - 1);
    int64_t min_old = start;  // spans keep increasing order in both sequences
    int64_t q = start;
    uint64_t h = HashAt(rebuilt.data() + q, k);
    while (true) {
      const int64_t found = min_old + k <= old_n ? index.Find(h, min_old, cached, rebuilt.data() + q, k) : -1;
      if (found < 0) {
        if (q + k >= new_n) break;
        h = (h - Mix(rebuilt[static_cast<size_t>(q)]) * top) * kBase + Mix(rebuilt[static_cast<size_t>(q + k)]);
        ++q;
        continue;
      }
      int64_t len = k;
      while (found + len < old_n && q + len < new_n &&
             cached[static_cast<size_t>(found + len)] == rebuilt[static_cast<size_t>(q + len)]) {
        ++len;
      }
      if (q > gap_begin) plan.prefill_ranges_with_shift.emplace_back(gap_begin, q);
      plan.shifts.push_back({found, q, len});
      plan.shifted_tokens += len;
      min_old = found + len;
      q += len;
      gap_begin = q;
      if (q + k > new_n) break;
      h = HashAt(rebuilt.data() + q, k);
    }
  }
  if (gap_begin < new_n) plan.prefill_ranges_with_shift.emplace_back(gap_begin, new_n);
}

}  // namespace

KvPlan PlanKvResync(std::span<const int32_t> cached, std::span<const int32_t> rebuilt, int64_t page_size_tokens,
                    int64_t min_shift_tokens) {
  if (page_size_tokens < 1) {
    throw std::invalid_argument("page_size_tokens must be >= 1, got " + std::to_string(page_size_tokens));
  }
  if (min_shift_tokens < 0 || (min_shift_tokens > 0 && min_shift_tokens < 4)) {
    throw std::invalid_argument("min_shift_tokens must be 0 (no shifting) or >= 4, got " +
                                std::to_string(min_shift_tokens));
  }
  KvPlan plan;
  plan.page_size_tokens = page_size_tokens;
  plan.common_prefix_tokens = CommonPrefix(cached, rebuilt);
  const auto new_n = static_cast<int64_t>(rebuilt.size());
  const int64_t capped = std::min(plan.common_prefix_tokens, std::max<int64_t>(new_n - 1, 0));
  plan.reuse_tokens = AlignDownToPage(capped, page_size_tokens);
  plan.pages_kept = plan.reuse_tokens / page_size_tokens;
  plan.cached_pages = (static_cast<int64_t>(cached.size()) + page_size_tokens - 1) / page_size_tokens;
  plan.prefill_tokens = new_n - plan.reuse_tokens;
  if (min_shift_tokens > 0) {
    FindShifts(cached, rebuilt, plan.reuse_tokens, min_shift_tokens, plan);
  } else if (plan.reuse_tokens < new_n) {
    plan.prefill_ranges_with_shift.emplace_back(plan.reuse_tokens, new_n);
  }
  plan.prefill_tokens_with_shift = plan.prefill_tokens - plan.shifted_tokens;
  return plan;
}

}  // namespace ctxfold
