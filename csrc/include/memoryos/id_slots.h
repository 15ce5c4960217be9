// memoryos-gpu: open addressing by int64 id, the one mechanism behind the native tables that
// are keyed by an id (TextTable: texts by page or entry id; KeyCounts: counts by (user, term)).
//
// Why one: every such table needs the same four things -- a home slot, a linear probe, growth
// before it gets too full and deletion that leaves no hole in a probe run -- and a table with
// its own copy of them is a second place for the subtle one (the backward shift) to go wrong.
// Power-of-two slots, Fibonacci hashing (consecutive ids, and ids whose high bits are a small
// user index, spread over the table), at most 3/4 full, backward-shift deletion (no
// tombstones: a table that deletes a lot does not slow down).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace memoryos {

/// Slot: a trivially copyable struct with an ``int64_t id`` and ``bool used() const``, whose
/// value-initialised ``Slot{}`` is unused. What a used slot owns is its table's business: the
/// table releases it before erase().
template <typename Slot>
class IdSlots {
 public:
  explicit IdSlots(size_t initial = 1024) : slots_(initial, Slot{}), mask_(initial - 1) {
    shift_ = 64 - __builtin_ctzll(initial);
  }

  /// The slot holding ``id``, or the unused slot that ends its probe.
  size_t locate(int64_t id) const {
    size_t i = home(id);
    while (slots_[i].used() && slots_[i].id != id) i = (i + 1) & mask_;
    return i;
  }

  /// locate(), growing the table first when ``id`` is new and would fill it past 3/4.
  size_t locate_for_insert(int64_t id) {
    size_t i = locate(id);
    if (!slots_[i].used() && (count_ + 1) * 4 > slots_.size() * 3) {
      grow();
      i = locate(id);
    }
    return i;
  }

  Slot& operator[](size_t i) { return slots_[i]; }
  const Slot& operator[](size_t i) const { return slots_[i]; }

  /// Put ``slot`` into the unused slot ``i`` (from locate_for_insert).
  void fill(size_t i, const Slot& slot) {
    slots_[i] = slot;
    ++count_;
  }

  /// Empty the used slot ``i`` (whatever it owned already released): later entries of its
  /// probe run move up unless they sit at or after their home, so every probe still ends at
  /// the first unused slot.
  void erase(size_t i) {
    slots_[i] = Slot{};
    --count_;
    for (size_t j = (i + 1) & mask_; slots_[j].used(); j = (j + 1) & mask_) {
      const size_t h = home(slots_[j].id);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        slots_[j] = Slot{};
        i = j;
      }
    }
  }

  /// Ask for the cache line where ``id``'s probe starts (before locate()).
  void prefetch(int64_t id) const {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&slots_[home(id)]);
#endif
  }

  size_t size() const { return count_; }
  size_t capacity() const { return slots_.size(); }
  const std::vector<Slot>& slots() const { return slots_; }
  std::vector<Slot>& slots() { return slots_; }

 private:
  size_t home(int64_t id) const {
    return static_cast<size_t>((static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ULL) >> shift_);
  }

  void grow() {
    std::vector<Slot> old(slots_.size() * 2, Slot{});
    old.swap(slots_);
    mask_ = slots_.size() - 1;
    shift_ -= 1;
    for (const Slot& s : old) {
      if (s.used()) slots_[locate(s.id)] = s;
    }
  }

  std::vector<Slot> slots_;
  size_t mask_;
  int shift_;
  size_t count_ = 0;
};

}  // namespace memoryos
