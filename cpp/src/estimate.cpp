#include "ctxfold/estimate.hpp"

#include <algorithm>
#include <bit>
#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ctxfold {
namespace {

constexpr int kLongRun = 12;  // letters after this many in one run count as kLongRunLetters
// Vowels, bit (c - 'a') for lower-case c; y is one, or "system" and "rhythm" would be clusters.
constexpr uint32_t kVowels = (1u << ('a' - 'a')) | (1u << ('e' - 'a')) | (1u << ('i' - 'a')) | (1u << ('o' - 'a')) |
                             (1u << ('u' - 'a')) | (1u << ('y' - 'a'));

// Byte classes for the ASCII range; bytes >= 0x80 are handled by the UTF-8 branch.
// Multi-byte characters are split by their length: a rare character costs up to one token per byte,
// so the longer ones need the larger coefficient.
enum Class : uint8_t {
  kClsLetter, kClsDigit, kClsPunct, kClsSpace, kClsNewline, kClsMulti2, kClsMulti3, kClsMulti4, kClsCjk,
  kClsFallback,  // a character the tokenizer's vocabulary lacks (the fallback bits)
  kClsNone
};

constexpr std::array<uint8_t, 128> MakeAsciiTable() {
  std::array<uint8_t, 128> t{};
  for (int c = 0; c < 128; ++c) {
    uint8_t cls = kClsPunct;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) cls = kClsLetter;
    else if (c >= '0' && c <= '9') cls = kClsDigit;
    else if (c == ' ' || c == '\t') cls = kClsSpace;
    else if (c == '\n' || c == '\r') cls = kClsNewline;
    else if (c < 0x20 || c == 0x7F) cls = kClsMulti2;  // control bytes: a token each, like stray bytes
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
         (cp >= 0xFF00 && cp <= 0xFFEF);     // fullwidth forms
  // CJK extensions B and beyond (4 bytes) are rare: a tokenizer spells them byte by byte, so they
  // count with the other 4-byte characters.
}

// Scanning state carried across blocks, so the block and byte-by-byte paths can alternate.
struct ScanState {
  int64_t cnt[kClsNone] = {};
  int64_t runs[kClsNone] = {};
  int64_t multi_space_runs = 0;
  int64_t case_switches = 0;
  int64_t upper_letters = 0;
  int64_t glued_letter_runs = 0;
  int64_t long_run_letters = 0;
  int64_t letter_run_len = 0;  // length of the current run of letters, capped at kLongRun
  int64_t consonant_clusters = 0;
  int64_t consonant_run_len = 0;  // length of the current run of consonants, capped at 2
  int64_t space_newlines = 0;
  int64_t fallback_bytes = 0;
  const uint64_t* fallback_bits = nullptr;  // null: no character is known to be spelled byte by byte
  int64_t tabs = 0;
  uint8_t prev = kClsNone;    // class of the previous character
  bool prev_lower = false;    // the previous character is a lower-case ASCII letter
  int64_t space_run_len = 0;  // length of the current run of spaces, capped at 2 by the block path
};

// One character at p[i]: classifies it, updates the counters, returns its length in bytes.
inline size_t ScanOne(const uint8_t* p, size_t i, size_t n, ScanState& st) noexcept {
  const uint8_t b = p[i];
  uint8_t cls;
  size_t len = 1;
  if (b < 0x80) {
    cls = kAscii[b];
    st.tabs += b == '\t';
    const bool lower = cls == kClsLetter && (b & 0x20) != 0;
    st.upper_letters += cls == kClsLetter && !lower;
    if (cls == kClsLetter) {
      st.long_run_letters += st.letter_run_len >= kLongRun;
      st.letter_run_len = std::min<int64_t>(st.letter_run_len + 1, kLongRun);
    } else {
      st.letter_run_len = 0;
    }
    const bool consonant = cls == kClsLetter && ((kVowels >> ((b | 0x20) - 'a')) & 1u) == 0;
    st.consonant_clusters += consonant && st.consonant_run_len >= 2;
    st.consonant_run_len = consonant ? std::min<int64_t>(st.consonant_run_len + 1, 2) : 0;
    st.case_switches += cls == kClsLetter && !lower && st.prev_lower;
    st.prev_lower = lower;
  } else {
    st.prev_lower = false;
    st.letter_run_len = 0;
    st.consonant_run_len = 0;
    len = SequenceLength(b);
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
    if (valid && len < 4 && st.fallback_bits != nullptr && ((st.fallback_bits[cp >> 6] >> (cp & 63)) & 1u) != 0) {
      cls = kClsFallback;
      st.fallback_bytes += static_cast<int64_t>(len);
    } else {
      cls = valid && IsCjk(cp) ? kClsCjk : len == 4 ? kClsMulti4 : len == 3 ? kClsMulti3 : kClsMulti2;
    }
  }
  ++st.cnt[cls];
  st.space_newlines += cls == kClsNewline && st.space_run_len >= 2;
  st.glued_letter_runs += cls == kClsLetter && st.prev == kClsPunct;
  if (cls == kClsSpace) {
    if (++st.space_run_len == 2) ++st.multi_space_runs;
  } else {
    st.space_run_len = 0;
  }
  st.runs[cls] += cls != st.prev;
  st.prev = cls;
  return len;
}

#if defined(__GNUC__)
#define CTXFOLD_ALWAYS_INLINE __attribute__((always_inline))
#else
#define CTXFOLD_ALWAYS_INLINE
#endif

#if defined(__SSE2__)
// 64 ASCII bytes at once: one bit mask per class, then popcounts. Counting byte by byte into
// cnt[cls] chains every byte of a run through one memory counter (store-to-load forwarding,
// several cycles a byte); masks keep everything in registers. Returns false, touching nothing,
// when the block holds a non-ASCII byte (the caller then goes byte by byte).
CTXFOLD_ALWAYS_INLINE inline bool ScanAsciiBlock(const uint8_t* p, ScanState& st) noexcept {
  uint64_t letter = 0, digit = 0, space = 0, newline = 0, high = 0, tab = 0, lowbit = 0, control = 0, vowel = 0;
  for (int k = 0; k < 4; ++k) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k));
    const __m128i y = _mm_or_si128(x, _mm_set1_epi8(0x20));  // ASCII lower case
    const __m128i l = _mm_and_si128(_mm_cmpgt_epi8(y, _mm_set1_epi8('a' - 1)), _mm_cmplt_epi8(y, _mm_set1_epi8('z' + 1)));
    const __m128i d = _mm_and_si128(_mm_cmpgt_epi8(x, _mm_set1_epi8('0' - 1)), _mm_cmplt_epi8(x, _mm_set1_epi8('9' + 1)));
    const __m128i t = _mm_cmpeq_epi8(x, _mm_set1_epi8('\t'));
    const __m128i s = _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8(' ')), t);
    const __m128i nl = _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('\n')), _mm_cmpeq_epi8(x, _mm_set1_epi8('\r')));
    const __m128i v = _mm_or_si128(
        _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(y, _mm_set1_epi8('a')), _mm_cmpeq_epi8(y, _mm_set1_epi8('e'))),
                     _mm_or_si128(_mm_cmpeq_epi8(y, _mm_set1_epi8('i')), _mm_cmpeq_epi8(y, _mm_set1_epi8('o')))),
        _mm_or_si128(_mm_cmpeq_epi8(y, _mm_set1_epi8('u')), _mm_cmpeq_epi8(y, _mm_set1_epi8('y'))));
    const int shift = 16 * k;
    vowel |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(v))) << shift;
    high |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(x))) << shift;
    letter |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(l))) << shift;
    digit |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(d))) << shift;
    space |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(s))) << shift;
    newline |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(nl))) << shift;
    tab |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(t))) << shift;
    // Control bytes (< 0x20, and 0x7F); tabs and newlines are taken out below. Signed compare: a
    // byte >= 0x80 is negative here, but then the block is not ASCII and is not used.
    const __m128i ctl = _mm_or_si128(_mm_cmplt_epi8(x, _mm_set1_epi8(0x20)), _mm_cmpeq_epi8(x, _mm_set1_epi8(0x7F)));
    control |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(ctl))) << shift;
    // Bit 0x20 set on a letter means lower case.
    const __m128i lc = _mm_cmpeq_epi8(_mm_and_si128(x, _mm_set1_epi8(0x20)), _mm_set1_epi8(0x20));
    lowbit |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(lc))) << shift;
  }
  if (high != 0) return false;
  st.tabs += std::popcount(tab);
  const uint64_t lower = letter & lowbit;
  const uint64_t upper = letter & ~lowbit;
  st.upper_letters += std::popcount(upper);
  {
    // Letters whose previous kLongRun bytes are letters: r_n = "a run of >= n letters ends here",
    // built by doubling (r_{a+b} = r_a & (r_b << a)) in 5 steps instead of 12 shifts. The bytes
    // before the block enter through the current run's length r: the virtual previous mask of
    // r_n has its top r - n + 1 bits set.
    const int64_t r = st.letter_run_len;
    const auto prev_bits = [r](int n) -> uint64_t {
      return r >= n ? ~uint64_t{0} << (63 - (r - n)) : 0;
    };
    const auto shl = [](uint64_t x, uint64_t prev, int k) -> uint64_t { return (x << k) | (prev >> (64 - k)); };
    const uint64_t r1 = letter;
    const uint64_t r2 = r1 & shl(r1, prev_bits(1), 1);
    const uint64_t r4 = r2 & shl(r2, prev_bits(2), 2);
    const uint64_t r8 = r4 & shl(r4, prev_bits(4), 4);
    const uint64_t r12 = r8 & shl(r4, prev_bits(4), 8);
    const uint64_t r13 = r12 & shl(r1, prev_bits(1), 12);
    static_assert(kLongRun == 12, "the doubling steps above are written for runs of 12");
    st.long_run_letters += std::popcount(r13);
    st.letter_run_len = ~letter == 0 ? kLongRun : std::min<int64_t>(std::countl_one(letter), kLongRun);
  }
  {
    // Consonants after two consonants, the bytes before the block entering through the run length
    // as for spaces below.
    const uint64_t cons = letter & ~vowel;
    const int64_t r = st.consonant_run_len;
    const uint64_t prev1 = (cons << 1) | (r >= 1 ? 1u : 0u);
    const uint64_t prev2 = (cons << 2) | (r >= 2 ? 3u : (r == 1 ? 2u : 0u));
    st.consonant_clusters += std::popcount(cons & prev1 & prev2);
    st.consonant_run_len = (cons >> 63) ? ((cons >> 62) == 3 ? 2 : 1) : 0;
  }
  st.case_switches += std::popcount(upper & ((lower << 1) | (st.prev_lower ? 1u : 0u)));
  st.prev_lower = (lower >> 63) != 0;
  control &= ~(space | newline);
  const uint64_t punct = ~(letter | digit | space | newline | control);
  const uint64_t masks[5] = {letter, digit, punct, space, newline};
  st.glued_letter_runs += std::popcount(letter & ((punct << 1) | (st.prev == kClsPunct ? 1u : 0u)));
  const uint8_t classes[5] = {kClsLetter, kClsDigit, kClsPunct, kClsSpace, kClsNewline};
  uint8_t last = kClsNone;
  for (int c = 0; c < 5; ++c) {
    const uint64_t m = masks[c];
    const uint64_t before = (m << 1) | (st.prev == classes[c] ? 1u : 0u);  // bit i: byte i-1 in class
    st.cnt[classes[c]] += std::popcount(m);
    st.runs[classes[c]] += std::popcount(m & ~before);
    if (m >> 63) last = classes[c];
  }
  st.cnt[kClsMulti2] += std::popcount(control);  // its runs are no feature: counted, not tracked
  if (control >> 63) last = kClsMulti2;
  // A run of two or more spaces is counted at its second space: space, after a space, after a non-space.
  const uint64_t prev1 = (space << 1) | (st.prev == kClsSpace ? 1u : 0u);
  const uint64_t prev2 = (space << 2) | (st.space_run_len >= 2 ? 3u : (st.space_run_len == 1 ? 2u : 0u));
  st.multi_space_runs += std::popcount(space & prev1 & ~prev2);
  st.space_newlines += std::popcount(newline & prev1 & prev2);
  // Only "0, 1, or at least 2" matters for the next multi-space test.
  st.space_run_len = (space >> 63) ? ((space >> 62) == 3 ? 2 : 1) : 0;
  st.prev = last;
  return true;
}
#endif

