// memoryos-gpu: per-user BM25 postings for long histories (CPU).
//
// The lexical index is one term row per page (LexicalView): a query walks its user's pages and
// tests each row's terms against the query's. That costs every term of every page, so a user
// with thousands of MTM pages paid ~0.1 us a page a query for the scan alone (history.py). A
// user with at least `min_pages` indexed pages therefore also gets postings: for each term, the
// pages holding it, so a query touches only its own terms' pages. The rows stay the source of
// truth (the CUDA pass scans them in parallel, the arena compacts them, a reopen loads them);
// the postings follow every row written or cleared.
//
// Deletion is lazy: each page slot has a generation, bumped whenever its row is cleared (a
// page deleted, its segment evicted, its row rewritten), and a posting counts only while its
// generation is its slot's. A user's lists are compacted when stale postings outnumber live
// ones. Results are the scan's to the bit: the same integer df, N and lengths, and BM25 summed
// in fixed point, where order does not matter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace memoryos {

/// One page holding a term: its pool slot, the term's count there, and the slot's generation
/// when the row was written.
struct Posting {
  int32_t slot;
  int32_t tf;
  uint32_t gen;
};

class Postings {
 public:
  /// One user's postings: term id -> pages holding it, and the counts of live and stale ones.
  struct UserIndex {
    std::unordered_map<int32_t, std::vector<Posting>> lists;
    int64_t live = 0;
    int64_t stale = 0;
  };

  explicit Postings(int32_t min_pages);

  int32_t min_pages() const { return min_pages_; }
  int64_t num_slots() const { return static_cast<int64_t>(gen_.size()); }
  /// User u's postings, or null (fewer than min_pages indexed pages: the pass scans its rows).
  const UserIndex* user(int64_t u) const {
    return u >= 0 && static_cast<size_t>(u) < index_.size() ? index_[u].get() : nullptr;
  }
  /// Whether a posting still describes its slot's row.
  bool current(const Posting& p) const { return gen_[static_cast<size_t>(p.slot)] == p.gen; }

  /// Follow the page pool to `num_slots` slots.
  void grow_slots(int64_t num_slots);
  /// Rows written (after `clear` of the same slots): page slots[i] of user users[i] holds the
  /// ascending ids[offsets[i]:offsets[i + 1]] with counts tf. Returns the users that reached
  /// min_pages indexed pages and have no postings yet: the caller builds them (`build`).
  std::vector<int32_t> write(const int32_t* users, const int64_t* slots, int64_t n,
                             const int64_t* offsets, const int32_t* ids, const int32_t* tf);
  /// Rows cleared (`terms[i]`: the distinct terms row slots[i] held, the lexical pool's count
  /// before the clear): their postings go stale.
  void clear(const int64_t* slots, const int32_t* terms, int64_t n);
  /// User u's postings from the rows of its indexed page slots (the lexical pool's arrays).
  void build(int32_t u, const int64_t* slots, int64_t n, const int64_t* start,
             const int32_t* count, const int32_t* terms, const int32_t* tf);
  /// Heap bytes held (lists at their capacity, the per-slot and per-user arrays).
  size_t nbytes() const;

 private:
  void grow_users(int32_t u);
  static void compact(UserIndex& ix, const std::vector<uint32_t>& gen);

  int32_t min_pages_;
  std::vector<uint32_t> gen_;    // per slot
  std::vector<int32_t> owner_;   // per slot: the user of its row, -1 when unindexed
  std::vector<int32_t> pages_;   // per user: indexed pages
  std::vector<std::unique_ptr<UserIndex>> index_;  // per user, null below min_pages
};

}  // namespace memoryos
