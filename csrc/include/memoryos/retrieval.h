// memoryos-gpu: the fused retrieval pass. For each query of a batch, over its own user's MTM:
//
//   1. segment score F = cos(e_s, q) + w * Jaccard(K_s, K_q) over the live segments -> top m;
//   2. dense candidates: the pages of those m segments with cosine >= the relevance floor;
//   3. lexical candidates: the user's MTM pages that contain a query term, scored by BM25 with
//      the user's own document frequencies (computed here from the pages' term rows); with
//      lexical_candidates = L > 0 only the L best of them (ties kept: lexical_floor), so that a
//      long history, where a name or a common word matches most pages, does not cost a cosine
//      for every page;
//   4. fusion over the union of both candidate sets: every candidate gets both its cosine and its
//      BM25 (0 when no query term matches), each signal is standardised over the union
//      ((x - mean) / std; a signal flat over them contributes 0: flat_spread), and the weighted
//      sum ranks them -> top k pages, best first, ties to the lower pool slot.
//
// One call does all of it, so nothing goes back to the host between the steps. The formulas are
// written once below (host and device); memoryos_gpu/ops/retrieval_reference.py restates them.
//
// Why the union: standardising each list over its own candidates (the earlier rule) maps a
// list's last candidate to the same 0 as a page the list never returned, and blows a list of
// three nearly equal BM25 scores up to the same spread as a decisive list. Scored on the union,
// a page that matches a query term always has the higher BM25 than one that does not, a list
// of near-equal matches stays near-equal against the non-matches, and each signal is still
// invariant to its own scale and offset. On LoCoMo dev it recalls more evidence than the
// earlier rule at 10 and 20 pages (benchmarks/README.md).
#pragma once

#include <cstdint>

#include "memoryos/formulas.h"
#include "memoryos/kernels.h"

