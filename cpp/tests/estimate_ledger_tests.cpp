#include <stdexcept>
#include <string>
#include <vector>

#include "check.hpp"
#include "ctxfold/estimate.hpp"
#include "ctxfold/ledger.hpp"

using namespace ctxfold;

CTXFOLD_TEST(features_count_each_class) {
  Features f{};
  AccumulateFeatures("ab 12  x\n\xE4\xB8\xAD\xC3\xA9!?", f);  // "ab 12  x\n中é!?"
  CHECK(f[kLetters] == 3);
  CHECK(f[kLetterRuns] == 2);
  CHECK(f[kDigits] == 2);
  CHECK(f[kDigitRuns] == 1);
  CHECK(f[kSpaces] == 3);
  CHECK(f[kMultiSpaceRuns] == 1);
  CHECK(f[kTabs] == 0);
  CHECK(f[kNewlines] == 1);
  CHECK(f[kCjkChars] == 1);
  CHECK(f[kOther2Chars] == 1);
  CHECK(f[kPunct] == 2);
  CHECK(f[kPunctRuns] == 1);
  CHECK(f[kTexts] == 1);
}

CTXFOLD_TEST(features_survive_invalid_utf8) {
  // Truncated sequences at the very end and stray continuation bytes must not read past the end.
  const std::string bad[] = {"\xE4", "\xE4\xB8", "\x80\x80", "a\xF0\x9F\x98", "\xFF\xFE"};
  for (const auto& s : bad) {
    Features f{};
    AccumulateFeatures(s, f);
    CHECK(f[kTexts] == 1);
  }
}

// Texts of 64+ bytes go through the 64-byte ASCII block path; runs that cross a block boundary,
// and blocks with a multi-byte character, must count exactly as the byte-by-byte path does.
CTXFOLD_TEST(features_block_path_matches_byte_path) {
  {
    Features f{};
    AccumulateFeatures(std::string(63, 'a') + "   b", f);  // a space run across bytes 63..65
    CHECK(f[kLetters] == 64);
    CHECK(f[kLetterRuns] == 2);
    CHECK(f[kSpaces] == 3);
    CHECK(f[kMultiSpaceRuns] == 1);
  }
  {
    Features f{};
    AccumulateFeatures(std::string(64, ' ') + std::string(64, ' ') + "x", f);  // one run over two blocks
    CHECK(f[kSpaces] == 128);
    CHECK(f[kTabs] == 0);
    CHECK(f[kMultiSpaceRuns] == 1);
    CHECK(f[kLetterRuns] == 1);
  }
  {
    Features f{};
    std::string s;
    for (int i = 0; i < 20; ++i) s += "ab  12,\n";  // 9 bytes: letters, spaces, digits, punct, newline
    AccumulateFeatures(s, f);
    CHECK(f[kLetters] == 40);
    CHECK(f[kLetterRuns] == 20);
    CHECK(f[kDigitRuns] == 20);
    CHECK(f[kPunctRuns] == 20);
    CHECK(f[kMultiSpaceRuns] == 20);
    CHECK(f[kNewlines] == 20);
  }
  {
    Features f{};
    AccumulateFeatures(std::string(62, 'a') + "\xC3\xA9" + std::string(10, 'b'), f);  // é straddles a block end
    CHECK(f[kOther2Chars] == 1);
    CHECK(f[kLetters] == 72);
    CHECK(f[kLetterRuns] == 2);
  }
}

CTXFOLD_TEST(estimate_empty_is_zero) {
  Coefficients c{};
  c[kTexts] = 3.0;
  CHECK(EstimateTokens("", c) == 0);
  CHECK(EstimateTokens("x", c) == 1);  // never more than one token per byte
  CHECK(EstimateTokens("xyz", c) == 3);
}

