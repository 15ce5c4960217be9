// memoryos-gpu: bindings of KeyCounts (memoryos/key_counts.h), the users' vocabulary table.
//
// The GIL stays held in every call: the table is read by stages running outside the engine
// lock while acceptance adds to it, and a call is one short loop (a batch's keys), so the
// interpreter lock is what keeps a lookup from meeting a half-grown table.
#include "key_counts_bindings.h"

#include <pybind11/numpy.h>

#include "memoryos/key_counts.h"

namespace memoryos {
namespace py = pybind11;

namespace {
using Keys = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

Keys flat(const Keys& keys) {
  if (keys.ndim() != 1) throw py::value_error("keys must be a 1-D array");
  return keys;
}
}  // namespace

void register_key_counts(py::module_& m) {
  py::class_<KeyCounts>(m, "KeyCounts",
                        "A hash table of int64 keys (>= 0) to int32 counts; a count that "
                        "reaches 0 is removed.")
      .def(py::init<>())
      .def(
          "add",
          [](KeyCounts& t, const Keys& keys, int32_t sign) {
            const Keys k = flat(keys);
            t.add(k.data(), k.size(), sign);
          },
          py::arg("keys"), py::arg("sign") = 1,
          "Add sign once for each occurrence of each key (ValueError for a negative key, "
          "and then nothing is added).")
      .def(
          "lookup",
          [](const KeyCounts& t, const Keys& keys) {
            const Keys k = flat(keys);
            py::array_t<int32_t> out(k.size());
            t.lookup(k.data(), k.size(), out.mutable_data());
            return out;
          },
          py::arg("keys"), "-> int32 count of each key (0: absent or negative).")
      .def("erase_range", &KeyCounts::erase_range, py::arg("lo"), py::arg("hi"),
           "Remove the keys in [lo, hi); returns how many.")
      .def("__len__", &KeyCounts::size)
      .def("nbytes", &KeyCounts::nbytes);
}

}  // namespace memoryos
