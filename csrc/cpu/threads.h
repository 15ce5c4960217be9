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

/// Multiply-adds a batch must hold before a team pays off. Waking a sleeping team
/// (OMP_WAIT_POLICY=PASSIVE, which serving needs) cost 70-100 us on the 2-core VM: a knowledge
/// top-k of 64 queries over 16-entry rings (0.4 M) took 83 us alone and 148 us on two threads,
/// and the retrieval path of 64 queries at 1,000 users ran 27 % faster (median) with it alone;
/// from 256 queries (1.6 M) two threads were as fast or faster inside a whole retrieval.
constexpr long long kTeamWork = 1'500'000;

/// The work a batch must hold for a team: kTeamWork unless set_team_work changed it.
long long team_work();

/// Set the work threshold (n < 0: back to kTeamWork; 0: a team from 16 queries, whatever the
/// work; the tests use it to run the team path on small inputs).
void set_team_work(long long n);

/// Whether a batch of `queries`, each ~`work_per_query` multiply-adds, runs on a team: at
/// least 16 queries (one schedule chunk per thread) and team_work() in all.
inline bool worth_a_team(long long queries, long long work_per_query) {
  return queries >= 16 && queries * work_per_query >= team_work();
}

}  // namespace cpu
}  // namespace memoryos