CTXFOLD_TEST(features_case_switches_and_char_lengths) {
  Features f{};
  // "camelCaseX", "\xF0\x9F\x98\x80" (an emoji, 4 bytes), "\xE2\x94\x80" (box drawing, 3 bytes)
  AccumulateFeatures("camelCaseX \xF0\x9F\x98\x80\xE2\x94\x80 aB", f);
  CHECK(f[kCaseSwitches] == 3);  // lC, eX, aB
  CHECK(f[kUpperLetters] == 3);
  CHECK(f[kGluedLetterRuns] == 0);
  Features p{};
  AccumulateFeatures("/home/user/x.py " + std::string(60, 'a') + "/b", p);  // the last one in the block path
  CHECK(p[kGluedLetterRuns] == 5);
  CHECK(p[kLongRunLetters] == 48);
  Features q{};
  AccumulateFeatures(std::string(60, 'a') + "1" + std::string(10, 'b') + "\xC3\xA9" + std::string(9, 'c'), q);
  CHECK(q[kLongRunLetters] == 48);

  CHECK(f[kOther4Chars] == 1);
  CHECK(f[kOther3Chars] == 1);
  CHECK(f[kOther2Chars] == 0);
  Features g{};
  AccumulateFeatures(std::string(63, 'a') + "B" + std::string(63, 'B') + "aZ", g);  // switches at byte 63 and 128
  CHECK(g[kCaseSwitches] == 2);
  CHECK(g[kUpperLetters] == 65);
  Features h{};
  AccumulateFeatures(std::string(70, '\t') + " \t", h);
  CHECK(h[kTabs] == 71);
  CHECK(h[kSpaces] == 72);
}

CTXFOLD_TEST(ledger_totals_and_truncate) {
  Ledger l;
  l.Append(1, 10, kFlagUser | kFlagUserTurn, 0);
  l.Append(2, 20, kFlagAssistant | kFlagToolCall, 1);
  l.Append(3, 30, kFlagToolResult, 1);
  CHECK(l.total_tokens() == 60);
  CHECK(l.num_user_turns() == 1);
  l.Replace(2, 4, 5, kFlagToolResult | kFlagArchived);
  CHECK(l.total_tokens() == 35);
  l.Truncate(1);
  CHECK(l.total_tokens() == 10);
  CHECK(l.size() == 1);
  CHECK_THROWS(l.Truncate(2), std::out_of_range);
  CHECK_THROWS(l.Append(5, -1, 0, 1), std::invalid_argument);
  CHECK_THROWS(l.Append(5, 1, 0, 7), std::invalid_argument);
  CHECK_THROWS(l.Replace(0, 1, 1, kFlagUser), std::invalid_argument);  // would drop a user turn
  l.RememberCount(42, 7);
  CHECK(l.CachedCount(42) == 7);
  CHECK(l.CachedCount(43) == -1);
}

CTXFOLD_TEST(features_fallback_clusters_and_space_newlines) {
  std::vector<uint64_t> bits(kFallbackWords, 0);
  bits[0x9FC0 >> 6] |= uint64_t{1} << (0x9FC0 & 63);
  const std::string text = "strength  \n \n\xE9\xBF\x80\xE4\xB8\xAD";  // ..., U+9FC0 (listed), U+4E2D (not)
  Features f{};
  AccumulateFeatures(text, f, bits.data());
  CHECK(f[kConsonantClusters] == 3);  // s-t-r: r; n-g-t-h: t, h
  CHECK(f[kSpaceNewlines] == 1);      // only the break after two spaces
  CHECK(f[kFallbackBytes] == 3);
  CHECK(f[kCjkChars] == 1);
  Features g{};
  AccumulateFeatures(text, g);  // no bits: U+9FC0 is a CJK character like any other
  CHECK(g[kFallbackBytes] == 0 && g[kCjkChars] == 2);
  // The block path carries the consonant run and the space run across a block boundary.
  Features h{};
  AccumulateFeatures(std::string(62, 'a') + "bcd" + std::string(62, ' ') + "\n", h);
  CHECK(h[kConsonantClusters] == 1);
  CHECK(h[kSpaceNewlines] == 1);
}