namespace memoryos {

/// The lexical index: one ascending row of (term id, tf) per page pool slot, in a shared pool.
struct LexicalView {
  const int64_t* start;   ///< [NP] first entry of page p's row in terms / tf
  const int32_t* count;   ///< [NP] distinct terms of page p (0: not indexed)
  const int32_t* length;  ///< [NP] tokens of page p, BM25's |D|
  const int32_t* terms;   ///< [T] term ids, ascending within each row
  const int32_t* tf;      ///< [T] occurrences of the term in the page
  int64_t num_entries;    ///< T
};

/// Each query's distinct term ids in order of first occurrence, CSR.
struct QueryTerms {
  const int64_t* offsets;  ///< [B + 1]
  const int32_t* ids;      ///< [offsets[B]]
};

struct RetrievalParams {
  int32_t top_segments;    ///< m
  float keyword_weight;    ///< weight of Jaccard(K_s, K_q) in the segment score
  int32_t jaccard_terms;   ///< K_q = the first this-many query terms
  float dense_floor;       ///< a page of a chosen segment is a candidate when its cosine >= this
  float lexical_weight;    ///< weight of the BM25 list against the dense list's 1; 0 = no BM25
  int32_t lexical_candidates;  ///< the BM25 list's length L (lexical_floor); 0 = every match
  float bm25_k1;
  float bm25_b;
};

/// [B, k] outputs, best first, padded with -inf / kNoId.
struct RetrievalOut {
  float* score;      ///< fused score
  int32_t* page;     ///< page pool slot
  int32_t* segment;  ///< segment slot the page lives in
  int32_t k;
};

/// Served pages fold into their segments' heat: each (query, segment) once, N_visit += 1,
/// last_access = max(last_access, now); heat recomputed for those segments.
struct ServedHits {
  const int32_t* user;     ///< [B]
  const int32_t* segment;  ///< [B, k] (RetrievalOut.segment)
  const double* now;       ///< [B]
  int64_t size;            ///< B
  int32_t k;
  uint8_t* credited;       ///< out [B, k]: 1 at the first position of each credited segment
  uint8_t* promote;        ///< out [B, k]: credited and heat >= tau and L_interaction > 0
};

// ---- formulas (host and device) ------------------------------------------------------------

/// BM25's inverse document frequency, ln(1 + (N - df + 0.5) / (df + 0.5)) (always > 0).
MOS_HD float bm25_idf(int32_t n_docs, int32_t df) {
  return logf(1.f + (static_cast<float>(n_docs - df) + 0.5f) / (static_cast<float>(df) + 0.5f));
}

/// One matching term's BM25 contribution: idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b*|D|/avg)).
MOS_HD float bm25_term(float idf, int32_t tf, int32_t doc_len, float avg_len, float k1, float b) {
  const float t = static_cast<float>(tf);
  return idf * t * (k1 + 1.f) / (t + k1 * (1.f - b + b * static_cast<float>(doc_len) / avg_len));
}

/// A page's BM25 is the sum of its matching terms' contributions taken in fixed point (steps of
/// 2^-32, int64): integer addition is associative, so two pages whose contributions are the same
/// in another order get the same bits. A float sum could differ in its last bit, and
/// standardising a list of such ties (all candidates equal but for rounding) would blow that
/// residue up to a full spread of +-1.
MOS_HD int64_t bm25_fixed(float contribution) {
  return static_cast<int64_t>(contribution * 4294967296.f + 0.5f);  // >= 0: round half up
}
MOS_HD float bm25_from_fixed(int64_t sum) {
  return static_cast<float>(static_cast<double>(sum) * 2.3283064365386963e-10);  // * 2^-32
}

/// Relative slack under the L-th highest BM25 (see lexical_floor).
constexpr float kLexicalTieSlack = 1e-5f;

/// The lowest BM25 that still makes the lexical list, given the L-th highest of the user's pages.
/// Scores within kLexicalTieSlack of it are kept, so that a near-tie that float32 kernels and a
/// float64 reference could order either way never splits the list differently.
MOS_HD float lexical_floor(float lth_highest) { return lth_highest * (1.f - kLexicalTieSlack); }

/// A signal is flat over the candidates when its spread is within this fraction of its
/// magnitude. Scores equal in exact arithmetic can come out of float32 formulas an ulp or a few
/// apart (BM25 of tf 3 in 5 tokens and of tf 1 in 1 token, say): standardising such a residue
/// would blow it up to a full +-1 spread, one that a float64 reference does not see. A spread
/// this small against the scores' size carries no ranking either way.
constexpr float kFlatSpread = 1e-5f;

/// Whether a signal whose candidates range over [lo, hi] counts as equal on all of them.
MOS_HD bool flat_spread(float lo, float hi) {
  return hi - lo <= kFlatSpread * fmaxf(fabsf(lo), fabsf(hi));
}

/// A signal standardised over the candidates: (x - mean) / std, 0 when the signal is flat over
/// them (std = 0 is passed then, never a rounding residue: flat_spread).
MOS_HD float standardized(float x, float mean, float stddev) {
  return stddev > 0.f ? (x - mean) / stddev : 0.f;
}

/// A candidate's fused score. Without the lexical list it is the cosine itself (the paper).
MOS_HD float fused_score(float cosine, float cos_mean, float cos_std, float lexical,
                         float lex_mean, float lex_std, float lexical_weight) {
  if (!(lexical_weight > 0.f)) return cosine;
  return standardized(cosine, cos_mean, cos_std) +
         lexical_weight * standardized(lexical, lex_mean, lex_std);
}

/// Index of `id` in an ascending row, or -1.
MOS_HD int32_t find_term(const int32_t* row, int32_t n, int32_t id) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = (lo + hi) >> 1;
    if (row[mid] < id) lo = mid + 1;
    else hi = mid;
  }
  return lo < n && row[lo] == id ? lo : -1;
}

// ---- launchers -----------------------------------------------------------------------------
class Postings;  // memoryos/postings.h: per-user postings of long histories (CPU)

/// `postings`: null, or the users' postings (a user that has them is scored from them; the
/// scores are the row scan's to the bit).
void retrieve_cpu(const QueryBatch& q, const QueryTerms& terms, const SegmentView& seg,
                  const PageView& pages, const LexicalView& lex, const Postings* postings,
                  const RetrievalParams& params, RetrievalOut out);
void credit_served_cpu(const ServedHits& hits, HeatState state, const HeatParams& params);

/// `scratch`: device floats [B, 2 * scratch_width], scratch_width >= the page positions of any
/// query's user (the sum of its live segments' page counts).
void retrieve_cuda(const QueryBatch& q, const QueryTerms& terms, const SegmentView& seg,
                   const PageView& pages, const LexicalView& lex, const RetrievalParams& params,
                   RetrievalOut out, float* scratch, int32_t scratch_width, int64_t stream);
void credit_served_cuda(const ServedHits& hits, HeatState state, const HeatParams& params,
                        int64_t stream);

}  // namespace memoryos
