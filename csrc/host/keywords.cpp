// memoryos-gpu: keyword candidates of a batch (see memoryos/keywords.h for the rules).
#include "memoryos/keywords.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "codepoints.h"
#include "memoryos/languages.h"
#include "memoryos/terms.h"

namespace memoryos {
namespace {

using Word = std::vector<uint32_t>;

/// Detects a sentence end in the gap between two words: a newline, or [.!?]+ ["')\]]* \s.
class GapState {
 public:
  void reset() { state_ = 0, ended_ = false; }
  bool ended() const { return ended_; }
  void feed(uint32_t c) {
    const bool stop = c == '.' || c == '!' || c == '?';
    const bool closer = c == '"' || c == '\'' || c == ')' || c == ']';
    if (c == '\n' || (state_ != 0 && cp::is_space(c))) ended_ = true;
    if (stop) state_ = 1;
    else if (closer && state_ != 0) state_ = 2;
    else state_ = 0;
  }

 private:
  int state_ = 0;  // 0: nothing pending, 1: after [.!?]+, 2: after closers that followed them
  bool ended_ = false;
};

template <typename W>
bool ends_with(const W& w, const char* suffix) {
  const size_t n = std::char_traits<char>::length(suffix);
  if (w.size() < n) return false;
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<uint32_t>(w[w.size() - n + i]) != static_cast<uint32_t>(suffix[i])) return false;
  }
  return true;
}

/// Whether every code point of `w` (code points, or the bytes of an ASCII word) is a digit.
template <typename W>
bool all_digits(const W& w) {
  for (auto c : w) {
    if (!cp::is_digit(static_cast<uint32_t>(c))) return false;
  }
  return !w.empty();
}

/// keywords._fold_plural on code points (or on the bytes of an ASCII word).
template <typename W>
void fold_plural(W* w) {
  if (w->size() <= 4 || static_cast<uint32_t>(w->back()) != 's' || all_digits(*w)) return;
  if (ends_with(*w, "ss") || ends_with(*w, "us") || ends_with(*w, "is")) return;
  if (ends_with(*w, "ies") && w->size() > 5) {
    w->resize(w->size() - 3);
    w->push_back('y');
  } else if (ends_with(*w, "ches") || ends_with(*w, "shes") || ends_with(*w, "xes") ||
             ends_with(*w, "zes") || ends_with(*w, "sses")) {
    w->resize(w->size() - 2);
  } else {
    w->pop_back();
  }
}

/// casefold (a combining dot above after an i and Arabic and Hebrew vowel marks dropped:
/// words.casefold), U+2019 read as ', a
/// trailing "'s" dropped, then every apostrophe dropped. `norm` holds code points, or, for an
/// all-ASCII surface, the UTF-8 bytes themselves (casefold is then ASCII lower case and
/// neither U+2019 nor the dot can occur).
template <typename Ch, typename W>
void normalise(const Ch* surface, size_t n, W* norm) {
  norm->clear();
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<uint32_t>(surface[i]);
    if (cp::is_optional_mark(c)) continue;
    cp::casefold(c == 0x2019 ? 0x27 : c, norm);
    if constexpr (!std::is_same_v<W, std::string>) {
      while (norm->size() >= 2 && norm->back() == 0x307 && (*norm)[norm->size() - 2] == 'i') {
        norm->pop_back();
      }
    }
  }
  if (norm->size() >= 2 && (*norm)[norm->size() - 2] == '\'' && norm->back() == 's') {
    norm->resize(norm->size() - 2);
  }
  norm->erase(std::remove(norm->begin(), norm->end(), '\''), norm->end());
}

/// The UTF-8 of a normalised word: encoded from code points, or already there (an ASCII
/// word normalised in place, `norm` being `utf8`).
void to_utf8(const Word& norm, std::string* utf8) {
  utf8->clear();
  for (uint32_t c : norm) cp::put_utf8(c, utf8);
}
void to_utf8([[maybe_unused]] const std::string& norm, [[maybe_unused]] std::string* utf8) {}

/// The surface's flags: an acronym, or capitalised (first code point upper case).
template <typename Ch>
void classify(const Ch* surface, size_t n, bool* acronym, bool* capitalised) {
  int letters = 0;
  bool all_upper = true;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<uint32_t>(surface[i]);
    if (cp::is_alpha(c)) {
      ++letters;
      all_upper = all_upper && cp::is_upper(c);
    }
  }
  *acronym = letters >= 2 && all_upper;
  *capitalised = n > 0 && cp::is_upper(static_cast<uint32_t>(surface[0]));
}

