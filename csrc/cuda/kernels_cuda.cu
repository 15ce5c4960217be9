// memoryos-gpu: CUDA kernels. Same contracts, formulas and tie rules as csrc/cpu/kernels_cpu.cpp;
// launch geometry and the reasons for it are in csrc/cuda/README.md.
//
// Device selection: every launcher switches to the device that owns its first input pointer
// (cudaPointerGetAttributes) for the duration of the call and restores the caller's device after,
// so arrays on a non-current GPU work; host or unregistered pointers leave the current device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "memoryos/kernels.h"

namespace memoryos {

// ---- Storage conversions (declared generically in formulas.h) ----------------------------------
template <>
MOS_HD float to_float<__half>(__half v) {
  return __half2float(v);
}
template <>
MOS_HD float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

namespace {

constexpr int kThreads = 256;               // threads per CTA of the top-k kernels
constexpr int kWarps = kThreads / 32;       // 8
constexpr int kRowsPerWarp = 2;             // rows a warp scores at once
constexpr int kChunk = 256;                 // candidate positions scored between two merges
// At least 4 CTAs (32 warps) per SM: caps registers at 64, enough for 2 rows x 16-byte vectors
// in flight per lane without spills, and keeps the bytes in flight per SM above what HBM needs.
constexpr int kMinCtasPerSm = 4;
constexpr int kHeatWarps = 8;               // recompute_heat: warps (= requests) per CTA
constexpr int kHitThreads = 256;            // apply_hits: threads per CTA
constexpr unsigned kFull = 0xffffffffu;

// ---- Host helpers -------------------------------------------------------------------------------
void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("memoryos_gpu CUDA error in ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

/// Switches to the device that owns `ptr` for one call; restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(const void* ptr) {
    cudaPointerAttributes attr{};
    if (ptr == nullptr || cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
      cudaGetLastError();  // unregistered pointer on old runtimes: keep the current device
      return;
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) return;
    int current = 0;
    check(cudaGetDevice(&current), "cudaGetDevice");
    if (current == attr.device) return;
    check(cudaSetDevice(attr.device), "cudaSetDevice");
    previous_ = current;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

cudaStream_t as_stream(int64_t stream) {
  return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream));
}

unsigned grid_for(int64_t items, int64_t per_cta, const char* what) {
  const int64_t ctas = (items + per_cta - 1) / per_cta;
  if (ctas > INT_MAX) {
    throw std::runtime_error(std::string(what) + ": batch of " + std::to_string(items) +
                             " is too large for one launch");
  }
  return static_cast<unsigned>(ctas);
}

template <typename T>
struct Tag {
  using type = T;
};

template <typename Fn>
void dispatch_dtype(EmbDtype dtype, Fn&& fn) {
  switch (dtype) {
    case EmbDtype::kFloat32: fn(Tag<float>{}); return;
    case EmbDtype::kFloat16: fn(Tag<__half>{}); return;
    case EmbDtype::kBFloat16: fn(Tag<__nv_bfloat16>{}); return;
  }
  throw std::runtime_error("memoryos_gpu: unknown embedding dtype");
}

/// Elements per vector load: 16 bytes when every row start is 16-byte aligned, else 8 bytes,
/// else one element. Rows are d elements apart, so base alignment + d decide it for all rows.
// Why: 16-byte loads are the fewest memory instructions per byte (d = 384 fp16 is 48 loads a
// row); the runtime pick keeps odd d or offset views correct instead of rejecting them.
template <typename T>
int pick_vec(const void* base, int d) {
  const auto addr = reinterpret_cast<uintptr_t>(base);
  const int v16 = 16 / static_cast<int>(sizeof(T)), v8 = 8 / static_cast<int>(sizeof(T));
  if (d % v16 == 0 && addr % 16 == 0) return v16;
  if (d % v8 == 0 && addr % 8 == 0) return v8;
  return 1;
}

template <typename T, typename Fn>
void dispatch_vec(int vec, Fn&& fn) {
  constexpr int v16 = 16 / static_cast<int>(sizeof(T)), v8 = 8 / static_cast<int>(sizeof(T));
  if (vec == v16) fn(std::integral_constant<int, v16>{});
  else if (vec == v8) fn(std::integral_constant<int, v8>{});
  else fn(std::integral_constant<int, 1>{});
}

// ---- Shared-memory layout of the top-k kernels (same arithmetic on host and device) ------------
struct Entry {
  float score;
  int32_t id;
};

__host__ __device__ inline size_t align16(size_t n) { return (n + 15) & ~static_cast<size_t>(15); }

struct TopkLayout {
  size_t qs, qk, run0, run1, chunk, misc, off, segrow, total;
  // d query floats, q_kw query keywords, k running entries (x2), chosen_width segment ranges.
  __host__ __device__ TopkLayout(int d, int q_kw, int k, int chosen_width) {
    size_t o = 0;
    qs = o;     o = align16(o + sizeof(float) * d);
    qk = o;     o = align16(o + sizeof(int32_t) * q_kw);
    run0 = o;   o = align16(o + sizeof(Entry) * k);
    run1 = o;   o = align16(o + sizeof(Entry) * k);
    chunk = o;  o = align16(o + sizeof(Entry) * kChunk);
    misc = o;   o = align16(o + sizeof(int32_t) * (4 + kWarps));  // cnt[2], info[2], red[kWarps]
    off = o;    o = align16(o + sizeof(int64_t) * (chosen_width + 1));
    segrow = o; o = align16(o + sizeof(int64_t) * chosen_width);
    total = o;
  }
};

/// Opts the kernel into more than 48 KiB of dynamic shared memory when the layout needs it;
/// throws a clear error past the device limit (very large k or chosen_width).
template <typename Kernel>
void prepare_smem(Kernel kernel, size_t bytes, const char* what, int k) {
  if (bytes <= 48 * 1024) return;
  int dev = 0, optin = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
        "cudaDeviceGetAttribute");
  if (bytes > static_cast<size_t>(optin)) {
    throw std::runtime_error(std::string(what) + ": k = " + std::to_string(k) + " needs " +
                             std::to_string(bytes) + " bytes of shared memory per query, this "
                             "device allows " + std::to_string(optin) +
                             " (about 16 bytes per unit of k); lower k");
  }
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)),
        "cudaFuncSetAttribute");
}

