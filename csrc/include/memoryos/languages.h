// memoryos-gpu: the language a text is written in, found from stopword lists.
//
// The rule (memoryos_gpu/text/stopword_lists.py says why): each word of the text (every
// occurrence, normalised) counts for every language list it is in; the list with the most
// counts, if it has at least two and more than the caller's own list (English), is the
// text's language (ties: the first list). The keyword scanner drops that language's
// stopwords; the term splitter adds the page's date in that language's words.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "memoryos/word_set.h"

namespace memoryos {

/// The bit of the caller's own stopword list; bits 0..30 are the languages' lists.
constexpr uint32_t kOwnStopwords = uint32_t{1} << 31;

/// The lists as WordMasks bits: `languages` at bits 0..30, `own` at bit 31.
inline WordMasks stopword_masks(const std::vector<std::string>& own,
                                const std::vector<std::vector<std::string>>& languages) {
  if (languages.size() > 31) throw std::invalid_argument("at most 31 language stopword lists");
  std::vector<std::vector<std::string>> lists(32);
  std::copy(languages.begin(), languages.end(), lists.begin());
  lists[31] = own;
  return WordMasks(lists);
}

/// One text's words counted for the lists that hold them.
class LanguageVotes {
 public:
  /// One word occurrence, in the lists of `mask` (WordMasks bits).
  void count(uint32_t mask) {
    for (; mask != 0; mask &= mask - 1) ++hits_[static_cast<size_t>(__builtin_ctz(mask))];
  }

  /// The text's language: its list's bit, or -1 (the caller's own language).
  int language() const {
    size_t best = 0;
    for (size_t b = 1; b < 31; ++b) {
      if (hits_[b] > hits_[best]) best = b;
    }
    const int32_t n = hits_[best];
    return n >= 2 && n > hits_[31] ? static_cast<int>(best) : -1;
  }

  void clear() { hits_.fill(0); }

 private:
  std::array<int32_t, 32> hits_{};
};

}  // namespace memoryos
