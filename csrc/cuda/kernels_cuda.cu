// memoryos-gpu: CUDA kernels. Same contracts, formulas and tie rules as csrc/cpu/kernels_cpu.cpp
// (one meaning for every input: see kernels.h); launch geometry and the reasons for it are in
// csrc/cuda/README.md.
//
// Device selection: every launcher switches to the device that owns its first input pointer
// (cudaPointerGetAttributes) for the duration of the call and restores the caller's device after,
// so arrays on a non-current GPU work; host pointers leave the current device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

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

constexpr int kThreads = 256;          // threads per CTA of the top-k kernels
constexpr int kWarps = kThreads / 32;  // 8
constexpr int kRowsPerGroup = 2;       // rows a lane group scores at once
constexpr int kChunk = kThreads;       // candidate positions resolved per pass (one per thread)
constexpr int kWarpTopk = 32;          // k up to this: one top-k list per warp, in registers
// At least 4 CTAs (32 warps) per SM: caps registers at 64, enough for 2 rows x 3 16-byte
// vectors in flight per lane without spills, and 32 warps keep ~48-96 KB in flight per SM,
// about twice what HBM needs to stay busy (bandwidth x latency / SMs).
constexpr int kMinCtasPerSm = 4;
constexpr int kHeatWarps = 8;     // recompute_heat: warps (= requests) per CTA
constexpr int kHitThreads = 256;  // apply_hits: threads per CTA
constexpr unsigned kFull = 0xffffffffu;
constexpr int kSpecialDim = 384;  // all-MiniLM-L6-v2, the default embedder: compiled apart
constexpr int kKwHash = 128;      // slots of the query keyword hash table (power of two)
constexpr int kKwHashMax = 64;    // sets up to this size use it (load <= 1/2), larger ones search

// ---- Host helpers: errors -----------------------------------------------------------------------
[[noreturn]] void fail(cudaError_t err, const char* what, const char* note = "") {
  throw std::runtime_error(std::string("memoryos_gpu CUDA error in ") + what + ": " +
                           cudaGetErrorString(err) + note);
}

/// Clears the runtime's last-error slot only if it holds `err`, the error our own call just
/// returned: an error recorded by other code stays for that code to see.
void consume_own(cudaError_t err) {
  if (err != cudaSuccess && cudaPeekAtLastError() == err) (void)cudaGetLastError();
}

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  consume_own(err);
  fail(err, what);
}

/// MEMORYOS_GPU_CUDA_SYNC=1: synchronise the stream after every launch, so that a fault inside
/// a kernel is reported by the launcher that started it (read once per process).
bool sync_launches() {
  static const bool on = [] {
    const char* v = std::getenv("MEMORYOS_GPU_CUDA_SYNC");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

/// Launches kernel<<<grid, block, smem, stream>>>(args...) and checks the launch itself (the
/// error cudaLaunchKernelEx returns, not a global "last error"), then, in sync mode, the run.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), unsigned grid, unsigned block, size_t smem,
            cudaStream_t stream, const char* what, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    consume_own(err);
    fail(err, what, " (an error left by earlier asynchronous work on this device shows here "
                    "too; MEMORYOS_GPU_CUDA_SYNC=1 attributes faults to their launch)");
  }
  if (sync_launches()) {
    const cudaError_t run = cudaStreamSynchronize(stream);
    if (run != cudaSuccess) {
      consume_own(run);
      fail(run, what, " (while the kernel ran)");
    }
  }
}

/// Switches to the device that owns `ptr` for one call; restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(const void* ptr) {
    cudaPointerAttributes attr{};
    // CUDA >= 11 answers for any pointer (host ones as unregistered); an error here means the
    // runtime itself is unusable, and the launch would fail with it anyway.
    check(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) return;
    int current = 0;
    check(cudaGetDevice(&current), "cudaGetDevice");
    if (current == attr.device) return;
    check(cudaSetDevice(attr.device), "cudaSetDevice");
    previous_ = current;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) consume_own(cudaSetDevice(previous_));
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

/// Opts `kernel` into `bytes` of dynamic shared memory when that exceeds the 48 KiB default.
/// The attribute is per function and device and only ever grows, under a lock, so a launch
/// that needs less than the current value never depends on which thread set it last (setting
/// it per call let one thread lower it between another thread's set and launch).
void ensure_smem(const void* kernel, size_t bytes, const char* what, int k) {
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
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> granted;
  std::lock_guard<std::mutex> lock(mutex);
  size_t& have = granted[{kernel, dev}];
  if (have >= bytes) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)),
        "cudaFuncSetAttribute");
  have = bytes;
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

/// Calls fn(integral_constant<V>, integral_constant<D>): D = 384 (compile-time row length, only
/// with 16-byte vectors) or 0 (run-time d), and V the vector width pick_vec allows.
template <typename T, typename Fn>
void dispatch_shape(const void* base, int d, Fn&& fn) {
  constexpr int v16 = 16 / static_cast<int>(sizeof(T)), v8 = 8 / static_cast<int>(sizeof(T));
  const int vec = pick_vec<T>(base, d);
  if (vec == v16 && d == kSpecialDim) {
    fn(std::integral_constant<int, v16>{}, std::integral_constant<int, kSpecialDim>{});
  } else if (vec == v16) {
    fn(std::integral_constant<int, v16>{}, std::integral_constant<int, 0>{});
  } else if (vec == v8) {
    fn(std::integral_constant<int, v8>{}, std::integral_constant<int, 0>{});
  } else {
    fn(std::integral_constant<int, 1>{}, std::integral_constant<int, 0>{});
  }
}