// ---- Device helpers -----------------------------------------------------------------------------
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

/// V consecutive query floats from shared memory (16/8-byte reads when V allows).
template <int V>
__device__ __forceinline__ void load_query(const float* qs, int i, float (&out)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int t = 0; t < V / 4; ++t) {
      const float4 f = reinterpret_cast<const float4*>(qs + i * V)[t];
      out[4 * t] = f.x; out[4 * t + 1] = f.y; out[4 * t + 2] = f.z; out[4 * t + 3] = f.w;
    }
  } else if constexpr (V == 2) {
    const float2 f = reinterpret_cast<const float2*>(qs)[i];
    out[0] = f.x; out[1] = f.y;
  } else {
    out[0] = qs[i];
  }
}

/// The storage elements packed in one 32-bit word of a vector load, converted with to_float.
template <typename T>
__device__ __forceinline__ void unpack_word(uint32_t w, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    out[0] = to_float(__uint_as_float(w));
  } else if constexpr (std::is_same_v<T, __half>) {
    out[0] = to_float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    out[1] = to_float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "embeddings are fp32, fp16 or bf16");
    out[0] = to_float(__ushort_as_bfloat16(static_cast<unsigned short>(w & 0xffffu)));
    out[1] = to_float(__ushort_as_bfloat16(static_cast<unsigned short>(w >> 16)));
  }
}

/// Vector i (V elements) of an embedding row, converted to fp32.
template <typename T, int V>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int i, float (&out)[V]) {
  constexpr int bytes = V * static_cast<int>(sizeof(T));
  constexpr int per_word = 4 / static_cast<int>(sizeof(T));
  if constexpr (bytes == 16) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row) + i);
    unpack_word<T>(raw.x, out);
    unpack_word<T>(raw.y, out + per_word);
    unpack_word<T>(raw.z, out + 2 * per_word);
    unpack_word<T>(raw.w, out + 3 * per_word);
  } else if constexpr (bytes == 8) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(row) + i);
    unpack_word<T>(raw.x, out);
    unpack_word<T>(raw.y, out + per_word);
  } else {
    static_assert(V == 1, "vector loads are 16 or 8 bytes, or one element");
    out[0] = to_float(row[i]);
  }
}

