#include "ctxfold/ledger.hpp"

#include <stdexcept>
#include <string>

namespace ctxfold {

namespace {
void CheckSegment(int64_t index, int64_t num_tokens, int64_t group_start) {
  if (num_tokens < 0) {
    throw std::invalid_argument("segment " + std::to_string(index) + ": num_tokens must be >= 0, got " +
                                std::to_string(num_tokens));
  }
  if (group_start < 0 || group_start > index) {
    throw std::invalid_argument("segment " + std::to_string(index) + ": group_start must be in [0, " +
                                std::to_string(index) + "], got " + std::to_string(group_start));
  }
}
}  // namespace

void Ledger::Append(uint64_t content_key, int64_t num_tokens, uint32_t flags, int64_t group_start) {
  CheckSegment(size(), num_tokens, group_start);
  const int32_t turn = static_cast<int32_t>(num_user_turns() + ((flags & kFlagUserTurn) ? 1 : 0));
  tokens_.push_back(num_tokens);
  flags_.push_back(flags);
  turns_.push_back(turn);
  groups_.push_back(static_cast<int32_t>(group_start));
  keys_.push_back(content_key);
  total_tokens_ += num_tokens;
}

void Ledger::AppendBatch(std::span<const uint64_t> keys, std::span<const int64_t> num_tokens,
                         std::span<const uint32_t> flags, std::span<const int64_t> group_start) {
  const size_t n = keys.size();
  if (num_tokens.size() != n || flags.size() != n || group_start.size() != n) {
    throw std::invalid_argument("append_batch: keys, num_tokens, flags and group_start must have one length");
  }
  for (size_t i = 0; i < n; ++i) CheckSegment(size() + static_cast<int64_t>(i), num_tokens[i], group_start[i]);
  const size_t want = tokens_.size() + n;
  tokens_.reserve(want);
  flags_.reserve(want);
  turns_.reserve(want);
  groups_.reserve(want);
  keys_.reserve(want);
  for (size_t i = 0; i < n; ++i) Append(keys[i], num_tokens[i], flags[i], group_start[i]);
}

void Ledger::Truncate(int64_t num_segments) {
  if (num_segments < 0 || num_segments > size()) {
    throw std::out_of_range("truncate: num_segments must be in [0, " + std::to_string(size()) + "], got " +
                            std::to_string(num_segments));
  }
  for (int64_t i = num_segments; i < size(); ++i) total_tokens_ -= tokens_[static_cast<size_t>(i)];
  const auto n = static_cast<size_t>(num_segments);
  tokens_.resize(n);
  flags_.resize(n);
  turns_.resize(n);
  groups_.resize(n);
  keys_.resize(n);
}

void Ledger::Replace(int64_t index, uint64_t content_key, int64_t num_tokens, uint32_t flags) {
  CheckIndex(index);
  if (num_tokens < 0) {
    throw std::invalid_argument("replace: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  }
  const auto i = static_cast<size_t>(index);
  if ((flags ^ flags_[i]) & kFlagUserTurn) {
    // Turn numbers of every later segment would shift; a rewrite of that kind is a truncate+append.
    throw std::invalid_argument("replace: cannot change whether segment " + std::to_string(index) +
                                " is a user turn; truncate and append instead");
  }
  total_tokens_ += num_tokens - tokens_[i];
  tokens_[i] = num_tokens;
  flags_[i] = flags;
  keys_[i] = content_key;
}

int64_t Ledger::CachedCount(uint64_t content_key) const noexcept {
  const auto it = cache_.find(content_key);
  return it == cache_.end() ? -1 : it->second;
}

void Ledger::RememberCount(uint64_t content_key, int64_t num_tokens) {
  if (num_tokens < 0) throw std::invalid_argument("remember_count: num_tokens must be >= 0");
  cache_[content_key] = num_tokens;
}

void Ledger::Clear() noexcept {
  tokens_.clear();
  flags_.clear();
  turns_.clear();
  groups_.clear();
  keys_.clear();
  total_tokens_ = 0;
}

int64_t Ledger::NumTokensAt(int64_t index) const {
  CheckIndex(index);
  return tokens_[static_cast<size_t>(index)];
}

uint32_t Ledger::FlagsAt(int64_t index) const {
  CheckIndex(index);
  return flags_[static_cast<size_t>(index)];
}

int32_t Ledger::UserTurnAt(int64_t index) const {
  CheckIndex(index);
  return turns_[static_cast<size_t>(index)];
}

int32_t Ledger::GroupStartAt(int64_t index) const {
  CheckIndex(index);
  return groups_[static_cast<size_t>(index)];
}

uint64_t Ledger::KeyAt(int64_t index) const {
  CheckIndex(index);
  return keys_[static_cast<size_t>(index)];
}

void Ledger::CheckIndex(int64_t index) const {
  if (index < 0 || index >= size()) {
    throw std::out_of_range("segment index " + std::to_string(index) + " out of range: the ledger holds " +
                            std::to_string(size()) + (size() == 1 ? " segment" : " segments"));
  }
}

}  // namespace ctxfold
