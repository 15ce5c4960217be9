// memoryos-gpu: a flat hash table of int64 keys to int32 counts (each user's vocabulary).
//
// Why native: every accepted page adds ~30 (user, term) keys and every derived page looks up
// as many. A NumPy log-structured table (sorted runs merged by searchsorted + insert) cost
// ~5 us a page of memory-system time in bulk ingestion, most of it re-sorting keys as runs
// merged; one probe a key costs a few nanoseconds. The table is IdSlots (memoryos/id_slots.h),
// as the text tables are, with 12-byte slots (key, count; a count is never 0 in the table):
// 16-32 bytes a key against the sorted runs' 12 (at 10,000 users x 20 LoCoMo pages, 2.65
// million keys: 50 MB against ~32 MB).
#pragma once

#include <cstddef>
#include <cstdint>

#include "memoryos/id_slots.h"

namespace memoryos {

class KeyCounts {
 public:
  /// Add ``sign`` for each occurrence of each key (a key twice adds twice); a count that
  /// reaches 0 is removed. Keys must be >= 0 (a vocabulary key is (user index << 32) | term
  /// id: a negative one is a caller's bug, refused before anything is added).
  void add(const int64_t* keys, int64_t n, int32_t sign);
  /// The count of each key (0 where absent, and for a negative key).
  void lookup(const int64_t* keys, int64_t n, int32_t* out) const;
  /// Remove every key in [lo, hi); returns how many were removed.
  int64_t erase_range(int64_t lo, int64_t hi);

  int64_t size() const { return static_cast<int64_t>(slots_.size()); }
  int64_t nbytes() const { return static_cast<int64_t>(slots_.capacity() * sizeof(Slot)); }

 private:
  /// Packed: 12 bytes, not 16 (the vocabulary holds millions).
  struct __attribute__((packed)) Slot {
    int64_t id;
    int32_t count;
    bool used() const { return count != 0; }
  };
  IdSlots<Slot> slots_;
};

}  // namespace memoryos