/// One document's candidates while it is scanned.
struct DocCandidates {
  WordIndex index;  // word -> position in the lists below
  std::vector<std::string> words;
  std::vector<uint64_t> hashes;  // word_hash of each word
  std::vector<bool> ascii;
  std::vector<int32_t> tf;
  std::vector<uint8_t> flags;
  std::vector<uint32_t> lists;  // the stopword lists (bits) each word's surfaces are in
  LanguageVotes votes;  // the document's words, by list (memoryos/languages.h)

  void flush(bool with_ids, KeywordBatch* out) {
    const int language = votes.language();
    const uint32_t drop = language < 0 ? 0 : uint32_t{1} << language;
    for (size_t i = 0; i < words.size(); ++i) {
      if ((lists[i] & drop) != 0) continue;  // a stopword of the document's language
      const std::string& w = words[i];
      out->ids.push_back(with_ids && ascii[i] ? cached_term_id(w, hashes[i]) : -1);
      out->tf.push_back(tf[i]);
      out->flags.push_back(flags[i]);
      out->words += w;
      out->word_hashes.push_back(hashes[i]);
      out->word_ends.push_back(static_cast<int64_t>(out->words.size()));
    }
    out->offsets.push_back(static_cast<int64_t>(out->ids.size()));
    index.clear(), words.clear(), hashes.clear(), ascii.clear(), tf.clear(), flags.clear();
    lists.clear(), votes.clear();
  }
};

}  // namespace

KeywordScanner::KeywordScanner(const std::vector<std::string>& stopwords,
                               const std::vector<std::string>& date_words,
                               const std::vector<std::string>& ambiguous_dates,
                               const KeywordOptions& options,
                               const std::vector<std::vector<std::string>>& language_stopwords)
    : stopwords_(stopword_masks(stopwords, language_stopwords)),
      date_words_(date_words.begin(), date_words.end()),
      ambiguous_(ambiguous_dates.begin(), ambiguous_dates.end()),
      options_(options) {
  if (options.min_len < 0) throw std::invalid_argument("min_len must be >= 0");
}

