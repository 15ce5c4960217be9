// memoryos-gpu: the fused retrieval pass on CUDA (contract in memoryos/retrieval.h; the CPU loop
// in csrc/cpu/retrieval_cpu.cpp is the readable version of the same steps).
//
// One CTA of 256 threads per query. The query's user owns at most S segment slots and their
// pages; the CTA walks them in a flat index space (segment prefix sums in shared memory), so
// every step is a strided loop over the CTA's threads with shared-memory reductions, and no
// intermediate result leaves the device. Two per-query scratch rows in global memory (sized by the
// caller to the batch's largest page count) hold the dense cosines and the fused scores.
//
//   1. query embedding and terms -> shared memory; |q|^2 by a block reduction;
//   2. segment scores (one warp per live segment: dot + norm over d, Jaccard on lane 0) -> top m
//      by m rounds of a warp arg-max (m is small);
//   3. BM25 statistics: N, total length and each query term's df over the user's live pages;
//   4. BM25 of every live page -> scratch; the lexical list's floor (bisection on the bits of
//      the L-th highest score);
//   5. cosines of the candidates (chosen segments' pages, the lexical list; one warp per page)
//      -> scratch; both signals' moments over the candidates -> fused scores;
//   6. top k by k rounds of a block arg-max under ranks_before (exactly the CPU's order).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

#include "memoryos/retrieval.h"

namespace memoryos {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
/// Query terms held in shared memory; the Python layer caps queries at this many (ops/retrieval).
constexpr int kMaxQueryTerms = 256;
constexpr int kMaxJaccardTerms = 64;

__device__ __forceinline__ float ld(float v) { return v; }
__device__ __forceinline__ float ld(__half v) { return __half2float(v); }
__device__ __forceinline__ float ld(__nv_bfloat16 v) { return __bfloat162float(v); }

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("memoryos_gpu CUDA error in ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

/// After a launch: the launch error always; with MEMORYOS_GPU_CUDA_SYNC=1 also wait for the
/// kernel, so a device fault is reported by the call that caused it.
void check_launch(cudaStream_t stream, const char* what) {
  check(cudaPeekAtLastError(), what);
  static const bool sync = [] {
    const char* v = std::getenv("MEMORYOS_GPU_CUDA_SYNC");
    return v != nullptr && v[0] == '1';
  }();
  if (sync) check(cudaStreamSynchronize(stream), what);
}

struct Shared {
  float red_f[kWarps];
  int32_t red_i[kWarps];
  int32_t n_docs;
  unsigned long long total_len;
  int32_t nq;
  int32_t nk;
  int32_t q_terms[kMaxQueryTerms];
  int32_t df[kMaxQueryTerms];
  int32_t kq[kMaxJaccardTerms];  // the first Jaccard terms, ascending
};

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

/// Block sum of one float per thread (every thread gets the result).
__device__ float block_sum(float v, Shared& sh) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sh.red_f[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < kWarps; ++w) t += sh.red_f[w];
  __syncthreads();
  return t;
}

/// Block maximum of one float per thread (every thread gets the result).
__device__ float block_max(float v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sh.red_f[warp] = v;
  __syncthreads();
  float m = sh.red_f[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, sh.red_f[w]);
  __syncthreads();
  return m;
}

/// Block arg-max of (score, id) under ranks_before; every thread gets the winner.
__device__ void block_best(float* score, int32_t* id, Shared& sh) {
  float s = *score;
  int32_t i = *id;
  for (int o = 16; o > 0; o >>= 1) {
    const float s2 = __shfl_xor_sync(kFull, s, o);
    const int32_t i2 = __shfl_xor_sync(kFull, i, o);
    if (i2 != kNoId && (i == kNoId || ranks_before(s2, i2, s, i))) {
      s = s2;
      i = i2;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sh.red_f[warp] = s;
    sh.red_i[warp] = i;
  }
  __syncthreads();
  s = -FLT_MAX;
  i = kNoId;
  for (int w = 0; w < kWarps; ++w) {
    if (sh.red_i[w] != kNoId && (i == kNoId || ranks_before(sh.red_f[w], sh.red_i[w], s, i))) {
      s = sh.red_f[w];
      i = sh.red_i[w];
    }
  }
  __syncthreads();
  *score = s;
  *id = i;
}

/// Pool slot of page position i of segment row `row`, or -1 when there is no live page.
__device__ int64_t page_slot(const PageView& pages, int64_t row, int32_t i) {
  const int32_t block = pages.block_table[row * pages.table_width + i / pages.block_size];
  const int64_t slot = static_cast<int64_t>(block) * pages.block_size + i % pages.block_size;
  if (block < 0 || slot >= pages.num_pages || !pages.live[slot]) return -1;
  return slot;
}

/// Flat page index -> (segment slot, position) through the prefix sums in `prefix` [S + 1].
__device__ void locate(const int32_t* prefix, int32_t slots, int32_t flat, int32_t* s, int32_t* i) {
  int32_t lo = 0, hi = slots;  // the last segment whose prefix <= flat
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= flat) lo = mid;
    else hi = mid - 1;
  }
  *s = lo;
  *i = flat - prefix[lo];
}

