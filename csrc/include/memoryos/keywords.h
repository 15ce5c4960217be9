// memoryos-gpu: keyword candidates of whole batches of texts, in native code.
//
// The extractive keyword stage scores every word of a page by tf * idf * boost, where the
// boosts need each word's surface form (capitalised, an acronym, at a sentence start). Finding
// the words, folding them and classifying their surfaces is one call per batch here instead of
// a Python loop per word. The rules are those memoryos_gpu.text.keywords documents, with the
// character classes and case folding of the Python that built the project (unicode_tables.inc):
//
//   - the caller passes NFKC-normalised texts (NOT case-folded) joined by U+0000;
//   - a word is [^\W_]+(?:['\u2019][^\W_]+)* (alnum runs joined through inner apostrophes),
//     except that an elided article before a vowel or h is a word of its own (l'été: l, été;
//     codepoints.h elides, words.py ELIDED);
//     its normalised form is its casefold with U+2019 read as ', a trailing "'s" dropped, then
//     every apostrophe dropped; stopwords (tested on the normalised form) and words shorter
//     than min_len code points (unless all digits) are skipped; fold_plurals applies the
//     suffix rule of keywords._fold_plural;
//   - a document's language: each word (occurrence, normalised, before the plural rule) counts
//     for every language stopword list it is in; the list with the most, if it has at least
//     two and more than `stopwords` has, is the document's language (ties: the first list),
//     and candidates whose words are in it are dropped (a German page loses "und" and
//     "der"; an English page keeps "die" and "come");
//   - a word is sentence-initial when it is a document's first, or the gap before it holds a
//     newline or [.!?]+ ["')\]]* followed by whitespace;
//   - flags, OR-ed over a candidate's occurrences: proper (an acronym -- two or more letters,
//     all upper case -- or capitalised not at a sentence start), capitalised at a sentence
//     start, a date word (holds a digit, or is in `date_words`), an ambiguous date word.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "memoryos/word_set.h"

namespace memoryos {

enum KeywordFlag : uint8_t {
  kProper = 1,
  kCapitalInitial = 2,
  kDateWord = 4,
  kAmbiguousDate = 8,
};

/// Distinct candidate words of each document, in order of first occurrence (CSR).
struct KeywordBatch {
  std::vector<int64_t> offsets;   ///< [n + 1]: document i's candidates [offsets[i], offsets[i+1])
  std::vector<int32_t> ids;       ///< term_id of an ASCII word; -1 for others (hashed by Python)
  std::vector<int32_t> tf;        ///< occurrences in the document
  std::vector<uint8_t> flags;     ///< KeywordFlag bits
  std::string words;              ///< the normalised words' UTF-8, back to back
  std::vector<int64_t> word_ends;  ///< byte end of each word in `words`
  std::vector<uint64_t> word_hashes;  ///< word_hash of each word
};

struct KeywordOptions {
  int32_t min_len = 2;
  bool fold_plurals = false;
};

/// Finds keyword candidates. Holds the word lists; thread-safe once built.
class KeywordScanner {
 public:
  /// `language_stopwords`: other languages' lists (at most 31); a document written in one
  /// of them (see above) loses that list's words too.
  KeywordScanner(const std::vector<std::string>& stopwords,
                 const std::vector<std::string>& date_words,
                 const std::vector<std::string>& ambiguous_dates, const KeywordOptions& options,
                 const std::vector<std::vector<std::string>>& language_stopwords = {});

  /// `text`: `n_docs` NFKC texts joined by U+0000, code units of one width (1, 2 or 4 bytes).
  /// `with_ids` false leaves every id -1 (document frequencies need only the words).
  KeywordBatch scan(const void* text, size_t length, int kind, int64_t n_docs,
                    bool with_ids = true) const;

  const KeywordOptions& options() const { return options_; }

 private:
  WordMasks stopwords_;  // bit 31: `stopwords`; bits 0..30: `language_stopwords`
  WordSet date_words_, ambiguous_;
  KeywordOptions options_;
};

}  // namespace memoryos
