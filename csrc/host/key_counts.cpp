// memoryos-gpu: the flat key -> count table (see memoryos/key_counts.h).
#include "memoryos/key_counts.h"

#include <stdexcept>
#include <utility>

namespace memoryos {

namespace {
constexpr size_t kMinSlots = 1024;

/// splitmix64's finaliser: the keys' low bits are term hashes but their high bits a small
/// user index, so the slot must mix both.
inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
}  // namespace

KeyCounts::KeyCounts() : keys_(kMinSlots, kEmpty), counts_(kMinSlots, 0), mask_(kMinSlots - 1) {}

size_t KeyCounts::slot_of(int64_t key) const {
  size_t s = mix(static_cast<uint64_t>(key)) & mask_;
  while (keys_[s] != kEmpty && keys_[s] != key) s = (s + 1) & mask_;
  return s;
}

void KeyCounts::add(const int64_t* keys, int64_t n, int32_t sign) {
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] < 0) throw std::invalid_argument("KeyCounts keys must be >= 0");
  }
  if (sign == 0) return;
  for (int64_t i = 0; i < n; ++i) {
    if (4 * (size_ + 1) > 3 * static_cast<int64_t>(keys_.size())) grow();  // load <= 3/4
    const size_t s = slot_of(keys[i]);
    if (keys_[s] == kEmpty) {
      keys_[s] = keys[i];
      counts_[s] = sign;
      ++size_;
    } else if ((counts_[s] += sign) == 0) {
      erase_at(s);
    }
  }
}

void KeyCounts::lookup(const int64_t* keys, int64_t n, int32_t* out) const {
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] < 0) {
      out[i] = 0;
      continue;
    }
    const size_t s = slot_of(keys[i]);
    out[i] = keys_[s] == kEmpty ? 0 : counts_[s];
  }
}

int64_t KeyCounts::erase_range(int64_t lo, int64_t hi) {
  // Collect first: erasing shifts later entries back, past a scan's position.
  std::vector<int64_t> doomed;
  for (int64_t k : keys_) {
    if (k != kEmpty && k >= lo && k < hi) doomed.push_back(k);
  }
  for (int64_t k : doomed) erase_at(slot_of(k));
  return static_cast<int64_t>(doomed.size());
}

int64_t KeyCounts::nbytes() const {
  return static_cast<int64_t>(keys_.size() * (sizeof(int64_t) + sizeof(int32_t)));
}

void KeyCounts::erase_at(size_t hole) {
  // Backward-shift deletion: move each later entry of the probe run into the hole when its
  // home slot does not lie (cyclically) between the hole and where it sits now.
  size_t s = hole;
  for (;;) {
    s = (s + 1) & mask_;
    if (keys_[s] == kEmpty) break;
    const size_t home = mix(static_cast<uint64_t>(keys_[s])) & mask_;
    const bool stays = hole <= s ? (hole < home && home <= s) : (hole < home || home <= s);
    if (stays) continue;
    keys_[hole] = keys_[s];
    counts_[hole] = counts_[s];
    hole = s;
  }
  keys_[hole] = kEmpty;
  counts_[hole] = 0;
  --size_;
}

void KeyCounts::grow() {
  std::vector<int64_t> old_keys(2 * keys_.size(), kEmpty);
  std::vector<int32_t> old_counts(2 * counts_.size(), 0);
  old_keys.swap(keys_);
  old_counts.swap(counts_);
  mask_ = keys_.size() - 1;
  for (size_t i = 0; i < old_keys.size(); ++i) {
    if (old_keys[i] == kEmpty) continue;
    const size_t s = slot_of(old_keys[i]);
    keys_[s] = old_keys[i];
    counts_[s] = old_counts[i];
  }
}

}  // namespace memoryos