/// cos(q, row) by one warp (every lane gets it). A row whose squared norm falls outside
/// [2^-60, FLT_MAX] is summed again scaled by a power of two (exact), as on the CPU; a row
/// with NaN or infinity gives NaN.
template <typename T>
__device__ float cosine_warp(const float* qs, float q_norm, const T* row, int d) {
  float dot = 0.f, n = 0.f;
  for (int j = threadIdx.x & 31; j < d; j += 32) {
    const float v = ld(row[j]);
    dot += qs[j] * v;
    n += v * v;
  }
  n = warp_sum(n);
  dot = warp_sum(dot);
  if (norm_in_safe_range(n)) return cosine_from_sums(dot, q_norm, n);
  float m = 0.f;  // warp-uniform from here: n is the warp's sum
  bool finite = true;
  for (int j = threadIdx.x & 31; j < d; j += 32) {
    const float v = ld(row[j]);
    finite &= isfinite(v);
    m = fmaxf(m, fabsf(v));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
  if (!__all_sync(kFull, finite)) return NAN;
  if (m == 0.f) return 0.f;
  const Pow2Scale f = pow2_scale(pow2_exponent(m));
  dot = n = 0.f;
  for (int j = threadIdx.x & 31; j < d; j += 32) {
    const float v = (ld(row[j]) * f.f1) * f.f2;
    dot += qs[j] * v;
    n += v * v;
  }
  return cosine_from_sums(warp_sum(dot), q_norm, warp_sum(n));
}

__device__ float bm25_of(const LexicalView& lex, int64_t slot, const Shared& sh, float avg_len,
                         const RetrievalParams& p) {
  const int32_t* row = lex.terms + lex.start[slot];
  const int32_t n = lex.count[slot];
  int64_t sum = 0;
  for (int t = 0; t < sh.nq; ++t) {
    const int32_t at = find_term(row, n, sh.q_terms[t]);
    if (at < 0) continue;
    sum += bm25_fixed(bm25_term(bm25_idf(sh.n_docs, sh.df[t]), lex.tf[lex.start[slot] + at],
                                lex.length[slot], avg_len, p.bm25_k1, p.bm25_b));
  }
  return bm25_from_fixed(sum);
}

/// The lowest BM25 that makes the lexical list (retrieval.h: lexical_floor), block-uniform: 0
/// when at most `cap` pages match (or cap is 0), else the cap-th highest score less the tie
/// slack. The cap-th highest is the largest t with #(score >= t) >= cap; positive floats order
/// as their bit patterns, so t is found by bisection on the bits: 31 block counts.
__device__ float lexical_list_floor(const float* lexs, int32_t total, int32_t cap, Shared& sh) {
  if (cap <= 0) return 0.f;
  auto at_least = [&](float t) {
    float c = 0.f;
    for (int32_t f = threadIdx.x; f < total; f += kThreads) c += lexs[f] > 0.f && lexs[f] >= t;
    return block_sum(c, sh);  // exact: counts stay far below 2^24
  };
  if (at_least(0.f) <= static_cast<float>(cap)) return 0.f;
  uint32_t lo = 1u, hi = 0x7f800000u;  // #(>= lo) >= cap > #(>= hi): the smallest subnormal, inf
  while (hi - lo > 1u) {
    const uint32_t mid = lo + (hi - lo) / 2u;
    if (at_least(__uint_as_float(mid)) >= static_cast<float>(cap)) lo = mid;
    else hi = mid;
  }
  return lexical_floor(__uint_as_float(lo));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
retrieve_kernel(QueryBatch q, QueryTerms terms, SegmentView seg, PageView pages, LexicalView lex,
                RetrievalParams p, RetrievalOut out, float* scratch, int32_t scratch_width) {
  extern __shared__ __align__(16) unsigned char dyn[];
  float* qs = reinterpret_cast<float*>(dyn);                        // [d]
  float* seg_score = qs + q.dim;                                     // [S]
  int32_t* prefix = reinterpret_cast<int32_t*>(seg_score + seg.slots);  // [S + 1]
  int32_t* is_chosen = prefix + seg.slots + 1;                       // [S]
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* o_score = out.score + b * out.k;
  int32_t* o_page = out.page + b * out.k;
  int32_t* o_seg = out.segment + b * out.k;
  for (int j = tid; j < out.k; j += kThreads) {
    o_score[j] = -INFINITY;
    o_page[j] = kNoId;
    o_seg[j] = kNoId;
  }
  const int64_t u = q.user[b];
  if (u < 0 || u >= seg.num_users || u >= pages.num_users) return;
  const T* seg_emb = static_cast<const T*>(seg.emb);
  const T* page_emb = static_cast<const T*>(pages.emb);
  float* coss = scratch + b * 2 * static_cast<int64_t>(scratch_width);  // cosine or NaN
  float* lexs = coss + scratch_width;                                    // BM25, then fused

  // 1. query: a NaN or infinite one matches nothing; an extreme one is scaled by a power of two
  //    (exact: no cosine changes) so that its squared norm cannot overflow, as on the CPU
  float qm = 0.f;
  bool q_finite = true;
  for (int j = tid; j < q.dim; j += kThreads) {
    const float v = q.emb[b * q.dim + j];
    qs[j] = v;
    q_finite &= isfinite(v);
    qm = fmaxf(qm, fabsf(v));
  }
  if (__syncthreads_or(!q_finite)) return;
  qm = block_max(qm, sh);
  if (!(qm >= 0x1p-32f && qm <= 0x1p32f) && qm > 0.f) {
    const Pow2Scale f = pow2_scale(pow2_exponent(qm));
    for (int j = tid; j < q.dim; j += kThreads) qs[j] = (qs[j] * f.f1) * f.f2;
  }
  __syncthreads();
  float qn = 0.f;
  for (int j = tid; j < q.dim; j += kThreads) qn += qs[j] * qs[j];
  const float q_norm = block_sum(qn, sh);
  if (tid == 0) {
    const int64_t lo = terms.offsets[b], hi = terms.offsets[b + 1];
    sh.nq = static_cast<int32_t>(hi - lo < kMaxQueryTerms ? hi - lo : kMaxQueryTerms);
    for (int t = 0; t < sh.nq; ++t) sh.q_terms[t] = terms.ids[lo + t];
    sh.nk = sh.nq < p.jaccard_terms ? sh.nq : p.jaccard_terms;
    if (sh.nk > kMaxJaccardTerms) sh.nk = kMaxJaccardTerms;
    for (int t = 0; t < sh.nk; ++t) {  // insertion sort of the first nk terms
      int32_t v = sh.q_terms[t];
      int j = t;
      while (j > 0 && sh.kq[j - 1] > v) {
        sh.kq[j] = sh.kq[j - 1];
        --j;
      }
      sh.kq[j] = v;
    }
    sh.n_docs = 0;
    sh.total_len = 0;
  }
  for (int t = tid; t < kMaxQueryTerms; t += kThreads) sh.df[t] = 0;
  __syncthreads();

  // 2. segments: one warp per live slot
  for (int32_t s = warp; s < seg.slots; s += kWarps) {
    const int64_t row = u * seg.slots + s;
    float score = -INFINITY;
    if (seg.live[row]) {
      const float cos = cosine_warp(qs, q_norm, seg_emb + row * q.dim, q.dim);
      float jac = 0.f;
      if (lane == 0) jac = jaccard_set_row(sh.kq, sh.nk, seg.keywords + row * seg.kw_width,
                                           seg.kw_width);
      score = rank_score(segment_score(cos, jac, p.keyword_weight));
    }
    if (lane == 0) {
      seg_score[s] = score;
      is_chosen[s] = 0;
    }
  }
  __syncthreads();
  // top m by m rounds of a warp arg-max; ties to the lower slot. Slot s is only ever read and
  // written by lane s % 32 here, so the rounds share no memory between lanes (any m).
  if (warp == 0) {
    for (int r = 0; r < p.top_segments; ++r) {
      float bs = -INFINITY;
      int32_t bi = kNoId;
      for (int32_t s = lane; s < seg.slots; s += 32) {
        const float v = seg_score[s];
        if (v != -INFINITY && (bi == kNoId || ranks_before(v, s, bs, bi))) {
          bs = v;
          bi = s;
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float s2 = __shfl_xor_sync(kFull, bs, o);
        const int32_t i2 = __shfl_xor_sync(kFull, bi, o);
        if (i2 != kNoId && (bi == kNoId || ranks_before(s2, i2, bs, bi))) {
          bs = s2;
          bi = i2;
        }
      }
      if (bi == kNoId) break;
      if (lane == (bi & 31)) {
        is_chosen[bi] = 1;
        seg_score[bi] = -INFINITY;
      }
    }
  }
  __syncthreads();

  // page positions of every live segment (prefix sums over the slots)
  if (tid == 0) {
    const int32_t cap = pages.table_width * pages.block_size;
    int32_t acc = 0;
    for (int32_t s = 0; s < seg.slots; ++s) {
      prefix[s] = acc;
      const int64_t row = u * seg.slots + s;
      if (seg.live[row]) acc += pages.npages[row] < cap ? pages.npages[row] : cap;
    }
    prefix[seg.slots] = acc;
  }
  __syncthreads();
  const int32_t total = prefix[seg.slots] < scratch_width ? prefix[seg.slots] : scratch_width;
  const bool lexical = p.lexical_weight > 0.f && sh.nq > 0;

  // 3. BM25 statistics
  if (lexical) {
    for (int32_t f = tid; f < total; f += kThreads) {
      int32_t s, i;
      locate(prefix, seg.slots, f, &s, &i);
      const int64_t slot = page_slot(pages, u * seg.slots + s, i);
      if (slot < 0) continue;
      atomicAdd(&sh.n_docs, 1);
      atomicAdd(&sh.total_len, static_cast<unsigned long long>(lex.length[slot]));
      const int32_t* row = lex.terms + lex.start[slot];
      for (int t = 0; t < sh.nq; ++t)
        if (find_term(row, lex.count[slot], sh.q_terms[t]) >= 0) atomicAdd(&sh.df[t], 1);
    }
  }
  __syncthreads();
  const float avg_len = sh.n_docs > 0 && sh.total_len > 0
                            ? static_cast<float>(static_cast<double>(sh.total_len) / sh.n_docs)
                            : 1.f;

  // 4. BM25 of every live page (0 when none matches, -1 when the position holds no page)
  for (int32_t f = tid; f < total; f += kThreads) {
    int32_t s, i;
    locate(prefix, seg.slots, f, &s, &i);
    const int64_t slot = page_slot(pages, u * seg.slots + s, i);
    lexs[f] = slot < 0 ? -1.f : (lexical ? bm25_of(lex, slot, sh, avg_len, p) : 0.f);
  }
  __syncthreads();
  const float lex_floor =
      lexical ? lexical_list_floor(lexs, total, p.lexical_candidates, sh) : 0.f;
  // 5. cosines of the candidates' pages (chosen segments, or the lexical list), one warp per
  //    page; a page that is no candidate gets NaN
  for (int32_t f = warp; f < total; f += kWarps) {
    int32_t s, i;
    locate(prefix, seg.slots, f, &s, &i);
    const float lx = lexs[f];
    const bool listed = lx > 0.f && lx >= lex_floor;
    float cos = NAN;
    if (lx >= 0.f && (is_chosen[s] || listed)) {
      const int64_t slot = page_slot(pages, u * seg.slots + s, i);
      const float c = cosine_warp(qs, q_norm, page_emb + slot * q.dim, q.dim);
      if (c == c && (listed || c >= p.dense_floor)) cos = c;  // NaN: never a candidate
    }
    if (lane == 0) coss[f] = cos;
  }
  __syncthreads();
  // moments of both signals over the candidates (two passes: mean, then squared deviations)
  float n = 0.f, c_sum = 0.f, l_sum = 0.f, c_lo = INFINITY, c_hi = -INFINITY, l_lo = INFINITY,
        l_hi = -INFINITY;
  for (int32_t f = tid; f < total; f += kThreads) {
    const float c = coss[f];
    if (isnan(c)) continue;
    n += 1.f;
    c_sum += c;
    l_sum += lexs[f];
    c_lo = fminf(c_lo, c);
    c_hi = fmaxf(c_hi, c);
    l_lo = fminf(l_lo, lexs[f]);
    l_hi = fmaxf(l_hi, lexs[f]);
  }
  n = block_sum(n, sh);
  if (n == 0.f) return;  // block-uniform: no candidate, the row stays padded
  const float c_mean = block_sum(c_sum, sh) / n, l_mean = block_sum(l_sum, sh) / n;
  const bool c_flat = flat_spread(-block_max(-c_lo, sh), block_max(c_hi, sh));
  const bool l_flat = flat_spread(-block_max(-l_lo, sh), block_max(l_hi, sh));
  float c_sq = 0.f, l_sq = 0.f;
  for (int32_t f = tid; f < total; f += kThreads) {
    const float c = coss[f];
    if (isnan(c)) continue;
    c_sq += (c - c_mean) * (c - c_mean);
    l_sq += (lexs[f] - l_mean) * (lexs[f] - l_mean);
  }
  const float c_std = c_flat ? 0.f : sqrtf(block_sum(c_sq, sh) / n);
  const float l_std = l_flat ? 0.f : sqrtf(block_sum(l_sq, sh) / n);
  const float weight = lexical ? p.lexical_weight : 0.f;
  for (int32_t f = tid; f < total; f += kThreads) {
    const float c = coss[f];
    lexs[f] = isnan(c) ? -INFINITY : fused_score(c, c_mean, c_std, lexs[f], l_mean, l_std, weight);
  }
  __syncthreads();
  float* fused = lexs;

  // 6. top k: k rounds of a block arg-max over (fused score, pool slot)
  for (int r = 0; r < out.k; ++r) {
    float bs = -INFINITY;
    int32_t bi = kNoId, bf = -1;
    for (int32_t f = tid; f < total; f += kThreads) {
      const float v = fused[f];
      if (v == -INFINITY) continue;
      int32_t s, i;
      locate(prefix, seg.slots, f, &s, &i);
      const int32_t slot = static_cast<int32_t>(page_slot(pages, u * seg.slots + s, i));
      if (bi == kNoId || ranks_before(v, slot, bs, bi)) {
        bs = v;
        bi = slot;
        bf = f;
      }
    }
    float ws = bs;
    int32_t wi = bi;
    block_best(&ws, &wi, sh);
    if (wi == kNoId) break;
    if (bi == wi && bf >= 0) {  // the thread that holds the winner records and removes it
      int32_t s, i;
      locate(prefix, seg.slots, bf, &s, &i);
      o_score[r] = ws;
      o_page[r] = wi;
      o_seg[r] = s;
      fused[bf] = -INFINITY;
    }
    __syncthreads();
  }
}

/// One thread per query: N_visit and last_access of each served segment, once per query.
__global__ void credit_kernel(ServedHits hits, HeatState state) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= hits.size) return;
  const int32_t u = hits.user[b];
  for (int32_t j = 0; j < hits.k; ++j) {
    const int64_t at = b * hits.k + j;
    hits.credited[at] = 0;
    hits.promote[at] = 0;
    const int32_t s = hits.segment[at];
    if (u < 0 || u >= state.num_users || s < 0 || s >= state.slots) continue;
    const int64_t row = static_cast<int64_t>(u) * state.slots + s;
    if (!state.live[row]) continue;
    bool seen = false;
    for (int32_t i = 0; i < j && !seen; ++i) seen = hits.segment[b * hits.k + i] == s;
    if (seen) continue;
    atomicAdd(&state.n_visit[row], 1);
    auto* addr = reinterpret_cast<unsigned long long*>(&state.last_access[row]);
    unsigned long long old = *addr;
    while (__longlong_as_double(static_cast<long long>(old)) < hits.now[b]) {
      const unsigned long long got =
          atomicCAS(addr, old, static_cast<unsigned long long>(__double_as_longlong(hits.now[b])));
      if (got == old) break;
      old = got;
    }
    hits.credited[at] = 1;
  }
}

/// After every credit landed: heat of the credited segments and their promotion flags.
__global__ void promote_kernel(ServedHits hits, HeatState state, HeatParams params) {
  const int64_t at = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (at >= hits.size * hits.k || !hits.credited[at]) return;
  const int64_t b = at / hits.k;
  const int64_t row = static_cast<int64_t>(hits.user[b]) * state.slots + hits.segment[at];
  const float h = heat(params, state.n_visit[row], state.l_interaction[row], hits.now[b],
                       state.last_access[row]);
  state.heat[row] = h;  // the same value from every query that credited the row (recency 1)
  hits.promote[at] = h >= params.tau && state.l_interaction[row] > 0;
}

cudaStream_t as_stream(int64_t stream) {
  return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream));
}

}  // namespace

