#!/usr/bin/env bash
# Builds detdit and runs every test suite (CPU; CUDA tests skip with a reason
# on a machine without a GPU). The README's test command; .ci/run calls it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
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
