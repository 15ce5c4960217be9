// memoryos-gpu: the CPU kernels' inner loops (dot products, norms, cosines), shared by every CPU
// kernel file so that all of them score with the same instruction sequence on every machine.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "memoryos/formulas.h"

// ---- Determinism across machines ----------------------------------------------------------------
// The per-query bodies are compiled twice, for AVX2 and for the x86-64 baseline (SSE2), and the
// loader picks one at run time, so a portable wheel (no -march=native) still runs the inner loops
// 8 floats wide where the CPU allows. Both clones must produce the same bits, or a near-tie,
// min_score or theta decision could flip between machines. Two rules make them equal:
//  1. No FMA in any clone: the AVX2 clone is "avx2", not "arch=x86-64-v3" (which adds FMA), so
//     no compiler can contract a*b + c into one rounding in one clone and two in the other.
//     CMakeLists.txt also passes -ffp-contract=off, so non-x86 builds (no clones) do not fuse.
//  2. A fixed summation order written out in the source (kLanes partial sums, lane j takes
//     elements j, j + kLanes, ...; then a fixed tree), never `omp simd reduction`, which lets
//     each clone pick its own vector width and therefore its own order. Without -ffast-math
//     the compiler may vectorise these loops only in ways that keep that order: the AVX2
//     clone holds the partial sums in 2 ymm registers per sum, the baseline in 4 xmm.
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#define MOS_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOS_CPU_CLONES
#endif

// The inner loops are forced inline so that each clone compiles its own copy for its own ISA
// (an out-of-line helper would run baseline code inside the AVX2 clone).
#if defined(__GNUC__)
#define MOS_CPU_INLINE inline __attribute__((always_inline))
#else
#define MOS_CPU_INLINE inline
#endif

