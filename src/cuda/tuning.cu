// The process-wide launch tunables (src/cuda/tuning.h).
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {

LaunchTuning& launch_tuning() {
  static LaunchTuning tuning;
  return tuning;
}

}  // namespace cuda
}  // namespace detdit