/// Dot product with the shared query and squared norm of NR rows at once; null rows are skipped.
/// Lanes split d in V-element vectors; the result is warp-reduced (every lane holds it).
// Why: several rows per warp put 2x the bytes in flight per warp (bandwidth-bound kernel), and
// the query is read from shared memory once per vector for all NR rows.
template <typename T, int V, int NR>
__device__ __forceinline__ void warp_dot_norm(const float* qs, const T* const (&rows)[NR],
                                              int nvec, int lane, float (&dot)[NR],
                                              float (&norm)[NR]) {
#pragma unroll
  for (int r = 0; r < NR; ++r) dot[r] = norm[r] = 0.f;
#pragma unroll 2
  for (int i = lane; i < nvec; i += 32) {
    float e[NR][V];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (rows[r] != nullptr) {
        load_row<T, V>(rows[r], i, e[r]);
      } else {
#pragma unroll
        for (int t = 0; t < V; ++t) e[r][t] = 0.f;
      }
    }
    float qv[V];
    load_query<V>(qs, i, qv);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
      for (int t = 0; t < V; ++t) {
        dot[r] = fmaf(qv[t], e[r][t], dot[r]);
        norm[r] = fmaf(e[r][t], e[r][t], norm[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    dot[r] = warp_sum(dot[r]);
    norm[r] = warp_sum(norm[r]);
  }
}

// ---- Keywords -----------------------------------------------------------------------------------
__device__ __forceinline__ bool sorted_contains(const int32_t* a, int len, int32_t v) {
  int lo = 0, hi = len;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo < len && a[lo] == v;
}

struct KwScan {
  int distinct;  ///< distinct ids before the first pad (valid when sorted)
  int inter;     ///< how many of those are in the probe row
  int len;       ///< index of the first pad (or the width)
  bool sorted;   ///< ascending up to the first pad (duplicates allowed)
};

/// Lane-parallel scan of one padded keyword row: lane j looks at id j of each 32-wide piece.
/// `first` is row[lane] (or the pad past the width), loaded early by the caller. When `probe` is
/// non-null, also counts the distinct ids present in the sorted probe[0, probe_len).
// Why: the merge in formulas.h is serial (~K dependent steps per row); on sorted rows the
// same counts come from one coalesced load + ballots. Unsorted rows fall back to jaccard().
__device__ __forceinline__ KwScan warp_kw_scan(const int32_t* row, int width, int32_t first,
                                               const int32_t* probe, int probe_len, int lane) {
  KwScan r{0, 0, 0, true};
  int32_t carry = 0;
  for (int base = 0; base < width; base += 32) {
    const int j = base + lane;
    const int32_t v = base == 0 ? first : (j < width ? row[j] : kKeywordPad);
    const unsigned pads = __ballot_sync(kFull, v == kKeywordPad);
    const int nvalid = pads ? __ffs(static_cast<int>(pads)) - 1 : 32;
    const bool valid = lane < nvalid;
    int32_t prev = __shfl_up_sync(kFull, v, 1);
    if (lane == 0) prev = carry;
    const bool has_prev = j > 0;
    if (__any_sync(kFull, valid && has_prev && v < prev)) {
      r.sorted = false;
      break;
    }
    const bool distinct = valid && (!has_prev || v != prev);
    const bool found = distinct && probe != nullptr && sorted_contains(probe, probe_len, v);
    r.distinct += __popc(__ballot_sync(kFull, distinct));
    r.inter += __popc(__ballot_sync(kFull, found));
    r.len += nvalid;
    carry = __shfl_sync(kFull, v, 31);
    if (pads) break;
  }
  return r;
}

// ---- The running top-k of one CTA ---------------------------------------------------------------
/// Merge a chunk of cn unsorted entries into the sorted running list cur[0, rn); the best
/// min(k, rn + cn) go to nxt, sorted. Each entry's rank is counted directly: ranks_before, then
/// position (running first, then chunk index) for equal pairs, so ranks are a permutation.
// Why: one pass of independent counting (no k rounds of block argmax, no sort network) keeps the
// cost linear in k; chunks are pre-filtered against the current k-th entry, so most are tiny.
__device__ __forceinline__ void merge_chunk(const Entry* cur, int rn, const Entry* chunk, int cn,
                                            int k, Entry* nxt) {
  for (int e = threadIdx.x; e < rn + cn; e += blockDim.x) {
    Entry x;
    int rank;
    if (e < rn) {
      x = cur[e];
      rank = e;
      for (int j = 0; j < cn && rank < k; ++j) {
        rank += ranks_before(chunk[j].score, chunk[j].id, x.score, x.id) ? 1 : 0;
      }
    } else {
      const int c = e - rn;
      x = chunk[c];
      int lo = 0, hi = rn;  // running entries placed before x: those x does not rank before
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (ranks_before(x.score, x.id, cur[mid].score, cur[mid].id)) hi = mid;
        else lo = mid + 1;
      }
      rank = lo;
      for (int j = 0; j < cn && rank < k; ++j) {
        const Entry y = chunk[j];
        const bool before = ranks_before(y.score, y.id, x.score, x.id) ||
                            (j < c && !ranks_before(x.score, x.id, y.score, y.id));
        rank += before ? 1 : 0;
      }
    }
    if (rank < k) nxt[rank] = x;
  }
}

/// A candidate row (nullptr = skip it) and the id it is ranked and reported under.
template <typename T>
struct Cand {
  const T* row;
  int32_t id;
};

struct TopkSmem {
  Entry* run0;
  Entry* run1;
  Entry* chunk;
  int* cnt;  // [2], alternating per pass
};

/// Scores candidate positions [0, total) of one query and writes its top-k (padded) to out_*.
/// Src resolves a position to a Cand, and turns a cosine into the final
/// score; see the three Src structs below. Must be called by the whole CTA.
// Why: bounded shared memory (k + kChunk entries) for any number of candidates, so a segment
// may hold any number of pages and S / R are not limited by shared memory.
template <typename T, int V, typename Src>
__device__ void topk_over(const Src& src, int64_t total, const float* qs, float q_norm, int nvec,
                          int k, TopkSmem sm, float* out_scores, int32_t* out_ids) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  Entry* cur = sm.run0;
  Entry* nxt = sm.run1;
  int rn = 0;      // entries in cur; same value in every thread
  int parity = 0;  // which cnt[] this pass appends to
  for (int64_t start = 0; start < total; start += kChunk) {
    const int64_t end = total - start < kChunk ? total : start + kChunk;
    for (int64_t p0 = start + warp * kRowsPerWarp; p0 < end; p0 += kWarps * kRowsPerWarp) {
      const T* rows[kRowsPerWarp];
      int32_t ids[kRowsPerWarp];
      int32_t pre[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const Cand<T> c = p0 + r < end ? src.row(p0 + r) : Cand<T>{nullptr, kNoId};
        rows[r] = c.row;
        ids[r] = c.id;
        pre[r] = rows[r] != nullptr ? src.prefetch(p0 + r, lane) : 0;
      }
      float dot[kRowsPerWarp], norm[kRowsPerWarp];
      warp_dot_norm<T, V, kRowsPerWarp>(qs, rows, nvec, lane, dot, norm);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (rows[r] == nullptr) continue;  // warp-uniform
        float score = src.score(p0 + r, cosine_from_sums(dot[r], q_norm, norm[r]), pre[r], lane);
        if (lane != 0 || !src.keep(score)) continue;
        // NaN (only from non-finite stored embeddings) would break the strict order the merge
        // needs; it ranks and reports as -inf.
        if (isnan(score)) score = neg_inf();
        if (rn < k || ranks_before(score, ids[r], cur[k - 1].score, cur[k - 1].id)) {
          sm.chunk[atomicAdd(&sm.cnt[parity], 1)] = Entry{score, ids[r]};
        }
      }
    }
    __syncthreads();
    const int cn = sm.cnt[parity];
    if (threadIdx.x == 0) sm.cnt[parity ^ 1] = 0;  // last read in the previous pass
    if (cn > 0) merge_chunk(cur, rn, sm.chunk, cn, k, nxt);
    __syncthreads();
    if (cn > 0) {
      Entry* t = cur;
      cur = nxt;
      nxt = t;
      rn = rn + cn < k ? rn + cn : k;
    }
    parity ^= 1;
  }
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    out_scores[j] = j < rn ? cur[j].score : neg_inf();
    out_ids[j] = j < rn ? cur[j].id : kNoId;
  }
}