// ---- Row geometry -------------------------------------------------------------------------------
/// How one lane group scores a row: G lanes split it in V-element vectors, NV per lane.
/// Run-time d (D = 0): G = 32 and a loop. d = 384: all NV loads of a row are issued at once, and
/// G = 16 for 2-byte types (48 vectors = 3 per lane in 16 lanes, where 32 lanes would leave
/// half of them idle on their second vector), so a warp scores 4 rows per step, 2 for fp32.
template <int V, int D>
struct Geometry {
  static constexpr int nvec = D / V;
  static constexpr int group = (D == 0 || nvec % 32 == 0) ? 32 : (nvec % 16 == 0 ? 16 : 32);
  static constexpr int per_lane = D == 0 ? 0 : (nvec + group - 1) / group;
  static constexpr int groups = 32 / group;
  static constexpr int rows_per_warp = groups * kRowsPerGroup;
};

// ---- Shared-memory layout of the top-k kernels (same arithmetic on host and device) ------------
struct Entry {
  float score;
  int32_t id;
};

__host__ __device__ inline size_t align16(size_t n) { return (n + 15) & ~static_cast<size_t>(15); }

struct TopkLayout {
  size_t qs, qk, qflag, qset, qhash, cand, misc, wl, run0, run1, chunk, off, segrow, total;
  // d query floats, q_kw query keywords (raw, first-occurrence flags, set), the candidate rows
  // of one pass, the warp lists (k <= 32) or the running list (x2) + chunk (k > 32), and the
  // chosen_width segment ranges of select_pages.
  __host__ __device__ TopkLayout(int d, int q_kw, int k, int chosen_width) {
    size_t o = 0;
    qs = o;     o = align16(o + sizeof(float) * d);
    qk = o;     o = align16(o + sizeof(int32_t) * q_kw);
    qflag = o;  o = align16(o + sizeof(int32_t) * q_kw);
    qset = o;   o = align16(o + sizeof(int32_t) * q_kw);
    qhash = o;  o = align16(o + (q_kw > 0 ? sizeof(int32_t) * kKwHash : 0));
    cand = o;   o = align16(o + sizeof(int32_t) * kChunk);
    misc = o;   o = align16(o + sizeof(int32_t) * (8 + 2 * kWarps));  // scalars, counts, red
    const bool small = k <= kWarpTopk;
    wl = o;     o = align16(o + (small ? sizeof(Entry) * kWarps * kWarpTopk : 0));
    run0 = o;   o = align16(o + (small ? 0 : sizeof(Entry) * k));
    run1 = o;   o = align16(o + (small ? 0 : sizeof(Entry) * k));
    chunk = o;  o = align16(o + (small ? 0 : sizeof(Entry) * kChunk));
    off = o;    o = align16(o + sizeof(int64_t) * (chosen_width + 1));
    segrow = o; o = align16(o + sizeof(int64_t) * chosen_width);
    total = o;
  }
};

struct Smem {
  float* qs;
  int32_t* qk;
  int32_t* qflag;
  int32_t* qset;
  int32_t* qhash;    // [kKwHash] the query set as an open-addressing table, -1 = empty
  int32_t* cand;     // [kChunk] row index (= reported id) of each valid candidate of a pass
  int32_t* misc;     // [1] chunk count, [2..3] query keywords, [8, 8 + kWarps) per warp
  float* red;        // [kWarps] block reductions of stage_query (apart from misc: no reuse race)
  Entry* wl;         // [kWarps][kWarpTopk]
  Entry* run0;
  Entry* run1;
  Entry* chunk;
  int64_t* off;
  int64_t* seg_row;
};

__device__ Smem carve(const TopkLayout& L) {
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  Smem s;
  s.qs = reinterpret_cast<float*>(base + L.qs);
  s.qk = reinterpret_cast<int32_t*>(base + L.qk);
  s.qflag = reinterpret_cast<int32_t*>(base + L.qflag);
  s.qset = reinterpret_cast<int32_t*>(base + L.qset);
  s.qhash = reinterpret_cast<int32_t*>(base + L.qhash);
  s.cand = reinterpret_cast<int32_t*>(base + L.cand);
  s.misc = reinterpret_cast<int32_t*>(base + L.misc);
  s.red = reinterpret_cast<float*>(s.misc + 8 + kWarps);
  s.wl = reinterpret_cast<Entry*>(base + L.wl);
  s.run0 = reinterpret_cast<Entry*>(base + L.run0);
  s.run1 = reinterpret_cast<Entry*>(base + L.run1);
  s.chunk = reinterpret_cast<Entry*>(base + L.chunk);
  s.off = reinterpret_cast<int64_t*>(base + L.off);
  s.seg_row = reinterpret_cast<int64_t*>(base + L.segrow);
  return s;
}

// ---- Device helpers -----------------------------------------------------------------------------
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

/// Sum over the G lanes of a group (xor butterflies stay inside aligned groups of G lanes).
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

template <int G>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
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

/// The raw bits of vector i (V elements) of a row: one 16- or 8-byte load, or one element.
template <typename T, int V>
struct Raw {
  static constexpr int bytes = V * static_cast<int>(sizeof(T));
  using type = std::conditional_t<bytes == 16, uint4, std::conditional_t<bytes == 8, uint2, T>>;
};

template <typename T, int V>
__device__ __forceinline__ typename Raw<T, V>::type load_raw(const T* __restrict__ row, int i) {
  using R = typename Raw<T, V>::type;
  if constexpr (Raw<T, V>::bytes == 16 || Raw<T, V>::bytes == 8) {
    return __ldg(reinterpret_cast<const R*>(row) + i);
  } else {
    static_assert(V == 1, "vector loads are 16 or 8 bytes, or one element");
    return row[i];
  }
}

template <typename T, int V>
__device__ __forceinline__ void convert(const typename Raw<T, V>::type& raw, float (&out)[V]) {
  constexpr int per_word = 4 / static_cast<int>(sizeof(T));
  if constexpr (Raw<T, V>::bytes == 16) {
    unpack_word<T>(raw.x, out);
    unpack_word<T>(raw.y, out + per_word);
    unpack_word<T>(raw.z, out + 2 * per_word);
    unpack_word<T>(raw.w, out + 3 * per_word);
  } else if constexpr (Raw<T, V>::bytes == 8) {
    unpack_word<T>(raw.x, out);
    unpack_word<T>(raw.y, out + per_word);
  } else {
    out[0] = to_float(raw);
  }
}

