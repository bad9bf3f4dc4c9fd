#include "ctxfold/estimate.hpp"

#include <cmath>

namespace ctxfold {
namespace {

// Byte classes for the ASCII range; bytes >= 0x80 are handled by the UTF-8 branch.
enum Class : uint8_t { kClsLetter, kClsDigit, kClsPunct, kClsSpace, kClsNewline, kClsMulti, kClsCjk, kClsNone };

constexpr std::array<uint8_t, 128> MakeAsciiTable() {
  std::array<uint8_t, 128> t{};
  for (int c = 0; c < 128; ++c) {
    uint8_t cls = kClsPunct;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) cls = kClsLetter;
    else if (c >= '0' && c <= '9') cls = kClsDigit;
    else if (c == ' ' || c == '\t') cls = kClsSpace;
    else if (c == '\n' || c == '\r') cls = kClsNewline;
    t[static_cast<size_t>(c)] = cls;
  }
  return t;
}
constexpr std::array<uint8_t, 128> kAscii = MakeAsciiTable();

// Length of the UTF-8 sequence a lead byte starts; 1 for stray continuation or invalid bytes, so
// broken input advances byte by byte.
inline size_t SequenceLength(uint8_t lead) noexcept {
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  if (lead >= 0xE0) return lead <= 0xEF ? 3 : 1;
  if (lead >= 0xC2) return 2;
  return 1;
}

inline bool IsCjk(uint32_t cp) noexcept {
  return (cp >= 0x2E80 && cp <= 0x9FFF) ||   // CJK radicals, kana, CJK unified ideographs
         (cp >= 0xAC00 && cp <= 0xD7AF) ||   // Hangul syllables
         (cp >= 0xF900 && cp <= 0xFAFF) ||   // CJK compatibility ideographs
         (cp >= 0xFF00 && cp <= 0xFFEF) ||   // fullwidth forms
         (cp >= 0x20000 && cp <= 0x3FFFF);   // CJK extensions B and beyond
}

}  // namespace

void AccumulateFeatures(std::string_view text, Features& out) noexcept {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  // Local counters keep the loop in registers; `out` is written once at the end.
  int64_t cnt[kClsNone] = {};
  int64_t runs[kClsNone] = {};
  int64_t multi_space_runs = 0;
  uint8_t prev = kClsNone;
  int64_t space_run_len = 0;
  size_t i = 0;
  while (i < n) {
    const uint8_t b = p[i];
    uint8_t cls;
    if (b < 0x80) {
      cls = kAscii[b];
      ++i;
    } else {
      size_t len = SequenceLength(b);
      uint32_t cp = 0;
      bool valid = len > 1 && i + len <= n;
      if (valid) {
        cp = b & (0xFFu >> (len + 1));
        for (size_t k = 1; k < len; ++k) {
          const uint8_t c = p[i + k];
          if ((c & 0xC0) != 0x80) { valid = false; break; }
          cp = (cp << 6) | (c & 0x3Fu);
        }
      }
      if (!valid) len = 1;
      cls = valid && IsCjk(cp) ? kClsCjk : kClsMulti;
      i += len;
    }
    ++cnt[cls];
    if (cls == kClsSpace) {
      if (++space_run_len == 2) ++multi_space_runs;
    } else {
      space_run_len = 0;
    }
    runs[cls] += cls != prev;
    prev = cls;
  }
  out[kLetters] += cnt[kClsLetter];
  out[kLetterRuns] += runs[kClsLetter];
  out[kDigits] += cnt[kClsDigit];
  out[kDigitRuns] += runs[kClsDigit];
  out[kPunct] += cnt[kClsPunct];
  out[kPunctRuns] += runs[kClsPunct];
  out[kSpaces] += cnt[kClsSpace];
  out[kMultiSpaceRuns] += multi_space_runs;
  out[kNewlines] += cnt[kClsNewline];
  out[kOtherChars] += cnt[kClsMulti];
  out[kCjkChars] += cnt[kClsCjk];
  out[kTexts] += 1;
}

int64_t EstimateTokens(std::string_view text, const Coefficients& coef) noexcept {
  Features f{};
  AccumulateFeatures(text, f);
  double sum = 0.0;
  for (int k = 0; k < kNumFeatures; ++k) sum += coef[static_cast<size_t>(k)] * static_cast<double>(f[static_cast<size_t>(k)]);
  if (text.empty()) return 0;  // an empty text has no tokens whatever the intercept says
  return sum > 0.0 ? static_cast<int64_t>(std::llround(sum)) : 0;
}

void EstimateBatch(std::string_view data, std::span<const int64_t> offsets, const Coefficients& coef,
                   std::span<int64_t> out_tokens) noexcept {
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    const auto begin = static_cast<size_t>(offsets[i]);
    const auto end = static_cast<size_t>(offsets[i + 1]);
    out_tokens[i] = EstimateTokens(data.substr(begin, end - begin), coef);
  }
}

void FeatureBatch(std::string_view data, std::span<const int64_t> offsets, std::span<int64_t> out_rows) noexcept {
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    const auto begin = static_cast<size_t>(offsets[i]);
    const auto end = static_cast<size_t>(offsets[i + 1]);
    Features f{};
    AccumulateFeatures(data.substr(begin, end - begin), f);
    for (size_t k = 0; k < kNumFeatures; ++k) out_rows[i * kNumFeatures + k] = f[k];
  }
}

}  // namespace ctxfold
