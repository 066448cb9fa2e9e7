#!/usr/bin/env bash
# Every GPU check of detdit in one run, for a CUDA machine (run on H200s; see
# docs/gpu.md). Stages (pick with arguments; default all but matrix, the full
# byte-equality matrix, patches, and profile, Nsight Compute of chosen bench
# cases' kernels; ptx, which builds a second tree for compute_80 PTX, is in the
# default because CI compiles sm_90 alone and so never the sm_80 paths):
#   build cuda parallel verify mpi parity sanitizer racecheck python bench predict compare ptx matrix patches profile
# Logs and JSON reports go to gpu-out/; when $OUT is set (the device tool's
# folder, which takes back only a few files) the summary and one archive of
# gpu-out/ are copied there. The last lines printed are the summary.
# `compare` (scripts/torch_compare.py) needs the extension: run after python.
# NVLink multicast stays off for every process this starts.
# DETDIT_STAGE_TIMEOUT=N caps every stage's time limit at N seconds, and
# DETDIT_DEADLINE=N ends the run N seconds after it started (a stage gets what
# is left; one that would get under 10 s is skipped and says so), so a chosen
# set of stages fits one device call. DETDIT_BUILD_TARGETS names the CMake
# targets the build stage and the patches stage build (default: all), DETDIT_CUDA_TESTS the cuda
# stage's tests (a ctest -R regex; default: all of -L cuda), DETDIT_PYTESTS the Python tests
# the python stage runs (default: tests/python), DETDIT_BENCH_OPS the bench's
# ops in the order to run them (default: all, as `detdit bench --list` lists
# them), DETDIT_COMPARE_OPS torch_compare.py's. The bench and the comparison run
# one op at a time, each with its own report, so a stage cut short loses one
# op's numbers only.
# `patches` A/B-tests kernel changes in one run: for each file of
# DETDIT_PATCHES (unified diffs against this tree, e.g. `git diff
# main...exp-branch > exp.patch`) it applies the patch, rebuilds incrementally, runs
# the CUDA tests DETDIT_PATCH_TESTS selects (a ctest -R regex; default all of
# -L cuda) and the bench of DETDIT_BENCH_OPS, then reverses the patch (also
# when the script ends while it is applied, unless it is killed); logs and
# reports go to gpu-out/<patch name>/ (paths without spaces, one directory per
# basename). Run `bench` first in the same call for the unpatched numbers of
# the same machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for limit in DETDIT_STAGE_TIMEOUT DETDIT_DEADLINE; do
  if [ -n "${!limit:-}" ] && ! [[ ${!limit} =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu_check.sh: $limit must be a whole number of seconds > 0, got '${!limit}'" >&2
    exit 2
  fi
done
out=gpu-out
mkdir -p "$out"
build="${DETDIT_BUILD_DIR:-build-gpu}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages=("$@")
[ "${#stages[@]}" -eq 0 ] && stages=(build cuda parallel verify mpi parity sanitizer racecheck python bench predict compare ptx)
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
summary="$out/summary.txt"
: >"$summary"
# Each line also lands in $OUT at once: a call cut off at the device's time limit brings the
# summary back (the archive of gpu-out/ is made at the end only).
note() { echo "$*" | tee -a "$summary"; if [ -n "${OUT:-}" ]; then cp "$summary" "$OUT/"; fi; }
run() {  # run NAME TIMEOUT_S COMMAND...: log to $out/NAME.log, record the exit code
  local name=$1 limit=$2
  shift 2
  [ -n "${DETDIT_STAGE_TIMEOUT:-}" ] && [ "$DETDIT_STAGE_TIMEOUT" -lt "$limit" ] && limit=$DETDIT_STAGE_TIMEOUT
  if [ -n "${DETDIT_DEADLINE:-}" ]; then
    local left=$((DETDIT_DEADLINE - SECONDS))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
      note "$(printf '%-10s skipped: %ss left before DETDIT_DEADLINE' "$name" "$left")"
      return 124
    fi
  fi
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  note "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(tail -n 1 "$out/$name.log" | cut -c1-150)")"
  return $rc
}
mpi=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS)

