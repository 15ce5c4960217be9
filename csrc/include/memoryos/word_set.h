// memoryos-gpu: flat hash tables of UTF-8 words for the text scanners' inner loops.
//
// Why not std::unordered_set<std::string>: every word of every page and query is tested
// against the stopwords (and the keyword scanner's date lists), and each document's distinct
// words are counted in a map. libstdc++'s tables hash with a prime modulus (two integer
// divisions a probe) and chase a node per bucket; a profile of the keyword scan put ~25 % of
// it there, and the per-document map's node allocations another ~5 %. These are open
// addressing over power-of-two slots: one FNV-1a hash, a mask, a compare.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace memoryos {

/// FNV-1a of a word (64-bit), folded: the slot picker of the tables below and of the term
/// id cache (terms.cpp).
inline uint64_t word_hash(std::string_view w) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : w) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ULL;
  return h ^ (h >> 29);
}

/// An immutable set of words (built once: stopwords, date words).
class WordSet {
 public:
  WordSet() = default;
  template <typename It>
  WordSet(It first, It last) {
    for (It it = first; it != last; ++it) words_.emplace_back(*it);
    size_t cap = 16;
    while (cap < 2 * words_.size()) cap *= 2;
    slots_.assign(cap, -1);
    for (size_t i = 0; i < words_.size(); ++i) {
      size_t s = word_hash(words_[i]) & (cap - 1);
      while (slots_[s] >= 0 && words_[static_cast<size_t>(slots_[s])] != words_[i]) {
        s = (s + 1) & (cap - 1);
      }
      slots_[s] = static_cast<int32_t>(i);  // a repeated word keeps one slot
    }
  }

  /// Whether `w` (of word_hash `hash`: the callers hash a word once for all their lookups)
  /// is in the set.
  bool contains(std::string_view w, uint64_t hash) const { return find(w, hash) >= 0; }

  /// The position of `w` in the words the set was built from (the last, for a repeated
  /// word), or -1.
  int32_t find(std::string_view w, uint64_t hash) const {
    const size_t mask = slots_.size() - 1;
    for (size_t s = hash & mask;; s = (s + 1) & mask) {
      const int32_t k = slots_[s];
      if (k < 0 || words_[static_cast<size_t>(k)] == w) return k;
    }
  }

 private:
  std::vector<std::string> words_;
  std::vector<int32_t> slots_;
};

/// An immutable map of words to bit masks (built once: the stopword lists, a bit a list).
class WordMasks {
 public:
  WordMasks() = default;
  /// `lists[b]`: the words of bit b (at most 32 lists); a word in several lists gets
  /// every one's bit.
  explicit WordMasks(const std::vector<std::vector<std::string>>& lists) {
    if (lists.size() > 32) throw std::invalid_argument("at most 32 word lists");
    std::vector<std::string> words;
    for (size_t b = 0; b < lists.size(); ++b) {
      for (const std::string& w : lists[b]) {
        words.push_back(w);
        masks_.push_back(uint32_t{1} << b);
      }
    }
    set_ = WordSet(words.begin(), words.end());
    // a repeated word's slot names its last position: gather every position's bit there
    for (size_t i = 0; i < words.size(); ++i) {
      const auto k = static_cast<size_t>(set_.find(words[i], word_hash(words[i])));
      if (k != i) masks_[k] |= masks_[i];
    }
  }

  /// The bits of `w` (of word_hash `hash`), 0 for a word in no list.
  uint32_t mask(std::string_view w, uint64_t hash) const {
    const int32_t k = set_.find(w, hash);
    return k < 0 ? 0 : masks_[static_cast<size_t>(k)];
  }

 private:
  WordSet set_;
  std::vector<uint32_t> masks_;
};

/// Position of each distinct word of one document in the caller's list of them. Reused from
/// document to document: clear() resets only the slots the last document used.
class WordIndex {
 public:
  /// The position `w` was given, or -1 after giving it `next` (a word seen for the first
  /// time). `words[k]` must be the word at position k (the caller's list, which this indexes).
  /// `hash` is word_hash(w).
  int64_t find_or_add(std::string_view w, uint64_t hash, int64_t next,
                      const std::vector<std::string>& words) {
    if (2 * (used_.size() + 1) > slots_.size()) grow(words);
    const size_t mask = slots_.size() - 1;
    for (size_t s = hash & mask;; s = (s + 1) & mask) {
      const int64_t k = slots_[s];
      if (k < 0) {
        slots_[s] = next;
        used_.push_back(s);
        return -1;
      }
      if (words[static_cast<size_t>(k)] == w) return k;
    }
  }

  void clear() {
    for (size_t s : used_) slots_[s] = -1;
    used_.clear();
  }

 private:
  void grow(const std::vector<std::string>& words) {
    const size_t cap = slots_.empty() ? 64 : 2 * slots_.size();
    std::vector<int64_t> old;
    old.reserve(used_.size());
    for (size_t s : used_) old.push_back(slots_[s]);
    slots_.assign(cap, -1);
    used_.clear();
    for (int64_t k : old) {
      size_t s = word_hash(words[static_cast<size_t>(k)]) & (cap - 1);
      while (slots_[s] >= 0) s = (s + 1) & (cap - 1);
      slots_[s] = k;
      used_.push_back(s);
    }
  }

  std::vector<int64_t> slots_;
  std::vector<size_t> used_;
};

}  // namespace memoryos
