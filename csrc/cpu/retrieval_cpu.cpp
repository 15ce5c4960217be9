// memoryos-gpu: the fused retrieval pass on the CPU (see memoryos/retrieval.h). One OpenMP task
// per query: a query reads only its own user's rows, so queries never share writable memory.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "memoryos/postings.h"
#include "memoryos/retrieval.h"
#include "threads.h"
#include "vector_math.h"

namespace memoryos {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

/// A page that made one of the two lists, with both of its scores.
struct Candidate {
  int32_t slot;
  int32_t segment;
  float cosine;
  float lexical;  // BM25, 0 when no query term matched
};

/// Mean and standard deviation (population) of one signal over the candidates; std is exactly 0
/// when the signal is flat over them (flat_spread).
template <typename Get>
void moments(const std::vector<Candidate>& cand, Get get, float* mean, float* stddev) {
  double sum = 0.0;
  float lo = get(cand[0]), hi = lo;
  for (const Candidate& c : cand) {
    const float v = get(c);
    sum += v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const double m = sum / static_cast<double>(cand.size());
  double sq = 0.0;
  for (const Candidate& c : cand) sq += (get(c) - m) * (get(c) - m);
  *mean = static_cast<float>(m);
  const double var = sq / static_cast<double>(cand.size());
  *stddev = flat_spread(lo, hi) ? 0.f : static_cast<float>(std::sqrt(var));
}

/// A query term found in a page: which term (its index in the query) and how often.
struct Match {
  int32_t term;
  int32_t tf;
};

/// Per-thread scratch, reused across the queries a thread runs.
struct Scratch {
  std::vector<float> query;  // the query scaled for overflow-safe cosines (cpu::prepare_query)
  std::vector<int32_t> query_kw;
  std::vector<int32_t> df;
  std::vector<float> idf;
  std::vector<int32_t> q_sorted;     // the query's term ids, ascending ...
  std::vector<int32_t> q_index;      // ... and each one's index in the query
  std::vector<Match> matches;        // the query terms each page holds, page after page ...
  std::vector<int32_t> match_start;  // ... page i's from match_start[i] (pages in visit order)
  std::vector<int32_t> walk;         // pool slot of page i (visit order: walk_pages) ...
  std::vector<int32_t> walk_seg;     // ... and its segment slot
  std::vector<float> lex;            // BM25 of page i (visit order)
  std::vector<float> best;           // the positive BM25 scores, for the L-th highest
  std::vector<float> seg_score;
  std::vector<int32_t> seg_id;
  std::vector<uint8_t> chosen;
  std::vector<int32_t> scored;       // walk positions whose cosine is computed
  std::vector<int64_t> fixed;        // BM25 sums in fixed point by walk position (postings)
  std::vector<Candidate> cand;
};

inline const float* f32(const void* p) { return static_cast<const float*>(p); }

/// Every live page of user `u`'s live segments, in segment slot then position order, into
/// sc.walk (pool slots) and sc.walk_seg (their segment slots). The later steps are plain loops
/// over these lists: a loop body in a lambda would be compiled out of line, outside the AVX2
/// clone of retrieve_one, and score every page's cosine with baseline instructions (measured:
/// a third of the pass at 2,000 pages a user).
void walk_pages(const SegmentView& seg, const PageView& pages, int64_t u, Scratch& sc) {
  sc.walk.clear();
  sc.walk_seg.clear();
  const int32_t cap = pages.table_width * pages.block_size;
  for (int32_t s = 0; s < seg.slots; ++s) {
    const int64_t row = u * seg.slots + s;
    if (!seg.live[row]) continue;
    const int32_t n = pages.npages[row] < cap ? pages.npages[row] : cap;
    const int32_t* table = pages.block_table + row * pages.table_width;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t block = table[i / pages.block_size];
      const int64_t slot = static_cast<int64_t>(block) * pages.block_size + i % pages.block_size;
      if (block < 0 || slot >= pages.num_pages || !pages.live[slot]) continue;
      sc.walk.push_back(static_cast<int32_t>(slot));
      sc.walk_seg.push_back(s);
    }
  }
}

/// Top-m segments by cos + w * Jaccard; returns how many were found.
MOS_CPU_CLONES
int top_segments(const cpu::PreparedQuery& pq, const int32_t* kq, int nk, const SegmentView& seg,
                 int64_t u, int d, const RetrievalParams& p, Scratch& sc) {
  const float* emb = f32(seg.emb);
  sc.seg_score.assign(p.top_segments, kNegInf);
  sc.seg_id.assign(p.top_segments, kNoId);
  int len = 0;
  for (int32_t s = 0; s < seg.slots; ++s) {
    const int64_t row = u * seg.slots + s;
    if (!seg.live[row]) continue;
    const float jac = jaccard_set_row(kq, nk, seg.keywords + row * seg.kw_width, seg.kw_width);
    const float score = segment_score(cpu::cosine(pq, emb + row * d, d), jac, p.keyword_weight);
    topk_insert(sc.seg_score.data(), sc.seg_id.data(), p.top_segments, &len, rank_score(score),
                s);
  }
  return len;
}

/// A 1,024-bit filter of a query's term ids (their low bits: the ids are hashes): a page term
/// whose bit is clear is no query term, so nearly every term of a page costs one test and a
/// query of 8 terms sends < 1 % of the others on to the binary search.
struct TermFilter {
  static constexpr uint32_t kWords = 16;
  uint64_t bits[kWords] = {};
  void add(int32_t id) {
    const uint32_t v = static_cast<uint32_t>(id);
    bits[(v >> 6) % kWords] |= uint64_t{1} << (v & 63u);
  }
  bool may_hold(int32_t id) const {
    const uint32_t v = static_cast<uint32_t>(id);
    return (bits[(v >> 6) % kWords] >> (v & 63u)) & 1u;
  }
};

/// The query's terms sorted (with their query indices) and their filter.
TermFilter prepare_terms(const int32_t* qt, int nq, Scratch& sc) {
  sc.q_index.resize(nq);
  for (int t = 0; t < nq; ++t) sc.q_index[t] = t;
  std::sort(sc.q_index.begin(), sc.q_index.end(), [qt](int32_t a, int32_t b) {
    return qt[a] < qt[b];
  });
  sc.q_sorted.resize(nq);
  TermFilter filter;
  for (int t = 0; t < nq; ++t) {
    sc.q_sorted[t] = qt[sc.q_index[t]];
    filter.add(sc.q_sorted[t]);
  }
  return filter;
}

/// Pages ahead whose term rows lexical_stats asks the memory for.
/// Pages ahead whose tf rows lexical_stats asks the memory for, and scored pages ahead whose
/// embedding rows the cosine loop asks for. A page's row lies wherever its page was written, so
/// the hardware sees no stream: in a perf profile at 2,000 pages a user the tf load of each
/// matching page was 23 % of the pass, the first line of each scored row most of the cosines'
/// 27 %. Both prefetches: ~20 % less a query there (medians of 25 alternated runs), neutral at
/// 20 pages a user.
constexpr size_t kRowPrefetch = 4;
constexpr size_t kEmbPrefetch = 4;

inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#endif
}