/// Per row of a lane group: dot product with the (scaled) shared query and squared norm; null
/// rows give 0. With SCALED, every element is first multiplied by that row's power-of-two
/// factors (the rescaled pass): the same lanes sum the same elements in the same order, so a
/// row and its power-of-two multiple get bit-equal cosines on both passes. Results are
/// group-reduced (every lane of the group holds them).
// Why several rows per group: each lane issues all its loads of kRowsPerGroup rows before the
// first use, which doubles the bytes in flight per warp (the kernels are bandwidth-bound); the
// query is read from shared memory once per vector for all of them.
template <typename T, int V, int D, bool SCALED>
__device__ __forceinline__ void group_dot_norm(const float* qs, const T* const (&rows)[kRowsPerGroup],
                                               int d, int lane_g, const Pow2Scale (&scale)[kRowsPerGroup],
                                               float (&dot)[kRowsPerGroup],
                                               float (&norm)[kRowsPerGroup]) {
  using G = Geometry<V, D>;
  using R = typename Raw<T, V>::type;
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r) dot[r] = norm[r] = 0.f;
  auto accumulate = [&](int i, const R (&raw)[kRowsPerGroup]) {
    float qv[V];
    load_query<V>(qs, i, qv);
#pragma unroll
    for (int r = 0; r < kRowsPerGroup; ++r) {
      float e[V];
      convert<T, V>(raw[r], e);
#pragma unroll
      for (int t = 0; t < V; ++t) {
        const float x = SCALED ? (e[t] * scale[r].f1) * scale[r].f2 : e[t];
        dot[r] = fmaf(qv[t], x, dot[r]);
        norm[r] = fmaf(x, x, norm[r]);
      }
    }
  };
  if constexpr (D != 0) {
    R raw[G::per_lane][kRowsPerGroup];
#pragma unroll
    for (int j = 0; j < G::per_lane; ++j) {
      const int i = lane_g + j * G::group;
#pragma unroll
      for (int r = 0; r < kRowsPerGroup; ++r) {
        raw[j][r] = rows[r] != nullptr && i < G::nvec ? load_raw<T, V>(rows[r], i) : R{};
      }
    }
#pragma unroll
    for (int j = 0; j < G::per_lane; ++j) {
      if (lane_g + j * G::group < G::nvec) accumulate(lane_g + j * G::group, raw[j]);
    }
  } else {
    const int nvec = d / V;
#pragma unroll 2
    for (int i = lane_g; i < nvec; i += G::group) {
      R raw[kRowsPerGroup];
#pragma unroll
      for (int r = 0; r < kRowsPerGroup; ++r) raw[r] = rows[r] != nullptr ? load_raw<T, V>(rows[r], i) : R{};
      accumulate(i, raw);
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r) {
    dot[r] = group_sum<G::group>(dot[r]);
    norm[r] = group_sum<G::group>(norm[r]);
  }
}

/// max |element| of a row (group-reduced) and whether all its elements are finite (NaN
/// compares false, so it fails the finiteness test); for the rescaled pass only.
template <typename T, int V, int D>
__device__ __forceinline__ float group_max_abs(const T* row, int d, int lane_g, bool* finite) {
  using G = Geometry<V, D>;
  const int nvec = D != 0 ? G::nvec : d / V;
  float mx = 0.f;
  bool ok = true;
  for (int i = lane_g; row != nullptr && i < nvec; i += G::group) {
    float e[V];
    convert<T, V>(load_raw<T, V>(row, i), e);
#pragma unroll
    for (int t = 0; t < V; ++t) {
      const float a = fabsf(e[t]);
      ok &= a <= 3.40282346638528859812e+38f;
      mx = a > mx ? a : mx;
    }
  }
  const unsigned bad = __ballot_sync(kFull, !ok);
  const int lane = threadIdx.x & 31;
  const unsigned mine = G::group == 32 ? kFull : (0xffffu << (lane & 16));  // this lane's group
  *finite = (bad & mine) == 0;
  return group_max<G::group>(mx);
}

/// The rescaled pass of a group's two rows (redo0 / redo1: which need it; both are computed):
/// each row is scaled by the power of two that brings its largest |element| into [0.5, 1),
/// then summed exactly as the first pass did. Out of line: it is cold, and inlined it would
/// hold registers across the hot loop (ptxas spilled there).
template <typename T, int V, int D>
__device__ __noinline__ float2 rescaled_cosines(const float* qs, float q_norm, const T* row0,
                                                const T* row1, int d, int lane_g, float2 cosine,
                                                bool redo0, bool redo1) {
  static_assert(kRowsPerGroup == 2, "written for two rows per group");
  const T* const rows[kRowsPerGroup] = {row0, row1};
  float m[kRowsPerGroup];
  bool finite[kRowsPerGroup];
  Pow2Scale scale[kRowsPerGroup];
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r) {
    m[r] = group_max_abs<T, V, D>(rows[r], d, lane_g, &finite[r]);
    scale[r] = pow2_scale(pow2_exponent(m[r]));
  }
  float dot[kRowsPerGroup], norm[kRowsPerGroup];
  group_dot_norm<T, V, D, true>(qs, rows, d, lane_g, scale, dot, norm);
  float out[kRowsPerGroup] = {cosine.x, cosine.y};
  const bool redo[kRowsPerGroup] = {redo0, redo1};
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r) {
    if (!redo[r]) continue;
    out[r] = !finite[r] ? __int_as_float(0x7fffffff)  // NaN: ranks as -inf
             : m[r] == 0.f ? 0.f
                           : cosine_from_sums(dot[r], q_norm, norm[r]);
  }
  return make_float2(out[0], out[1]);
}

