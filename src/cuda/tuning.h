// Launch tunables of the CUDA backend. Numerics fixes every order of
// operations; these only change which thread or block computes what, so every
// legal value gives the same bytes (tests/cuda sweep them to prove it).
// The launchers read the defaults below, fixed for the process; only a test
// replaces them, for its own thread and scope (ScopedLaunchTuning,
// tests/cuda/cuda_test_util.h), through set_test_launch_tuning.
#pragma once

namespace detdit {
namespace cuda {

struct LaunchTuning {
  int linear_columns_per_warp = 0;   // linear forward: output columns per warp, 1, 2 or 4, or 0: chosen
                                     // by N and x's staging (src/cuda/linear.cu)
  bool linear_shared_x = true;       // linear forward: x widened into shared memory where it fits, or
                                     // read from global memory per vector
  int linear_partial_rows = 4;       // linear d_x partials: rows of grad per pass, 1, 2 or 4
  int elementwise_threads = 256;     // threads per block of elementwise and fold kernels: 64..1024
  int vector_bytes = 16;             // widest access of gather / gate_residual forward: 16, 8, 4 or 2
  int partial_columns_per_thread = 4;  // rmsnorm / gate / gather partials: columns per thread, 1, 2 or 4
  bool rmsnorm_fused_partials = true;  // rmsnorm table partials in the d_weight pass (when every chunk's
                                      // segment sums fit in shared memory), or a second pass
  bool region_backward_walk = true;   // gate_residual_rmsnorm backward: the row coefficients, then one
                                      // walk per chunk for every output and partial (src/cuda/gate_residual_rmsnorm.cu),
                                      // where it applies; or the halves
  bool region_row_walk = true;        // that walk over whole rows, one block per chunk computing the
                                      // coefficients itself (h and d_out read once), where it applies
                                      // (src/cuda/gate_residual_rmsnorm_row_walk.cu)
  int region_row_walk_min_chunks = 0;  // the row walk needs at least this many chunks, or 0: the SM count
  int region_row_walk_max_segments = 4;  // and at most this many segments per chunk (1..32)
};

// The tunables every launcher reads: the defaults above, or the values a test
// installed on the calling thread.
const LaunchTuning& launch_tuning();

// Tests only: `tuning` (not owned; nullptr: the defaults again) becomes what
// launch_tuning() returns on the calling thread. Returns the previous one
// (nullptr: the defaults), for the caller to put back.
const LaunchTuning* set_test_launch_tuning(const LaunchTuning* tuning);

}  // namespace cuda
}  // namespace detdit
