// memoryos-gpu: the native term splitter (see memoryos/terms.h for the rules).
#include "memoryos/terms.h"

#include "codepoints.h"
#include "memoryos/languages.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace memoryos {
namespace {

using cp::is_alnum;
using cp::is_apostrophe;
using cp::put_utf8;

// ---- BLAKE2b (RFC 7693), unkeyed, 8-byte digest ---------------------------------------------
constexpr uint64_t kIV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                             0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                             0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline void mix(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) {
  v[a] = v[a] + v[b] + x;
  v[d] = rotr(v[d] ^ v[a], 32);
  v[c] = v[c] + v[d];
  v[b] = rotr(v[b] ^ v[c], 24);
  v[a] = v[a] + v[b] + y;
  v[d] = rotr(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];
  v[b] = rotr(v[b] ^ v[c], 63);
}

void compress(uint64_t* h, const uint8_t* block, uint64_t counter, bool last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; ++i) {
    uint64_t w = 0;
    for (int j = 7; j >= 0; --j) w = (w << 8) | block[8 * i + j];  // little-endian words
    m[i] = w;
  }
  for (int i = 0; i < 8; ++i) {
    v[i] = h[i];
    v[i + 8] = kIV[i];
  }
  v[12] ^= counter;  // the byte counter's high word is 0: words are far below 2^64 bytes
  if (last) v[14] = ~v[14];
  for (const auto& s : kSigma) {
    mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

/// One document's terms: its token ids in text order, turned into (id, tf) rows at the end.
struct DocTerms {
  std::vector<int32_t> tokens;
  std::vector<uint32_t> lists;  // each token's language lists (WordMasks bits 0..30)
  std::vector<std::pair<int32_t, int32_t>> scratch;  // (id, first position)

  void push(int32_t id, uint32_t in_lists) {
    tokens.push_back(id);
    lists.push_back(in_lists);
  }

  /// Drops the tokens in language list `language` (a bit; -1: none), keeping their order.
  void drop_language(int language) {
    if (language < 0) return;
    const uint32_t bit = uint32_t{1} << language;
    size_t kept = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if ((lists[i] & bit) != 0) continue;
      tokens[kept] = tokens[i];
      lists[kept++] = lists[i];
    }
    tokens.resize(kept);
    lists.resize(kept);
  }

  void flush(const TermOptions& opt, TermBatch* out) {
    scratch.clear();
    for (size_t i = 0; i < tokens.size(); ++i) scratch.emplace_back(tokens[i], static_cast<int32_t>(i));
    std::sort(scratch.begin(), scratch.end());  // by id, then by position
    // runs of one id: (first position, id, count)
    std::vector<std::array<int32_t, 3>>& runs = runs_;
    runs.clear();
    for (size_t i = 0; i < scratch.size();) {
      size_t j = i;
      while (j < scratch.size() && scratch[j].first == scratch[i].first) ++j;
      runs.push_back({scratch[i].second, scratch[i].first, static_cast<int32_t>(j - i)});
      i = j;
    }
    if (!opt.sorted || static_cast<int32_t>(runs.size()) > opt.max_terms) {
      std::sort(runs.begin(), runs.end());  // first occurrence order
      if (static_cast<int32_t>(runs.size()) > opt.max_terms) runs.resize(opt.max_terms);
      if (opt.sorted) {
        std::sort(runs.begin(), runs.end(),
                  [](const auto& x, const auto& y) { return x[1] < y[1]; });
      }
    }
    for (const auto& r : runs) {
      out->ids.push_back(r[1]);
      out->tf.push_back(r[2]);
    }
    out->offsets.push_back(static_cast<int64_t>(out->ids.size()));
    out->length.push_back(static_cast<int32_t>(tokens.size()));
    tokens.clear();
    lists.clear();
  }

 private:
  std::vector<std::array<int32_t, 3>> runs_;
};

constexpr const char* kWeekdays[7] = {"monday", "tuesday", "wednesday", "thursday",
                                      "friday", "saturday", "sunday"};
constexpr const char* kMonths[12] = {"january", "february", "march",     "april",
                                     "may",     "june",     "july",      "august",
                                     "september", "october", "november", "december"};

/// Days since 1970-01-01 -> (year, month 1-12, day 1-31), proleptic Gregorian (H. Hinnant's
/// civil_from_days).
void civil_from_days(int64_t z, int64_t* y, int* m, int* d) {
  z += 719468;
  const int64_t era = (z >= 0 ? z : z - 146096) / 146097;
  const int64_t doe = z - era * 146097;
  const int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
  const int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
  const int64_t mp = (5 * doy + 2) / 153;
  *d = static_cast<int>(doy - (153 * mp + 2) / 5 + 1);
  *m = static_cast<int>(mp < 10 ? mp + 3 : mp - 9);
  *y = yoe + era * 400 + (*m <= 2);
}

}  // namespace