/// The cosines of a group's rows, overflow-safe: one pass, then (only if some row of the warp
/// has a squared norm outside [2^-60, FLT_MAX], warp-uniformly) the rescaled pass for those.
/// fp16 rows never need it: their squared norms lie in [2^-48, 2^33] or are 0.
template <typename T, int V, int D>
__device__ __forceinline__ void group_cosines(const float* qs, float q_norm,
                                              const T* const (&rows)[kRowsPerGroup], int d,
                                              int lane_g, float (&cosine)[kRowsPerGroup]) {
  Pow2Scale unit[kRowsPerGroup];
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r) unit[r] = Pow2Scale{1.f, 1.f};
  float dot[kRowsPerGroup], norm[kRowsPerGroup];
  group_dot_norm<T, V, D, false>(qs, rows, d, lane_g, unit, dot, norm);
  bool redo[kRowsPerGroup];
  bool any = false;
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r) {
    redo[r] = rows[r] != nullptr && !norm_in_safe_range(norm[r]);
    cosine[r] = cosine_from_sums(dot[r], q_norm, norm[r]);
    any |= redo[r];
  }
  if constexpr (!std::is_same_v<T, __half>) {
    if (__any_sync(kFull, any)) {  // warp-uniform: the rescaled pass shuffles
      const float2 c = rescaled_cosines<T, V, D>(qs, q_norm, rows[0], rows[1], d, lane_g,
                                                 make_float2(cosine[0], cosine[1]), redo[0],
                                                 redo[1]);
      cosine[0] = c.x;
      cosine[1] = c.y;
    }
  }
}

// ---- Query staging ------------------------------------------------------------------------------
/// Stages query b in shared memory as fp32, scaled by a power of two so its largest |component|
/// is in [0.5, 1) (exact; cosines keep their bits, and its squared norm is at most d). Returns
/// that squared norm, the same in every thread, or -1 for a query with a NaN or infinite
/// component (it gets a padded row). Must be called by the whole CTA; ends with __syncthreads.
// Why in shared memory: every lane group reads the whole query once per candidate row; from
// shared memory that costs no global traffic, and its norm is reduced once per CTA.
__device__ float stage_query(const float* q, int d, float* qs, float* red) {
  float mx = 0.f;
  bool ok = true;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = q[i];
    qs[i] = v;
    const float a = fabsf(v);
    ok &= a <= 3.40282346638528859812e+38f;
    mx = a > mx ? a : mx;
  }
  mx = group_max<32>(mx);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  if (__syncthreads_or(!ok)) return -1.f;  // block-uniform; also orders red[] and qs[]
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, red[w]);
  const Pow2Scale f = pow2_scale(pow2_exponent(m));
  float acc = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = (qs[i] * f.f1) * f.f2;
    qs[i] = v;
    acc = fmaf(v, v, acc);
  }
  acc = group_sum<32>(acc);
  __syncthreads();  // everyone has read red[] (the max) before it is reused
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += red[w];
  return total;
}

// ---- Keywords -----------------------------------------------------------------------------------
/// Builds the query's keyword set (sorted, unique: formulas.h) in shared memory in parallel:
/// each id's first occurrence before the first pad is placed at its rank among the distinct
/// ids. Returns the set size (the same in every thread). Whole CTA; ends with __syncthreads.
// Why not keyword_set(): that serial insertion is ~Q^2 dependent steps for one thread; here
// every thread does O(Q) independent ones.
__device__ int stage_query_keywords(const int32_t* kw, int width, const Smem& sm) {
  if (threadIdx.x == 0) {
    sm.misc[2] = width;  // the first pad's index
    sm.misc[3] = 0;      // the set's size
  }
  __syncthreads();
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const int32_t v = kw[i];
    sm.qk[i] = v;
    if (v == kKeywordPad) atomicMin(&sm.misc[2], i);
  }
  __syncthreads();
  const int len = sm.misc[2];
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    sm.qflag[i] = first_occurrence(sm.qk, i) ? 1 : 0;
  }
  __syncthreads();
  int mine = 0;
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    if (!sm.qflag[i]) continue;
    const int32_t v = sm.qk[i];
    int rank = 0;
    for (int j = 0; j < len; ++j) rank += sm.qflag[j] && sm.qk[j] < v;
    sm.qset[rank] = v;
    ++mine;
  }
  if (mine > 0) atomicAdd(&sm.misc[3], mine);
  __syncthreads();
  return sm.misc[3];
}

/// The query's keyword set as the segment scans see it: the sorted set, and for sets of up to
/// kKwHashMax ids also an open-addressing hash table of it.
// Why the table: a lookup is one shared-memory load (two at worst, load <= 1/2) where a binary
// search over the sorted set is ~log2(n) dependent loads, ~30 instructions per id; the scans
// run once per 32 ids of every candidate row, so this is the segment kernel's biggest cost.
struct KwSet {
  const int32_t* sorted;
  const int32_t* table;  // null: search `sorted`
  int n;

  __device__ __forceinline__ static unsigned slot(int32_t v) {
    return (static_cast<uint32_t>(v) * 0x9E3779B1u) >> 25;  // 7 bits: kKwHash = 128
  }
  __device__ __forceinline__ bool contains(int32_t v) const {
    if (table == nullptr) return set_contains(sorted, n, v);
    for (unsigned h = slot(v);; h = (h + 1) & (kKwHash - 1)) {
      const int32_t t = table[h];
      if (t == v) return true;
      if (t == kKeywordPad) return false;  // -1 never is an id (it ends a row)
    }
  }
};
static_assert(kKwHash == 128, "KwSet::slot takes 7 bits");

