// memoryos-gpu: the native builder of a retrieval batch's result objects (assembly_bindings.cpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace memoryos {

void register_assembly(pybind11::module_& m);

}  // namespace memoryos
