#!/usr/bin/env bash
# Builds what the sanitizer and fuzz stages of scripts/test.sh run, one build after another:
#   build-asan  AddressSanitizer + UBSan (RelWithDebInfo): qring-launch and the net and
#               collectives tests (label "sanitize")
#   build-tsan  ThreadSanitizer: the collectives tests scripts/tsan.sh runs (QRING_TSAN_STEP=build)
#   build-fuzz  the libFuzzer targets (scripts/fuzz.sh, QRING_FUZZ_STEP=build)
# QRING_SKIP_SANITIZE=1 / QRING_SKIP_TSAN=1 / QRING_SKIP_FUZZ=1 leave one out. After each
# build it prints "== built DIR in N s, CPU M s" (user + system) and creates DIR/.qring-built, which scripts/test.sh
# waits for: it runs this script in the background at the lowest CPU priority (nice 19) while
# its Release, Python, Slurm and emulated-hosts stages run, which leave much of the CPU idle
# (real processes waiting on deadlines, Slurm's clock, namespaces' links).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cpu_ticks.sh
built() {  # built DIR COMMAND...: runs the build, then marks DIR as built
  local dir=$1 t0 c0
  shift
  t0=$(date +%s)
  c0=$(cpu_ticks)
  rm -f "$dir/.qring-built"
  "$@"
  touch "$dir/.qring-built"
  echo "== built $dir in $(( $(date +%s) - t0 )) s, CPU $(( ($(cpu_ticks) - c0) / $(getconf CLK_TCK) )) s"
}
if [ "${QRING_SKIP_SANITIZE:-0}" != 1 ]; then
  targets="qring-launch $(cd tests && ls test_net_*.cc test_coll_*.cc | sed 's/\.cc$//' | tr '\n' ' ')"
  built build-asan env QRING_TARGETS="$targets" QRING_BUILD_TYPE=RelWithDebInfo \
    scripts/build.sh build-asan -DQRING_SANITIZE=address,undefined -DQRING_BUILD_TESTS=ON
fi
if [ "${QRING_SKIP_TSAN:-0}" != 1 ]; then
  built build-tsan env QRING_TSAN_STEP=build scripts/tsan.sh build-tsan
fi
if [ "${QRING_SKIP_FUZZ:-0}" != 1 ]; then
  built build-fuzz env QRING_FUZZ_STEP=build scripts/fuzz.sh build-fuzz
fi