/// Fills the hash table with the set (whole CTA; ends with __syncthreads).
__device__ void build_kw_hash(const int32_t* set, int n, int32_t* table) {
  for (int i = threadIdx.x; i < kKwHash; i += blockDim.x) table[i] = kKeywordPad;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t v = set[i];
    for (unsigned h = KwSet::slot(v);; h = (h + 1) & (kKwHash - 1)) {
      if (atomicCAS(&table[h], kKeywordPad, v) == kKeywordPad) break;  // ids are unique
    }
  }
  __syncthreads();
}

struct KwCounts {
  int distinct;  ///< distinct ids before the first pad
  int inter;     ///< how many of those are in the query set
  bool sorted;   ///< non-decreasing up to the first pad (the fast scan's counts are valid)
};

/// Lane-parallel scan of one padded keyword row: lane j looks at id j of each 32-wide piece.
/// `first` is row[lane] (or the pad past the width), loaded early by the caller. On a
/// non-decreasing row, distinct ids are the ones that differ from their predecessor, and each
/// is binary-searched in the sorted query set.
// Why: the merge in formulas.h is serial (~K dependent steps per row); on sorted rows the
// same counts come from one coalesced load + ballots.
__device__ __forceinline__ KwCounts warp_kw_sorted(const int32_t* row, int width, int32_t first,
                                                   const KwSet& set, int lane) {
  KwCounts r{0, 0, true};
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
      return r;
    }
    const bool distinct = valid && (!has_prev || v != prev);
    const bool found = distinct && set.contains(v);
    r.distinct += __popc(__ballot_sync(kFull, distinct));
    r.inter += __popc(__ballot_sync(kFull, found));
    carry = __shfl_sync(kFull, v, 31);
    if (pads) break;
  }
  return r;
}

