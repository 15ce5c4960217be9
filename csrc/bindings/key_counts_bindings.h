// memoryos-gpu: registration of the key -> count table's bindings (key_counts_bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace memoryos {
void register_key_counts(pybind11::module_& m);
}  // namespace memoryos
