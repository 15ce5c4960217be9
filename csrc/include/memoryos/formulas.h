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
/// a row ends at the first pad or at its width (see "Keyword sets" below for other rows).
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

/// Squared norms the one-pass cosine trusts. Below 2^-60 squares of components under 2^-75
/// are lost to underflow (a row of v x 1e-30 would get cosine 0), above FLT_MAX the sum is
/// infinite (a row of v x 1e20 would get NaN or 0); such rows are rescaled and summed again.
constexpr float kMinSafeNormSq = 8.67361737988403547e-19f;  // 2^-60

MOS_HD bool norm_in_safe_range(float norm_sq) {
  return norm_sq >= kMinSafeNormSq && norm_sq <= 3.40282346638528859812e+38f;  // false for NaN
}

/// The exponent e with max_abs * 2^-e in [0.5, 1) (0 for 0): scaling a vector by 2^-e is exact
/// and leaves every cosine unchanged, and bounds its squared norm by its length.
MOS_HD int pow2_exponent(float max_abs) {
  int e = 0;
  frexpf(max_abs, &e);
  return max_abs > 0.f ? e : 0;
}

/// Two factors whose product is 2^-e, applied as (x * f1) * f2: each multiplication is exact
/// (or, scaling down into the subnormals, one correct rounding, like ldexp), and a multiply
/// vectorises where an ldexp call per element costs ~10 ns. 2^-e alone is not a float for
/// e < -127 (a subnormal vector scaled up), hence the split.
struct Pow2Scale {
  float f1, f2;
};

MOS_HD Pow2Scale pow2_scale(int e) {
  if (e >= -126) return Pow2Scale{ldexpf(1.f, -e), 1.f};
  return Pow2Scale{ldexpf(1.f, 64), ldexpf(1.f, -e - 64)};
}

/// The score a top-k ranks and reports: NaN (only from non-finite inputs outside the contract)
/// becomes -inf, because ranking needs a strict order; on the CPU and the GPU alike.
MOS_HD float rank_score(float score) { return score != score ? -HUGE_VALF : score; }

// ---- Keyword sets -------------------------------------------------------------------------------
// The keyword set of a row is the set of distinct ids before its first kKeywordPad (or its
// width), in any order: Jaccard is a set measure, so [1, 1, 2] and [2, 1] are the set {1, 2}.
// The contract is sorted, unique rows (the Python layer normalises every row it writes or
// queries with) and the fast paths assume it; any other row gets the same set semantics on
// every path (CPU, CUDA, reference) through the slower general loops below.

/// Number of entries of a keyword row before its first pad (its width if it has none).
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

/// Whether ids[0, n) is strictly ascending (a sorted set, the contract's form).
MOS_HD bool is_sorted_set(const int32_t* ids, int n) {
  for (int i = 1; i < n; ++i) {
    if (ids[i - 1] >= ids[i]) return false;
  }
  return true;
}

/// Whether ids[i] is the first occurrence of its value in ids[0, i].
MOS_HD bool first_occurrence(const int32_t* ids, int i) {
  for (int j = 0; j < i; ++j) {
    if (ids[j] == ids[i]) return false;
  }
  return true;
}

/// Whether v is in ids[0, n) (any order).
MOS_HD bool contains(const int32_t* ids, int n, int32_t v) {
  for (int j = 0; j < n; ++j) {
    if (ids[j] == v) return true;
  }
  return false;
}

/// Whether v is in the sorted set set[0, n) (binary search).
MOS_HD bool set_contains(const int32_t* set, int n, int32_t v) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (set[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo < n && set[lo] == v;
}

/// Writes the keyword set of row[0, width) to out (sorted, unique) and returns its size.
/// Serial (insertion into out); the CPU runs it once per query, the GPU has a parallel twin.
MOS_HD int keyword_set(const int32_t* row, int width, int32_t* out) {
  const int n = keyword_count(row, width);
  int size = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t v = row[i];
    int pos = size;
    while (pos > 0 && out[pos - 1] > v) --pos;
    if (pos > 0 && out[pos - 1] == v) continue;
    for (int j = size; j > pos; --j) out[j] = out[j - 1];
    out[pos] = v;
    ++size;
  }
  return size;
}

/// Jaccard index |A n B| / |A u B| from the counts; 0 when either set is empty (the paper and
/// the reference code score "no keywords" as no overlap).
MOS_HD float jaccard_from_counts(int inter, int na, int nb) {
  if (na == 0 || nb == 0 || inter == 0) return 0.f;  // no division for the common no-overlap
  return static_cast<float>(inter) / static_cast<float>(na + nb - inter);
}

/// Jaccard of a sorted set (a query's keyword set, built once) and any keyword row. Sorted
/// rows take the merge; others count their distinct ids and look each up in the set.
MOS_HD float jaccard_set_row(const int32_t* set, int ns, const int32_t* row, int width) {
  if (ns == 0) return 0.f;
  int n = 0;
  bool sorted = true;  // counted and checked in one pass: this runs for every candidate row
  while (n < width && row[n] != kKeywordPad) {
    sorted &= n == 0 || row[n - 1] < row[n];
    ++n;
  }
  if (n == 0) return 0.f;
  if (sorted) return jaccard_from_counts(sorted_intersection(set, ns, row, n), ns, n);
  int distinct = 0, inter = 0;
  for (int i = 0; i < n; ++i) {
    if (!first_occurrence(row, i)) continue;
    ++distinct;
    inter += set_contains(set, ns, row[i]);
  }
  return jaccard_from_counts(inter, ns, distinct);
}

/// Jaccard of two keyword rows with the set semantics above (merge when both are sorted sets).
MOS_HD float jaccard(const int32_t* a, int width_a, const int32_t* b, int width_b) {
  const int na = keyword_count(a, width_a);
  if (is_sorted_set(a, na)) return jaccard_set_row(a, na, b, width_b);
  const int nb = keyword_count(b, width_b);
  int da = 0, db = 0, inter = 0;
  for (int i = 0; i < na; ++i) {
    if (!first_occurrence(a, i)) continue;
    ++da;
    inter += contains(b, nb, a[i]);
  }
  for (int j = 0; j < nb; ++j) db += first_occurrence(b, j);
  return jaccard_from_counts(inter, da, db);
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
