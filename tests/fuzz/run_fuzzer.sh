#!/usr/bin/env bash
# Builds a libFuzzer harness with clang (libFuzzer + ASan + UBSan) and runs it
# for SECONDS (default 180) at the lowest CPU priority:
#   tests/fuzz/run_fuzzer.sh [SECONDS] [safetensors|plan|validation]
# safetensors (default) fuzzes the safetensors reader, plan the IndexPlan
# builders, validation the op entry points' argument checks. The library is
# built once with clang into $FUZZ_OUT/build (CPU only, no MPI). Each target's
# committed corpus seeds it: tests/fuzz/corpus/ for safetensors (replayed by
# tests/cpu/safetensors_test.cc), tests/fuzz/corpus-<target>/ for the others.
# New inputs go to a scratch corpus, crashing inputs to the committed corpus
# as crash-* (keep them: they become regression tests). FUZZ_FLAGS adds
# libFuzzer options, e.g. "-fork=1 -ignore_crashes=1" to go on past findings.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
seconds="${1:-180}"
target="${2:-safetensors}"
case "$target" in
  safetensors) corpus="$root/tests/fuzz/corpus"; extra=(-max_len=4096 "-dict=$root/tests/fuzz/safetensors.dict") ;;
  plan) corpus="$root/tests/fuzz/corpus-plan"; extra=(-max_len=4096) ;;
  validation) corpus="$root/tests/fuzz/corpus-validation"; extra=(-max_len=256) ;;
  *) echo "run_fuzzer.sh: unknown target '$target' (safetensors, plan or validation)" >&2; exit 2 ;;
esac
out="${FUZZ_OUT:-/tmp/detdit_fuzz}"
mkdir -p "$out/corpus-$target" "$corpus"
if [ ! -f "$out/build/build.ninja" ]; then
  CXX=clang++ cmake -S "$root" -B "$out/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETDIT_ENABLE_CUDA=OFF \
    -DDETDIT_ENABLE_MPI=OFF -DDETDIT_BUILD_TESTS=OFF -DDETDIT_SANITIZE=fuzzer-no-link,address,undefined >/dev/null
fi
nice -n 19 cmake --build "$out/build" --target detdit -j "$(nproc)" >/dev/null
clang++ -std=c++17 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=undefined -I"$root/include" -I"$root/src" "$root/tests/fuzz/${target}_fuzz.cc" \
  "$out/build/libdetdit.a" -pthread -o "$out/${target}_fuzz"
# shellcheck disable=SC2086  # FUZZ_FLAGS is a list of options
nice -n 19 "$out/${target}_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 "${extra[@]}" ${FUZZ_FLAGS:-} \
  -artifact_prefix="$corpus/" "$out/corpus-$target" "$corpus"
