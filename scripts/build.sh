#!/usr/bin/env bash
# Configures and builds qring.
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]
# QRING_BUILD_TYPE (default Release), QRING_JOBS (default nproc), QRING_TARGETS (default all).
# Several QRING_TARGETS build as one goal, the target qring_build_only that depends on them
# (CMakeLists.txt, QRING_BUILD_ONLY): CMake's top-level Makefile is .NOTPARALLEL, so several
# --target goals would build one after another, each test (one source file) on one core.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
shift || true
read -r -a targets <<<"${QRING_TARGETS:-}"
only=$(IFS=';'; echo "${targets[*]}")
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="${QRING_BUILD_TYPE:-Release}" \
  -DQRING_BUILD_ONLY="$only" "$@" >/dev/null
goal=()
[ -z "$only" ] || goal=(--target qring_build_only)
cmake --build "$BUILD_DIR" -j "${QRING_JOBS:-$(nproc)}" "${goal[@]}"
