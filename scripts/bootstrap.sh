#!/usr/bin/env bash
# Installs what detdit's build needs (Debian packages by name) and builds it
# into build/. Safe to run again: installed packages are skipped and the build
# is incremental. Used by scripts/test.sh and scripts/verify.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

packages=(cmake ninja-build g++ git libgtest-dev nlohmann-json3-dev libssl-dev libopenmpi-dev openmpi-bin)
# the PyTorch extension (python/, built against Debian's CPU torch) and its pytest suite
packages+=(python3-torch libtorch-dev python3-dev python3-setuptools python3-pytest)
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
if [ ! -f "$build_dir/build.ninja" ]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${DETDIT_CMAKE_ARGS:-}
fi
cmake --build "$build_dir" -j "$(nproc)"
