#!/usr/bin/env bash
# Configures and builds qring. Usage: scripts/build.sh [BUILD_DIR] [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
shift || true
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=${QRING_BUILD_TYPE:-Release} "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "${QRING_JOBS:-$(nproc)}"
