#include <stdexcept>
#include <string>

#include "check.hpp"
#include "ctxfold/ledger.hpp"

using namespace ctxfold;

namespace {
// The message of the std::out_of_range that `fn` throws, or "" when it throws none.
template <class F>
std::string OutOfRangeMessage(F fn) {
  try {
    (void)fn();
  } catch (const std::out_of_range& e) {
    return e.what();
  }
  return "";
}
}  // namespace

CTXFOLD_TEST(ledger_element_access_matches_columns) {
  Ledger l;
  l.Append(11, 10, kFlagUser | kFlagUserTurn, 0);
  l.Append(12, 20, kFlagAssistant | kFlagToolCall, 1);
  l.Append(13, 30, kFlagToolResult, 1);
  l.Append(14, 40, kFlagUser | kFlagUserTurn, 3);
  for (int64_t i = 0; i < l.size(); ++i) {
    const auto k = static_cast<size_t>(i);
    CHECK(l.NumTokensAt(i) == l.tokens()[k]);
    CHECK(l.FlagsAt(i) == l.flags()[k]);
    CHECK(l.UserTurnAt(i) == l.user_turns()[k]);
    CHECK(l.GroupStartAt(i) == l.group_starts()[k]);
    CHECK(l.KeyAt(i) == l.keys()[k]);
  }
  CHECK(l.NumTokensAt(3) == 40);
  CHECK(l.UserTurnAt(3) == 2);
  CHECK(l.GroupStartAt(2) == 1);
  l.Replace(2, 15, 5, kFlagToolResult | kFlagArchived);
  CHECK(l.NumTokensAt(2) == 5);
  CHECK(l.FlagsAt(2) == (kFlagToolResult | kFlagArchived));
  CHECK(l.KeyAt(2) == 15);
}

CTXFOLD_TEST(ledger_element_access_is_bounds_checked) {
  Ledger l;
  CHECK_THROWS(l.NumTokensAt(0), std::out_of_range);
  CHECK(OutOfRangeMessage([&] { return l.FlagsAt(0); }) ==
        "segment index 0 out of range: the ledger holds 0 segments");
  l.Append(1, 7, kFlagUser, 0);
  CHECK(l.NumTokensAt(0) == 7);
  CHECK(OutOfRangeMessage([&] { return l.NumTokensAt(1); }) ==
        "segment index 1 out of range: the ledger holds 1 segment");
  CHECK(OutOfRangeMessage([&] { return l.GroupStartAt(-1); }) ==
        "segment index -1 out of range: the ledger holds 1 segment");
  CHECK_THROWS(l.UserTurnAt(1), std::out_of_range);
  CHECK_THROWS(l.KeyAt(-1), std::out_of_range);
  l.Truncate(0);
  CHECK_THROWS(l.NumTokensAt(0), std::out_of_range);
}
