#include <string>

#include "check.hpp"
#include "ctxfold/jsonscan.hpp"

using ctxfold::HasLongNumber;

CTXFOLD_TEST(long_numbers_outside_strings_are_found) {
  CHECK(HasLongNumber(R"({"a": 123456789012345678901})", 20));
  CHECK(HasLongNumber(R"([1, -18446744073709551616])", 20));
  CHECK(HasLongNumber("1.00000000000000000000", 20));  // a long fraction: flagged too, harmlessly
  CHECK(!HasLongNumber(R"({"a": 18446744073709551})", 20));
  CHECK(HasLongNumber(R"({"a": 18446744073709551})", 17));
  CHECK(!HasLongNumber("", 20));
}

CTXFOLD_TEST(digits_inside_strings_do_not_count) {
  CHECK(!HasLongNumber(R"({"id": "123456789012345678901234567890"})", 20));
  // Escaped quotes keep the string open; an escaped backslash before a quote does not.
  CHECK(!HasLongNumber(R"(["a \" 123456789012345678901234567890 \" b"])", 20));
  CHECK(HasLongNumber(R"(["a \\", 123456789012345678901234567890])", 20));
  CHECK(!HasLongNumber(R"(["a \\\" 123456789012345678901234567890"])", 20));
}

CTXFOLD_TEST(an_unterminated_string_ends_the_scan) {
  CHECK(!HasLongNumber(R"(["open 123456789012345678901234567890)", 20));
  CHECK(!HasLongNumber(R"(["ends with a backslash \)", 20));
  CHECK(HasLongNumber(R"(123456789012345678901 ["open)", 20));
}

CTXFOLD_TEST(a_run_is_cut_by_any_other_byte) {
  CHECK(!HasLongNumber("1234567890 1234567890", 20));
  CHECK(!HasLongNumber("1234567890\"\"1234567890", 20));
  std::string big(100000, '7');
  CHECK(HasLongNumber(big, 20));
  CHECK(!HasLongNumber("\"" + big + "\"", 20));
}
