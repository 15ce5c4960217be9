// memoryos-gpu: DLPack argument parsing and validation with clear Python errors.
#include "tensor_arg.h"

#include <sstream>

namespace memoryos {
namespace {

Dt to_dt(const DLDataType& t) {
  if (t.lanes != 1) return Dt::other;
  if (t.code == kDLFloat && t.bits == 32) return Dt::f32;
  if (t.code == kDLFloat && t.bits == 16) return Dt::f16;
  if (t.code == kDLBfloat && t.bits == 16) return Dt::bf16;
  if (t.code == kDLFloat && t.bits == 64) return Dt::f64;
  if (t.code == kDLInt && t.bits == 32) return Dt::i32;
  if (t.code == kDLInt && t.bits == 64) return Dt::i64;
  if (t.code == kDLUInt && t.bits == 8) return Dt::u8;
  // bool arrays are exported as uint8-sized kDLBool (code 6) by NumPy and torch
  if (t.code == 6 && t.bits == 8) return Dt::u8;
  return Dt::other;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

bool is_row_major(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] == 0) return true;  // empty arrays have arbitrary strides
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

}  // namespace

const char* dt_name(Dt dt) {
  switch (dt) {
    case Dt::f32: return "float32";
    case Dt::f16: return "float16";
    case Dt::bf16: return "bfloat16";
    case Dt::f64: return "float64";
    case Dt::i32: return "int32";
    case Dt::i64: return "int64";
    case Dt::u8: return "uint8";
    default: return "unsupported";
  }
}

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

TensorArg tensor_arg(py::handle obj, const char* name, int64_t stream) {
  if (!py::hasattr(obj, "__dlpack__") || !py::hasattr(obj, "__dlpack_device__")) {
    throw py::type_error(std::string(name) + ": expected an array supporting DLPack "
                         "(numpy.ndarray, torch.Tensor, ...), got " +
                         py::str(py::type::of(obj)).cast<std::string>());
  }
  auto dev = obj.attr("__dlpack_device__")().cast<std::pair<int, int>>();
  py::object capsule;
  if (dev.first == kDLCUDA || dev.first == kDLCUDAManaged) {
    capsule = obj.attr("__dlpack__")(py::arg("stream") = stream == 0 ? py::object(py::int_(1))
                                                                     : py::object(py::int_(stream)));
  } else {
    capsule = obj.attr("__dlpack__")();
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + ": __dlpack__ did not return a 'dltensor' capsule");
  }
  const DLTensor& t = managed->dl_tensor;
  TensorArg a;
  a.name = name;
  a.data = static_cast<char*>(t.data) + t.byte_offset;
  a.dtype = to_dt(t.dtype);
  a.on_cuda = t.device.device_type == kDLCUDA || t.device.device_type == kDLCUDAManaged;
  a.device_id = t.device.device_id;
  a.shape.assign(t.shape, t.shape + t.ndim);
  a.capsule = capsule;
  if (t.device.device_type != kDLCPU && !a.on_cuda && t.device.device_type != kDLCUDAHost) {
    throw py::value_error(a.name + ": arrays must live on the CPU or a CUDA device");
  }
  if (!is_row_major(t)) {
    throw py::value_error(a.name + ": array must be C-contiguous (call .contiguous() / "
                          "numpy.ascontiguousarray first)");
  }
  return a;
}

void expect_dtype(const TensorArg& t, std::vector<Dt> allowed) {
  for (Dt d : allowed)
    if (t.dtype == d) return;
  std::string names;
  for (size_t i = 0; i < allowed.size(); ++i) names += (i ? " or " : "") + std::string(dt_name(allowed[i]));
  throw py::type_error(t.name + ": expected dtype " + names + ", got " + dt_name(t.dtype));
}

void expect_ndim(const TensorArg& t, size_t ndim) {
  if (t.shape.size() != ndim) {
    throw py::value_error(t.name + ": expected " + std::to_string(ndim) + " dimensions, got shape " +
                          shape_str(t.shape));
  }
}

void expect(const TensorArg& t, std::vector<int64_t> shape, Dt dt) {
  expect_dtype(t, {dt});
  bool ok = t.shape.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == t.shape[i];
  if (!ok) {
    throw py::value_error(t.name + ": expected shape " + shape_str(shape) + " (-1 = any), got " +
                          shape_str(t.shape));
  }
}

bool same_device(const std::vector<const TensorArg*>& args) {
  const TensorArg* first = args.at(0);
  for (const TensorArg* a : args) {
    if (a->on_cuda != first->on_cuda || (a->on_cuda && a->device_id != first->device_id)) {
      throw py::value_error("all arrays must live on the same device: '" + first->name + "' is on " +
                            (first->on_cuda ? "cuda:" + std::to_string(first->device_id) : "cpu") +
                            " but '" + a->name + "' is on " +
                            (a->on_cuda ? "cuda:" + std::to_string(a->device_id) : "cpu"));
    }
  }
  return first->on_cuda;
}

}  // namespace memoryos
