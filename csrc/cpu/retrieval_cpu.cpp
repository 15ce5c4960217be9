// memoryos-gpu: the fused retrieval pass on the CPU (see memoryos/retrieval.h). One OpenMP task
// per query: a query reads only its own user's rows, so queries never share writable memory.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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
/// when the signal is equal on all of them.
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
  *stddev = hi > lo ? static_cast<float>(std::sqrt(sq / static_cast<double>(cand.size()))) : 0.f;
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
  std::vector<int32_t> q_sorted;     // the query's term ids, ascending ...
  std::vector<int32_t> q_index;      // ... and each one's index in the query
  std::vector<Match> matches;        // the query terms each page holds, page after page ...
  std::vector<int32_t> match_start;  // ... page i's from match_start[i] (pages in visit order)
  std::vector<float> seg_score;
  std::vector<int32_t> seg_id;
  std::vector<uint8_t> chosen;
  std::vector<Candidate> cand;
};

inline const float* f32(const void* p) { return static_cast<const float*>(p); }

/// Visit every live page of user `u`'s live segments: fn(pool slot, segment slot).
template <typename Fn>
inline void for_each_page(const SegmentView& seg, const PageView& pages, int64_t u, Fn&& fn) {
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
      fn(static_cast<int32_t>(slot), s);
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

/// The query's terms sorted (with their query indices) and a 64-bit filter of them: a page
/// term whose bit is clear is no query term, so most of a page's terms cost one test.
uint64_t prepare_terms(const int32_t* qt, int nq, Scratch& sc) {
  sc.q_index.resize(nq);
  for (int t = 0; t < nq; ++t) sc.q_index[t] = t;
  std::sort(sc.q_index.begin(), sc.q_index.end(), [qt](int32_t a, int32_t b) {
    return qt[a] < qt[b];
  });
  sc.q_sorted.resize(nq);
  uint64_t filter = 0;
  for (int t = 0; t < nq; ++t) {
    sc.q_sorted[t] = qt[sc.q_index[t]];
    filter |= uint64_t{1} << (static_cast<uint32_t>(sc.q_sorted[t]) & 63u);
  }
  return filter;
}

/// One pass over the user's pages: which query terms each page holds (kept for bm25 in the
/// query's term order, as the formula sums them), each term's document frequency, N and the
/// mean length.
void lexical_stats(const int32_t* qt, int nq, const SegmentView& seg, const PageView& pages,
                   const LexicalView& lex, int64_t u, Scratch& sc, int32_t* n_docs,
                   float* avg_len) {
  const uint64_t filter = prepare_terms(qt, nq, sc);
  sc.df.assign(nq, 0);
  sc.matches.clear();
  sc.match_start.clear();
  int64_t total = 0;
  int32_t n = 0;
  for_each_page(seg, pages, u, [&](int32_t slot, int32_t) {
    ++n;
    total += lex.length[slot];
    const size_t first = sc.matches.size();
    sc.match_start.push_back(static_cast<int32_t>(first));
    const int64_t start = lex.start[slot];
    const int32_t* row = lex.terms + start;
    for (int32_t j = 0; j < lex.count[slot]; ++j) {
      const int32_t id = row[j];
      if (!((filter >> (static_cast<uint32_t>(id) & 63u)) & 1u)) continue;
      const int32_t at = find_term(sc.q_sorted.data(), nq, id);
      if (at < 0) continue;
      const int32_t t = sc.q_index[at];
      ++sc.df[t];
      sc.matches.push_back({t, lex.tf[start + j]});
    }
    std::sort(sc.matches.begin() + first, sc.matches.end(),
              [](const Match& a, const Match& b) { return a.term < b.term; });
  });
  sc.match_start.push_back(static_cast<int32_t>(sc.matches.size()));
  *n_docs = n;
  *avg_len = n > 0 && total > 0 ? static_cast<float>(static_cast<double>(total) / n) : 1.f;
}

/// BM25 of the page visited `ordinal`-th by lexical_stats, from the matches it recorded.
inline float bm25(int32_t ordinal, const LexicalView& lex, int32_t slot, const Scratch& sc,
                  int32_t n_docs, float avg_len, const RetrievalParams& p) {
  float score = 0.f;
  for (int32_t i = sc.match_start[ordinal]; i < sc.match_start[ordinal + 1]; ++i) {
    const Match& m = sc.matches[i];
    score += bm25_term(bm25_idf(n_docs, sc.df[m.term]), m.tf, lex.length[slot], avg_len,
                       p.bm25_k1, p.bm25_b);
  }
  return score;
}

MOS_CPU_CLONES
void retrieve_one(const QueryBatch& q, const QueryTerms& terms, const SegmentView& seg,
                  const PageView& pages, const LexicalView& lex, const RetrievalParams& p,
                  RetrievalOut out, int64_t b, Scratch& sc) {
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

  const bool lexical = p.lexical_weight > 0.f && nq > 0;
  int32_t n_docs = 0;
  float avg_len = 1.f;
  if (lexical) lexical_stats(qt, nq, seg, pages, lex, u, sc, &n_docs, &avg_len);

  const float* emb = f32(pages.emb);
  sc.cand.clear();
  int32_t ordinal = 0;  // pages come in lexical_stats' order
  for_each_page(seg, pages, u, [&](int32_t slot, int32_t s) {
    const float lx = lexical ? bm25(ordinal++, lex, slot, sc, n_docs, avg_len, p) : 0.f;
    if (!sc.chosen[s] && !(lx > 0.f)) return;
    const float cos = cpu::cosine(pq, emb + static_cast<int64_t>(slot) * d, d);
    if (cos != cos) return;  // a stored row with NaN (outside the contract): never a candidate
    if (lx > 0.f || cos >= p.dense_floor) sc.cand.push_back({slot, s, cos, lx});
  });
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
                  const PageView& pages, const LexicalView& lex, const RetrievalParams& params,
                  RetrievalOut out) {
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
    for (int64_t b = 0; b < q.size; ++b) retrieve_one(q, terms, seg, pages, lex, params, out, b, sc);
  }
}

void credit_served_cpu(const ServedHits& hits, HeatState state, const HeatParams& params) {
  // Serial: queries of one user in one batch may credit the same segment.
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
      const float h = heat(params, state.n_visit[row], state.l_interaction[row], hits.now[b],
                           state.last_access[row]);
      state.heat[row] = h;
      hits.credited[at] = 1;
      hits.promote[at] = h >= params.tau && state.l_interaction[row] > 0;
    }
  }
}

}  // namespace memoryos
