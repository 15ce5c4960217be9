// memoryos-gpu: registration of the retrieval-path bindings (retrieval_bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace memoryos {
void register_retrieval(pybind11::module_& m);
}  // namespace memoryos
