#!/usr/bin/env bash
# The test command: installs what it needs, builds (Release and a sanitizer build), and runs
# every test through ctest. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

echo "== build (Release)"
scripts/build.sh build
echo "== tests (Release)"
(cd build && ctest --output-on-failure --timeout 300 -j 2)

if [ "${QRING_SKIP_SANITIZE:-0}" != 1 ]; then
  echo "== build (address,undefined sanitizers)"
  QRING_BUILD_TYPE=RelWithDebInfo scripts/build.sh build-asan -DQRING_SANITIZE=address,undefined
  echo "== tests (sanitizers)"
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
     ctest --output-on-failure --timeout 300 -j 2 -L sanitize)
fi