namespace {

struct ScanContext {
  bool with_ids;
  const WordMasks& stop;
  const WordSet& dates;
  const WordSet& ambiguous;
  const KeywordOptions& opt;
};

/// Adds one word (its surface: `n` code units) to the document's candidates, normalised
/// into `norm`: code points (a Word) in general, or the UTF-8 string itself for an all-ASCII
/// surface (`norm` == `utf8`: no code point buffers, nothing to re-encode). A candidate's
/// first occurrence gets its date flags, every occurrence ORs in its surface's flags.
template <typename Ch, typename Norm>
void add_word(const ScanContext& ctx, const Ch* surface, size_t n, bool initial, Norm* norm,
              std::string* utf8, DocCandidates* doc) {
  normalise(surface, n, norm);
  if (norm->empty()) return;
  to_utf8(*norm, utf8);
  uint64_t hash = word_hash(*utf8);  // one hash for every lookup below
  const uint32_t lists = ctx.stop.mask(*utf8, hash);
  doc->votes.count(lists);
  if ((lists & kOwnStopwords) != 0) return;
  if (static_cast<int32_t>(norm->size()) < ctx.opt.min_len && !all_digits(*norm)) return;
  if (ctx.opt.fold_plurals) {
    fold_plural(norm);
    to_utf8(*norm, utf8);
    hash = word_hash(*utf8);
  }
  int64_t at = doc->index.find_or_add(*utf8, hash, static_cast<int64_t>(doc->words.size()),
                                      doc->words);
  if (at < 0) {
    at = static_cast<int64_t>(doc->words.size());
    bool ascii = true, digit = false;
    for (auto c : *norm) {
      const auto u = static_cast<uint32_t>(c);
      ascii = ascii && u < 128, digit = digit || cp::is_digit(u);
    }
    uint8_t f = 0;
    if (digit || ctx.dates.contains(*utf8, hash)) f |= kDateWord;
    if (ctx.ambiguous.contains(*utf8, hash)) f |= kAmbiguousDate;
    doc->words.push_back(*utf8);
    doc->hashes.push_back(hash);
    doc->ascii.push_back(ascii);
    doc->tf.push_back(0);
    doc->flags.push_back(f);
    doc->lists.push_back(0);
  }
  bool acronym, capitalised;
  classify(surface, n, &acronym, &capitalised);
  const auto k = static_cast<size_t>(at);
  doc->tf[k] += 1;
  doc->lists[k] |= lists;  // a plural folded into the word may be in other lists
  if (acronym || (capitalised && !initial)) doc->flags[k] |= kProper;
  else if (capitalised) doc->flags[k] |= kCapitalInitial;
}

template <typename Ch>
int64_t scan_text(const Ch* s, size_t n, const ScanContext& ctx, KeywordBatch* out) {
  DocCandidates doc;
  GapState gap;
  Word norm;
  std::string utf8;
  std::vector<size_t> units;  // where each letter of an unspaced run starts, then its end
  bool first = true;  // the next word is its document's first
  bool elided_initial = false;  // the word before was a sentence-initial elided article
  int64_t docs = 0;
  size_t i = 0;
  while (i < n) {
    const auto c = static_cast<uint32_t>(s[i]);
    if (c == 0) {
      doc.flush(ctx.with_ids, out);
      ++docs, ++i, first = true;
      gap.reset();
      continue;
    }
    if (cp::is_unspaced(c)) {  // a run of an unspaced script: its overlapping letter pairs
      i = cp::unspaced_run(s, i, n, &units);
      for (size_t k = 0; k < cp::unspaced_words(units); ++k) {
        const bool initial = k == 0 && (first || gap.ended());
        add_word(ctx, s + units[k], cp::pair_end(units, k) - units[k], initial, &norm, &utf8,
                 &doc);
      }
      first = false;
      gap.reset();
      continue;
    }
    if (!cp::is_alnum(c)) {
      gap.feed(c);
      ++i;
      continue;
    }
    const size_t start = i;
    bool ascii = true;
    while (true) {
      for (; i < n && cp::continues_word(static_cast<uint32_t>(s[i])); ++i) ascii &= s[i] < 128;
      if (i + 1 < n && cp::is_apostrophe(static_cast<uint32_t>(s[i])) &&
          cp::starts_word(static_cast<uint32_t>(s[i + 1])) &&
          !cp::elides(s + start, i - start, static_cast<uint32_t>(s[i + 1]))) {
        ascii &= s[i++] < 128;
        continue;
      }
      break;
    }
    // the word after an elided article starts its sentence if the article did ("L'École")
    const bool initial = first || gap.ended() || elided_initial;
    if (ascii) {
      add_word(ctx, s + start, i - start, initial, &utf8, &utf8, &doc);
    } else {
      add_word(ctx, s + start, i - start, initial, &norm, &utf8, &doc);
    }
    elided_initial = initial && i + 1 < n && cp::is_apostrophe(static_cast<uint32_t>(s[i])) &&
                     cp::elides(s + start, i - start, static_cast<uint32_t>(s[i + 1]));
    first = false;
    gap.reset();
  }
  doc.flush(ctx.with_ids, out);
  return docs + 1;
}

}  // namespace

KeywordBatch KeywordScanner::scan(const void* text, size_t length, int kind, int64_t n_docs,
                                  bool with_ids) const {
  KeywordBatch out;
  out.offsets.reserve(static_cast<size_t>(n_docs) + 1);
  out.offsets.push_back(0);
  if (n_docs == 0) return out;
  const ScanContext ctx{with_ids, stopwords_, date_words_, ambiguous_, options_};
  int64_t docs = 0;
  switch (kind) {
    case 1: docs = scan_text(static_cast<const uint8_t*>(text), length, ctx, &out); break;
    case 2: docs = scan_text(static_cast<const uint16_t*>(text), length, ctx, &out); break;
    case 4: docs = scan_text(static_cast<const uint32_t*>(text), length, ctx, &out); break;
    default: throw std::invalid_argument("unknown string kind " + std::to_string(kind));
  }
  if (docs != n_docs) {
    throw std::invalid_argument("the text holds " + std::to_string(docs) +
                                " documents (U+0000-separated), expected " + std::to_string(n_docs));
  }
  return out;
}

}  // namespace memoryos
