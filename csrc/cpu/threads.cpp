// memoryos-gpu: the CPU kernels' team size (see threads.h).
#include "threads.h"

#include <atomic>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace memoryos {
namespace cpu {
namespace {
std::atomic<int> g_limit{0};  // 0: OpenMP's default
std::atomic<long long> g_work{kTeamWork};
}  // namespace

int team_size() {
#if defined(_OPENMP)
  const int limit = g_limit.load(std::memory_order_relaxed);
  return limit > 0 ? limit : omp_get_max_threads();
#else
  return 1;
#endif
}

void set_team_limit(int n) { g_limit.store(n > 0 ? n : 0, std::memory_order_relaxed); }

long long team_work() { return g_work.load(std::memory_order_relaxed); }

void set_team_work(long long n) { g_work.store(n >= 0 ? n : kTeamWork, std::memory_order_relaxed); }

}  // namespace cpu
}  // namespace memoryos