__device__ void write_padding(float* out_scores, int32_t* out_ids, int k) {
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    out_scores[j] = neg_inf();
    out_ids[j] = kNoId;
  }
}

/// Stages query b in shared memory as fp32 and returns its squared norm (same in every thread).
/// Ends with __syncthreads; red must hold kWarps floats.
// Why: every warp reads the whole query once per candidate row; from shared memory that costs
// no global traffic, and its norm is reduced once per CTA instead of once per row.
__device__ float stage_query(const float* q, int d, float* qs, float* red) {
  float acc = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = q[i];
    qs[i] = v;
    acc = fmaf(v, v, acc);
  }
  acc = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += red[w];
  return total;
}

// ---- Candidate sources --------------------------------------------------------------------------
template <typename T>
struct SegmentSrc {
  const T* emb;            // this user's [S, d]
  const uint8_t* live;     // this user's [S]
  const int32_t* kw;       // this user's [S, K]
  int d, kw_width;
  const int32_t* q_kw;     // shared [Q]; null when the query has no keywords
  int q_width, q_len, q_distinct;
  bool q_sorted;
  float keyword_weight;

  __device__ Cand<T> row(int64_t p) const {
    return Cand<T>{live[p] ? emb + p * d : nullptr, static_cast<int32_t>(p)};
  }
  __device__ int32_t prefetch(int64_t p, int lane) const {
    return q_kw != nullptr && lane < kw_width ? kw[p * kw_width + lane] : kKeywordPad;
  }
  __device__ float score(int64_t p, float cosine, int32_t first, int lane) const {
    float jac = 0.f;
    if (q_kw != nullptr) {  // block-uniform
      const int32_t* seg_kw = kw + p * kw_width;
      KwScan s{0, 0, 0, false};
      if (q_sorted) s = warp_kw_scan(seg_kw, kw_width, first, q_kw, q_len, lane);
      if (s.sorted) {
        jac = jaccard_from_counts(s.inter, q_distinct, s.distinct);
      } else {  // unsorted row (outside the contract): the serial merge itself
        if (lane == 0) jac = jaccard(q_kw, q_width, seg_kw, kw_width);
        jac = __shfl_sync(kFull, jac, 0);
      }
    }
    return segment_score(cosine, jac, keyword_weight);
  }
  __device__ bool keep(float) const { return true; }
};

