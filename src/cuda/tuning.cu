// The launch tunables (src/cuda/tuning.h): fixed defaults, and the calling
// thread's test values where a test installed them.
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

const LaunchTuning kDefaultLaunchTuning{};
// Thread-local, so a test's values never reach another thread's launches.
thread_local const LaunchTuning* test_launch_tuning = nullptr;

}  // namespace

const LaunchTuning& launch_tuning() { return test_launch_tuning ? *test_launch_tuning : kDefaultLaunchTuning; }

const LaunchTuning* set_test_launch_tuning(const LaunchTuning* tuning) {
  const LaunchTuning* previous = test_launch_tuning;
  test_launch_tuning = tuning;
  return previous;
}

}  // namespace cuda
}  // namespace detdit
