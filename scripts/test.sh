#!/usr/bin/env bash
# Builds detdit and runs every test suite (CPU; CUDA tests skip with a reason
# on a machine without a GPU), then the sanitizer job. The README's test
# command; .ci/run calls it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# CUDA on (the default; it builds when nvcc is present): scripts/verify.sh may
# have configured the build directory without it on a machine without a GPU.
DETDIT_CMAKE_ARGS="-DDETDIT_ENABLE_CUDA=ON ${DETDIT_CMAKE_ARGS:-}" bash scripts/bootstrap.sh
build_dir="${DETDIT_BUILD_DIR:-build}"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" --timeout 1200

# ---- Python: the PyTorch extension (python/, docs/python.md) ----------------
# Builds detdit._C with /usr/bin/python3 and Debian's python3-torch (installed by
# bootstrap.sh) against the library just built, then runs the pytest suite (CPU;
# its GPU tests skip with the reason on a machine without a GPU).
build_abs="$(cd "$build_dir" && pwd)"
echo "detdit: building the PyTorch extension against $build_abs/libdetdit.a"
DETDIT_BUILD_DIR="$build_abs" /usr/bin/python3 python/setup.py -q build_ext --inplace
DETDIT_BUILD_DIR="$build_abs" PYTHONPATH="$root/python" /usr/bin/python3 -m pytest tests/python -q -rxs

# ---- Sanitizers: the CPU library, CLI and tests under ASan + UBSan -----------
# A second build (CUDA off) with every UBSan finding fatal, running the cpu and
# parallel suites. LeakSanitizer suppresses only the third-party libraries
# named in tests/sanitizer/lsan.supp. Their frames are found by the slow
# unwinder (fast_unwind_on_malloc=0: Open MPI has no frame pointers), which
# costs a DWARF unwind per malloc, so only the tests that start MPI
# processes (names with "Mpi") run with it. About 4 minutes to build and 2 to
# test on 2 cores.
sanitizer_start=$SECONDS
asan_dir="${build_dir}-asan"
if [ ! -f "$asan_dir/build.ninja" ]; then
  cmake -S . -B "$asan_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETDIT_ENABLE_CUDA=OFF \
    -DDETDIT_SANITIZE=address,undefined
fi
cmake --build "$asan_dir" -j "$(nproc)"
echo "detdit: the cpu and parallel suites under AddressSanitizer + UndefinedBehaviorSanitizer ($asan_dir)"
export UBSAN_OPTIONS="print_stacktrace=1" LSAN_OPTIONS="suppressions=$root/tests/sanitizer/lsan.supp"
ctest --test-dir "$asan_dir" -L 'cpu|parallel' -E Mpi --output-on-failure -j "$(nproc)" --timeout 1200
ASAN_OPTIONS="fast_unwind_on_malloc=0" \
  ctest --test-dir "$asan_dir" -L 'cpu|parallel' -R Mpi --output-on-failure -j "$(nproc)" --timeout 1200
echo "detdit: sanitizer job passed in $((SECONDS - sanitizer_start)) s"
