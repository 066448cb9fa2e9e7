#!/usr/bin/env bash
# Installs what detdit's build needs (Debian packages by name) and builds it
# into build/. Safe to run again: installed packages are skipped and the build
# is incremental. Used by scripts/test.sh and scripts/verify.sh.
#
#   bash scripts/bootstrap.sh [TARGET...]    # the CMake targets to build (default: all)
#
# DETDIT_BUILD_DIR: the build directory (default build/). DETDIT_CMAKE_ARGS:
# more CMake arguments, split at spaces (e.g. "-DDETDIT_ENABLE_CUDA=OFF
# -DDETDIT_CUDA_ARCHITECTURES=90"). When set, CMake re-configures the build
# directory with them on every run, so they take effect on a configured one
# too; a value stays in its CMakeCache.txt until it is set again (or the
# directory is deleted).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# nlohmann-json3-dev and libssl-dev: the IO library (io/) of the CLI and the tests (the library
# alone and the Python package need neither)
packages=(cmake ninja-build g++ git libgtest-dev nlohmann-json3-dev libcli11-dev libssl-dev libopenmpi-dev openmpi-bin)
# the PyTorch extension (python/, built against Debian's CPU torch) and its pytest suite;
# venv and wheel for the documented pip install, which tests/docs runs
packages+=(python3-torch libtorch-dev python3-dev python3-setuptools python3-pytest python3-venv python3-wheel)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "detdit: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

build_dir="${DETDIT_BUILD_DIR:-build}"
if [ ! -f "$build_dir/build.ninja" ] || [ -n "${DETDIT_CMAKE_ARGS:-}" ]; then
  # shellcheck disable=SC2086  # DETDIT_CMAKE_ARGS is a list of arguments, split at spaces
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${DETDIT_CMAKE_ARGS:-}
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build_dir" -j "$(nproc)" "${targets[@]}"