/// The same counts for a row in any order (outside the contract): each lane takes ids
/// j = lane, lane + 32, ... before the first pad and counts those that are first occurrences.
__device__ __noinline__ KwCounts warp_kw_any(const int32_t* row, int width, const KwSet& set,
                                             int lane) {
  const int len = keyword_count(row, width);  // every lane; the row is in L1 by now
  int distinct = 0, inter = 0;
  for (int j = lane; j < len; j += 32) {
    if (!first_occurrence(row, j)) continue;
    ++distinct;
    inter += set.contains(row[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    distinct += __shfl_xor_sync(kFull, distinct, o);
    inter += __shfl_xor_sync(kFull, inter, o);
  }
  return KwCounts{distinct, inter, true};
}

/// Jaccard of the query set and a segment's keyword row (whole warp; every lane gets it).
__device__ __forceinline__ float warp_jaccard(const int32_t* row, int width, int32_t first,
                                              const KwSet& set, int lane) {
  KwCounts c = warp_kw_sorted(row, width, first, set, lane);
  if (!c.sorted) c = warp_kw_any(row, width, set, lane);
  return jaccard_from_counts(c.inter, set.n, c.distinct);
}

// ---- Top-k --------------------------------------------------------------------------------------
/// One warp's running top-k (k <= 32) in registers: lane j holds its j-th entry, len is
/// warp-uniform. A new entry goes before any equal one (equal pairs are indistinguishable).
// Why: with S = 200 segments and k = 5 nothing is ever pruned by a CTA-wide threshold; in
// registers an insertion is a ballot and two shuffles, with no shared memory and no barrier.
struct WarpTopk {
  float score = 0.f;
  int32_t id = kNoId;
  int len = 0;
  float kth_score = 0.f;
  int32_t kth_id = kNoId;

  __device__ __forceinline__ void insert(float s, int32_t i, int k, int lane) {
    if (len == k && !ranks_before(s, i, kth_score, kth_id)) return;  // warp-uniform
    const bool ahead = lane < len && ranks_before(score, id, s, i);
    const int pos = __popc(__ballot_sync(kFull, ahead));
    const float up_s = __shfl_up_sync(kFull, score, 1);
    const int32_t up_i = __shfl_up_sync(kFull, id, 1);
    if (lane == pos) {
      score = s;
      id = i;
    } else if (lane > pos) {
      score = up_s;
      id = up_i;
    }
    len = len < k ? len + 1 : k;
    kth_score = __shfl_sync(kFull, score, k - 1);
    kth_id = __shfl_sync(kFull, id, k - 1);
  }
};

/// How many of list[0, n) (sorted) come before x: those ranking before it, and with
/// `equal_first` also those equal to it (a pool slot reached twice by raw block tables is a
/// candidate twice; equal pairs are then ordered by list, so ranks stay a permutation).
__device__ __forceinline__ int count_before(const Entry* list, int n, const Entry& x,
                                            bool equal_first) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    const Entry& y = list[mid];
    const bool before = equal_first ? !ranks_before(x.score, x.id, y.score, y.id)
                                    : ranks_before(y.score, y.id, x.score, x.id);
    if (before) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/// Merges the kWarps sorted warp lists into the first k of out_*, padded. Each entry's rank is
/// its index in its own list plus, per other list, the entries placed before it (count_before;
/// equal entries of lower-numbered lists first), so ranks are a permutation. Whole CTA.
__device__ void merge_warp_lists(const Entry* wl, const int32_t* wlen, int k, float* out_scores,
                                 int32_t* out_ids) {
  int total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += wlen[w];
  const int w = threadIdx.x / kWarpTopk, j = threadIdx.x % kWarpTopk;
  if (w < kWarps && j < wlen[w]) {
    const Entry x = wl[w * kWarpTopk + j];
    int rank = j;
    for (int o = 0; o < kWarps; ++o) {
      if (o != w) rank += count_before(wl + o * kWarpTopk, wlen[o], x, o < w);
    }
    if (rank < k) {
      out_scores[rank] = x.score;
      out_ids[rank] = x.id;
    }
  }
  for (int r = total + threadIdx.x; r < k; r += blockDim.x) {
    out_scores[r] = neg_inf();
    out_ids[r] = kNoId;
  }
}

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
      rank = count_before(cur, rn, x, true);
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

__device__ void write_padding(float* out_scores, int32_t* out_ids, int k) {
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    out_scores[j] = neg_inf();
    out_ids[j] = kNoId;
  }
}

// ---- The shared top-k loop ----------------------------------------------------------------------
/// Scores candidate positions [0, total) of one query and writes its top-k (padded) to out_*.
/// Per pass of kChunk positions: every thread resolves one position to a row (Src::resolve:
/// liveness, block table; -1 = skip) and the valid rows are compacted in shared memory; then
/// lane groups score them, kRowsPerGroup rows per group at a time. Must be called by the whole
/// CTA, after the query is staged.
// Why resolve first: the 1-byte live flag (and, for pages, the block table) used to gate every
// row's embedding load, a dependent round trip per row; resolved per pass, it is one coalesced
// load for 256 positions, the divisions happen once per position, and warps only ever see
// live rows (no idle warps on dead slots).
template <typename T, int V, int D, bool SMALLK, typename Src>
__device__ void topk_over(const Src& src, int64_t total, const Smem& sm, float q_norm, int d,
                          int k, float* out_scores, int32_t* out_ids) {
  using G = Geometry<V, D>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = lane / G::group, lane_g = lane % G::group;
  WarpTopk wt;
  Entry* cur = sm.run0;
  Entry* nxt = sm.run1;
  int rn = 0;  // entries in cur (k > 32); the same in every thread
  for (int64_t start = 0; start < total; start += kChunk) {
    // resolve + compact this pass's positions (order kept: warp ballots, then warp offsets)
    const int64_t p = start + threadIdx.x;
    const int32_t row = p < total ? src.resolve(p) : -1;
    const unsigned valid = __ballot_sync(kFull, row >= 0);
    if (lane == 0) sm.misc[8 + warp] = __popc(valid);
    if (threadIdx.x == 0) sm.misc[1] = 0;
    __syncthreads();
    int before = 0, n = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? sm.misc[8 + w] : 0;
      n += sm.misc[8 + w];
    }
    if (row >= 0) sm.cand[before + __popc(valid & ((1u << lane) - 1u))] = row;
    __syncthreads();
    // score: warp w takes rows [step + w * rows_per_warp, ...) of the compacted list
    for (int c0 = warp * G::rows_per_warp; c0 < n; c0 += kWarps * G::rows_per_warp) {
      const int mine = c0 + group * kRowsPerGroup;
      const T* rows[kRowsPerGroup];
      int32_t ids[kRowsPerGroup];
      int32_t pre[kRowsPerGroup][G::groups];
#pragma unroll
      for (int r = 0; r < kRowsPerGroup; ++r) {
        ids[r] = mine + r < n ? sm.cand[mine + r] : kNoId;
        rows[r] = ids[r] >= 0 ? src.emb + static_cast<int64_t>(ids[r]) * d : nullptr;
      }
      // keyword prefetch for every row of the warp (the scan needs all 32 lanes per row)
#pragma unroll
      for (int g = 0; g < G::groups; ++g) {
#pragma unroll
        for (int r = 0; r < kRowsPerGroup; ++r) {
          const int c = c0 + g * kRowsPerGroup + r;
          pre[r][g] = c < n ? src.prefetch(sm.cand[c], lane) : kKeywordPad;
        }
      }
      float cosine[kRowsPerGroup];
      group_cosines<T, V, D>(sm.qs, q_norm, rows, d, lane_g, cosine);
#pragma unroll
      for (int g = 0; g < G::groups; ++g) {
#pragma unroll
        for (int r = 0; r < kRowsPerGroup; ++r) {
          const int c = c0 + g * kRowsPerGroup + r;
          if (c >= n) continue;  // warp-uniform
          const int32_t id = sm.cand[c];
          const float cos_r = __shfl_sync(kFull, cosine[r], g * G::group);
          const float score = rank_score(src.score(id, cos_r, pre[r][g], lane));
          if (!src.keep(score)) continue;  // warp-uniform
          if constexpr (SMALLK) {
            wt.insert(score, id, k, lane);
          } else if (lane == 0 && (rn < k || ranks_before(score, id, cur[k - 1].score,
                                                          cur[k - 1].id))) {
            sm.chunk[atomicAdd(&sm.misc[1], 1)] = Entry{score, id};
          }
        }
      }
    }
    if constexpr (!SMALLK) {
      __syncthreads();
      const int cn = sm.misc[1];
      if (cn > 0) merge_chunk(cur, rn, sm.chunk, cn, k, nxt);
      __syncthreads();  // also: misc[1] is read by all before the next pass resets it
      if (cn > 0) {
        Entry* t = cur;
        cur = nxt;
        nxt = t;
        rn = rn + cn < k ? rn + cn : k;
      }
    } else {
      __syncthreads();  // cand[] and misc[8..] are reused by the next pass
    }
  }
  if constexpr (SMALLK) {
    if (lane < wt.len) sm.wl[warp * kWarpTopk + lane] = Entry{wt.score, wt.id};
    if (lane == 0) sm.misc[8 + warp] = wt.len;
    __syncthreads();
    merge_warp_lists(sm.wl, sm.misc + 8, k, out_scores, out_ids);
  } else {
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
      out_scores[j] = j < rn ? cur[j].score : neg_inf();
      out_ids[j] = j < rn ? cur[j].id : kNoId;
    }
  }
}

// ---- Candidate sources --------------------------------------------------------------------------
template <typename T>
struct SegmentSrc {
  const T* emb;         // this user's [S, d]
  const uint8_t* live;  // this user's [S]
  const int32_t* kw;    // this user's [S, K]
  int kw_width;
  KwSet qset;           // shared: the query's keyword set (n = 0: no keyword term)
  float keyword_weight;

