// memoryos-gpu: the MemoryOS formulas, written once for host and device.
//
// Every kernel (CPU loops in csrc/cpu, CUDA in csrc/cuda) computes its scores through these
// functions, so both paths are the same arithmetic by construction. The NumPy oracle in
// memoryos_gpu/ops/reference.py restates them in plain Python for the tests.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MOS_HD __host__ __device__ __forceinline__
#else
#define MOS_HD inline
#endif

namespace memoryos {

/// Padding value of keyword-id rows. Real ids are 31-bit hashes (>= 0), sorted ascending;
/// a row ends at the first pad or at its width.
constexpr int32_t kKeywordPad = -1;

/// Padding of id outputs ("no result"). Score outputs are padded with -infinity.
constexpr int32_t kNoId = -1;

/// Storage -> fp32 conversion. Specialised for half / bfloat16 in the CUDA translation unit.
template <typename T>
MOS_HD float to_float(T v) {
  return static_cast<float>(v);
}

/// Cosine from the three accumulated sums; a zero vector has cosine 0 with anything.
MOS_HD float cosine_from_sums(float dot, float norm_a_sq, float norm_b_sq) {
  const float denom = sqrtf(norm_a_sq) * sqrtf(norm_b_sq);
  return denom > 0.f ? dot / denom : 0.f;
}

/// Number of ids in a keyword row: rows are sorted, unique, and padded at the end.
MOS_HD int keyword_count(const int32_t* row, int width) {
  int n = 0;
  while (n < width && row[n] != kKeywordPad) ++n;
  return n;
}

/// |A n B| of two sorted rows of unique ids, by a branch-free merge (each step advances the
/// smaller head, or both on a match): the mispredicted branches of a textbook merge cost more
/// than the arithmetic on the CPU, and the loop has no divergent paths on the GPU.
MOS_HD int sorted_intersection(const int32_t* a, int na, const int32_t* b, int nb) {
  int i = 0, j = 0, inter = 0;
  while (i < na && j < nb) {
    const int32_t x = a[i], y = b[j];
    inter += x == y;
    i += x <= y;
    j += y <= x;
  }
  return inter;
}

/// Jaccard index |A n B| / |A u B| of two keyword rows (sorted, unique, pad-terminated); 0 when
/// either set is empty (the paper and the reference code score "no keywords" as no overlap).
/// The Python layer normalises every row it writes or queries with, so rows are always sets.
MOS_HD float jaccard_from_counts(int inter, int na, int nb) {
  if (na == 0 || nb == 0) return 0.f;
  return static_cast<float>(inter) / static_cast<float>(na + nb - inter);
}

MOS_HD float jaccard(const int32_t* a, int width_a, const int32_t* b, int width_b) {
  const int na = keyword_count(a, width_a), nb = keyword_count(b, width_b);
  if (na == 0 || nb == 0) return 0.f;
  return jaccard_from_counts(sorted_intersection(a, na, b, nb), na, nb);
}

/// Segment score F = cos(e_s, e_q) + w * Jaccard(K_s, K_q) (paper, section 3.2; w = 1 there).
MOS_HD float segment_score(float cosine, float jaccard_index, float keyword_weight) {
  return cosine + keyword_weight * jaccard_index;
}

/// Heat parameters (paper defaults alpha = beta = gamma = 1, mu = 1e7 s, tau = 5).
struct HeatParams {
  float alpha;
  float beta;
  float gamma;
  double mu_seconds;
  float tau;
};

/// R_recency = exp(-dt / mu). dt is clamped at 0 so a replayed log whose clock runs backwards
/// never yields a recency above 1.
MOS_HD float recency(double now, double last_access, double mu_seconds) {
  const double dt = now > last_access ? now - last_access : 0.0;
  return static_cast<float>(exp(-dt / mu_seconds));
}

/// Heat = alpha * N_visit + beta * L_interaction + gamma * R_recency.
MOS_HD float heat(const HeatParams& p, int32_t n_visit, int32_t l_interaction, double now,
                  double last_access) {
  return p.alpha * static_cast<float>(n_visit) + p.beta * static_cast<float>(l_interaction) +
         p.gamma * recency(now, last_access, p.mu_seconds);
}

/// The one ranking rule of every top-k: higher score first, then the lower id.
MOS_HD bool ranks_before(float score_a, int32_t id_a, float score_b, int32_t id_b) {
  return score_a > score_b || (score_a == score_b && id_a < id_b);
}

/// Eviction order: the lowest key goes first, then the lower slot.
MOS_HD bool evicts_before(float key_a, int32_t slot_a, float key_b, int32_t slot_b) {
  return key_a < key_b || (key_a == key_b && slot_a < slot_b);
}

/// Insert (score, id) into a descending top-k list of current length *len (capacity k).
/// Used by the CPU loops and by single-thread parts of the CUDA kernels.
MOS_HD void topk_insert(float* scores, int32_t* ids, int k, int* len, float score, int32_t id) {
  int pos = *len;
  if (pos == k) {
    if (!ranks_before(score, id, scores[k - 1], ids[k - 1])) return;
    pos = k - 1;
  } else {
    ++(*len);
  }
  while (pos > 0 && ranks_before(score, id, scores[pos - 1], ids[pos - 1])) {
    scores[pos] = scores[pos - 1];
    ids[pos] = ids[pos - 1];
    --pos;
  }
  scores[pos] = score;
  ids[pos] = id;
}

}  // namespace memoryos
