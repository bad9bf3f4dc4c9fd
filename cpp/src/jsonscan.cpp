#include "ctxfold/jsonscan.hpp"

#include <cstring>

namespace ctxfold {
namespace {

// The index just past the quote that closes the string whose contents start at `i`, or size when
// the text ends first. A quote is escaped when an odd number of backslashes precedes it.
size_t SkipString(std::string_view s, size_t i) {
  while (i < s.size()) {
    const void* hit = std::memchr(s.data() + i, '"', s.size() - i);
    if (hit == nullptr) return s.size();
    const size_t q = static_cast<size_t>(static_cast<const char*>(hit) - s.data());
    size_t backslashes = 0;
    while (q - backslashes > i && s[q - backslashes - 1] == '\\') ++backslashes;
    if (backslashes % 2 == 0) return q + 1;
    i = q + 1;
  }
  return s.size();
}

}  // namespace

bool HasLongNumber(std::string_view json, size_t min_digits) {
  size_t run = 0;
  for (size_t i = 0; i < json.size();) {
    const char c = json[i];
    if (c == '"') {
      i = SkipString(json, i + 1);
      run = 0;
      continue;
    }
    if (c >= '0' && c <= '9') {
      if (++run >= min_digits) return true;
    } else {
      run = 0;
    }
    ++i;
  }
  return false;
}

}  // namespace ctxfold