/// BM25's mean page length over N pages of `total` tokens (1 for none): one rule for the row
/// scan and the postings, whose scores must agree to the bit.
inline float mean_length(int64_t total, int32_t n) {
  return n > 0 && total > 0 ? static_cast<float>(static_cast<double>(total) / n) : 1.f;
}

/// One pass over the term rows of the walked pages: which query terms each page holds (in the
/// row's order: BM25 sums them in fixed point, where order does not matter), each term's
/// document frequency, N and the mean length.
void lexical_stats(const int32_t* qt, int nq, const LexicalView& lex, Scratch& sc,
                   int32_t* n_docs, float* avg_len) {
  const TermFilter filter = prepare_terms(qt, nq, sc);
  sc.df.assign(nq, 0);
  sc.matches.clear();
  sc.match_start.clear();
  int64_t total = 0;
  const size_t n_walk = sc.walk.size();
  for (size_t o = 0; o < n_walk; ++o) {
    const int32_t slot = sc.walk[o];
    if (o + kRowPrefetch < n_walk) prefetch(lex.tf + lex.start[sc.walk[o + kRowPrefetch]]);
    total += lex.length[slot];
    const size_t first = sc.matches.size();
    sc.match_start.push_back(static_cast<int32_t>(first));
    const int64_t start = lex.start[slot];
    const int32_t* row = lex.terms + start;
    for (int32_t j = 0; j < lex.count[slot]; ++j) {
      const int32_t id = row[j];
      if (!filter.may_hold(id)) continue;
      const int32_t at = find_term(sc.q_sorted.data(), nq, id);
      if (at < 0) continue;
      const int32_t t = sc.q_index[at];
      ++sc.df[t];
      sc.matches.push_back({t, lex.tf[start + j]});
    }
  }
  sc.match_start.push_back(static_cast<int32_t>(sc.matches.size()));
  const int32_t n = static_cast<int32_t>(sc.walk.size());
  *n_docs = n;
  *avg_len = mean_length(total, n);
}