namespace memoryos {
namespace cpu {

/// Partial sums per accumulated quantity: lane j sums elements j, j + 16, j + 32, ... Two
/// 8-float vectors per quantity give two independent add chains, which hide the add latency.
constexpr int kLanes = 16;

/// The fixed reduction tree of kLanes partial sums (the same in every clone).
MOS_CPU_INLINE float lane_sum(const float (&v)[kLanes]) {
  float t[kLanes / 2];
  for (int j = 0; j < kLanes / 2; ++j) t[j] = v[j] + v[j + kLanes / 2];
  float u[kLanes / 4];
  for (int j = 0; j < kLanes / 4; ++j) u[j] = t[j] + t[j + kLanes / 4];
  return (u[0] + u[2]) + (u[1] + u[3]);
}

#if defined(__GNUC__)
// Why vector types and not plain loops: GCC vectorises a loop over 16 scalar partial sums the
// wrong way round (16 horizontal reductions, measured 10x slower). An 8-float vector type is
// lowered to one ymm register in the AVX2 clone and to two xmm registers in the baseline one,
// with the same elementwise operations, so the bits are the same.
typedef float f32x8 __attribute__((vector_size(32)));

/// Adds the products of a[0, d) and b[0, d) (lane order above) into s, and b's squares into n.
MOS_CPU_INLINE void accumulate(const float* a, const float* b, int d, float (&s)[kLanes],
                       float (&n)[kLanes]) {
  f32x8 s0 = {}, s1 = {}, n0 = {}, n1 = {};
  int i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    f32x8 a0, a1, b0, b1;  // unaligned loads
    std::memcpy(&a0, a + i, sizeof a0);
    std::memcpy(&a1, a + i + 8, sizeof a1);
    std::memcpy(&b0, b + i, sizeof b0);
    std::memcpy(&b1, b + i + 8, sizeof b1);
    s0 += a0 * b0;
    s1 += a1 * b1;
    n0 += b0 * b0;
    n1 += b1 * b1;
  }
  std::memcpy(s, &s0, sizeof s0);
  std::memcpy(s + 8, &s1, sizeof s1);
  std::memcpy(n, &n0, sizeof n0);
  std::memcpy(n + 8, &n1, sizeof n1);
  for (int j = 0; i + j < d; ++j) {
    s[j] += a[i + j] * b[i + j];
    n[j] += b[i + j] * b[i + j];
  }
}
#else
MOS_CPU_INLINE void accumulate(const float* a, const float* b, int d, float (&s)[kLanes],
                       float (&n)[kLanes]) {
  for (int j = 0; j < kLanes; ++j) s[j] = n[j] = 0.f;
  for (int i = 0; i < d; ++i) {
    s[i % kLanes] += a[i] * b[i];
    n[i % kLanes] += b[i] * b[i];
  }
}
#endif

/// Dot product and squared norm of b in one pass over b (a's norm is computed once per query).
/// Same bits in every clone and on every x86-64 machine (see the rules above).
MOS_CPU_INLINE void dot_and_norm(const float* a, const float* b, int d, float* dot, float* norm_b) {
  float s[kLanes], n[kLanes];
  accumulate(a, b, d, s, n);
  *dot = lane_sum(s);
  *norm_b = lane_sum(n);
}

MOS_CPU_INLINE float squared_norm(const float* a, int d) {
  float s[kLanes], n[kLanes];
  accumulate(a, a, d, s, n);
  return lane_sum(n);
}

/// max |a_i| and whether every a_i is finite, in one pass. On the bit patterns with the sign
/// cleared, unsigned order is |float| order, infinity above every finite value and NaN above
/// infinity, so one integer max answers both; integer max is associative, so it vectorises in
/// every clone (a float compare-select with a finiteness flag did not: measured 1.3 us a query).
MOS_CPU_INLINE float max_abs(const float* a, int d, bool* finite) {
  uint32_t m = 0;
  for (int i = 0; i < d; ++i) {
    uint32_t bits;
    std::memcpy(&bits, a + i, sizeof bits);
    bits &= 0x7fffffffu;
    m = bits > m ? bits : m;
  }
  *finite = m < 0x7f800000u;
  float out;
  std::memcpy(&out, &m, sizeof out);
  return out;
}

// ---- Overflow-safe cosines ----------------------------------------------------------------------
/// A query prepared once for overflow-safe cosines: if its magnitude is extreme, scaled by a
/// power of two (exact, so every cosine keeps its bits) until its largest |component| lies in
/// [0.5, 1); with its squared norm. `ok` is false for a query with a NaN or infinite component
/// (it matches nothing). Why: a finite fp32 vector of v x 1e20 has a squared norm above
/// FLT_MAX; prepared, the query is safe, and only a stored row's own range can still overflow.
struct PreparedQuery {
  const float* v;
  float norm_sq;
  bool ok;
};

/// Prepares query `q` (d floats), scaled into `scratch` (d floats) only when its largest
/// |component| lies outside [2^-32, 2^32] (inside, its squared norm and every dot product with
/// a row in the safe range are far from overflow and underflow, and the scaling would not
/// change any cosine's bits anyway).
inline PreparedQuery prepare_query(const float* q, int d, float* scratch) {
  bool finite = true;
  const float m = max_abs(q, d, &finite);
  if (!finite) return PreparedQuery{q, 0.f, false};
  if (m >= 0x1p-32f && m <= 0x1p32f) return PreparedQuery{q, squared_norm(q, d), true};
  const Pow2Scale f = pow2_scale(pow2_exponent(m));
  for (int i = 0; i < d; ++i) scratch[i] = (q[i] * f.f1) * f.f2;
  return PreparedQuery{scratch, squared_norm(scratch, d), true};
}

/// The cosine of a row whose squared norm fell outside the safe range: the row is rescaled by
/// a power of two like the query (one more pass, only for rows of extreme magnitude or zero).
inline float cosine_rescaled(const PreparedQuery& q, const float* b, int d) {
  bool finite = true;
  const float m = max_abs(b, d, &finite);
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  if (m == 0.f) return 0.f;
  const Pow2Scale f = pow2_scale(pow2_exponent(m));
  float s[kLanes] = {}, n[kLanes] = {};
  for (int i = 0; i < d; ++i) {
    const float x = (b[i] * f.f1) * f.f2;
    s[i % kLanes] += q.v[i] * x;
    n[i % kLanes] += x * x;
  }
  return cosine_from_sums(lane_sum(s), q.norm_sq, lane_sum(n));
}

/// cos(q, b) for any finite b (NaN when b holds NaN or infinity). The fast path is one pass;
/// rows outside [kMinSafeNormSq, FLT_MAX] take cosine_rescaled.
MOS_CPU_INLINE float cosine(const PreparedQuery& q, const float* b, int d) {
  float dot, norm;
  dot_and_norm(q.v, b, d, &dot, &norm);
  if (norm_in_safe_range(norm)) return cosine_from_sums(dot, q.norm_sq, norm);
  return cosine_rescaled(q, b, d);
}

}  // namespace cpu
}  // namespace memoryos