note "detdit gpu_check $(git rev-parse --short HEAD 2>/dev/null) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1) x$gpus, $(date -u +%FT%TZ)"
for stage in "${stages[@]}"; do
  case "$stage" in
    build)
      run build 600 bash -c "cmake -S . -B '$build' -G Ninja -DCMAKE_BUILD_TYPE=Release -DDETDIT_CUDA_ARCHITECTURES=90 &&
        cmake --build '$build' -j $(nproc) ${DETDIT_BUILD_TARGETS:+--target $DETDIT_BUILD_TARGETS}" || { note "build failed or skipped: nothing else can run"; exit 1; } ;;
    cuda) run cuda 500 ctest --test-dir "$build" -L cuda ${DETDIT_CUDA_TESTS:+-R "$DETDIT_CUDA_TESTS"} \
      --output-on-failure -j 8 --timeout 400 ;;
    parallel) run parallel 400 ctest --test-dir "$build" -L parallel --output-on-failure -j 4 --timeout 300 ;;
    verify) run verify 300 "$build/detdit" verify --full --device cuda --out "$out/verify_cuda.json" ;;
    mpi)
      [ "$gpus" -ge 2 ] && run mpi_verify 300 "${mpi[@]}" -np "$gpus" "$build/detdit" verify --full --comm mpi --device cuda \
        --out "$out/verify_mpi.json" ;;
    parity) run parity 300 python3 scripts/torch_parity.py --runner "$build/tests/torch_parity_main" ;;
    sanitizer)
      run sanitizer 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/detdit_cuda_tests" \
        --gtest_filter='SpHalvesCuda.*:FailureCuda.*:SiluCuda.*:InvarianceCuda.*:Cases/*CaseCuda.EqualsTheCpu/1_*:Cases/*CaseCuda.EqualsTheCpu/2_*-InvarianceCuda.TorchProfile*' ;;
    racecheck)  # shared-memory hazards of the row walk (its stages pass between warps through
      # mbarriers), every gate_residual_rmsnorm test case through it; about 1 minute on an H200
      run racecheck 300 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 \
        "$build/tests/detdit_cuda_tests" --gtest_filter='GateResidualRmsnormCuda.TheRowWalkGivesTheSameBytes' ;;
    python)
      run python_build 400 env DETDIT_BUILD_DIR="$PWD/$build" python3 python/setup.py -q build_ext --inplace &&
        run python_test 300 env DETDIT_BUILD_DIR="$PWD/$build" PYTHONPATH="$PWD/python" python3 -m pytest ${DETDIT_PYTESTS:-tests/python} -q -rxs ;;
    bench)
      bench_ops=${DETDIT_BENCH_OPS:-$("$build/detdit" bench --list | awk '{print $1}' | uniq)}
      [ -z "$bench_ops" ] && note "bench      no op to run: '$build/detdit bench --list' listed none"
      for op in $bench_ops; do
        run "bench_$op" 400 "$build/detdit" bench --device cuda --ops "$op" --out "$out/bench_$op.json"
      done
      [ "$gpus" -ge 2 ] && run mpi_bench 300 "${mpi[@]}" -np "$gpus" "$build/detdit" bench --comm mpi --device cuda ;;
    predict)  # SP/TP at 2, 4, 8 GPUs predicted from this one (docs/parallel.md); with several GPUs the
      # link is measured and the prediction of the MPI world compared with its measurement
      run predict 400 "$build/detdit" bench --device cuda --ops sp_region,tp_adaln_projection --predict-world 2,4,8 \
        --out "$out/predict.json"
      [ "$gpus" -ge 2 ] && run mpi_predict 400 "${mpi[@]}" -np "$gpus" "$build/detdit" bench --comm mpi --device cuda \
        --predict-world 2,4,8 --out "$out/predict_mpi.json" ;;
    compare)  # eager and torch.compile on the bench's cases, one process per op (docs/benchmarking.md)
      for op in ${DETDIT_COMPARE_OPS:-gate_residual_rmsnorm rmsnorm gate_residual adaln_projection timestep_mlp}; do
        run "compare_$op" 500 env DETDIT_BUILD_DIR="$PWD/$build" PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1 \
          python3 scripts/torch_compare.py \
          --ops "$op" --out "$out/compare_$op.json" &&
          "$build/detdit" report "$out/compare_$op.json" --out "$out/compare_$op.svg"
      done ;;
    profile)  # Nsight Compute of one call of each case's kernels (forward, backward, forward +
      # backward: the bench's three timings, one repeat, no warm-up), a CSV per case in its log;
      # DETDIT_PROFILE_OP and DETDIT_PROFILE_CASES (`;`-separated case names) choose them. Not
      # --quick: its cases are the small ones, named differently
      profile_op=${DETDIT_PROFILE_OP:-gate_residual_rmsnorm}
      IFS=';' read -r -a profile_cases <<<"${DETDIT_PROFILE_CASES:-modulated bfloat16 H=5376 block_S32768_T3_B2 d_h;modulated bfloat16 H=5376 interleaved_S32768_T3_B2 d_h}"
      for case_name in "${profile_cases[@]}"; do
        run "profile_${profile_op}_$(echo "$case_name" | tr -c 'A-Za-z0-9_\n' '_')" 500 \
          ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
          --section MemoryWorkloadAnalysis --csv --page details "$build/detdit" bench --device cuda \
          --ops "$profile_op" --cases "$case_name" --repeats 1 --warmup 0
      done ;;
    ptx)  # the portable profile from PTX alone: compute_80 PTX, compiled for this GPU by the driver at
      # load; verify compares every output bitwise with the CPU, as the native build's verify does,
      # so both builds give the CPU's bytes (docs/gpu.md)
      run ptx_build 600 bash -c "cmake -S . -B '$build-ptx' -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DDETDIT_CUDA_ARCHITECTURES=80-virtual && cmake --build '$build-ptx' --target detdit_cli -j $(nproc)" &&
        run ptx_verify 400 "$build-ptx/detdit" verify --full --device cuda --out "$out/verify_ptx.json" ;;
    matrix)  # the byte-equality matrix on this GPU (detdit verify --matrix, docs/cli.md): every
      # cell, the CPU comparison of each GPU result; the JSON and figure are for docs/evidence/
      run matrix 3000 "$build/detdit" verify --matrix --full --device cuda --out "$out/verify_matrix_cuda.json" \
        --figure "$out/verify_matrix_cuda.svg" ;;
    patches)
      patch_args=(-p1 --forward --batch --silent)
      for patch in ${DETDIT_PATCHES:-}; do
        name=$(basename "$patch" .patch)
        if ! patch "${patch_args[@]}" --dry-run <"$patch" >/dev/null; then
          note "$(printf '%-10s does not apply to this tree: skipped' "$name")"
          continue
        fi
        patch "${patch_args[@]}" <"$patch" || { note "$name: applying failed; the tree may be changed"; exit 1; }
        # Reversed however the script ends while it is applied (a stage's timeout, the deadline).
        trap 'patch -p1 -R --batch --silent <"$patch"' EXIT
        mkdir -p "$out/$name"
        if run "$name/build" 600 cmake --build "$build" -j "$(nproc)" ${DETDIT_BUILD_TARGETS:+--target $DETDIT_BUILD_TARGETS}; then
          run "$name/cuda" 500 ctest --test-dir "$build" -L cuda ${DETDIT_PATCH_TESTS:+-R "$DETDIT_PATCH_TESTS"} \
            --output-on-failure -j 8 --timeout 400
          for op in ${DETDIT_BENCH_OPS:-}; do
            run "$name/bench_$op" 400 "$build/detdit" bench --device cuda --ops "$op" --out "$out/$name/bench_$op.json"
          done
        fi
        trap - EXIT
        patch -p1 -R --batch --silent <"$patch" || { note "$name: reversing failed; the tree is still patched"; exit 1; }
      done
      [ -z "${DETDIT_PATCHES:-}" ] && note "patches    DETDIT_PATCHES names no patch"
      # The tree is the unpatched one again; later stages get a rebuilt unpatched build.
      run patches_rebuild 600 cmake --build "$build" -j "$(nproc)" ${DETDIT_BUILD_TARGETS:+--target $DETDIT_BUILD_TARGETS} ;;
    *) note "unknown stage $stage" ;;
  esac
done
cat "$summary"
if [ -n "${OUT:-}" ]; then
  cp "$summary" "$OUT/" && tar czf "$OUT/gpu-out.tgz" "$out"
fi
