#!/usr/bin/env bash
# ThreadSanitizer run of the collectives and quorum tests (the engine thread, callers that
# drive it, the quorum service and its waiters, several communicators per process).
#
#   scripts/tsan.sh [BUILD_DIR]        (default build-tsan)
#
# Builds the in-process test_coll_* suites with -fsanitize=thread (-O1 -g1) and runs each
# binary (file by file, -DQRING_UNITY_BUILD=OFF: the build that checks every file includes what
# it uses); any data race or other TSan report fails the run (halt_on_error). OpenMP runs with
# one thread (OMP_NUM_THREADS=1): libgomp is not instrumented, and its barriers would be
# reported as races. tests/tsan.supp suppresses what TSan reports inside the uninstrumented
# spdlog and libstdc++ (their synchronization is invisible to it; each entry says why).
# scripts/test.sh runs it (QRING_SKIP_TSAN=1 skips; docs/benchmarks.md, "Time of
# scripts/test.sh"), QRING_TSAN_JOBS binaries at a time. QRING_TSAN_TESTS overrides the suites
# (space-separated test binaries). QRING_TSAN_STEP=build only builds them, =run only runs
# them (scripts/test.sh builds while other stages run); default both.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-tsan}
TESTS=${QRING_TSAN_TESTS:-"test_coll_ring test_coll_agree test_coll_quorum test_coll_membership test_coll_straggler test_coll_rejoin test_coll_param_server test_coll_failover test_coll_clock"}
STEP=${QRING_TSAN_STEP:-all}
start=$(date +%s)
if [ "$STEP" != run ]; then
  QRING_TARGETS="$TESTS" QRING_BUILD_TYPE=RelWithDebInfo \
    scripts/build.sh "$BUILD" -DQRING_SANITIZE=thread -DQRING_BUILD_TESTS=ON \
    -DQRING_UNITY_BUILD=OFF
fi
built=$(date +%s)
[ "$STEP" != build ] || { echo "tsan: build $((built - start)) s"; exit 0; }
# tsan_one TEST: runs it; "ok" or "FAILED" goes to BUILD/TEST.tsan.verdict.
tsan_one() {
  if OMP_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
    timeout 1800 "$BUILD/tests/$1" --gtest_brief=1 >"$BUILD/$1.tsan.log" 2>&1; then
    echo ok >"$BUILD/$1.tsan.verdict"
  else
    echo FAILED >"$BUILD/$1.tsan.verdict"
  fi
}
# QRING_TSAN_JOBS binaries at a time (default one per core), the longest first
# (test_coll_failover: about 100 of the 173 s the nine took one after another).
order="$(for t in $TESTS; do [ "$t" != test_coll_failover ] || echo "$t"; done)
$(for t in $TESTS; do [ "$t" = test_coll_failover ] || echo "$t"; done)"
. scripts/run_at_most.sh
# shellcheck disable=SC2086  # $order: one binary per word
run_at_most "${QRING_TSAN_JOBS:-$(nproc)}" "== tsan" tsan_one $order
failed=0
for t in $TESTS; do
  if [ "$(cat "$BUILD/$t.tsan.verdict")" = ok ]; then
    echo "tsan: $t: $(tail -1 "$BUILD/$t.tsan.log")"
  else
    failed=1
    echo "tsan: $t FAILED"
    grep -E "WARNING: ThreadSanitizer|SUMMARY|FAILED" "$BUILD/$t.tsan.log" | head -20
  fi
done
end=$(date +%s)
echo "tsan: build $((built - start)) s, tests $((end - built)) s"
exit $failed
