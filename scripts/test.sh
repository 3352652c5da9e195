#!/usr/bin/env bash
# The test command: installs what it needs, builds, and runs every test.
#   0. the structure rule that a script can check: no class in collectives/ over 500 lines
#   1. Release build, every GoogleTest suite through ctest; the Python tests (pytest:
#      python/tests, needs PyTorch: scripts/setup.sh installs it here; tests/test_reproduce.py,
#      scripts/reproduce.py's reading of runs; tests/test_fault_case42.py, the fault matrix's
#      accuracy verdict; tests/test_bench_ab.py, bench_ab.py's interval); a C++ program built
#      against the installed library (tests/consumer/run.sh: CMake package and pkg-config)
#   2. AddressSanitizer + UndefinedBehaviorSanitizer build of the network and collectives
#      tests (label "sanitize"), run through ctest, one test per binary (its cases in one
#      process: an ASan process costs ~0.2 CPU s to start; tests/CMakeLists.txt)
#   3. Slurm integration tests on a local Slurm cluster (tests/slurm/run.sh)
#   4. multi-host tests on hosts emulated with network namespaces (tests/netns/run.sh)
#   5. ThreadSanitizer build of the collectives and quorum tests, run (scripts/tsan.sh)
#   6. the fuzz targets, a fixed time each (scripts/fuzz.sh; QRING_FUZZ_SECONDS, default 10)
#   7. the paper reproduction at smoke scale (scripts/reproduce.sh --smoke: every experiment
#      on synthetic data; checks that every artefact is produced and well formed)
# Exits non-zero on any failure. QRING_SKIP_PYTHON=1 skips the Python tests.
# QRING_SKIP_SANITIZE=1 / QRING_SKIP_SLURM=1 / QRING_SKIP_NETNS=1 / QRING_SKIP_TSAN=1 /
# QRING_SKIP_FUZZ=1 / QRING_SKIP_REPRODUCE=1 skip 2 / 3 / 4 / 5 / 6 / 7.
# Order: 1, 4, then 3 in the background beside 7 and the wait for the ASan build, then 2, 5, 6.
# The builds of 2, 5 and 6 (scripts/build_sanitizers.sh) run in the background at the lowest
# priority from the end of the Release build on, in the CPU time that stages 1, 3, 4 and 7 leave
# idle; each of 2, 5, 6 waits for its own build (the builds' logs: build/sanitizer-builds.log,
# build/build-*.log). Stage 3 mostly waits on Slurm's clock (its jobs' time limits and
# signals; it and its jobs use about half a core), so it runs in the background (its output in build/slurm-tests.log, printed when it
# is joined, before stage 2; a failure there fails this script as one in the foreground does),
# beside stages that assert nothing about time: Python and the emulated hosts run before it.
# Every stage prints its seconds, the CPU seconds its processes used (user + system; the
# background builds' own are in their log), the seconds the machine's CPUs were idle (all
# CPUs summed, whatever ran: on a quiet machine what the stage leaves unused) and the load
# average when it ends; a table of all of them and the total comes last. On a shared machine
# the CPU seconds say what a stage costs whatever else runs.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# cpu_ticks: user + system CPU of this shell's finished children, in clock ticks.
. scripts/cpu_ticks.sh
hz=$(getconf CLK_TCK)
# idle_ticks: idle + iowait ticks of all CPUs since boot (/proc/stat).
idle_ticks() {
  local cpu user nice sys idle iowait rest
  read -r cpu user nice sys idle iowait rest </proc/stat
  echo $((idle + iowait))
}
stage=""
stage_at=$start
stage_cpu=$(cpu_ticks)
stage_idle=$(idle_ticks)
start_idle=$stage_idle
summary=""
bg_pid=""
bg_log=build/sanitizer-builds.log
slurm_pid=""
slurm_log=build/slurm-tests.log
end_stage() {
  [ -n "$stage" ] || return 0
  local now secs cpu idle load
  now=$(date +%s)
  secs=$((now - stage_at))
  cpu=$(( ($(cpu_ticks) - stage_cpu) / hz ))
  idle=$(( ($(idle_ticks) - stage_idle) / hz ))
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  echo "== $stage: $secs s, CPU $cpu s, idle $idle s (load average $load)"
  summary+=$(printf '%6d s %6d s CPU %6d s idle  %s (load %s)' "$secs" "$cpu" "$idle" "$stage" \
    "$load")$'\n'
  stage=""
}
section() {
  end_stage
  stage=$1
  stage_at=$(date +%s)
  stage_cpu=$(cpu_ticks)
  stage_idle=$(idle_ticks)
  echo "== $stage (at $((stage_at - start)) s)"
}
finish() {
  local rc=$?
  end_stage
  if [ -n "$bg_pid" ] && kill -0 "$bg_pid" 2>/dev/null; then
    kill -- "-$bg_pid" 2>/dev/null || true
  fi
  if [ -n "$slurm_pid" ] && kill -0 "$slurm_pid" 2>/dev/null; then
    # SIGTERM: tests/slurm/run.sh's exit trap cancels its jobs and stops its cluster.
    echo "== stopping the Slurm tests still running in the background ($slurm_log)"
    kill -- "-$slurm_pid" 2>/dev/null || true
  fi
  [ ! -f "$bg_log" ] || grep '^== \(built\|FAILED\)' "$bg_log" | sed 's/^== /== background: /' || true
  echo "== stage times"
  printf '%s' "$summary"
  printf '%6d s %6d s CPU %6d s idle  total without the background builds (load %s)\n' \
    $(( $(date +%s) - start )) $(( $(cpu_ticks) / hz )) $(( ($(idle_ticks) - start_idle) / hz )) \
    "$(cut -d' ' -f1-3 /proc/loadavg)"
  exit $rc
}
trap finish EXIT
# wait_built DIR: waits until the background build of DIR is done; fails if it failed.
wait_built() {
  section "waiting for the background build of $1"
  while [ ! -e "$1/.qring-built" ]; do
    if [ -e "$1/.qring-failed" ] || ! kill -0 "$bg_pid" 2>/dev/null; then
      echo "the background build of $1 failed (build/$1.log, $bg_log):"
      tail -40 "build/$1.log" 2>/dev/null || tail -40 "$bg_log"
      return 1
    fi
    sleep 2
  done
}
# slurm_start: starts stage 3 in the background, in a session of its own (so that its CPU is
# not counted in whichever foreground stage it ends in, and so that it can be stopped whole);
# its output goes to $slurm_log, then a line "RC SECONDS CPU_SECONDS" to $slurm_log.done.
slurm_start() {
  echo "== Slurm integration tests: started in the background (at $(( $(date +%s) - start )) s; output in $slurm_log)"
  rm -f "$slurm_log.done"
  (setsid bash -c '. scripts/cpu_ticks.sh; t0=$(date +%s); rc=0 all=-
     cpu_group_enter "qring-slurm-tests-$$" || true
     tests/slurm/run.sh build || rc=$?
     [ -z "$CPU_GROUP" ] || all=$(cpu_group_seconds)
     cpu_group_leave
     echo "$rc $(( $(date +%s) - t0 )) $(( $(cpu_ticks) / $(getconf CLK_TCK) )) $all" >"$0.done"' \
     "$slurm_log" >"$slurm_log" 2>&1 </dev/null & echo $! >"$slurm_log.pid")
  slurm_pid=$(cat "$slurm_log.pid")
}
# slurm_join: waits for stage 3, prints its output, adds its line to the table (its own seconds
# and CPU seconds, as it ran beside the others; and where a cgroup could count them, the CPU
# seconds of everything it started, Slurm's daemons and jobs too) and fails if it failed.
slurm_join() {
  local rc secs cpu all
  section "waiting for the Slurm integration tests (background)"
  while [ ! -e "$slurm_log.done" ] && kill -0 "$slurm_pid" 2>/dev/null; do sleep 2; done
  end_stage
  slurm_pid=""
  echo "== Slurm integration tests (ran in the background; $slurm_log):"
  cat "$slurm_log"
  read -r rc secs cpu all <"$slurm_log.done" 2>/dev/null || { rc=1 secs=0 cpu=0 all=-; }
  echo "== Slurm integration tests: $secs s, CPU $cpu s, with Slurm's daemons and jobs $all s (in the background), exit $rc"
  summary+=$(printf '%6d s %6d s CPU %6s   Slurm integration tests (in the background; CPU with its daemons and jobs: %s s)' \
    "$secs" "$cpu" "" "$all")$'\n'
  return "$rc"
}

[ "${QRING_SKIP_PYTHON:-0}" = 1 ] || export QRING_SETUP_TORCH=1  # PyTorch, pytest
section "setup (scripts/setup.sh)"
scripts/setup.sh

section "structure: no class in collectives/ over 500 lines (scripts/class_sizes.py)"
scripts/class_sizes.py --limit 500 collectives | tail -1
section "build (Release)"
scripts/build.sh build -DQRING_BUILD_TESTS=ON
# The sanitizer and fuzz builds, in their own process group (ended with this script) and not
# this shell's child (their CPU is not counted in the stage they happen to end in).
rm -f build-{asan,tsan,fuzz}/.qring-built build-{asan,tsan,fuzz}/.qring-failed
# setsid: a process group to kill at the end; with autogroup scheduling (Linux's default for
# sessions) a new session is a scheduling group of its own, weighed like the tests' unless its
# own nice (/proc/self/autogroup) says otherwise: 19 there, so the tests keep the CPU they use.
# Inside that group the ASan build keeps nice 0, so that the TSan and fuzz builds beside it
# (SCHED_IDLE) take only what it leaves idle; without autogroup it runs at nice 19 itself.
(setsid sh -c 'if [ "$(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null)" = 1 ] &&
                  echo 19 2>/dev/null >/proc/self/autogroup; then exec scripts/build_sanitizers.sh
               else exec nice -n 19 scripts/build_sanitizers.sh; fi' \
   >"$bg_log" 2>&1 </dev/null & echo $! >build/sanitizer-builds.pid)
bg_pid=$(cat build/sanitizer-builds.pid)

section "tests (Release)"
(cd build && ctest --output-on-failure --no-tests=error --timeout 300 -j 2)

if [ "${QRING_SKIP_PYTHON:-0}" != 1 ]; then
  section "Python tests (pytest: python/tests, tests/test_reproduce.py, tests/test_fault_case42.py, tests/test_bench_ab.py)"
  QRING_BUILD=build /usr/bin/python3 -m pytest -q -p no:cacheprovider python/tests tests/test_reproduce.py tests/test_fault_case42.py \
    tests/test_bench_ab.py
fi
section "C++ program against the installed library (tests/consumer)"
tests/consumer/run.sh build

if [ "${QRING_SKIP_NETNS:-0}" != 1 ]; then
  section "multi-host tests on emulated hosts (network namespaces)"
  tests/netns/run.sh build
fi

end_stage
slurm_start

if [ "${QRING_SKIP_REPRODUCE:-0}" != 1 ]; then
  section "paper reproduction, smoke scale"
  scripts/reproduce.sh --smoke --out build/reproduce-smoke
fi

slurm_join

if [ "${QRING_SKIP_SANITIZE:-0}" != 1 ]; then
  wait_built build-asan
  section "tests (address,undefined sanitizers: net and collectives tests)"
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     ctest --output-on-failure --no-tests=error --timeout 600 -j 2 -L sanitize)
fi

if [ "${QRING_SKIP_TSAN:-0}" != 1 ]; then
  wait_built build-tsan
  section "ThreadSanitizer run of the collectives and quorum tests"
  QRING_TSAN_STEP=run scripts/tsan.sh build-tsan
fi

if [ "${QRING_SKIP_FUZZ:-0}" != 1 ]; then
  wait_built build-fuzz
  section "fuzz targets (libFuzzer + ASan/UBSan, ${QRING_FUZZ_SECONDS:-10} s each)"
  QRING_FUZZ_SECONDS=${QRING_FUZZ_SECONDS:-10} QRING_FUZZ_STEP=run scripts/fuzz.sh build-fuzz
fi

end_stage
echo "== all tests passed in $(( $(date +%s) - start )) s"