  __device__ int32_t resolve(int64_t p) const { return live[p] ? static_cast<int32_t>(p) : -1; }
  __device__ int32_t prefetch(int32_t s, int lane) const {
    return qset.n > 0 && lane < kw_width ? kw[static_cast<int64_t>(s) * kw_width + lane]
                                         : kKeywordPad;
  }
  __device__ float score(int32_t s, float cosine, int32_t first, int lane) const {
    float jac = 0.f;
    if (qset.n > 0) {  // block-uniform
      jac = warp_jaccard(kw + static_cast<int64_t>(s) * kw_width, kw_width, first, qset, lane);
    }
    return segment_score(cosine, jac, keyword_weight);
  }
  __device__ bool keep(float) const { return true; }
};

template <typename T>
struct RingSrc {
  const T* emb;         // this owner's [R, d]
  const uint8_t* live;  // this owner's [R]

  __device__ int32_t resolve(int64_t p) const { return live[p] ? static_cast<int32_t>(p) : -1; }
  __device__ int32_t prefetch(int32_t, int) const { return 0; }
  __device__ float score(int32_t, float cosine, int32_t, int) const { return cosine; }
  __device__ bool keep(float) const { return true; }
};

template <typename T>
struct PageSrc {
  const T* emb;                // [NP, d]
  const uint8_t* live;         // [NP]
  const int32_t* block_table;  // [U, S, MB]
  const int64_t* off;          // shared [cw + 1]: first flat position of each chosen segment
  const int64_t* seg_row;      // shared [cw]: u * S + s
  int cw, block_size, table_width;
  int64_t num_pages;
  float min_score;

  __device__ int32_t resolve(int64_t p) const {
    int lo = 0, hi = cw - 1;  // the last chosen segment whose range starts at or before p
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (off[mid] <= p) lo = mid;
      else hi = mid - 1;
    }
    const int32_t i = static_cast<int32_t>(p - off[lo]);  // < MB * P <= INT_MAX pages
    const int32_t block = block_table[seg_row[lo] * table_width + i / block_size];
    const int64_t slot = static_cast<int64_t>(block) * block_size + i % block_size;
    if (block < 0 || slot >= num_pages || !live[slot]) return -1;
    return static_cast<int32_t>(slot);
  }
  __device__ int32_t prefetch(int32_t, int) const { return 0; }
  __device__ float score(int32_t, float cosine, int32_t, int) const { return cosine; }
  __device__ bool keep(float score) const { return !(score < min_score); }
};

// ---- Kernels ------------------------------------------------------------------------------------
// Why one CTA per query: the query's candidates (one user's S slots, or its chosen segments'
// pages) are scored by 8 warps in parallel and ranked in that CTA, with no cross-CTA merge;
// 1k-10k queries give thousands of CTAs to fill every SM.
template <typename T, int V, int D, bool SMALLK>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    score_segments_kernel(QueryBatch q, SegmentView seg, float keyword_weight, TopK out) {
  const int64_t b = blockIdx.x;
  const TopkLayout L(q.dim, q.kw_width, out.k, 0);
  const Smem sm = carve(L);
  float* out_s = out.scores + b * out.k;
  int32_t* out_i = out.ids + b * out.k;
  const int32_t u = q.user[b];
  if (u < 0 || u >= seg.num_users) {  // block-uniform
    write_padding(out_s, out_i, out.k);
    return;
  }
  const float q_norm = stage_query(q.emb + b * q.dim, q.dim, sm.qs, sm.red);  // syncs
  if (q_norm < 0.f) {
    write_padding(out_s, out_i, out.k);
    return;
  }
  const bool has_kw = q.kw_width > 0 && q.keywords != nullptr;
  const int nset = has_kw ? stage_query_keywords(q.keywords + b * q.kw_width, q.kw_width, sm) : 0;
  const bool hashed = nset > 0 && nset <= kKwHashMax;  // block-uniform
  if (hashed) build_kw_hash(sm.qset, nset, sm.qhash);
  const int64_t base = static_cast<int64_t>(u) * seg.slots;
  SegmentSrc<T> src;
  src.emb = static_cast<const T*>(seg.emb) + base * q.dim;
  src.live = seg.live + base;
  src.kw = seg.keywords + base * seg.kw_width;
  src.kw_width = seg.kw_width;
  src.qset = KwSet{sm.qset, hashed ? sm.qhash : nullptr, nset};
  src.keyword_weight = keyword_weight;
  topk_over<T, V, D, SMALLK>(src, seg.slots, sm, q_norm, q.dim, out.k, out_s, out_i);
}

template <typename T, int V, int D, bool SMALLK>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    select_pages_kernel(QueryBatch q, const int32_t* chosen, int32_t chosen_width, PageView pages,
                        float min_score, TopK out) {
  const int64_t b = blockIdx.x;
  const TopkLayout L(q.dim, 0, out.k, chosen_width);
  const Smem sm = carve(L);
  float* out_s = out.scores + b * out.k;
  int32_t* out_i = out.ids + b * out.k;
  const int32_t u = q.user[b];
  if (u < 0 || u >= pages.num_users || chosen_width <= 0) {
    write_padding(out_s, out_i, out.k);
    return;
  }
  // Per chosen segment: its row and page count (capped at the table; 0 for a slot out of
  // range or repeated: a segment chosen twice counts once), in parallel.
  const int32_t* mine = chosen + b * chosen_width;
  const int64_t cap = static_cast<int64_t>(pages.table_width) * pages.block_size;
  for (int c = threadIdx.x; c < chosen_width; c += blockDim.x) {
    const int32_t s = mine[c];
    int64_t n = 0, row = 0;
    if (s >= 0 && s < pages.slots && first_occurrence(mine, c)) {
      row = static_cast<int64_t>(u) * pages.slots + s;
      const int32_t np = pages.npages[row];
      n = np < 0 ? 0 : (np < cap ? np : cap);
    }
    sm.seg_row[c] = row;
    sm.off[c + 1] = n;  // counts for now; prefix-summed below
  }
  const float q_norm = stage_query(q.emb + b * q.dim, q.dim, sm.qs, sm.red);  // syncs
  if (q_norm < 0.f) {
    write_padding(out_s, out_i, out.k);
    return;
  }
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
  src.block_size = pages.block_size;
  src.table_width = pages.table_width;
  src.num_pages = pages.num_pages;
  src.min_score = min_score;
  topk_over<T, V, D, SMALLK>(src, sm.off[chosen_width], sm, q_norm, q.dim, out.k, out_s, out_i);
}

