// cases/parallel_for.h: the reference backend's parallel_for behind a function.
#include "cases/parallel_for.h"

#include "cpu/parallel.h"

namespace detdit {
namespace cases {

void parallel_for(int64_t begin, int64_t end, const std::function<void(int64_t)>& fn) {
  cpu::parallel_for(begin, end, fn);
}

}  // namespace cases
}  // namespace detdit
