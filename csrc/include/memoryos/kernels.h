// memoryos-gpu: kernel contracts shared by the CPU loops, the CUDA kernels and the bindings.
//
// Raw pointers plus shapes only (no Python, no torch). Every array is dense row-major.
// Both paths (CPU and CUDA) give every input the same meaning, inside the contract or not:
// an out-of-range user / owner slot gets a padded row; an out-of-range chosen segment slot,
// a repeated one, a hit outside [0, U) x [0, S) is skipped; a query with a NaN or infinite
// component gets a padded row; keyword rows are sets (formulas.h, "Keyword sets"); a NaN
// score (a stored row with NaN or infinity) ranks and reports as -inf; a pool slot that the
// block tables reach twice is a candidate twice (the arena never builds such tables).
// Shapes below use: B queries, U user slots, S segment slots per user, d embedding dim,
// K keyword width of a segment row, Q keyword width of a query row, MB block-table width,
// P pages per block, NP page-pool slots (= blocks * P), O knowledge owners, R ring capacity.
#pragma once

#include <cstdint>

#include "memoryos/formulas.h"

namespace memoryos {

/// Element type of stored embeddings. Queries are always fp32; scores accumulate in fp32.
enum class EmbDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

/// The segment part of the arena, as the scoring kernels read it.
struct SegmentView {
  const void* emb;         ///< [U, S, d] EmbDtype
  const int32_t* keywords; ///< [U, S, K] ids, kKeywordPad-padded (sorted, unique: fast path)
  const uint8_t* live;     ///< [U, S] 1 = slot holds a segment
  int64_t num_users;       ///< U
  int32_t slots;           ///< S
  int32_t kw_width;        ///< K
  EmbDtype dtype;
};

/// The page part of the arena: a pool of fixed-size blocks and a block table per segment.
/// Page i of segment (u, s) lives in pool slot block_table[u, s, i / P] * P + i % P.
struct PageView {
  const void* emb;            ///< [NP, d] EmbDtype
  const uint8_t* live;        ///< [NP] 0 = deleted page (skipped, never returned)
  const int32_t* npages;      ///< [U, S] pages appended to the segment (deleted ones included)
  const int32_t* block_table; ///< [U, S, MB] block ids, -1 past the end
  int64_t num_pages;          ///< NP
  int64_t num_users;          ///< U (rows of npages / block_table)
  int32_t slots;              ///< S (rows of npages / block_table per user)
  int32_t block_size;         ///< P
  int32_t table_width;        ///< MB
  EmbDtype dtype;
};

/// A batch of queries. A user[b] outside [0, U) gets a padded row.
struct QueryBatch {
  const float* emb;        ///< [B, d]
  const int32_t* user;     ///< [B] user slot (or knowledge owner slot)
  const int32_t* keywords; ///< [B, Q] ids, padded (any order); may be null when Q == 0
  int64_t size;            ///< B
  int32_t dim;             ///< d (of every embedding array the kernel reads)
  int32_t kw_width;        ///< Q
};

/// Heat statistics of every segment slot ([U, S] each).
struct HeatState {
  int32_t* n_visit;
  int32_t* l_interaction;
  double* last_access;
  float* heat;
  const uint8_t* live;
  int64_t num_users;
  int32_t slots;
};

/// Retrieval hits to fold into the heat statistics: N_visit += 1, last_access = max(last, now).
struct HitList {
  const int32_t* user;  ///< [H]
  const int32_t* slot;  ///< [H]
  const double* now;    ///< [H]
  int64_t size;         ///< H
};

/// Users whose heat is recomputed at their own "now" (logical or wall clock).
struct HeatRecompute {
  const int32_t* user;       ///< [n]
  const double* now;         ///< [n]
  const uint8_t* need_evict; ///< [n] 1 = also pick this user's eviction victim
  int64_t size;              ///< n
  bool evict_by_visits;      ///< false: lowest heat (paper); true: lowest N_visit (LFU, reference)
  uint8_t* promote;          ///< out [n, S]: 1 = live and heat >= tau
  int32_t* evict_slot;       ///< out [n]: victim slot, -1 when not asked or no live segment
};

/// The knowledge ring buffers.
struct KnowledgeView {
  const void* emb;       ///< [O, R, d] EmbDtype
  const uint8_t* live;   ///< [O, R]
  int64_t num_owners;    ///< O
  int32_t capacity;      ///< R
  EmbDtype dtype;
};

/// Top-k outputs, [B, k] each, padded with -inf / kNoId.
struct TopK {
  float* scores;
  int32_t* ids;
  int32_t k;
};

// ---- CPU (csrc/cpu/kernels_cpu.cpp), OpenMP over queries / users -------------------------------
void score_segments_cpu(const QueryBatch& q, const SegmentView& seg, float keyword_weight,
                        TopK out);
void select_pages_cpu(const QueryBatch& q, const int32_t* chosen, int32_t chosen_width,
                      const PageView& pages, float min_score, TopK out);
void apply_hits_cpu(const HitList& hits, HeatState state);
void recompute_heat_cpu(const HeatRecompute& req, HeatState state, const HeatParams& params);
void knowledge_topk_cpu(const QueryBatch& q, const KnowledgeView& kn, TopK out);

/// Self-check of the CPU determinism rule (csrc/cpu/vector_math.h): the cosines of rows [n, d]
/// with q computed by the baseline build into out[0, n) and, where the CPU has AVX2, by the
/// AVX2 build into out[n, 2n); returns how many builds ran (1 or 2). Both must be bit-equal.
int cpu_cosines_per_isa(const float* q, const float* rows, int64_t n, int d, float* out);

// ---- CUDA (csrc/cuda/kernels_cuda.cu); stream is a cudaStream_t passed as an integer -----------
bool cuda_compiled();
int cuda_device_count();
/// MEMORYOS_GPU_CUDA_SYNC=1: every launch synchronises its stream and reports a fault there.
bool cuda_sync_launches();
void score_segments_cuda(const QueryBatch& q, const SegmentView& seg, float keyword_weight,
                         TopK out, int64_t stream);
void select_pages_cuda(const QueryBatch& q, const int32_t* chosen, int32_t chosen_width,
                       const PageView& pages, float min_score, TopK out, int64_t stream);
void apply_hits_cuda(const HitList& hits, HeatState state, int64_t stream);
void recompute_heat_cuda(const HeatRecompute& req, HeatState state, const HeatParams& params,
                         int64_t stream);
void knowledge_topk_cuda(const QueryBatch& q, const KnowledgeView& kn, TopK out, int64_t stream);

}  // namespace memoryos
