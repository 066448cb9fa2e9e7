#!/usr/bin/env bash
# Builds detdit and runs every test suite (CPU; CUDA tests skip with a reason
# on a machine without a GPU) and the docs' examples, then the pre-C++11 ABI
# job and the sanitizer job. The README's test command; .ci/run calls it.
# Prints each job's time when it ends and all of them on its last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# Each job's time: job NAME starts the next job, ending the one before; the
# summary (also when a job fails) lists the ended ones and the one it stopped in.
job_name="" job_start=$SECONDS job_times=()
job() {
  if [ -n "$job_name" ]; then
    job_times+=("$job_name $((SECONDS - job_start)) s")
    echo "detdit: job $job_name took $((SECONDS - job_start)) s"
  fi
  job_name="$1" job_start=$SECONDS
}
summary() {
  local rc=$? times="" t
  for t in "${job_times[@]}"; do times+="${times:+, }$t"; done
  if [ "$rc" -eq 0 ]; then
    echo "detdit: test.sh passed in $SECONDS s: $times"
  else
    echo "detdit: test.sh failed in job $job_name after $((SECONDS - job_start)) s (exit $rc)${times:+; before it: $times}" >&2
  fi
}
trap summary EXIT

# CUDA on (the default; it builds when nvcc is present): scripts/verify.sh may
# have configured the build directory without it on a machine without a GPU.
# Without a GPU the CUDA backend is compiled and not run, so for one
# architecture, sm_90 (the GPUs it is tuned on); the compute_80 PTX build is
# scripts/gpu_check.sh's ptx stage, run on a GPU. With a GPU the default
# architectures (DETDIT_CUDA_ARCHITECTURES in CMakeLists.txt; -U drops a value
# an earlier run left in the cache). DETDIT_CMAKE_ARGS comes last and wins.
if nvidia-smi -L >/dev/null 2>&1; then cuda_archs=-UDETDIT_CUDA_ARCHITECTURES; else cuda_archs=-DDETDIT_CUDA_ARCHITECTURES=90; fi
job build
DETDIT_CMAKE_ARGS="-DDETDIT_ENABLE_CUDA=ON $cuda_archs ${DETDIT_CMAKE_ARGS:-}" bash scripts/bootstrap.sh
build_dir="${DETDIT_BUILD_DIR:-build}"

# ctest lists a skipped test as "***Skipped" without the reason; GoogleTest's
# output in ctest's log has it (the lines after "file:line: Skipped").
# Prints one line per skipped test of the last ctest run in build directory $1.
print_skip_reasons() {
  local log="$1/Testing/Temporary/LastTest.log"
  [ -f "$log" ] || return 0
  awk '
    / Testing: / { name = $0; sub(/^[0-9]+\/[0-9]+ Testing: /, "", name); reading = 0; reason = "" }
    reading && /^\[  SKIPPED \]/ { reading = 0; skipped[name] = reason }
    reading { line = $0; gsub(/^[ \t]+|[ \t]+$/, "", line); if (line != "") reason = reason (reason == "" ? "" : " ") line; next }
    /: Skipped$/ { reading = 1; reason = "" }
    END {
      n = 0
      for (t in skipped) order[++n] = t
      for (i = 2; i <= n; i++) { t = order[i]; for (j = i - 1; j >= 1 && order[j] > t; j--) order[j + 1] = order[j]; order[j + 1] = t }
      if (n > 0) printf "detdit: %d tests skipped (reasons from their output):\n", n
      for (i = 1; i <= n; i++) printf "  %s: %s\n", order[i], skipped[order[i]] == "" ? "(no reason given)" : skipped[order[i]]
    }' "$log"
}

job ctest
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" --timeout 1200
print_skip_reasons "$build_dir"

# ---- Python: the PyTorch extension (python/, docs/python.md) ----------------
# Builds detdit._C with /usr/bin/python3 and Debian's python3-torch (installed by
# bootstrap.sh) against the library just built, then runs the pytest suite (CPU;
# its GPU tests skip with the reason on a machine without a GPU). The suite takes
# its op inputs from the C++ op cases, which the build's tests/detdit_export_cases
# writes out (tests/python/op_cases.py): built here too when a build of fewer
# targets left it out.
job python+docs
build_abs="$(cd "$build_dir" && pwd)"
cmake --build "$build_dir" --target detdit_export_cases
echo "detdit: building the PyTorch extension against $build_abs/libdetdit.a"
DETDIT_BUILD_DIR="$build_abs" /usr/bin/python3 python/setup.py -q build_ext --inplace
# tests/docs runs every code example of README.md and docs/*.md (a pip install among them).
DETDIT_BUILD_DIR="$build_abs" PYTHONPATH="$root/python" /usr/bin/python3 -m pytest tests/python tests/docs -q -rxs

# ---- torch.compile: Debian 13's torch 2.6 in a chroot (docs/python.md) ------
job torch.compile
bash scripts/torch_compile_check.sh