void retrieve_cuda(const QueryBatch& q, const QueryTerms& terms, const SegmentView& seg,
                   const PageView& pages, const LexicalView& lex, const RetrievalParams& params,
                   RetrievalOut out, float* scratch, int32_t scratch_width, int64_t stream) {
  if (q.size > INT32_MAX) throw std::runtime_error("batch too large for one launch");
  const size_t smem = sizeof(float) * (q.dim + seg.slots) + sizeof(int32_t) * (2 * seg.slots + 1);
  const cudaStream_t s = as_stream(stream);
  auto launch = [&](auto kernel) {
    if (smem > 48 * 1024) {  // the opt-in limit, raised once per size under a lock, never lowered
      static std::mutex mu;
      static size_t raised = 0;
      std::lock_guard<std::mutex> lock(mu);
      if (smem > raised) {
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(smem)),
              "retrieve: shared memory");
        raised = smem;
      }
    }
    kernel<<<static_cast<unsigned>(q.size), kThreads, smem, s>>>(q, terms, seg, pages, lex, params,
                                                                out, scratch, scratch_width);
  };
  switch (seg.dtype) {
    case EmbDtype::kFloat32: launch(retrieve_kernel<float>); break;
    case EmbDtype::kFloat16: launch(retrieve_kernel<__half>); break;
    case EmbDtype::kBFloat16: launch(retrieve_kernel<__nv_bfloat16>); break;
  }
  check_launch(s, "retrieve");
}

void credit_served_cuda(const ServedHits& hits, HeatState state, const HeatParams& params,
                        int64_t stream) {
  const cudaStream_t s = as_stream(stream);
  const unsigned per_query = static_cast<unsigned>((hits.size + 255) / 256);
  credit_kernel<<<per_query, 256, 0, s>>>(hits, state);
  check_launch(s, "credit_served");
  const unsigned per_hit = static_cast<unsigned>((hits.size * hits.k + 255) / 256);
  promote_kernel<<<per_hit, 256, 0, s>>>(hits, state, params);
  check_launch(s, "credit_served: promote");
}

}  // namespace memoryos
