// The segment table of one conversation: per segment (a message, or a rendered span of one) its
// token count, role/kind flags, user-turn number and atomic group, with running totals in O(1).
//
// Memory: 28 bytes per segment in five parallel arrays (so each can be handed out as a zero-copy
// numpy view), plus one hash-map entry per distinct content in the count cache.
// Thread safety: none; one ledger belongs to one conversation, whose owner serialises access.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace ctxfold {

// Segment flags. Shared with Python (ctxfold.ledger.SegmentFlag); keep the values in sync.
enum SegmentFlag : uint32_t {
  kFlagSystem = 1u << 0,      // system prompt or tool definitions: never part of a tail
  kFlagUser = 1u << 1,        // any user-role message
  kFlagUserTurn = 1u << 2,    // a real user turn: not a queued insert, resume message or tool result
  kFlagAssistant = 1u << 3,   // assistant message
  kFlagToolCall = 1u << 4,    // assistant message that carries tool calls
  kFlagToolResult = 1u << 5,  // tool result
  kFlagThinking = 1u << 6,    // thinking / reasoning span
  kFlagQueued = 1u << 7,      // user message queued while a turn was running
  kFlagResume = 1u << 8,      // synthetic resume/continue instruction
  kFlagError = 1u << 9,       // tool result that reports an error
  kFlagSummary = 1u << 10,    // a compaction summary
  kFlagArchived = 1u << 11,   // tool result replaced by an archive marker
};

class Ledger {
 public:
  // Appends one segment. `group_start` is the index of the first segment of the atomic group this
  // segment belongs to (an assistant tool call and its results share one group); a segment that
  // starts its own group passes its own index. Throws std::invalid_argument on a negative count
  // or a group_start that is not an earlier (or this) segment.
  void Append(uint64_t content_key, int64_t num_tokens, uint32_t flags, int64_t group_start);

  // Appends many segments; same rules as Append, checked before anything is appended.
  void AppendBatch(std::span<const uint64_t> keys, std::span<const int64_t> num_tokens,
                   std::span<const uint32_t> flags, std::span<const int64_t> group_start);

  // Drops segments [num_segments, size). O(dropped). Throws std::out_of_range past the end.
  void Truncate(int64_t num_segments);

  // Replaces the content of one segment (an archived output, a rewritten message). O(1).
  void Replace(int64_t index, uint64_t content_key, int64_t num_tokens, uint32_t flags);

  // Count cache keyed by content hash: -1 when unknown. Counting a new request costs only the
  // messages whose content the cache has not seen.
  int64_t CachedCount(uint64_t content_key) const noexcept;
  void RememberCount(uint64_t content_key, int64_t num_tokens);

  int64_t size() const noexcept { return static_cast<int64_t>(tokens_.size()); }
  int64_t total_tokens() const noexcept { return total_tokens_; }
  int64_t num_user_turns() const noexcept { return turns_.empty() ? 0 : turns_.back(); }
  int64_t cache_size() const noexcept { return static_cast<int64_t>(cache_.size()); }

  // One segment's fields, without handing out a whole column. O(1). Throw std::out_of_range
  // naming the index and the size unless 0 <= index < size().
  int64_t NumTokensAt(int64_t index) const;
  uint32_t FlagsAt(int64_t index) const;
  int32_t UserTurnAt(int64_t index) const;
  int32_t GroupStartAt(int64_t index) const;
  uint64_t KeyAt(int64_t index) const;

  std::span<const int64_t> tokens() const noexcept { return tokens_; }
  std::span<const uint32_t> flags() const noexcept { return flags_; }
  // Number of real user turns up to and including each segment.
  std::span<const int32_t> user_turns() const noexcept { return turns_; }
  std::span<const int32_t> group_starts() const noexcept { return groups_; }
  std::span<const uint64_t> keys() const noexcept { return keys_; }

  void Clear() noexcept;

 private:
  void CheckIndex(int64_t index) const;

  std::vector<int64_t> tokens_;
  std::vector<uint32_t> flags_;
  std::vector<int32_t> turns_;
  std::vector<int32_t> groups_;
  std::vector<uint64_t> keys_;
  int64_t total_tokens_ = 0;
  std::unordered_map<uint64_t, int64_t> cache_;
};

}  // namespace ctxfold