# ---- The pre-C++11 libstdc++ ABI (old-ABI torch; python/setup.py) -----------
# The library passes std::string through its API, so for an old-ABI torch
# setup.py builds it with -DDETDIT_CXX11_ABI=0. This builds it so (CPU only)
# with the CLI and the cpu suite and runs the suite. Debian's libgtest is built
# with the new ABI, so GoogleTest's own sources (/usr/src/googletest, from
# libgtest-dev) are built with the old one first.
job old-abi
abi_dir="${build_dir}-abi0"
gtest_dir="${build_dir}-abi0-googletest"
gtest_prefix="$(mkdir -p "$gtest_dir" && cd "$gtest_dir" && pwd)/install"
if [ ! -f "$gtest_prefix/lib/cmake/GTest/GTestConfig.cmake" ]; then
  cmake -S /usr/src/googletest -B "$gtest_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
    -DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=0 -DCMAKE_INSTALL_PREFIX="$gtest_prefix" >/dev/null
  cmake --build "$gtest_dir" --target install >/dev/null
fi
if [ ! -f "$abi_dir/build.ninja" ]; then
  cmake -S . -B "$abi_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDETDIT_ENABLE_CUDA=OFF -DDETDIT_CXX11_ABI=0 \
    -DCMAKE_PREFIX_PATH="$gtest_prefix"
fi
cmake --build "$abi_dir" -j "$(nproc)" --target detdit_cpu_suite
# The define reached every object: a new-ABI library defines hundreds of
# symbols tagged [abi:cxx11] (std::string returns), this one none.
if nm --defined-only "$abi_dir/libdetdit.a" | grep -q cxx11; then
  echo "detdit: $abi_dir/libdetdit.a defines new-ABI (cxx11) symbols despite -DDETDIT_CXX11_ABI=0" >&2
  exit 1
fi
echo "detdit: the cpu suite built with the pre-C++11 ABI ($abi_dir)"
ctest --test-dir "$abi_dir" -L cpu --output-on-failure -j "$(nproc)" --timeout 1200
print_skip_reasons "$abi_dir"
# setup.py refuses to link that library into this torch (new ABI), naming the mismatch.
if DETDIT_BUILD_DIR="$abi_dir" /usr/bin/python3 python/setup.py -q build_ext --inplace >"$abi_dir/setup.log" 2>&1 ||
   ! grep -q "uses the pre-C++11 libstdc++ ABI but this torch" "$abi_dir/setup.log"; then
  echo "detdit: setup.py did not refuse the pre-C++11 library under a new-ABI torch:" >&2
  cat "$abi_dir/setup.log" >&2
  exit 1
fi

# ---- Sanitizers: the CPU library, CLI and tests under ASan + UBSan -----------
# A second build (CUDA off) with every UBSan finding fatal, running the cpu and
# parallel suites. LeakSanitizer suppresses only the third-party libraries
# named in tests/sanitizer/lsan.supp. Their frames are found by the slow
# unwinder (fast_unwind_on_malloc=0: Open MPI has no frame pointers), which
# costs a DWARF unwind per malloc, so only the tests that start MPI
# processes (names with "Mpi") run with it, all of them. The heaviest other
# tests are left out here (the main job's ctest runs them): each repeats code
# the suites run at small sizes, at the H3 sizes or many sizes, for a
# size-dependent property (a rounding statistic, the traffic count's
# independence of S up to 131072, linear time in 200,000 blocks, TP 5 and 7 of
# the 520 MB weight, and the modulation forms' SP ops at every world size 1..8,
# whose code the SpForms tiny-shard and odd-sequence tests run here).
job sanitizers
asan_dir="${build_dir}-asan"
if [ ! -f "$asan_dir/build.ninja" ]; then
  cmake -S . -B "$asan_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETDIT_ENABLE_CUDA=OFF \
    -DDETDIT_SANITIZE=address,undefined
fi
cmake --build "$asan_dir" -j "$(nproc)"
echo "detdit: the cpu and parallel suites under AddressSanitizer + UndefinedBehaviorSanitizer ($asan_dir)"
export UBSAN_OPTIONS="print_stacktrace=1" LSAN_OPTIONS="suppressions=$root/tests/sanitizer/lsan.supp"
heavy='AdalnProjectionAccuracy\.H3ShapeIsCorrectlyRoundedAtLeast99_98Percent|SpRegion\.FoldChainBytesDoNotDependOnSeqLenOrPacking'
heavy+='|Manifest\.ManyBlocksInferAndCompareInLinearTime|TpAdalnProjection\.H3ShapeTp5And7'
heavy+='|SpForms\..*EveryWorldSize'
ctest --test-dir "$asan_dir" -L 'cpu|parallel' -E "Mpi|^($heavy)\$" --output-on-failure -j "$(nproc)" --timeout 1200
print_skip_reasons "$asan_dir"
# use_tls=0: LeakSanitizer's scan of thread-local storage crashed its tracer
# (signal 11, "LeakSanitizer has encountered a fatal error") at the exit of
# these MPI worker processes on Debian 12 after every rank's test had passed
# (a build of this tree; one of December's earlier trees did not); without the
# TLS roots a block reachable only from TLS would be reported, never hidden.
ASAN_OPTIONS="fast_unwind_on_malloc=0" LSAN_OPTIONS="$LSAN_OPTIONS:use_tls=0" \
  ctest --test-dir "$asan_dir" -L 'cpu|parallel' -R Mpi --output-on-failure -j "$(nproc)" --timeout 1200
print_skip_reasons "$asan_dir"
job ""
