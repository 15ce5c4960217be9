// memoryos-gpu: CPU kernels. One OpenMP task per query (or per user for heat): queries in a
// batch belong to different users, so their memory never overlaps and no locking is needed.
// Every index is bounds-checked here, with the CUDA kernels' meaning: an out-of-range user or
// owner slot gets a padded row, an out-of-range segment slot or hit is skipped.
#include <limits>
#include <vector>

#include "memoryos/kernels.h"
#include "threads.h"
#include "vector_math.h"

namespace memoryos {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A loop runs on the calling thread unless its batch holds enough work (cpu::worth_a_team):
// waking an OpenMP team costs more than small work, and on an oversubscribed machine a sleeping
// team can take a whole scheduler time slice (~10 ms measured here) to start.

/// The CPU path stores fp32 only (the bindings reject other dtypes before we get here).
inline const float* emb_f32(const void* base) { return static_cast<const float*>(base); }

inline void fill_topk(TopK out, int64_t b) {
  for (int j = 0; j < out.k; ++j) {
    out.scores[b * out.k + j] = kNegInf;
    out.ids[b * out.k + j] = kNoId;
  }
}

/// Per-query scratch: the scaled query and the query's keyword set (one allocation per call of
/// a query body, reused by all candidates).
struct Scratch {
  std::vector<float> q;
  std::vector<int32_t> kw;
};

MOS_CPU_CLONES
void score_one_query(const QueryBatch& q, const SegmentView& seg, float keyword_weight, TopK out,
                     int64_t b, Scratch& scratch) {
  const int d = q.dim;
  const float* seg_emb = emb_f32(seg.emb);
  fill_topk(out, b);
  const int64_t u = q.user[b];
  if (u < 0 || u >= seg.num_users) return;
  const cpu::PreparedQuery pq = cpu::prepare_query(q.emb + b * d, d, scratch.q.data());
  if (!pq.ok) return;
  const int nq = q.kw_width > 0 ? keyword_set(q.keywords + b * q.kw_width, q.kw_width,
                                              scratch.kw.data())
                                : 0;
  int len = 0;
  for (int s = 0; s < seg.slots; ++s) {
    const int64_t row = u * seg.slots + s;
    if (!seg.live[row]) continue;
    const float jac =
        nq > 0 ? jaccard_set_row(scratch.kw.data(), nq, seg.keywords + row * seg.kw_width,
                                 seg.kw_width)
               : 0.f;
    const float score = segment_score(cpu::cosine(pq, seg_emb + row * d, d), jac, keyword_weight);
    topk_insert(out.scores + b * out.k, out.ids + b * out.k, out.k, &len, rank_score(score), s);
  }
}

/// Whether chosen segment c of a query repeats an earlier one (a segment counts once).
inline bool repeated(const int32_t* chosen, int c) { return !first_occurrence(chosen, c); }

MOS_CPU_CLONES
void select_one_query(const QueryBatch& q, const int32_t* chosen, int32_t chosen_width,
                      const PageView& pages, float min_score, TopK out, int64_t b,
                      Scratch& scratch) {
  const int d = q.dim;
  const float* page_emb = emb_f32(pages.emb);
  fill_topk(out, b);
  const int64_t u = q.user[b];
  if (u < 0 || u >= pages.num_users) return;
  const cpu::PreparedQuery pq = cpu::prepare_query(q.emb + b * d, d, scratch.q.data());
  if (!pq.ok) return;
  const int32_t* mine = chosen + b * chosen_width;
  int len = 0;
  for (int c = 0; c < chosen_width; ++c) {
    const int32_t s = mine[c];
    if (s < 0 || s >= pages.slots || repeated(mine, c)) continue;
    const int64_t row = u * pages.slots + s;
    const int32_t cap = pages.table_width * pages.block_size;
    const int32_t n = pages.npages[row] < cap ? pages.npages[row] : cap;
    const int32_t* table = pages.block_table + row * pages.table_width;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t block = table[i / pages.block_size];
      const int64_t slot = static_cast<int64_t>(block) * pages.block_size + i % pages.block_size;
      if (block < 0 || slot >= pages.num_pages || !pages.live[slot]) continue;
      const float score = rank_score(cpu::cosine(pq, page_emb + slot * d, d));
      if (score < min_score) continue;
      topk_insert(out.scores + b * out.k, out.ids + b * out.k, out.k, &len, score,
                  static_cast<int32_t>(slot));
    }
  }
}

MOS_CPU_CLONES
void knowledge_one_query(const QueryBatch& q, const KnowledgeView& kn, TopK out, int64_t b,
                         Scratch& scratch) {
  const int d = q.dim;
  const float* kn_emb = emb_f32(kn.emb);
  fill_topk(out, b);
  const int64_t o = q.user[b];
  if (o < 0 || o >= kn.num_owners) return;
  const cpu::PreparedQuery pq = cpu::prepare_query(q.emb + b * d, d, scratch.q.data());
  if (!pq.ok) return;
  const int64_t base = o * kn.capacity;
  int len = 0;
  for (int32_t e = 0; e < kn.capacity; ++e) {
    if (!kn.live[base + e]) continue;
    topk_insert(out.scores + b * out.k, out.ids + b * out.k, out.k, &len,
                rank_score(cpu::cosine(pq, kn_emb + (base + e) * d, d)), e);
  }
}