CTXFOLD_ALWAYS_INLINE inline void Scan(const uint8_t* p, size_t n, ScanState& st) noexcept {
  size_t i = 0;
#if defined(__SSE2__)
  while (i + 64 <= n) {
    if (ScanAsciiBlock(p + i, st)) {
      i += 64;
      continue;
    }
    // A block with multi-byte characters: go byte by byte to its end (a sequence may run past it).
    const size_t stop = i + 64;
    while (i < stop) i += ScanOne(p, i, n, st);
  }
#endif
  while (i < n) i += ScanOne(p, i, n, st);
}

#if defined(__GNUC__) && defined(__x86_64__)
// The block path does a dozen popcounts per 64 bytes. The baseline x86-64 target has no popcnt
// instruction (it is emulated in about 12 operations), so the scan is compiled a second time for
// CPUs that have it, and chosen once at run time: this halves the time per block.
__attribute__((target("popcnt"))) void ScanPopcnt(const uint8_t* p, size_t n, ScanState& st) noexcept {
  Scan(p, n, st);
}
bool HasPopcnt() noexcept {
  // Decided on first use (thread-safe static), not at load time, when the CPU data may not be set.
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("popcnt"));
  return has;
}
#endif

}  // namespace

void AccumulateFeatures(std::string_view text, Features& out, const uint64_t* fallback_bits) noexcept {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  ScanState st;
  st.fallback_bits = fallback_bits;
#if defined(__GNUC__) && defined(__x86_64__)
  if (HasPopcnt()) {
    ScanPopcnt(p, n, st);
  } else {
    Scan(p, n, st);
  }
#else
  Scan(p, n, st);
#endif
  out[kLetters] += st.cnt[kClsLetter];
  out[kLetterRuns] += st.runs[kClsLetter];
  out[kDigits] += st.cnt[kClsDigit];
  out[kDigitRuns] += st.runs[kClsDigit];
  out[kPunct] += st.cnt[kClsPunct];
  out[kPunctRuns] += st.runs[kClsPunct];
  out[kSpaces] += st.cnt[kClsSpace];
  out[kMultiSpaceRuns] += st.multi_space_runs;
  out[kTabs] += st.tabs;
  out[kNewlines] += st.cnt[kClsNewline];
  out[kUpperLetters] += st.upper_letters;
  out[kCaseSwitches] += st.case_switches;
  out[kGluedLetterRuns] += st.glued_letter_runs;
  out[kLongRunLetters] += st.long_run_letters;
  out[kConsonantClusters] += st.consonant_clusters;
  out[kSpaceNewlines] += st.space_newlines;
  out[kFallbackBytes] += st.fallback_bytes;
  out[kOther2Chars] += st.cnt[kClsMulti2];
  out[kOther3Chars] += st.cnt[kClsMulti3];
  out[kOther4Chars] += st.cnt[kClsMulti4];
  out[kCjkChars] += st.cnt[kClsCjk];
  out[kTexts] += 1;
}

