#!/usr/bin/env bash
# Builds what `detdit verify` needs (the detdit CLI target, not the tests) and
# runs it on the embedded default. Extra arguments go to detdit verify (see
# build/detdit verify --help); DETDIT_BUILD_DIR and DETDIT_CMAKE_ARGS as for
# scripts/bootstrap.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build_dir="${DETDIT_BUILD_DIR:-build}"
# Without a GPU, verify runs on the CPU, and the CUDA backend (two
# architectures) is half of the first build: a new build directory gets the
# CPU backend only. scripts/test.sh turns CUDA on again when nvcc is present.
if [ ! -f "$build_dir/build.ninja" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "detdit: no GPU visible: building the CPU backend only"
  export DETDIT_CMAKE_ARGS="-DDETDIT_ENABLE_CUDA=OFF ${DETDIT_CMAKE_ARGS:-}"
fi
bash scripts/bootstrap.sh detdit_cli
exec "$build_dir/detdit" verify "$@"
