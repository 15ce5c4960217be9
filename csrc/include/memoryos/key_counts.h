// memoryos-gpu: a flat hash table of int64 keys to int32 counts (each user's vocabulary).
//
// Why native: every accepted page adds ~30 (user, term) keys and every derived page looks up
// as many. A NumPy log-structured table (sorted runs merged by searchsorted + insert) cost
// ~5 us a page of memory-system time in bulk ingestion, most of it re-sorting keys as runs
// merged; one probe a key costs a few nanoseconds. Open addressing over power-of-two slots,
// linear probing, a zero count removed at once (backward-shift deletion, so no tombstones:
// a long-lived table with many deleted users does not slow down). Slots are 12 bytes (key,
// count) and the table grows at 3/4 full: 16-32 bytes a key against the sorted runs' 12 (at
// 10,000 users x 20 LoCoMo pages, 2.65 million keys: 50 MB against ~32 MB; growing at 1/2
// full took 24-48 bytes a key).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace memoryos {

class KeyCounts {
 public:
  KeyCounts();

  /// Add ``sign`` for each occurrence of each key (a key twice adds twice); a count that
  /// reaches 0 is removed. Keys must be >= 0 (the empty-slot marker is -1).
  void add(const int64_t* keys, int64_t n, int32_t sign);
  /// The count of each key (0 where absent, and for a negative key).
  void lookup(const int64_t* keys, int64_t n, int32_t* out) const;
  /// Remove every key in [lo, hi); returns how many were removed.
  int64_t erase_range(int64_t lo, int64_t hi);

  int64_t size() const { return size_; }
  int64_t nbytes() const;

 private:
  static constexpr int64_t kEmpty = -1;
  size_t slot_of(int64_t key) const;
  void grow();
  void erase_at(size_t slot);

  std::vector<int64_t> keys_;
  std::vector<int32_t> counts_;
  size_t mask_ = 0;
  int64_t size_ = 0;
};

}  // namespace memoryos
