#!/usr/bin/env bash
# Configures and builds qring.
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]
# QRING_BUILD_TYPE (default Release), QRING_JOBS (default nproc), QRING_TARGETS (default all).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
shift || true
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="${QRING_BUILD_TYPE:-Release}" "$@" >/dev/null
targets=()
for t in ${QRING_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "${QRING_JOBS:-$(nproc)}" "${targets[@]}"
