#!/usr/bin/env bash
# Builds the safetensors reader fuzzer with clang (libFuzzer + ASan + UBSan)
# and runs it for SECONDS (default 180) at the lowest CPU priority. The
# committed corpus tests/fuzz/corpus/ seeds it (and is replayed by
# tests/cpu/safetensors_test.cc); new inputs go to a scratch corpus, crashing
# inputs to tests/fuzz/corpus/crash-* (keep them: they become regression tests).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
seconds="${1:-180}"
out="${FUZZ_OUT:-/tmp/detdit_fuzz}"
mkdir -p "$out/corpus"
clang++ -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=undefined -I"$root/include" -I"$root/src" \
  "$root/tests/fuzz/safetensors_fuzz.cc" "$root/src/io/safetensors.cc" "$root/src/common/tensor.cc" \
  "$root/src/common/status.cc" -o "$out/safetensors_fuzz"
nice -n 19 "$out/safetensors_fuzz" -max_total_time="$seconds" -max_len=4096 -timeout=10 \
  -artifact_prefix="$root/tests/fuzz/corpus/crash-" -dict="$root/tests/fuzz/safetensors.dict" \
  "$out/corpus" "$root/tests/fuzz/corpus"