/// BM25 of each page visited by lexical_stats (into sc.lex, zeroed, in visit order), from the
/// matches it recorded.
void bm25_from_matches(const LexicalView& lex, Scratch& sc, int32_t n_docs, float avg_len,
                       const RetrievalParams& p) {
  sc.idf.resize(sc.df.size());  // a term's idf is the query's, not the page's: once each
  for (size_t t = 0; t < sc.df.size(); ++t) sc.idf[t] = bm25_idf(n_docs, sc.df[t]);
  for (size_t o = 0; o < sc.walk.size(); ++o) {
    if (sc.match_start[o] == sc.match_start[o + 1]) continue;
    const int32_t len = lex.length[sc.walk[o]];
    int64_t sum = 0;
    for (int32_t i = sc.match_start[o]; i < sc.match_start[o + 1]; ++i) {
      const Match& m = sc.matches[i];
      sum += bm25_fixed(bm25_term(sc.idf[m.term], m.tf, len, avg_len, p.bm25_k1, p.bm25_b));
    }
    sc.lex[o] = bm25_from_fixed(sum);
  }
}

/// The same BM25 (into sc.lex, zeroed) from the user's postings: only the query's own terms'
/// pages are touched. N, the mean length and each df are the scan's integers, and the sums
/// are in fixed point, so the scores are lexical_stats + bm25_from_matches' to the bit.
void bm25_from_postings(const int32_t* qt, int nq, const LexicalView& lex,
                        const Postings& postings, const Postings::UserIndex& ix,
                        int64_t num_pages, Scratch& sc, const RetrievalParams& p) {
  prepare_terms(qt, nq, sc);
  // by pool slot: its walk position, else -1. Kept by the thread across batches (a batch's
  // Scratch is new, and filling a pool-sized array per batch would cost ~1 ms at 2M pages);
  // only the walk's entries are set, and they are reset below.
  thread_local std::vector<int32_t> walk_at;
  if (walk_at.size() < static_cast<size_t>(num_pages)) {
    walk_at.resize(static_cast<size_t>(num_pages), -1);
  }
  const size_t n = sc.walk.size();
  int64_t total = 0;
  for (size_t o = 0; o < n; ++o) {
    walk_at[sc.walk[o]] = static_cast<int32_t>(o);
    total += lex.length[sc.walk[o]];
  }
  const int32_t n_docs = static_cast<int32_t>(n);
  const float avg_len = mean_length(total, n_docs);
  sc.fixed.assign(n, 0);
  for (int t = 0; t < nq; ++t) {
    const int32_t id = sc.q_sorted[t];
    if (t > 0 && id == sc.q_sorted[t - 1]) continue;  // a repeated query term counts once
    const auto found = ix.lists.find(id);
    if (found == ix.lists.end()) continue;
    const std::vector<Posting>& list = found->second;
    int32_t df = 0;
    for (const Posting& e : list) df += postings.current(e) && walk_at[e.slot] >= 0;
    if (df == 0) continue;
    const float idf = bm25_idf(n_docs, df);
    for (const Posting& e : list) {
      const int32_t o = walk_at[e.slot];
      if (o < 0 || !postings.current(e)) continue;
      sc.fixed[o] += bm25_fixed(
          bm25_term(idf, e.tf, lex.length[e.slot], avg_len, p.bm25_k1, p.bm25_b));
    }
  }
  for (size_t o = 0; o < n; ++o) {
    if (sc.fixed[o] != 0) sc.lex[o] = bm25_from_fixed(sc.fixed[o]);
    walk_at[sc.walk[o]] = -1;
  }
}