/// Runs body(b, scratch) for every query, on an OpenMP team when the batch holds enough work
/// (`per_query` multiply-adds a query, see cpu::worth_a_team); each thread owns one Scratch.
template <typename Body>
void for_each_query(const QueryBatch& q, long long per_query, Body body) {
#pragma omp parallel num_threads(cpu::team_size()) if (cpu::worth_a_team(q.size, per_query))
  {
    Scratch scratch{std::vector<float>(q.dim > 0 ? q.dim : 1),
                    std::vector<int32_t>(q.kw_width > 0 ? q.kw_width : 1)};
#pragma omp for schedule(dynamic, 8)
    for (int64_t b = 0; b < q.size; ++b) body(b, scratch);
  }
}

/// The cosines of rows[0, n) with q through cpu::cosine, inlined into one wrapper per ISA (not
/// cloned: each wrapper is pinned to its target, so the self-check can run both on one CPU).
MOS_CPU_INLINE void cosines_body(const float* q, const float* rows, int64_t n, int d,
                                 float* out) {
  std::vector<float> scratch(d > 0 ? d : 1);
  const cpu::PreparedQuery pq = cpu::prepare_query(q, d, scratch.data());
  for (int64_t r = 0; r < n; ++r) out[r] = pq.ok ? cpu::cosine(pq, rows + r * d, d) : 0.f;
}

void cosines_baseline(const float* q, const float* rows, int64_t n, int d, float* out) {
  cosines_body(q, rows, n, d, out);
}

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#define MOS_HAS_AVX2_BUILD 1
__attribute__((target("avx2"))) void cosines_avx2(const float* q, const float* rows, int64_t n,
                                                  int d, float* out) {
  cosines_body(q, rows, n, d, out);
}
#endif

}  // namespace

void score_segments_cpu(const QueryBatch& q, const SegmentView& seg, float keyword_weight,
                        TopK out) {
  const long long work = static_cast<long long>(seg.slots) * q.dim;
  for_each_query(q, work, [&](int64_t b, Scratch& s) {
    score_one_query(q, seg, keyword_weight, out, b, s);
  });
}

void select_pages_cpu(const QueryBatch& q, const int32_t* chosen, int32_t chosen_width,
                      const PageView& pages, float min_score, TopK out) {
  const long long work = static_cast<long long>(chosen_width) * pages.block_size * q.dim;
  for_each_query(q, work, [&](int64_t b, Scratch& s) {
    select_one_query(q, chosen, chosen_width, pages, min_score, out, b, s);
  });
}

void apply_hits_cpu(const HitList& hits, HeatState state) {
  // Serial: a batch may hit the same segment twice, and hits are few compared with scoring.
  for (int64_t h = 0; h < hits.size; ++h) {
    const int32_t u = hits.user[h], s = hits.slot[h];
    if (u < 0 || u >= state.num_users || s < 0 || s >= state.slots) continue;
    const int64_t row = static_cast<int64_t>(u) * state.slots + s;
    if (!state.live[row]) continue;
    state.n_visit[row] += 1;
    if (hits.now[h] > state.last_access[row]) state.last_access[row] = hits.now[h];
  }
}

void recompute_heat_cpu(const HeatRecompute& req, HeatState state, const HeatParams& params) {
  // a row walks its user's slots: a few dozen operations each (the heat's exp among them)
#pragma omp parallel for num_threads(cpu::team_size()) schedule(static) \
    if (cpu::worth_a_team(req.size, 32LL * state.slots))
  for (int64_t r = 0; r < req.size; ++r) {
    const int64_t u = req.user[r];
    const bool valid = u >= 0 && u < state.num_users;
    const int64_t base = u * state.slots;
    int32_t victim = kNoId;
    float victim_key = 0.f;
    for (int32_t s = 0; s < state.slots; ++s) {
      const int64_t row = base + s;
      uint8_t promote = 0;
      if (valid && state.live[row]) {
        const float h = heat(params, state.n_visit[row], state.l_interaction[row], req.now[r],
                             state.last_access[row]);
        state.heat[row] = h;
        promote = h >= params.tau;
        const float key = req.evict_by_visits ? static_cast<float>(state.n_visit[row]) : h;
        if (victim == kNoId || evicts_before(key, s, victim_key, victim)) {
          victim = s;
          victim_key = key;
        }
      }
      req.promote[r * state.slots + s] = promote;
    }
    req.evict_slot[r] = req.need_evict[r] ? victim : kNoId;
  }
}

void knowledge_topk_cpu(const QueryBatch& q, const KnowledgeView& kn, TopK out) {
  const long long work = static_cast<long long>(kn.capacity) * q.dim;
  for_each_query(q, work, [&](int64_t b, Scratch& s) { knowledge_one_query(q, kn, out, b, s); });
}

}  // namespace memoryos

namespace memoryos {

int cpu_cosines_per_isa(const float* q, const float* rows, int64_t n, int d, float* out) {
  cosines_baseline(q, rows, n, d, out);
#if defined(MOS_HAS_AVX2_BUILD)
  if (__builtin_cpu_supports("avx2")) {
    cosines_avx2(q, rows, n, d, out + n);
    return 2;
  }
#endif
  return 1;
}

}  // namespace memoryos
