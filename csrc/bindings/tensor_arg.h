// memoryos-gpu: arrays in from Python through DLPack, so the extension never links against a
// particular torch build. NumPy arrays, torch tensors and any other DLPack producer work.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace memoryos {
namespace py = pybind11;

// ---- The DLPack ABI (v0.8 unversioned capsule "dltensor"; stable since 2017) ------------------
extern "C" {
enum DLDeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
enum DLDataTypeCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4 };
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
}

/// Element types the kernels accept.
enum class Dt { f32, f16, bf16, f64, i32, i64, u8, other };

/// A borrowed view of one argument array. Holds the DLPack capsule, whose destructor releases
/// the producer's reference, so the view is valid for the duration of the call.
struct TensorArg {
  std::string name;
  void* data = nullptr;
  Dt dtype = Dt::other;
  bool on_cuda = false;
  int device_id = 0;
  std::vector<int64_t> shape;
  py::object capsule;

  int64_t dim(size_t i) const { return shape.at(i); }
  int64_t numel() const;
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

/// Read a DLPack producer. For CUDA producers, `stream` is the consumer stream passed to
/// __dlpack__ so the producer orders its pending work before ours.
TensorArg tensor_arg(py::handle obj, const char* name, int64_t stream);

/// Raise ValueError unless `t` has exactly `shape` (-1 = any) and dtype `dt`.
void expect(const TensorArg& t, std::vector<int64_t> shape, Dt dt);
void expect_dtype(const TensorArg& t, std::vector<Dt> allowed);
void expect_ndim(const TensorArg& t, size_t ndim);
/// Raise ValueError unless every argument lives on one device; returns true for CUDA.
bool same_device(const std::vector<const TensorArg*>& args);

const char* dt_name(Dt dt);

}  // namespace memoryos
