// memoryos-gpu: linked instead of csrc/cuda/retrieval_cuda.cu when the build has no CUDA. The
// bindings check cuda_compiled() first and raise a clear Python error, so these never run.
#include <stdexcept>

#include "memoryos/retrieval.h"

namespace memoryos {
void retrieve_cuda(const QueryBatch&, const QueryTerms&, const SegmentView&, const PageView&,
                   const LexicalView&, const RetrievalParams&, RetrievalOut, float*, int32_t, int64_t) {
  throw std::runtime_error("memoryos_gpu was built without CUDA");
}
void credit_served_cuda(const ServedHits&, HeatState, const HeatParams&, int64_t) {
  throw std::runtime_error("memoryos_gpu was built without CUDA");
}
}  // namespace memoryos
