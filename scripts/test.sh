#!/usr/bin/env bash
# The test command: installs what it needs, builds, and runs every test.
#   0. the structure rule that a script can check: no class in collectives/ over 500 lines
#   1. Release build, every GoogleTest suite through ctest; the Python tests (pytest:
#      python/tests, needs PyTorch: scripts/setup.sh installs it here); a C++ program built
#      against the installed library (tests/consumer/run.sh: CMake package and pkg-config)
#   2. AddressSanitizer + UndefinedBehaviorSanitizer build of the network and collectives
#      tests (label "sanitize"), run through ctest
#   3. Slurm integration tests on a local Slurm cluster (tests/slurm/run.sh)
#   4. multi-host tests on hosts emulated with network namespaces (tests/netns/run.sh)
#   5. ThreadSanitizer build of the collectives and quorum tests, run (scripts/tsan.sh)
#   6. the fuzz targets, a fixed time each (scripts/fuzz.sh; QRING_FUZZ_SECONDS, default 10)
#   7. the paper reproduction at smoke scale (scripts/reproduce.sh --smoke: every experiment
#      on synthetic data; checks that every artefact is produced and well formed)
# Exits non-zero on any failure. QRING_SKIP_PYTHON=1 skips the Python tests.
# QRING_SKIP_SANITIZE=1 / QRING_SKIP_SLURM=1 / QRING_SKIP_NETNS=1 / QRING_SKIP_TSAN=1 /
# QRING_SKIP_FUZZ=1 / QRING_SKIP_REPRODUCE=1 skip 2 / 3 / 4 / 5 / 6 / 7.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${QRING_SKIP_PYTHON:-0}" = 1 ] || export QRING_SETUP_TORCH=1  # PyTorch, pytest
scripts/setup.sh
start=$(date +%s)
section() { echo "== $1 (at $(( $(date +%s) - start )) s)"; }

section "structure: no class in collectives/ over 500 lines (scripts/class_sizes.py)"
scripts/class_sizes.py --limit 500 collectives | tail -1
section "build (Release)"
scripts/build.sh build -DQRING_BUILD_TESTS=ON
section "tests (Release)"
(cd build && ctest --output-on-failure --no-tests=error --timeout 300 -j 2)

if [ "${QRING_SKIP_PYTHON:-0}" != 1 ]; then
  section "Python tests (pytest: python/tests)"
  QRING_BUILD=build /usr/bin/python3 -m pytest -q -p no:cacheprovider python/tests
fi
section "C++ program against the installed library (tests/consumer)"
tests/consumer/run.sh build

if [ "${QRING_SKIP_SANITIZE:-0}" != 1 ]; then
  section "build (address,undefined sanitizers: net and collectives tests)"
  targets="qring-launch $(cd tests && ls test_net_*.cc test_coll_*.cc | sed 's/\.cc$//' | tr '\n' ' ')"
  QRING_TARGETS="$targets" QRING_BUILD_TYPE=RelWithDebInfo \
    scripts/build.sh build-asan -DQRING_SANITIZE=address,undefined -DQRING_BUILD_TESTS=ON
  section "tests (sanitizers)"
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     ctest --output-on-failure --no-tests=error --timeout 600 -j 2 -L sanitize)
fi

section "Slurm integration tests"
tests/slurm/run.sh build

if [ "${QRING_SKIP_NETNS:-0}" != 1 ]; then
  section "multi-host tests on emulated hosts (network namespaces)"
  tests/netns/run.sh build
fi

if [ "${QRING_SKIP_TSAN:-0}" != 1 ]; then
  section "ThreadSanitizer build and run of the collectives and quorum tests"
  scripts/tsan.sh build-tsan
fi

if [ "${QRING_SKIP_FUZZ:-0}" != 1 ]; then
  section "fuzz targets (libFuzzer + ASan/UBSan, ${QRING_FUZZ_SECONDS:-10} s each)"
  QRING_FUZZ_SECONDS=${QRING_FUZZ_SECONDS:-10} scripts/fuzz.sh build-fuzz
fi

if [ "${QRING_SKIP_REPRODUCE:-0}" != 1 ]; then
  section "paper reproduction, smoke scale"
  scripts/reproduce.sh --smoke --out build/reproduce-smoke
fi

echo "== all tests passed in $(( $(date +%s) - start )) s"
