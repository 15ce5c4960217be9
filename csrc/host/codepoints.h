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

}  // namespace cp
}  // namespace memoryos
