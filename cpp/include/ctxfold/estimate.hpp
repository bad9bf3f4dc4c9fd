// Byte-class token estimator: counts a handful of byte classes in one pass and combines them with
// per-tokenizer coefficients fitted against an exact tokenizer as an upper bound (see
// python/ctxfold/calibration.py). An estimate never exceeds the text's UTF-8 byte count: a
// byte-level tokenizer never needs more than one token per byte.
//
// A tokenizer spells a character its vocabulary lacks byte by byte, a token a byte, more than any
// class's coefficient allows for; which characters of the basic plane those are is the one thing
// a class cannot tell, so each calibration carries them as a bit set (the fallback bits below).
//
// Thread safety: all functions are pure; call them from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

namespace ctxfold {

// The features of one text, in the order the coefficients use them.
enum Feature : int {
  kLetters = 0,         // ASCII letters
  kLetterRuns,          // maximal runs of ASCII letters (roughly: words)
  kUpperLetters,        // upper-case ASCII letters (ALL_CAPS words split into more tokens)
  kCaseSwitches,        // upper-case letters right after a lower-case one (camelCase, base64)
  kGluedLetterRuns,     // letter runs right after punctuation (paths, identifiers): split more often
  kLongRunLetters,      // letters after the 12th of a run: words are rarely longer, gibberish is
  kConsonantClusters,   // consonants after two consonants (y counts as a vowel): rare in words, common in ids
  kDigits,              // ASCII digits
  kDigitRuns,           // maximal runs of digits (numbers)
  kPunct,               // ASCII punctuation and symbols
  kPunctRuns,           // maximal runs of punctuation
  kSpaces,              // spaces and tabs
  kMultiSpaceRuns,      // runs of two or more spaces/tabs (indentation, alignment)
  kTabs,                // tabs (also counted as spaces): a tab is rarely merged into the next word
  kNewlines,            // \n and \r
  kSpaceNewlines,       // line breaks right after a space or tab: the spaces cost a token of their own
  kOther2Chars,         // 2-byte UTF-8 characters (accents, Greek, Cyrillic), invalid bytes, ASCII controls
  kOther3Chars,         // 3-byte UTF-8 characters outside CJK (symbols, box drawing, other scripts)
  kOther4Chars,         // 4-byte UTF-8 characters (emoji, historic scripts, rare CJK ideographs)
  kCjkChars,            // CJK ideographs of the basic plane, kana, hangul, fullwidth forms
  kFallbackBytes,       // UTF-8 bytes of characters in the fallback bits (not counted in the classes above)
  kTexts,               // 1 per text: the intercept
  kNumFeatures,
};

using Features = std::array<int64_t, kNumFeatures>;
using Coefficients = std::array<double, kNumFeatures>;

// The fallback bits: code points U+0000..U+FFFF a tokenizer spells byte by byte, bit (cp & 63) of
// word cp >> 6, kFallbackWords words (8 KiB) the caller owns and keeps unchanged during the call.
// ASCII bits are ignored (a vocabulary holds ASCII). Null: no character is counted as fallback.
constexpr size_t kFallbackWords = 1024;

// Adds the byte-class counts of `text` to `out`. O(len), no allocation. Invalid UTF-8 is counted
// byte by byte as other characters, never rejected: the estimator must not fail where a tokenizer
// would fall back to byte tokens. With null `fallback_bits` kFallbackBytes stays 0.
void AccumulateFeatures(std::string_view text, Features& out, const uint64_t* fallback_bits = nullptr) noexcept;

// Estimated token count of one text: round(sum_i coef[i] * feature[i]) clamped to [0, text.size()].
int64_t EstimateTokens(std::string_view text, const Coefficients& coef, const uint64_t* fallback_bits = nullptr) noexcept;

// Texts packed back to back in `data`, text i spanning [offsets[i], offsets[i+1]).
// `offsets` has num_texts + 1 entries, non-decreasing, the last <= data.size(); the caller checks.
void EstimateBatch(std::string_view data, std::span<const int64_t> offsets, const Coefficients& coef,
                   std::span<int64_t> out_tokens, const uint64_t* fallback_bits = nullptr) noexcept;

// Feature rows of a batch, row-major [num_texts x kNumFeatures]; used to fit coefficients.
void FeatureBatch(std::string_view data, std::span<const int64_t> offsets, std::span<int64_t> out_rows,
                  const uint64_t* fallback_bits = nullptr) noexcept;

}  // namespace ctxfold
