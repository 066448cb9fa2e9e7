#!/usr/bin/env bash
# The torch.compile job: detdit's tests that need torch >= 2.4
# (tests/python/test_compile.py: opcheck of every op, the compiled H3 block,
# dynamic shapes) on Debian 13's torch 2.6, since Debian 12 (the CI system) has
# torch 1.13, which has no torch.compile; and the rest of tests/python with
# them, but for test_nn.py (it runs the detdit CLI, not built here),
# test_torch_compare.py (it runs the C++ case exporter, not built here) and
# test_distributed.py (torch 2.6's gloo now and then hangs a process in
# destroy_process_group; it runs on torch 1.13 in scripts/test.sh). Called by
# scripts/test.sh; docs/python.md says what it shows.
#
# Debian 13 (trixie) is made with debootstrap (Debian packages by name from
# Debian's archive) once per machine, outside the checkout, in
# DETDIT_CACHE_DIR (default /var/cache/detdit)/trixie-HASH, HASH naming what
# makes it (the package list, the archive, this recipe's version), so a changed
# list makes a new system beside the old one. It is made under a lock in a
# directory of its own and renamed to that name only once complete: a run never
# takes a half-made system, concurrent runs wait for one maker, and an
# interrupted make is deleted by the next. A run never writes into it: in a
# mount namespace of its own (its mounts end with its last process, also when
# it is killed) the system is mounted read-only, with this run's directory
# DIR-torch-compile (DIR the build directory, DETDIT_BUILD_DIR, default
# build/) at /detdit and as /tmp. Into DIR-torch-compile/src each run copies
# the checkout's files (tracked and untracked, not ignored); there setup.py
# builds the library with its own CMake build (as `pip install ./python` does:
# no prebuilt library; incremental, python/build/ is kept between runs) and
# the extension in place against torch 2.6, and the tests run, on the op cases
# that the main build's tests/detdit_export_cases writes into DIR-torch-compile/tmp
# first (DETDIT_OP_CASES: the chroot builds no IO library, so no exporter). Needs
# root (debootstrap, unshare, chroot), through sudo when not root.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build_dir="${DETDIT_BUILD_DIR:-build}"
case "$build_dir" in
  /*) run_dir="${build_dir}-torch-compile" ;;
  *) run_dir="$root/${build_dir}-torch-compile" ;;
esac
# debootstrap, unshare and chroot need root: as bootstrap.sh installs packages, through sudo otherwise
[ "$(id -u)" -eq 0 ] || exec sudo DETDIT_BUILD_DIR="$build_dir" DETDIT_CACHE_DIR="${DETDIT_CACHE_DIR:-}" \
  bash "${BASH_SOURCE[0]}"
start=$SECONDS

packages=python3,python3-torch,python3-pytest,python3-dev,python3-setuptools,libtorch-dev,pybind11-dev
packages+=,g++,cmake,ninja-build  # the library alone: no IO library, so no nlohmann-json or libssl
archive=http://deb.debian.org/debian
# Everything that makes the system; a change to any of it names a new one (recipe 2: /detdit made).
recipe="2 debootstrap --variant=minbase --include=$packages trixie $archive"
cache="${DETDIT_CACHE_DIR:-/var/cache/detdit}"
system="$cache/trixie-$(printf '%s' "$recipe" | sha256sum | cut -c1-16)"
if [ ! -d "$system" ]; then
  mkdir -p "$cache"
  exec 9>"$system.lock"
  flock 9  # one maker at a time; a run that waited here finds the system made
  if [ ! -d "$system" ]; then
    dpkg -s debootstrap >/dev/null 2>&1 || {
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    }
    # An interrupted make's leftovers (no one else is making while the lock is held); no
    # mount can be under them: debootstrap's own mounts lived in its namespace.
    rm -rf --one-file-system "$system".part-*
    part="$system.part-$$"
    echo "detdit: making Debian 13 (torch 2.6) in $system with debootstrap (once per machine)"
    log="$(mktemp)"
    unshare --mount debootstrap --variant=minbase --include="$packages" trixie "$part" "$archive" \
      >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
    rm -f "$log"
    rm -f "$part"/var/cache/apt/archives/*.deb  # the downloaded packages, installed now
    mkdir "$part/detdit"
    mv -T "$part" "$system"  # one rename: the name exists for a complete system only
  fi
  exec 9>&-
fi

# This run's directory: the sources copied in anew, the library's build kept (incremental).
mkdir -p "$run_dir"
if [ -d "$run_dir/src/python/build" ]; then mv "$run_dir/src/python/build" "$run_dir/python-build"; fi
rm -rf "$run_dir/src" "$run_dir/tmp"
mkdir -p "$run_dir/src" "$run_dir/tmp" "$run_dir/home"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -C "$run_dir/src" -xf -
if [ -d "$run_dir/python-build" ]; then mv "$run_dir/python-build" "$run_dir/src/python/build"; fi
# The op cases the tests take their inputs from, written by the main build's program
# (tests/support/export_cases.cc; the chroot builds the library alone, scripts/test.sh's
# build job built it), the set tests/python/conftest.py would export.
DETDIT_BUILD_DIR="$build_dir" python3 tests/python/op_cases.py "$run_dir/tmp/op_cases"

# shellcheck disable=SC2016  # $1 and $2 are the inner shell's
unshare --mount bash -c '
  set -e
  mount --bind "$2" "$2" && mount -o remount,bind,ro "$2"
  mount -t proc proc "$2/proc"
  mount -t tmpfs tmpfs "$2/dev/shm"
  mount --bind "$1" "$2/detdit"
  mount --bind "$1/tmp" "$2/tmp"
  exec chroot "$2" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/detdit/home TMPDIR=/tmp LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 DETDIT_OP_CASES=/tmp/op_cases /bin/bash -c "$3"' _ "$run_dir" "$system" "
  set -euo pipefail
  python3 -c 'import torch; print(\"detdit: torch\", torch.__version__, \"in Debian\", open(\"/etc/debian_version\").read().strip())'
  cd /detdit/src/python
  python3 setup.py -q build_ext --inplace >/detdit/setup.log 2>&1 || { tail -30 /detdit/setup.log >&2; exit 1; }
  cd /detdit/src && PYTHONPATH=/detdit/src/python python3 -m pytest tests/python -q -rxs \
    --ignore tests/python/test_nn.py --ignore tests/python/test_distributed.py \
    --ignore tests/python/test_torch_compare.py
"
echo "detdit: torch.compile job passed in $((SECONDS - start)) s"
