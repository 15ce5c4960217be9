// memoryos-gpu: the CPU kernels' inner loops (dot products and norms), shared by every CPU
// kernel file so that all of them score with the same instruction sequence.
#pragma once

// The per-query bodies are compiled twice, for x86-64-v3 (AVX2 + FMA) and for the baseline, and
// the loader picks one at run time: a portable wheel (no -march=native) still runs the inner dot
// products 8 floats wide where the CPU allows. Measured: ~2x on the scoring kernel here.
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#define MOS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MOS_CPU_CLONES
#endif

namespace memoryos {
namespace cpu {

/// Dot product and squared norm of b in one pass over b (a's norm is computed once per query).
inline void dot_and_norm(const float* a, const float* b, int d, float* dot, float* norm_b) {
  float s = 0.f, n = 0.f;
#pragma omp simd reduction(+ : s, n)
  for (int i = 0; i < d; ++i) {
    s += a[i] * b[i];
    n += b[i] * b[i];
  }
  *dot = s;
  *norm_b = n;
}

inline float squared_norm(const float* a, int d) {
  float n = 0.f;
#pragma omp simd reduction(+ : n)
  for (int i = 0; i < d; ++i) n += a[i] * a[i];
  return n;
}

}  // namespace cpu
}  // namespace memoryos