template <typename T, int V, int D, bool SMALLK>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    knowledge_topk_kernel(QueryBatch q, KnowledgeView kn, TopK out) {
  const int64_t b = blockIdx.x;
  const TopkLayout L(q.dim, 0, out.k, 0);
  const Smem sm = carve(L);
  float* out_s = out.scores + b * out.k;
  int32_t* out_i = out.ids + b * out.k;
  const int32_t o = q.user[b];
  if (o < 0 || o >= kn.num_owners) {
    write_padding(out_s, out_i, out.k);
    return;
  }
  const float q_norm = stage_query(q.emb + b * q.dim, q.dim, sm.qs, sm.red);  // syncs
  if (q_norm < 0.f) {
    write_padding(out_s, out_i, out.k);
    return;
  }
  const int64_t base = static_cast<int64_t>(o) * kn.capacity;
  RingSrc<T> src;
  src.emb = static_cast<const T*>(kn.emb) + base * q.dim;
  src.live = kn.live + base;
  topk_over<T, V, D, SMALLK>(src, kn.capacity, sm, q_norm, q.dim, out.k, out_s, out_i);
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

/// Launches one of the three top-k kernels: dtype x shape x top-k mode dispatch, shared
/// memory, checks.
template <template <typename, int, int, bool> class Kernel, typename... Args>
void launch_topk(const char* what, EmbDtype dtype, const void* emb, int d, const TopkLayout& L,
                 int k, int64_t batch, int64_t stream, Args... args) {
  const unsigned grid = grid_for(batch, 1, what);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_shape<T>(emb, d, [&](auto vec, auto dim) {
      constexpr int V = decltype(vec)::value, D = decltype(dim)::value;
      auto run = [&](auto kernel) {
        ensure_smem(reinterpret_cast<const void*>(kernel), L.total, what, k);
        launch(kernel, grid, kThreads, L.total, as_stream(stream), what, args...);
      };
      if (k <= kWarpTopk) run(Kernel<T, V, D, true>::kernel());
      else run(Kernel<T, V, D, false>::kernel());
    });
  });
}

template <typename T, int V, int D, bool SMALLK>
struct ScoreSegmentsKernel {
  static auto kernel() { return &score_segments_kernel<T, V, D, SMALLK>; }
};
template <typename T, int V, int D, bool SMALLK>
struct SelectPagesKernel {
  static auto kernel() { return &select_pages_kernel<T, V, D, SMALLK>; }
};
template <typename T, int V, int D, bool SMALLK>
struct KnowledgeTopkKernel {
  static auto kernel() { return &knowledge_topk_kernel<T, V, D, SMALLK>; }
};

}  // namespace

// ---- Public launchers ---------------------------------------------------------------------------
bool cuda_compiled() { return true; }

bool cuda_sync_launches() { return sync_launches(); }

int cuda_device_count() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    consume_own(err);  // no driver / no device: report 0, leave no error of ours behind
    return 0;
  }
  return n;
}

void score_segments_cuda(const QueryBatch& q, const SegmentView& seg, float keyword_weight,
                         TopK out, int64_t stream) {
  if (q.size == 0) return;
  DeviceGuard guard(q.emb);
  const TopkLayout L(q.dim, q.kw_width, out.k, 0);
  launch_topk<ScoreSegmentsKernel>("score_segments", seg.dtype, seg.emb, q.dim, L, out.k, q.size,
                                   stream, q, seg, keyword_weight, out);
}

void select_pages_cuda(const QueryBatch& q, const int32_t* chosen, int32_t chosen_width,
                       const PageView& pages, float min_score, TopK out, int64_t stream) {
  if (q.size == 0) return;
  DeviceGuard guard(q.emb);
  const TopkLayout L(q.dim, 0, out.k, chosen_width);
  launch_topk<SelectPagesKernel>("select_pages", pages.dtype, pages.emb, q.dim, L, out.k, q.size,
                                 stream, q, chosen, chosen_width, pages, min_score, out);
}

void knowledge_topk_cuda(const QueryBatch& q, const KnowledgeView& kn, TopK out, int64_t stream) {
  if (q.size == 0) return;
  DeviceGuard guard(q.emb);
  const TopkLayout L(q.dim, 0, out.k, 0);
  launch_topk<KnowledgeTopkKernel>("knowledge_topk", kn.dtype, kn.emb, q.dim, L, out.k, q.size,
                                   stream, q, kn, out);
}

void apply_hits_cuda(const HitList& hits, HeatState state, int64_t stream) {
  if (hits.size == 0) return;
  DeviceGuard guard(hits.user);
  const unsigned grid = grid_for(hits.size, kHitThreads, "apply_hits");
  launch(&apply_hits_kernel, grid, kHitThreads, 0, as_stream(stream), "apply_hits", hits, state);
}

void recompute_heat_cuda(const HeatRecompute& req, HeatState state, const HeatParams& params,
                         int64_t stream) {
  if (req.size == 0) return;
  DeviceGuard guard(req.user);
  const unsigned grid = grid_for(req.size, kHeatWarps, "recompute_heat");
  launch(&recompute_heat_kernel, grid, kHeatWarps * 32, 0, as_stream(stream), "recompute_heat",
         req, state, params);
}

}  // namespace memoryos
