#!/usr/bin/env bash
# Builds detdit and runs the main job: detdit verify on the embedded default.
# Extra arguments go to detdit verify (see build/detdit verify --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
exec "${DETDIT_BUILD_DIR:-build}/detdit" verify "$@"