int32_t term_id(const uint8_t* utf8, size_t n) {
  uint64_t h[8];
  std::memcpy(h, kIV, sizeof(h));
  h[0] ^= 0x01010000ULL ^ 8ULL;  // digest length 8, no key
  uint8_t block[128];
  size_t done = 0;
  while (n - done > 128) {
    compress(h, utf8 + done, done + 128, false);
    done += 128;
  }
  std::memset(block, 0, sizeof(block));
  std::memcpy(block, utf8 + done, n - done);
  compress(h, block, n, true);
  return static_cast<int32_t>(h[0] & 0x7FFFFFFFULL);
}

namespace {

/// The UTC date of an epoch timestamp as datetime.fromtimestamp reads it: false when out of
/// its range (years 1..9999). `wd`: Monday = 0.
bool utc_date(double timestamp, int64_t* y, int* m, int* d, int* wd) {
  if (!std::isfinite(timestamp)) return false;
  // datetime.fromtimestamp rounds to the microsecond (half to even), then takes the UTC day
  const double us = std::nearbyint(timestamp * 1e6);
  const double day = std::floor(us / 86400e6);
  if (!(day > -719163.0 - 1 && day < 2932897.0)) return false;
  const auto days = static_cast<int64_t>(day);
  civil_from_days(days, y, m, d);
  *wd = static_cast<int>(((days % 7) + 7 + 3) % 7);  // 1970-01-01 was a Thursday
  return *y >= 1 && *y <= 9999;
}

/// The English date words of a UTC date (weekday, day, month, year).
std::vector<std::string> english_date_words(int64_t y, int m, int d, int wd) {
  return {kWeekdays[wd], std::to_string(d), kMonths[m - 1], std::to_string(y)};
}

}  // namespace

std::vector<std::string> date_words(double timestamp) {
  int64_t y;
  int m, d, wd;
  if (!utc_date(timestamp, &y, &m, &d, &wd)) return {};
  return english_date_words(y, m, d, wd);
}

namespace {

/// The forms of a date name: the words of `names`, separated by spaces.
std::vector<std::string> forms_of(const std::string& names) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < names.size()) {
    const size_t end = std::min(names.find(' ', at), names.size());
    if (end > at) out.emplace_back(names, at, end - at);
    at = end + 1;
  }
  return out;
}

}  // namespace

TermSplitter::TermSplitter(const std::vector<std::string>& stopwords,
                           const std::vector<std::vector<std::string>>& language_stopwords,
                           const std::vector<std::vector<std::string>>& language_dates)
    : stopwords_(stopword_masks(stopwords, language_stopwords)) {
  if (language_dates.size() > language_stopwords.size()) {
    throw std::invalid_argument("date names for more languages than stopword lists");
  }
  for (const auto& names : language_dates) {
    if (!names.empty() && names.size() != 19) {
      throw std::invalid_argument("a language's date names are 12 months and 7 weekdays");
    }
    dates_.emplace_back();  // split into forms once, not at every page
    for (const auto& name : names) dates_.back().push_back(forms_of(name));
  }
}

namespace {

/// One entry of the word cache: a word of at most 26 bytes and its id.
struct CachedWord {
  int32_t id;
  uint8_t size;  // 0: empty (an empty word is never looked up)
  char bytes[27];
};
static_assert(sizeof(CachedWord) == 32, "two entries a cache line");

constexpr size_t kCacheBits = 15;  // 32,768 entries: 1 MB a thread

/// The cache entry of a word of word_hash `hash` (an entry holds its word, so a collision
/// costs a recomputation, never a wrong id).
inline size_t cache_index(uint64_t hash) {
  return static_cast<size_t>(hash & ((uint64_t{1} << kCacheBits) - 1));
}

}  // namespace

// Why a cache: a batch of queries (or pages) mostly repeats words earlier batches had, and
// BLAKE2b costs ~0.3 us a word, most of a query's split. Direct-mapped, exact (an entry holds
// its word) and bounded, so a lookup is one cache line; per thread, because the splitters run
// without the GIL. Longer words are always hashed (they are rare in chat text).
int32_t cached_term_id(std::string_view w, uint64_t hash) {
  thread_local std::vector<CachedWord> cache(size_t{1} << kCacheBits, CachedWord{0, 0, {}});
  if (w.empty() || w.size() > sizeof(CachedWord::bytes)) {
    return term_id(reinterpret_cast<const uint8_t*>(w.data()), w.size());
  }
  CachedWord& e = cache[cache_index(hash)];
  if (e.size == w.size() && std::memcmp(e.bytes, w.data(), w.size()) == 0) return e.id;
  e.id = term_id(reinterpret_cast<const uint8_t*>(w.data()), w.size());
  e.size = static_cast<uint8_t>(w.size());
  std::memcpy(e.bytes, w.data(), w.size());
  return e.id;
}