template <typename T>
struct RingSrc {
  const T* emb;         // this owner's [R, d]
  const uint8_t* live;  // this owner's [R]
  int d;
  __device__ Cand<T> row(int64_t p) const {
    return Cand<T>{live[p] ? emb + p * d : nullptr, static_cast<int32_t>(p)};
  }
  __device__ int32_t prefetch(int64_t, int) const { return 0; }
  __device__ float score(int64_t, float cosine, int32_t, int) const { return cosine; }
  __device__ bool keep(float) const { return true; }
};

template <typename T>
struct PageSrc {
  const T* emb;                // [NP, d]
  const uint8_t* live;         // [NP]
  const int32_t* block_table;  // [U, S, MB]
  const int64_t* off;          // shared [cw + 1]: first flat position of each chosen segment
  const int64_t* seg_row;      // shared [cw]: u * S + s
  int cw, d, block_size, table_width;
  int64_t num_pages;
  float min_score;

  __device__ Cand<T> row(int64_t p) const {
    int lo = 0, hi = cw - 1;  // the last chosen segment whose range starts at or before p
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (off[mid] <= p) lo = mid;
      else hi = mid - 1;
    }
    const int64_t i = p - off[lo];
    const int32_t block = block_table[seg_row[lo] * table_width + i / block_size];
    const int64_t slot = static_cast<int64_t>(block) * block_size + i % block_size;
    if (block < 0 || slot >= num_pages || !live[slot]) return Cand<T>{nullptr, kNoId};
    return Cand<T>{emb + slot * d, static_cast<int32_t>(slot)};
  }
  __device__ int32_t prefetch(int64_t, int) const { return 0; }
  __device__ float score(int64_t, float cosine, int32_t, int) const { return cosine; }
  __device__ bool keep(float score) const { return !(score < min_score); }
};

struct Carved {
  float* qs;
  int32_t* qk;
  TopkSmem topk;
  int32_t* info;  // [2]
  float* red;     // [kWarps]
  int64_t* off;
  int64_t* seg_row;
};

