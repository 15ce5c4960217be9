// memoryos-gpu: words -> hashed term ids, in native code for whole batches of texts.
//
// The lexical index (BM25 over each user's MTM pages) and the query keywords of the segment
// score both need the words of many texts per batch. Splitting, normalising and hashing them
// here is one call per batch instead of a Python loop per word. The rules are those of
// memoryos_gpu.text.keywords (the Python tokenizer the keyword extractor uses), so a word gets
// the same id on both sides:
//
//   - the caller passes texts already NFKC-normalised and case-folded (one Python call for the
//     whole batch), joined by U+0000;
//   - a word is a maximal run of code points for which Python's str.isalnum() holds, joined
//     through inner apostrophes (' or U+2019) followed by more of them (the regex
//     [^\W_]+(?:['\u2019][^\W_]+)*), except that an elided article before a vowel or h is a
//     word of its own (l'été: l, été; codepoints.h elides, words.py ELIDED);
//   - a trailing possessive "'s" is dropped, then every apostrophe ("don't" -> "dont");
//   - stopwords are dropped, and those of the document's language when it is written in another
//     (found by memoryos/languages.h from the language lists, as the keyword scanner finds it);
//   - a page's date words (given its timestamp): its UTC weekday, day, month and year in
//     English, and its weekday and month in the page's language when that is another one with
//     date names (every form of an inflected name), so a question in French finds a page of
//     May by "mai", one in Russian by "мая" or "мае";
//   - the id is BLAKE2b with an 8-byte digest of the word's UTF-8, read little-endian and masked
//     to 31 bits (memoryos_gpu.text.keywords.hash_keyword), so ids are >= 0 and -1 pads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "memoryos/word_set.h"

namespace memoryos {

/// 31-bit id of one normalised word (its UTF-8 bytes): BLAKE2b-64, little-endian, & 0x7fffffff.
int32_t term_id(const uint8_t* utf8, size_t n);

/// term_id of a word's UTF-8 (`hash`: its word_hash, which the caller has for its own
/// lookups), from the calling thread's cache of the words it hashed before (direct-mapped,
/// 1 MB; the id is a pure function of the word, so every caller shares it).
int32_t cached_term_id(std::string_view utf8, uint64_t hash);

/// Terms of a batch of documents in CSR form.
struct TermBatch {
  std::vector<int64_t> offsets;  ///< [n + 1]: document i's terms are [offsets[i], offsets[i+1])
  std::vector<int32_t> ids;      ///< distinct term ids of each document
  std::vector<int32_t> tf;       ///< occurrences of each id in its document
  std::vector<int32_t> length;   ///< [n] tokens of each document (stopwords excluded)
};

/// How documents are split into terms.
struct TermOptions {
  /// Keep at most this many distinct terms per document (later new words are ignored; their
  /// occurrences still count in the length). Queries use it to bound the work per query.
  int32_t max_terms = 1 << 30;
  /// true: each document's ids ascending (what a page's term row needs for binary search);
  /// false: in order of first occurrence (what a query's keywords need for "first N").
  bool sorted = true;
};

/// Splits and hashes documents. Holds the word lists; thread-safe once built.
class TermSplitter {
 public:
  /// `language_stopwords`: other languages' lists (at most 31), which find a page's language;
  /// `language_dates[b]`: list b's language's month names (12, January first) then weekday
  /// names (7, Monday first), case-folded, each its forms separated by spaces (every form is a
  /// date word), or empty (no date words of its own).
  explicit TermSplitter(const std::vector<std::string>& stopwords,
                        const std::vector<std::vector<std::string>>& language_stopwords = {},
                        const std::vector<std::vector<std::string>>& language_dates = {});

  /// `text` is `n_docs` documents joined by U+0000, as code units of one width (1, 2 or 4 bytes:
  /// CPython's string kinds). `timestamps` (n_docs values, or null) appends each document's
  /// UTC date words (weekday, day, month, year: "monday 8 may 2023"); NaN means none.
  TermBatch split(const void* text, size_t length, int kind, int64_t n_docs,
                  const double* timestamps, const TermOptions& options) const;

 private:
  WordMasks stopwords_;  // bit 31: `stopwords`; bits 0..30: `language_stopwords`
  std::vector<std::vector<std::vector<std::string>>> dates_;  // by language bit, name: forms
};

/// The UTC date words of an epoch timestamp, as memoryos_gpu.lexical.date_words writes them
/// (lower case): {"monday", "8", "may", "2023"}; empty when out of datetime's range.
std::vector<std::string> date_words(double timestamp);

}  // namespace memoryos