/// The lowest BM25 that makes the lexical list: lexical_floor under the L-th highest of
/// sc.lex, or 0 when at most L pages match (then every match is in).
float list_floor(Scratch& sc, const RetrievalParams& p) {
  sc.best.clear();
  for (const float x : sc.lex) {
    if (x > 0.f) sc.best.push_back(x);
  }
  const size_t cap = static_cast<size_t>(p.lexical_candidates);
  if (cap == 0 || sc.best.size() <= cap) return 0.f;
  std::nth_element(sc.best.begin(), sc.best.begin() + (cap - 1), sc.best.end(),
                   std::greater<float>());
  return lexical_floor(sc.best[cap - 1]);
}

MOS_CPU_CLONES
void retrieve_one(const QueryBatch& q, const QueryTerms& terms, const SegmentView& seg,
                  const PageView& pages, const LexicalView& lex, const Postings* postings,
                  const RetrievalParams& p, RetrievalOut out, int64_t b, Scratch& sc) {
  float* o_score = out.score + b * out.k;
  int32_t* o_page = out.page + b * out.k;
  int32_t* o_seg = out.segment + b * out.k;
  std::fill(o_score, o_score + out.k, kNegInf);
  std::fill(o_page, o_page + out.k, kNoId);
  std::fill(o_seg, o_seg + out.k, kNoId);
  const int d = q.dim;
  const int64_t u = q.user[b];
  sc.query.resize(d);
  const cpu::PreparedQuery pq = cpu::prepare_query(q.emb + b * d, d, sc.query.data());
  if (!pq.ok) return;  // a query with NaN or infinity matches nothing (padded row)
  const int32_t* qt = terms.ids + terms.offsets[b];
  const int nq = static_cast<int>(terms.offsets[b + 1] - terms.offsets[b]);
  const int nk = std::min(nq, static_cast<int>(p.jaccard_terms));
  sc.query_kw.assign(qt, qt + nk);
  std::sort(sc.query_kw.begin(), sc.query_kw.end());  // distinct already: a sorted set

  const int m = top_segments(pq, sc.query_kw.data(), nk, seg, u, d, p, sc);
  sc.chosen.assign(seg.slots, 0);
  for (int j = 0; j < m; ++j) sc.chosen[sc.seg_id[j]] = 1;

  walk_pages(seg, pages, u, sc);
  const bool lexical = p.lexical_weight > 0.f && nq > 0;
  float lex_floor = 0.f;  // a page is a lexical candidate when its BM25 is > 0 and >= this
  sc.lex.assign(sc.walk.size(), 0.f);
  if (lexical) {
    const Postings::UserIndex* ix = postings != nullptr ? postings->user(u) : nullptr;
    if (ix != nullptr) {
      bm25_from_postings(qt, nq, lex, *postings, *ix, pages.num_pages, sc, p);
    } else {
      int32_t n_docs = 0;
      float avg_len = 1.f;
      lexical_stats(qt, nq, lex, sc, &n_docs, &avg_len);
      bm25_from_matches(lex, sc, n_docs, avg_len, p);
    }
    lex_floor = list_floor(sc, p);
  }

  const float* emb = f32(pages.emb);
  sc.scored.clear();  // the pages whose cosine counts: their segment was chosen, or listed
  for (size_t o = 0; o < sc.walk.size(); ++o) {
    const float lx = sc.lex[o];
    if (sc.chosen[sc.walk_seg[o]] || (lx > 0.f && lx >= lex_floor)) {
      sc.scored.push_back(static_cast<int32_t>(o));
    }
  }
  sc.cand.clear();
  for (size_t i = 0; i < sc.scored.size(); ++i) {
    if (i + kEmbPrefetch < sc.scored.size()) {  // the row's first lines; the rest stream in
      const float* next = emb + static_cast<int64_t>(sc.walk[sc.scored[i + kEmbPrefetch]]) * d;
      prefetch(next);
      prefetch(next + 16);
    }
    const size_t o = static_cast<size_t>(sc.scored[i]);
    const int32_t slot = sc.walk[o], s = sc.walk_seg[o];
    const float lx = sc.lex[o];
    const bool listed = lx > 0.f && lx >= lex_floor;
    const float cos = cpu::cosine(pq, emb + static_cast<int64_t>(slot) * d, d);
    if (cos != cos) continue;  // a stored row with NaN (outside the contract): never a candidate
    if (listed || cos >= p.dense_floor) sc.cand.push_back({slot, s, cos, lx});
  }
  if (sc.cand.empty()) return;
  float cm = 0.f, cs = 0.f, lm = 0.f, ls = 0.f;
  if (lexical) {
    moments(sc.cand, [](const Candidate& c) { return c.cosine; }, &cm, &cs);
    moments(sc.cand, [](const Candidate& c) { return c.lexical; }, &lm, &ls);
  }
  int len = 0;
  for (const Candidate& c : sc.cand) {
    topk_insert(o_score, o_page, out.k, &len,
                fused_score(c.cosine, cm, cs, c.lexical, lm, ls, lexical ? p.lexical_weight : 0.f),
                c.slot);
  }
  for (int j = 0; j < len; ++j) {  // the segment of each returned page
    for (const Candidate& c : sc.cand) {
      if (c.slot == o_page[j]) {
        o_seg[j] = c.segment;
        break;
      }
    }
  }
}

}  // namespace