int64_t EstimateTokens(std::string_view text, const Coefficients& coef, const uint64_t* fallback_bits) noexcept {
  Features f{};
  AccumulateFeatures(text, f, fallback_bits);
  double sum = 0.0;
  for (int k = 0; k < kNumFeatures; ++k) sum += coef[static_cast<size_t>(k)] * static_cast<double>(f[static_cast<size_t>(k)]);
  if (text.empty()) return 0;  // an empty text has no tokens whatever the intercept says
  // A byte-level tokenizer never needs more than one token per byte: above that is waste.
  const auto nbytes = static_cast<int64_t>(text.size());
  return sum > 0.0 ? std::min(static_cast<int64_t>(std::llround(sum)), nbytes) : 0;
}

void EstimateBatch(std::string_view data, std::span<const int64_t> offsets, const Coefficients& coef,
                   std::span<int64_t> out_tokens, const uint64_t* fallback_bits) noexcept {
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    const auto begin = static_cast<size_t>(offsets[i]);
    const auto end = static_cast<size_t>(offsets[i + 1]);
    out_tokens[i] = EstimateTokens(data.substr(begin, end - begin), coef, fallback_bits);
  }
}

void FeatureBatch(std::string_view data, std::span<const int64_t> offsets, std::span<int64_t> out_rows,
                  const uint64_t* fallback_bits) noexcept {
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    const auto begin = static_cast<size_t>(offsets[i]);
    const auto end = static_cast<size_t>(offsets[i + 1]);
    Features f{};
    AccumulateFeatures(data.substr(begin, end - begin), f, fallback_bits);
    for (size_t k = 0; k < kNumFeatures; ++k) out_rows[i * kNumFeatures + k] = f[k];
  }
}

}  // namespace ctxfold
