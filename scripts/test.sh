#!/usr/bin/env bash
# Builds detdit and runs every test suite (CPU; CUDA tests skip with a reason
# on a machine without a GPU). The README's test command; .ci/run calls it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
build_dir="${DETDIT_BUILD_DIR:-build}"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" --timeout 1200
