// memoryos-gpu: how many OpenMP threads a CPU kernel's team may use.
//
// Why a process-wide limit instead of omp_set_num_threads: that sets the calling thread's ICV
// only, and the kernels run on whichever thread the caller (a server's executor, a background
// worker) happens to use. A team as wide as the machine is also wrong whenever other processes
// hold cores: `serve --workers N` runs N HTTP processes beside the engine, and a team member
// that the scheduler has parked holds the whole batch until it runs again (a full time slice,
// ~10 ms measured on two cores, against ~3 ms for the batch alone).
#pragma once

namespace memoryos {
namespace cpu {

/// Threads a team may use: the limit set_team_limit gave, else OpenMP's default
/// (omp_get_max_threads: OMP_NUM_THREADS or the cores). 1 without OpenMP.
int team_size();

/// Limit every later team to n threads (n <= 0: back to OpenMP's default).
void set_team_limit(int n);

}  // namespace cpu
}  // namespace memoryos