namespace {

/// The word lists a split reads.
struct SplitLists {
  const WordMasks& stop;  // bit 31: stopwords; bits 0..30: the languages' lists
  const std::vector<std::vector<std::vector<std::string>>>& dates;  // by language bit, name
};

/// A document's date words (terms.h): English, then its language's weekday and month (every
/// form the table gives each).
std::vector<std::string> doc_date_words(double timestamp, int language, const SplitLists& lists) {
  int64_t y;
  int m, d, wd;
  if (!utc_date(timestamp, &y, &m, &d, &wd)) return {};
  std::vector<std::string> out = english_date_words(y, m, d, wd);
  const auto b = static_cast<size_t>(language);
  if (language >= 0 && b < lists.dates.size() && !lists.dates[b].empty()) {
    for (const size_t name : {static_cast<size_t>(12 + wd), static_cast<size_t>(m - 1)}) {
      const auto& forms = lists.dates[b][name];
      out.insert(out.end(), forms.begin(), forms.end());
    }
  }
  return out;
}

template <typename Ch>
void split_text(const Ch* s, size_t n, int64_t n_docs, const double* timestamps,
                const TermOptions& opt, const SplitLists& lists, TermBatch* out) {
  DocTerms doc;
  LanguageVotes votes;  // the document's language: its stopwords go, its date words come
  std::string word;
  std::vector<size_t> units;  // where each letter of an unspaced run starts, then its end
  int64_t docs_done = 0;
  auto emit = [&](const std::string& w) {
    if (w.empty()) return;
    const uint64_t hash = word_hash(w);  // one hash for the stopwords and the id cache
    const uint32_t in_lists = lists.stop.mask(w, hash);
    votes.count(in_lists);
    if ((in_lists & kOwnStopwords) != 0) return;
    doc.push(cached_term_id(w, hash), in_lists & ~kOwnStopwords);
  };
  auto end_doc = [&]() {
    const int language = votes.language();
    doc.drop_language(language);  // before the date words: a page keeps its date in words
    if (timestamps != nullptr && docs_done < n_docs) {
      for (const auto& w : doc_date_words(timestamps[docs_done], language, lists)) emit(w);
    }
    votes.clear();  // after: the date words' own votes do not reach the next document
    doc.flush(opt, out);
    ++docs_done;
  };
  size_t i = 0;
  while (i < n) {
    const uint32_t c = static_cast<uint32_t>(s[i]);
    if (c == 0) {
      end_doc();
      ++i;
      continue;
    }
    if (cp::is_unspaced(c)) {  // a run of an unspaced script: its overlapping letter pairs
      i = cp::unspaced_run(s, i, n, &units);
      for (size_t k = 0; k < cp::unspaced_words(units); ++k) {
        word.clear();
        for (size_t j = units[k]; j < cp::pair_end(units, k); ++j) {
          put_utf8(static_cast<uint32_t>(s[j]), &word);
        }
        emit(word);
      }
      continue;
    }
    if (!is_alnum(c)) {
      ++i;
      continue;
    }
    // one word: a letter or digit, then letters, digits and marks, with inner apostrophes
    // (kept as ' for the possessive rule)
    word.clear();
    while (true) {
      while (i < n && cp::continues_word(static_cast<uint32_t>(s[i]))) {
        put_utf8(static_cast<uint32_t>(s[i++]), &word);
      }
      if (i + 1 < n && is_apostrophe(static_cast<uint32_t>(s[i])) &&
          cp::starts_word(static_cast<uint32_t>(s[i + 1])) &&
          !cp::elides(word.data(), word.size(), static_cast<uint32_t>(s[i + 1]))) {
        word.push_back('\'');
        ++i;
        continue;
      }
      break;
    }
    if (word.size() >= 2 && word[word.size() - 2] == '\'' && word.back() == 's') word.resize(word.size() - 2);
    word.erase(std::remove(word.begin(), word.end(), '\''), word.end());
    emit(word);
  }
  end_doc();
  if (docs_done != n_docs) {
    throw std::invalid_argument("the text holds " + std::to_string(docs_done) +
                                " documents (U+0000-separated), expected " + std::to_string(n_docs));
  }
}

}  // namespace

TermBatch TermSplitter::split(const void* text, size_t length, int kind, int64_t n_docs,
                              const double* timestamps, const TermOptions& options) const {
  TermBatch out;
  out.offsets.reserve(static_cast<size_t>(n_docs) + 1);
  out.offsets.push_back(0);
  out.length.reserve(static_cast<size_t>(n_docs));
  if (n_docs == 0) return out;
  const SplitLists lists{stopwords_, dates_};
  switch (kind) {
    case 1: split_text(static_cast<const uint8_t*>(text), length, n_docs, timestamps, options, lists, &out); break;
    case 2: split_text(static_cast<const uint16_t*>(text), length, n_docs, timestamps, options, lists, &out); break;
    case 4: split_text(static_cast<const uint32_t*>(text), length, n_docs, timestamps, options, lists, &out); break;
    default: throw std::invalid_argument("unknown string kind " + std::to_string(kind));
  }
  return out;
}

}  // namespace memoryos
