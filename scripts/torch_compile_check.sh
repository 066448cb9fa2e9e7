#!/usr/bin/env bash
# The torch.compile job: detdit's tests that need torch >= 2.4
# (tests/python/test_compile.py: opcheck of every op, the compiled H3 block,
# dynamic shapes) on Debian 13's torch 2.6, since Debian 12 (the CI system) has
# torch 1.13, which has no torch.compile; and the rest of tests/python with
# them, but for test_nn.py (it runs the detdit CLI, not built here) and
# test_distributed.py (torch 2.6's gloo now and then hangs a process in
# destroy_process_group, PyTorch issue 75097; it runs on torch 1.13 in
# scripts/test.sh). Called by scripts/test.sh; docs/python.md says what it shows.
#
# Debian 13 (trixie) is made once with debootstrap in DIR-trixie, DIR being
# the build directory (DETDIT_BUILD_DIR, default build/): Debian packages by
# name from Debian's archive. Each run copies the checkout's files in (tracked
# and untracked, not ignored), builds the library there (CPU, library only;
# incremental in DIR-trixie/build), the extension in place against torch 2.6,
# and runs the tests. Needs root (debootstrap, chroot, mounting /proc inside:
# torch reads it), through sudo when not root; nothing of the checkout is
# mounted into the chroot, so deleting DIR-trixie can never reach the checkout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build_dir="${DETDIT_BUILD_DIR:-build}"
case "$build_dir" in
  /*) system="${build_dir}-trixie" ;;
  *) system="$root/${build_dir}-trixie" ;;
esac
# debootstrap and chroot need root: as bootstrap.sh installs packages, through sudo otherwise
[ "$(id -u)" -eq 0 ] || exec sudo DETDIT_BUILD_DIR="$build_dir" bash "${BASH_SOURCE[0]}"
start=$SECONDS

unmount_proc() { if mountpoint -q "$system/proc"; then umount "$system/proc"; fi; }
if [ ! -f "$system/.detdit-ready" ]; then
  dpkg -s debootstrap >/dev/null 2>&1 || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  unmount_proc 2>/dev/null || true  # a half-made system from an interrupted run
  rm -rf --one-file-system "$system"
  packages=python3,python3-torch,python3-pytest,python3-dev,python3-setuptools,libtorch-dev,pybind11-dev
  packages+=,g++,cmake,ninja-build  # the library alone: no IO library, so no nlohmann-json or libssl
  echo "detdit: making Debian 13 (torch 2.6) in $system with debootstrap"
  log="$(mktemp)"
  debootstrap --variant=minbase --include="$packages" trixie "$system" http://deb.debian.org/debian \
    >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
  rm -f "$log"
  touch "$system/.detdit-ready"
fi

rm -rf "$system/src"
mkdir -p "$system/src"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -C "$system/src" -xf -
mount -t proc proc "$system/proc"
trap unmount_proc EXIT
chroot "$system" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 /bin/bash -c "
  set -euo pipefail
  python3 -c 'import torch; print(\"detdit: torch\", torch.__version__, \"in Debian\", open(\"/etc/debian_version\").read().strip())'
  cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDETDIT_LIBRARY_ONLY=ON \
    -DDETDIT_ENABLE_CUDA=OFF -DDETDIT_ENABLE_MPI=OFF >/dev/null
  cmake --build /build -j $(nproc) --target detdit >/dev/null
  cd /src/python && DETDIT_BUILD_DIR=/build python3 setup.py -q build_ext --inplace >/build/setup.log 2>&1 ||
    { tail -30 /build/setup.log >&2; exit 1; }
  cd /src && PYTHONPATH=/src/python python3 -m pytest tests/python -q -rxs \
    --ignore tests/python/test_nn.py --ignore tests/python/test_distributed.py
"
echo "detdit: torch.compile job passed in $((SECONDS - start)) s"
