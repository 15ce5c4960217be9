// memoryos-gpu: the key -> count table (see memoryos/key_counts.h).
#include "memoryos/key_counts.h"

#include <stdexcept>
#include <vector>

namespace memoryos {

void KeyCounts::add(const int64_t* keys, int64_t n, int32_t sign) {
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] < 0) throw std::invalid_argument("KeyCounts keys must be >= 0");
  }
  if (sign == 0) return;
  for (int64_t i = 0; i < n; ++i) {
    const size_t s = slots_.locate_for_insert(keys[i]);
    if (!slots_[s].used()) {
      slots_.fill(s, Slot{keys[i], sign});
    } else if ((slots_[s].count += sign) == 0) {
      slots_.erase(s);
    }
  }
}

void KeyCounts::lookup(const int64_t* keys, int64_t n, int32_t* out) const {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = keys[i] < 0 ? 0 : slots_[slots_.locate(keys[i])].count;  // an unused slot holds 0
  }
}

int64_t KeyCounts::erase_range(int64_t lo, int64_t hi) {
  // Collect first: erasing shifts later entries back, past a scan's position.
  std::vector<int64_t> doomed;
  for (const Slot& s : slots_.slots()) {
    if (s.used() && s.id >= lo && s.id < hi) doomed.push_back(s.id);
  }
  for (int64_t k : doomed) slots_.erase(slots_.locate(k));
  return static_cast<int64_t>(doomed.size());
}

}  // namespace memoryos
