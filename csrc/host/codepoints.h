// memoryos-gpu: Python's character classes and case folding for the native tokenizers.
//
// terms.cpp (BM25 terms) and keywords.cpp (keyword candidates) must split, fold and classify
// words exactly as memoryos_gpu.text.keywords does with Python's str methods, and
// text_table.cpp counts tokens as memoryos_gpu.page_views does. The tables for code points
// >= 128 come from that Python (scripts/gen_unicode_table.py); ASCII is inline.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace memoryos {
namespace cp {

#include "memoryos/unicode_tables.inc"

/// Whether c lies in one of the sorted, disjoint [start, end) ranges of `table`.
template <size_t N>
inline bool in_ranges(const uint32_t (&table)[N][2], uint32_t c) {
  size_t lo = 0, hi = N;  // the last range starting at or below c, if c is inside it
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (table[mid][0] <= c) lo = mid + 1;
    else hi = mid;
  }
  return lo > 0 && c < table[lo - 1][1];
}

inline bool ascii_digit(uint32_t c) { return c >= '0' && c <= '9'; }
inline bool ascii_upper(uint32_t c) { return c >= 'A' && c <= 'Z'; }
inline bool ascii_lower(uint32_t c) { return c >= 'a' && c <= 'z'; }

/// str.isalnum() of one code point: [^\W_] in Python's re.
inline bool is_alnum(uint32_t c) {
  if (c < 128) return ascii_digit(c) || ascii_lower(c) || ascii_upper(c);
  return in_ranges(kAlnumRanges, c);
}
inline bool is_alpha(uint32_t c) {
  if (c < 128) return ascii_lower(c) || ascii_upper(c);
  return in_ranges(kAlphaRanges, c);
}
inline bool is_upper(uint32_t c) { return c < 128 ? ascii_upper(c) : in_ranges(kUpperRanges, c); }
inline bool is_digit(uint32_t c) { return c < 128 ? ascii_digit(c) : in_ranges(kDigitRanges, c); }
/// str.isspace() of one code point: \s in Python's re.
inline bool is_space(uint32_t c) {
  if (c < 128) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
  return in_ranges(kSpaceRanges, c);
}
inline bool is_apostrophe(uint32_t c) { return c == 0x27 || c == 0x2019; }
/// A combining mark (general category M*): it continues the word before it.
inline bool is_mark(uint32_t c) { return c >= 128 && in_ranges(kMarkRanges, c); }
/// A letter of a script written without spaces between words (Han, kana, Thai, ...): a run
/// of them is split into overlapping pairs (memoryos_gpu/text/words.py).
inline bool is_unspaced(uint32_t c) { return c >= 128 && in_ranges(kUnspacedRanges, c); }
/// About one token to a tokenizer: a CJK ideograph, kana, bopomofo, hangul, or a CJK or
/// fullwidth punctuation or form (ONE_TOKEN_RANGES of scripts/gen_unicode_table.py, which
/// page_views.approx_tokens counts by). Nothing below U+1100 is: most text skips the search.
inline bool is_one_token(uint32_t c) { return c >= 0x1100 && in_ranges(kOneTokenRanges, c); }
/// An optional vowel or cantillation mark of Arabic (harakat) or Hebrew (niqqud): most text
/// leaves them out, so folding drops them and a vocalised word matches its plain spelling.
inline bool is_optional_mark(uint32_t c) {
  const bool in_block = (c >= 0x591 && c < 0x5C8) || (c >= 0x610 && c < 0x61B) ||
                        (c >= 0x64B && c < 0x660) || c == 0x670 || (c >= 0x6D6 && c < 0x6EE);
  return in_block && is_mark(c);
}
/// A code point that starts a word of a spaced script, and one that continues it.
inline bool starts_word(uint32_t c) { return is_alnum(c) && !is_unspaced(c); }
inline bool continues_word(uint32_t c) { return starts_word(c) || is_mark(c); }

