#!/usr/bin/env bash
# Builds what the sanitizer and fuzz stages of scripts/test.sh run:
#   build-asan  AddressSanitizer + UBSan (RelWithDebInfo): qring-launch and the net and
#               collectives tests (label "sanitize"), one ctest test per binary
#               (QRING_TEST_PER_BINARY), executables without PIE
#   build-tsan  ThreadSanitizer: the collectives tests scripts/tsan.sh runs (QRING_TSAN_STEP=build)
#   build-fuzz  the libFuzzer targets (scripts/fuzz.sh, QRING_FUZZ_STEP=build)
# The ASan build (needed first) runs beside the TSan build and then the fuzz build, which run
# under SCHED_IDLE (chrt --idle 0): they take only the CPU that nothing else wants, such as
# what the ASan build leaves idle while it links or compiles the last file of a library
# alone, so they take next to nothing from it.
# QRING_SKIP_SANITIZE=1 / QRING_SKIP_TSAN=1 / QRING_SKIP_FUZZ=1 leave one out. Each build's
# output goes to BUILD_LOGS/DIR.log (BUILD_LOGS: $QRING_SANITIZER_LOGS, default build); after
# it, this script prints "== built DIR in N s, CPU M s" (user + system) and creates
# DIR/.qring-built, or prints "== FAILED DIR" and creates DIR/.qring-failed. scripts/test.sh
# waits for those files: it runs this script in the background at the lowest CPU priority
# while its Release, Python, Slurm and emulated-hosts stages run, which leave part of the CPU
# idle (real processes waiting on deadlines, Slurm's clock, namespaces' links).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cpu_ticks.sh
logs=${QRING_SANITIZER_LOGS:-build}
mkdir -p "$logs"
built() {  # built DIR COMMAND...: runs the build, then marks DIR as built or failed
  local dir=$1 t0 c0
  shift
  t0=$(date +%s)
  c0=$(cpu_ticks)
  mkdir -p "$dir"
  rm -f "$dir/.qring-built" "$dir/.qring-failed"
  if ! "$@" >"$logs/$dir.log" 2>&1; then
    echo "== FAILED $dir (its log: $logs/$dir.log)"
    touch "$dir/.qring-failed"
    return 1
  fi
  echo "== built $dir in $(( $(date +%s) - t0 )) s, CPU $(( ($(cpu_ticks) - c0) / $(getconf CLK_TCK) )) s"
  touch "$dir/.qring-built"
}
asan() {
  [ "${QRING_SKIP_SANITIZE:-0}" != 1 ] || return 0
  # qring_sanitize_tests: qring-launch and the tests labelled "sanitize" (tests/CMakeLists.txt).
  built build-asan env QRING_TARGETS=qring_sanitize_tests QRING_BUILD_TYPE=RelWithDebInfo \
    scripts/build.sh build-asan -DQRING_SANITIZE=address,undefined -DQRING_BUILD_TESTS=ON \
    -DQRING_TEST_PER_BINARY=ON
}
tsan_then_fuzz() {
  local rc=0
  if [ "${QRING_SKIP_TSAN:-0}" != 1 ]; then
    built build-tsan env QRING_TSAN_STEP=build scripts/tsan.sh build-tsan || rc=1
  fi
  if [ "${QRING_SKIP_FUZZ:-0}" != 1 ]; then
    built build-fuzz env QRING_FUZZ_STEP=build scripts/fuzz.sh build-fuzz || rc=1
  fi
  return $rc
}
# unidle PID: PID and its descendants back to the normal policy (this script's priority); a
# child forked after its parent's switch inherits it.
unidle() {
  local p
  chrt --other -p 0 "$1" 2>/dev/null || true
  for p in $(ps -o pid= --ppid "$1"); do unidle "$p"; done
}
# SCHED_IDLE where chrt can set it; otherwise the two run side by side at the same priority.
# Once the ASan build is done, the others go on at this script's priority: SCHED_IDLE would
# also yield to anything else on the machine.
idle=()
chrt --idle 0 true 2>/dev/null && idle=(chrt --idle 0)
"${idle[@]}" bash -c "$(declare -f built tsan_then_fuzz cpu_ticks); logs=$logs; tsan_then_fuzz" &
others=$!
rc=0
asan || rc=1
unidle "$others"
wait "$others" || rc=1
exit $rc