__device__ Carved carve(const TopkLayout& L) {
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  Carved c;
  c.qs = reinterpret_cast<float*>(base + L.qs);
  c.qk = reinterpret_cast<int32_t*>(base + L.qk);
  c.topk.run0 = reinterpret_cast<Entry*>(base + L.run0);
  c.topk.run1 = reinterpret_cast<Entry*>(base + L.run1);
  c.topk.chunk = reinterpret_cast<Entry*>(base + L.chunk);
  int32_t* misc = reinterpret_cast<int32_t*>(base + L.misc);
  c.topk.cnt = misc;
  c.info = misc + 2;
  c.red = reinterpret_cast<float*>(misc + 4);
  c.off = reinterpret_cast<int64_t*>(base + L.off);
  c.seg_row = reinterpret_cast<int64_t*>(base + L.segrow);
  return c;
}

// ---- Kernels ------------------------------------------------------------------------------------
// Why one CTA per query: the query's candidates (one user's S slots, or its chosen segments'
// pages) are scored by 8 warps in parallel and ranked in that CTA's shared memory, with no
// cross-CTA merge; 10k+ queries give thousands of CTAs to fill every SM.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    score_segments_kernel(QueryBatch q, SegmentView seg, float keyword_weight, TopK out) {
  const int64_t b = blockIdx.x;
  const TopkLayout L(q.dim, q.kw_width, out.k, 0);
  const Carved sm = carve(L);
  float* out_s = out.scores + b * out.k;
  int32_t* out_i = out.ids + b * out.k;
  const int32_t u = q.user[b];
  if (u < 0 || u >= seg.num_users) {  // block-uniform
    write_padding(out_s, out_i, out.k);
    return;
  }
  const bool has_kw = q.kw_width > 0 && q.keywords != nullptr;
  for (int i = threadIdx.x; has_kw && i < q.kw_width; i += blockDim.x) {
    sm.qk[i] = q.keywords[b * q.kw_width + i];
  }
  if (threadIdx.x == 0) sm.topk.cnt[0] = 0;
  const float q_norm = stage_query(q.emb + b * q.dim, q.dim, sm.qs, sm.red);  // syncs
  if (has_kw && threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int32_t first = lane < q.kw_width ? sm.qk[lane] : kKeywordPad;
    const KwScan s = warp_kw_scan(sm.qk, q.kw_width, first, nullptr, 0, lane);
    if (lane == 0) {
      sm.info[0] = s.sorted ? s.len : -1;
      sm.info[1] = s.distinct;
    }
  }
  __syncthreads();
  const int64_t base = static_cast<int64_t>(u) * seg.slots;
  SegmentSrc<T> src;
  src.emb = static_cast<const T*>(seg.emb) + base * q.dim;
  src.live = seg.live + base;
  src.kw = seg.keywords + base * seg.kw_width;
  src.d = q.dim;
  src.kw_width = seg.kw_width;
  src.q_kw = has_kw ? sm.qk : nullptr;
  src.q_width = q.kw_width;
  src.q_sorted = has_kw && sm.info[0] >= 0;
  src.q_len = has_kw ? sm.info[0] : 0;
  src.q_distinct = has_kw ? sm.info[1] : 0;
  src.keyword_weight = keyword_weight;
  topk_over<T, V>(src, seg.slots, sm.qs, q_norm, q.dim / V, out.k, sm.topk, out_s, out_i);
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    select_pages_kernel(QueryBatch q, const int32_t* chosen, int32_t chosen_width, PageView pages,
                        float min_score, TopK out) {
  const int64_t b = blockIdx.x;
  const TopkLayout L(q.dim, 0, out.k, chosen_width);
  const Carved sm = carve(L);
  float* out_s = out.scores + b * out.k;
  int32_t* out_i = out.ids + b * out.k;
  const int32_t u = q.user[b];
  if (u < 0 || u >= pages.num_users || chosen_width <= 0) {
    write_padding(out_s, out_i, out.k);
    return;
  }
  // Per chosen segment: its row and page count (capped at the table), in parallel.
  const int64_t cap = static_cast<int64_t>(pages.table_width) * pages.block_size;
  for (int c = threadIdx.x; c < chosen_width; c += blockDim.x) {
    const int32_t s = chosen[b * chosen_width + c];
    int64_t n = 0, row = 0;
    if (s >= 0 && s < pages.slots) {
      row = static_cast<int64_t>(u) * pages.slots + s;
      const int32_t np = pages.npages[row];
      n = np < 0 ? 0 : (np < cap ? np : cap);
    }
    sm.seg_row[c] = row;
    sm.off[c + 1] = n;  // counts for now; prefix-summed below
  }
  if (threadIdx.x == 0) sm.topk.cnt[0] = 0;
  const float q_norm = stage_query(q.emb + b * q.dim, q.dim, sm.qs, sm.red);  // syncs
  if (threadIdx.x == 0) {
    sm.off[0] = 0;
    for (int c = 0; c < chosen_width; ++c) sm.off[c + 1] += sm.off[c];
  }
  __syncthreads();
  PageSrc<T> src;
  src.emb = static_cast<const T*>(pages.emb);
  src.live = pages.live;
  src.block_table = pages.block_table;
  src.off = sm.off;
  src.seg_row = sm.seg_row;
  src.cw = chosen_width;
  src.d = q.dim;
  src.block_size = pages.block_size;
  src.table_width = pages.table_width;
  src.num_pages = pages.num_pages;
  src.min_score = min_score;
  topk_over<T, V>(src, sm.off[chosen_width], sm.qs, q_norm, q.dim / V, out.k, sm.topk, out_s,
                  out_i);
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    knowledge_topk_kernel(QueryBatch q, KnowledgeView kn, TopK out) {
  const int64_t b = blockIdx.x;
  const TopkLayout L(q.dim, 0, out.k, 0);
  const Carved sm = carve(L);
  float* out_s = out.scores + b * out.k;
  int32_t* out_i = out.ids + b * out.k;
  const int32_t o = q.user[b];
  if (o < 0 || o >= kn.num_owners) {
    write_padding(out_s, out_i, out.k);
    return;
  }
  if (threadIdx.x == 0) sm.topk.cnt[0] = 0;
  const float q_norm = stage_query(q.emb + b * q.dim, q.dim, sm.qs, sm.red);  // syncs
  const int64_t base = static_cast<int64_t>(o) * kn.capacity;
  RingSrc<T> src;
  src.emb = static_cast<const T*>(kn.emb) + base * q.dim;
  src.live = kn.live + base;
  src.d = q.dim;
  topk_over<T, V>(src, kn.capacity, sm.qs, q_norm, q.dim / V, out.k, sm.topk, out_s, out_i);
}

/// last_access = max(last_access, now) as a CAS loop on the bit pattern; compares as doubles, so
/// negative and NaN values behave like the CPU's `if (now > last) last = now`.
__device__ void atomic_max_double(double* addr, double value) {
  auto* bits = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *reinterpret_cast<volatile unsigned long long*>(bits);
  while (value > __longlong_as_double(static_cast<long long>(old))) {
    const unsigned long long seen =
        atomicCAS(bits, old, static_cast<unsigned long long>(__double_as_longlong(value)));
    if (seen == old) break;
    old = seen;
  }
}

// Why one thread per hit: hits are few (B x m) and independent; atomics make duplicate hits on
// one segment add up exactly as the CPU's serial loop does.
__global__ void __launch_bounds__(kHitThreads) apply_hits_kernel(HitList hits, HeatState state) {
  const int64_t h = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= hits.size) return;
  const int32_t u = hits.user[h], s = hits.slot[h];
  if (u < 0 || u >= state.num_users || s < 0 || s >= state.slots) return;
  const int64_t row = static_cast<int64_t>(u) * state.slots + s;
  if (!state.live[row]) return;
  atomicAdd(&state.n_visit[row], 1);
  atomic_max_double(&state.last_access[row], hits.now[h]);
}