/// Appends str.casefold() of one code point to `out` (one to three code points).
template <typename Vec>
inline void casefold(uint32_t c, Vec* out) {
  if (c < 128) {
    out->push_back(ascii_upper(c) ? c + 32 : c);
    return;
  }
  constexpr size_t n = sizeof(kCaseFold) / sizeof(kCaseFold[0]);
  size_t lo = 0, hi = n;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (kCaseFold[mid][0] < c) lo = mid + 1;
    else hi = mid;
  }
  if (lo < n && kCaseFold[lo][0] == c) {
    for (uint32_t k = 0; k < kCaseFold[lo][1]; ++k) out->push_back(kCaseFold[lo][2 + k]);
  } else {
    out->push_back(c);
  }
}

/// The run of unspaced letters (each with its marks) that starts at s[i]: `units` gets where
/// each letter starts and then where the run ends; returns that end. Its words are the letter
/// pairs s[units[k], pair_end(units, k)) for k < unspaced_words(units).
template <typename Ch>
size_t unspaced_run(const Ch* s, size_t i, size_t n, std::vector<size_t>* units) {
  units->clear();
  while (i < n && is_unspaced(static_cast<uint32_t>(s[i]))) {
    units->push_back(i++);
    while (i < n && is_mark(static_cast<uint32_t>(s[i]))) ++i;
  }
  units->push_back(i);
  return i;
}
/// The words of a run: its overlapping letter pairs, or the one letter of a run of one.
inline size_t unspaced_words(const std::vector<size_t>& units) {
  return units.size() == 2 ? 1 : units.size() - 2;
}
inline size_t pair_end(const std::vector<size_t>& units, size_t k) {
  return units[std::min(k + 2, units.size() - 1)];
}

inline void put_utf8(uint32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

/// A letter a French, Italian or Catalan word begins with when the article before it is
/// elided (memoryos_gpu/text/words.py ELISION_NEXT: vowels, with their accents, and h).
inline bool elision_next(uint32_t c) {
  static const char32_t kNext[] = U"aeiouyh\u00e0\u00e2\u00e4\u00e1\u00e3\u00e5\u00e6"
                                  U"\u00e9\u00e8\u00ea\u00eb\u00ed\u00ec\u00ee\u00ef\u00f3"
                                  U"\u00f2\u00f4\u00f6\u00f5\u0153\u00fa\u00f9\u00fb\u00fc"
                                  U"\u00fd\u00ff"
                                  U"AEIOUYH\u00c0\u00c2\u00c4\u00c1\u00c3\u00c5\u00c6"
                                  U"\u00c9\u00c8\u00ca\u00cb\u00cd\u00cc\u00ce\u00cf\u00d3"
                                  U"\u00d2\u00d4\u00d6\u00d5\u0152\u00da\u00d9\u00db\u00dc"
                                  U"\u00dd\u0178";
  for (const char32_t* p = kNext; *p != 0; ++p) {
    if (static_cast<uint32_t>(*p) == c) return true;
  }
  return false;
}

/// Elision (memoryos_gpu/text/words.py ELIDED): whether the word so far, code units
/// [0, len) of `w`, is an elided article or pronoun (ASCII letters, either case) and `next`,
/// the code point after its apostrophe, a letter it is elided before. Then the apostrophe
/// ends the word and the next word begins after it (`l'été` is `l` and `été`).
template <typename Ch>
bool elides(const Ch* w, size_t len, uint32_t next) {
  if (len == 0 || len > 6 || !elision_next(next)) return false;
  std::string head;
  for (size_t k = 0; k < len; ++k) {
    const auto c = static_cast<uint32_t>(w[k]);
    if (!ascii_lower(c) && !ascii_upper(c)) return false;
    head.push_back(static_cast<char>(ascii_upper(c) ? c + 32 : c));
  }
  static const char* const kElided[] = {
      "c",    "d",     "j",      "l",      "m",      "n",      "s",    "t",   "v",
      "qu",   "jusqu", "lorsqu", "puisqu", "quoiqu", "presqu", "quelqu", "dell", "all",
      "nell", "sull",  "dall",   "coll",   "quell",  "quest",  "un",   "bell", "sant"};
  for (const char* e : kElided) {
    if (head == e) return true;
  }
  return false;
}

}  // namespace cp
}  // namespace memoryos
