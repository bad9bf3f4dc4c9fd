// A scan of JSON text for what a fast parser would read inexactly.
//
// Thread safety: pure; call it from any thread.
#pragma once

#include <cstddef>
#include <string_view>

namespace ctxfold {

// Whether `json` holds a run of at least `min_digits` ASCII digits outside its strings: in a number.
// A parser that reads integers as 64-bit words (and wider ones as doubles) must leave such a text to
// an exact one (for orjson, 19 digits: -9223372036854775809 is below -2**63). Digits inside strings
// (ids, hashes, timestamps in tool outputs) do not count. Strings are skipped from quote to
// unescaped quote with memchr, so a text that is mostly strings scans at memory speed. The text need
// not be valid JSON: the parser judges that.
bool HasLongNumber(std::string_view json, size_t min_digits);

}  // namespace ctxfold