// Why one warp per listed user: S = 200 slots is 7 strided steps for 32 lanes, and the victim is
// a 5-step shuffle reduction; no shared memory, no __syncthreads.
__global__ void __launch_bounds__(kHeatWarps * 32) recompute_heat_kernel(HeatRecompute req,
                                                                       HeatState state,
                                                                       HeatParams params) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kHeatWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= req.size) return;  // warp-uniform
  const int32_t u = req.user[r];
  const bool valid = u >= 0 && u < state.num_users;
  const double now = req.now[r];
  uint8_t* promote = req.promote + r * state.slots;
  int32_t victim = kNoId;
  float victim_key = 0.f;
  for (int32_t s = lane; s < state.slots; s += 32) {
    uint8_t flag = 0;
    const int64_t row = static_cast<int64_t>(u) * state.slots + s;
    if (valid && state.live[row]) {
      const float h = heat(params, state.n_visit[row], state.l_interaction[row], now,
                           state.last_access[row]);
      state.heat[row] = h;
      flag = h >= params.tau;
      const float key = req.evict_by_visits ? static_cast<float>(state.n_visit[row]) : h;
      if (victim == kNoId || evicts_before(key, s, victim_key, victim)) {
        victim = s;
        victim_key = key;
      }
    }
    promote[s] = flag;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int32_t other = __shfl_xor_sync(kFull, victim, o);
    const float other_key = __shfl_xor_sync(kFull, victim_key, o);
    if (other != kNoId &&
        (victim == kNoId || evicts_before(other_key, other, victim_key, victim))) {
      victim = other;
      victim_key = other_key;
    }
  }
  if (lane == 0) req.evict_slot[r] = req.need_evict[r] ? victim : kNoId;
}