void retrieve_cpu(const QueryBatch& q, const QueryTerms& terms, const SegmentView& seg,
                  const PageView& pages, const LexicalView& lex, const Postings* postings,
                  const RetrievalParams& params, RetrievalOut out) {
  // a query scores its user's segments and the pages of its top segments (dense; the table's
  // width is its largest segment's, so at most 16 pages a segment are counted), and the lexical
  // scan of its user's pages costs about as much again
  const long long per_segment =
      std::min<long long>(static_cast<long long>(pages.table_width) * pages.block_size, 16);
  const long long work =
      (static_cast<long long>(seg.slots) + 2LL * params.top_segments * per_segment) * q.dim;
#pragma omp parallel num_threads(cpu::team_size()) if (cpu::worth_a_team(q.size, work))
  {
    Scratch sc;
#pragma omp for schedule(dynamic, 8)
    for (int64_t b = 0; b < q.size; ++b) {
      retrieve_one(q, terms, seg, pages, lex, postings, params, out, b, sc);
    }
  }
}

void credit_served_cpu(const ServedHits& hits, HeatState state, const HeatParams& params) {
  // Serial: queries of one user in one batch may credit the same segment. Two passes, as on
  // CUDA: every credit of the batch lands, then heat and promotion flags are read from the
  // credited state (the queries of a batch are concurrent, so no query sees a partial batch).
  for (int64_t b = 0; b < hits.size; ++b) {
    const int64_t base = static_cast<int64_t>(hits.user[b]) * state.slots;
    for (int32_t j = 0; j < hits.k; ++j) {
      const int64_t at = b * hits.k + j;
      hits.credited[at] = 0;
      hits.promote[at] = 0;
      const int32_t s = hits.segment[at];
      if (s < 0 || s >= state.slots || !state.live[base + s]) continue;
      bool seen = false;
      for (int32_t i = 0; i < j && !seen; ++i) seen = hits.segment[b * hits.k + i] == s;
      if (seen) continue;
      const int64_t row = base + s;
      state.n_visit[row] += 1;
      if (hits.now[b] > state.last_access[row]) state.last_access[row] = hits.now[b];
      hits.credited[at] = 1;
    }
  }
  for (int64_t b = 0; b < hits.size; ++b) {
    const int64_t base = static_cast<int64_t>(hits.user[b]) * state.slots;
    for (int32_t j = 0; j < hits.k; ++j) {
      const int64_t at = b * hits.k + j;
      if (!hits.credited[at]) continue;
      const int64_t row = base + hits.segment[at];
      const float h = heat(params, state.n_visit[row], state.l_interaction[row], hits.now[b],
                           state.last_access[row]);
      state.heat[row] = h;
      hits.promote[at] = h >= params.tau && state.l_interaction[row] > 0;
    }
  }
}

}  // namespace memoryos
