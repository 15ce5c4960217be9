// memoryos-gpu: the in-memory texts of live pages and knowledge entries, by id
// (memoryos_gpu.page_views keeps one table of pages and one of knowledge texts).
//
// Why native: a retrieval batch returns ~20 pages and entries a query, of users spread over
// the whole store. Held as Python objects (a dict of tuples of str) every returned page cost a
// chain of cache misses (the dict's index, its entry, the key, the tuple, each text), which at
// 1,000-10,000 users made building the results the largest part of a query's host time. Here a
// record is one slot of an open-addressing table (ids hash straight to their slot) and one
// block holding its texts, so a batch can ask for all of them before it reads any (see
// Assembler), and the texts become fresh str objects with one copy each.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "memoryos/id_slots.h"

namespace memoryos {

/// A table of records by int64 id: two texts (each may be None), a timestamp, a link (the id
/// of a record in another table, -1 for none: a page's dialogue chain, whose meta summary is
/// kept once per chain so a growing chain rewrites one record, not one per page), the
/// texts' size in quarter tokens (page_views.token_quarters) and one shared
/// Python object (a page's read-only metadata). Not thread-safe: callers hold the GIL.
class TextTable {
 public:
  static constexpr int kTexts = 2;

  /// A record's texts and scalars; its code units follow it in the same allocation.
  struct Block {
    double timestamp;
    int64_t link;
    int64_t chars;            // quarter tokens of both texts (page_views.token_quarters)
    uint32_t length[kTexts];  // code points
    uint8_t kind[kTexts];     // 0: None, else the CPython kind (1, 2 or 4 bytes a code point)
    uint8_t ascii[kTexts];    // a kind-1 text of ASCII only
    const uint8_t* data(int i) const;
  };

  /// One slot of the table: empty while block is null.
  struct Slot {
    int64_t id;
    Block* block;
    PyObject* extra;  // owned reference, or null
    bool used() const { return block != nullptr; }
  };

  TextTable();
  ~TextTable();
  TextTable(const TextTable&) = delete;
  TextTable& operator=(const TextTable&) = delete;

  /// Insert or replace `id`'s record. texts: str or None; extra: any object, or null.
  void put(int64_t id, PyObject* const texts[kTexts], double timestamp, PyObject* extra,
           int64_t link);
  /// The record of `id`, or null.
  const Slot* find(int64_t id) const;
  /// Remove `id`'s record; false when there was none.
  bool erase(int64_t id);
  /// Replace text `i` of `id`'s record, keeping the rest; false when there is no record.
  bool set_text(int64_t id, int i, PyObject* text);
  /// Replace the link of `id`'s record in place; false when there is no record.
  bool set_link(int64_t id, int64_t link);

  /// Ask for the cache line where `id`'s probe starts (before find()).
  void prefetch(int64_t id) const { slots_.prefetch(id); }
  /// Text `i` of a record as a new str (a new reference to None when it has none); null with
  /// a Python error set when allocation fails.
  static PyObject* text(const Block* block, int i);

  size_t size() const { return slots_.size(); }
  /// Bytes held: the slots and every record's block.
  size_t nbytes() const { return slots_.capacity() * sizeof(Slot) + block_bytes_; }

 private:
  void release(Slot& slot);

  IdSlots<Slot> slots_;
  size_t block_bytes_ = 0;
};

void register_text_table(pybind11::module_& m);

}  // namespace memoryos