/// Launches one of the three top-k kernels: dtype x vector-width dispatch, shared memory, checks.
template <template <typename, int> class Launch, typename... Args>
void launch_topk(const char* what, EmbDtype dtype, const void* emb, int d, const TopkLayout& L,
                 int k, int64_t batch, int64_t stream, Args... args) {
  const unsigned grid = grid_for(batch, 1, what);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_vec<T>(pick_vec<T>(emb, d), [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      auto kernel = Launch<T, V>::kernel();
      prepare_smem(kernel, L.total, what, k);
      kernel<<<grid, kThreads, L.total, as_stream(stream)>>>(args...);
      check(cudaGetLastError(), what);
    });
  });
}

template <typename T, int V>
struct ScoreSegmentsLaunch {
  static auto kernel() { return &score_segments_kernel<T, V>; }
};
template <typename T, int V>
struct SelectPagesLaunch {
  static auto kernel() { return &select_pages_kernel<T, V>; }
};
template <typename T, int V>
struct KnowledgeTopkLaunch {
  static auto kernel() { return &knowledge_topk_kernel<T, V>; }
};

}  // namespace

// ---- Public launchers ---------------------------------------------------------------------------
bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: report 0 and leave no pending error
    return 0;
  }
  return n;
}

void score_segments_cuda(const QueryBatch& q, const SegmentView& seg, float keyword_weight,
                         TopK out, int64_t stream) {
  if (q.size == 0) return;
  DeviceGuard guard(q.emb);
  const TopkLayout L(q.dim, q.kw_width, out.k, 0);
  launch_topk<ScoreSegmentsLaunch>("score_segments", seg.dtype, seg.emb, q.dim, L, out.k, q.size,
                                   stream, q, seg, keyword_weight, out);
}

void select_pages_cuda(const QueryBatch& q, const int32_t* chosen, int32_t chosen_width,
                       const PageView& pages, float min_score, TopK out, int64_t stream) {
  if (q.size == 0) return;
  DeviceGuard guard(q.emb);
  const TopkLayout L(q.dim, 0, out.k, chosen_width);
  launch_topk<SelectPagesLaunch>("select_pages", pages.dtype, pages.emb, q.dim, L, out.k, q.size,
                                 stream, q, chosen, chosen_width, pages, min_score, out);
}

void knowledge_topk_cuda(const QueryBatch& q, const KnowledgeView& kn, TopK out, int64_t stream) {
  if (q.size == 0) return;
  DeviceGuard guard(q.emb);
  const TopkLayout L(q.dim, 0, out.k, 0);
  launch_topk<KnowledgeTopkLaunch>("knowledge_topk", kn.dtype, kn.emb, q.dim, L, out.k, q.size,
                                   stream, q, kn, out);
}

void apply_hits_cuda(const HitList& hits, HeatState state, int64_t stream) {
  if (hits.size == 0) return;
  DeviceGuard guard(hits.user);
  const unsigned grid = grid_for(hits.size, kHitThreads, "apply_hits");
  apply_hits_kernel<<<grid, kHitThreads, 0, as_stream(stream)>>>(hits, state);
  check(cudaGetLastError(), "apply_hits");
}

void recompute_heat_cuda(const HeatRecompute& req, HeatState state, const HeatParams& params,
                         int64_t stream) {
  if (req.size == 0) return;
  DeviceGuard guard(req.user);
  const unsigned grid = grid_for(req.size, kHeatWarps, "recompute_heat");
  recompute_heat_kernel<<<grid, kHeatWarps * 32, 0, as_stream(stream)>>>(req, state, params);
  check(cudaGetLastError(), "recompute_heat");
}

}  // namespace memoryos
