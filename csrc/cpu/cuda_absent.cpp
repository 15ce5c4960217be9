// memoryos-gpu: linked instead of csrc/cuda/*.cu when the build has no CUDA. The bindings check
// cuda_compiled() first and raise a clear Python error, so these bodies are never reached.
#include <stdexcept>

#include "memoryos/kernels.h"

namespace memoryos {
namespace {
[[noreturn]] void absent() { throw std::runtime_error("memoryos_gpu was built without CUDA"); }
}  // namespace

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
bool cuda_sync_launches() { return false; }
void score_segments_cuda(const QueryBatch&, const SegmentView&, float, TopK, int64_t) { absent(); }
void select_pages_cuda(const QueryBatch&, const int32_t*, int32_t, const PageView&, float, TopK,
                       int64_t) {
  absent();
}
void apply_hits_cuda(const HitList&, HeatState, int64_t) { absent(); }
void recompute_heat_cuda(const HeatRecompute&, HeatState, const HeatParams&, int64_t) { absent(); }
void knowledge_topk_cuda(const QueryBatch&, const KnowledgeView&, TopK, int64_t) { absent(); }
}  // namespace memoryos
