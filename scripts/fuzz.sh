#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang with AddressSanitizer and UBSan) and runs
# each for a fixed time from the committed corpus; any crash, sanitizer report, leak, timeout
# or out-of-memory fails the run and leaves the input under BUILD_DIR/artifacts/.
#
#   scripts/fuzz.sh [BUILD_DIR] [TARGET...]      (default build-fuzz, every target)
#
# QRING_FUZZ_SECONDS: time per target (default 10); QRING_FUZZ_JOBS: targets run at once
# (default one per core). New inputs the fuzzer finds go to
# BUILD_DIR/corpus/<target> (not the committed corpus; copy good ones to tests/fuzz/corpus by
# hand, or rerun tests/fuzz/make_corpus.py). Targets: fuzz_store (store frames and requests),
# fuzz_quorum_wire (READY/DECIDE/VIEW/... messages), fuzz_idx, fuzz_checkpoint, fuzz_config
# (TOML and overrides), fuzz_toml_nesting (deep nesting and dotted keys, built from the input),
# fuzz_idx_budget (honest IDX headers against a memory budget). QRING_FUZZ_STEP=build only
# builds the targets, =run only runs them (scripts/test.sh builds while other stages run).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-fuzz}
shift || true
SECONDS_PER=${QRING_FUZZ_SECONDS:-10}
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(fuzz_store fuzz_quorum_wire fuzz_idx fuzz_checkpoint fuzz_config
  fuzz_toml_nesting fuzz_idx_budget)
command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (scripts/setup.sh)" >&2; exit 1; }
STEP=${QRING_FUZZ_STEP:-all}
if [ "$STEP" != run ]; then
  CXX=clang++ cmake -S tests/fuzz -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  # Every target: the project's default goal, in parallel (several --target goals would build
  # one after another: CMake's top-level Makefile is .NOTPARALLEL).
  goal=()
  [ $# -eq 0 ] || goal=(--target "${TARGETS[@]}")
  cmake --build "$BUILD" -j "${QRING_JOBS:-$(nproc)}" "${goal[@]}"
fi
[ "$STEP" != build ] || exit 0
mkdir -p "$BUILD/artifacts"
# fuzz_one TARGET: runs it; its verdict ("ok" and its stats, or "FAILED" and the report's
# lines) goes to BUILD/TARGET.verdict.
fuzz_one() {
  local t=$1
  mkdir -p "$BUILD/corpus/$t"
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$BUILD/$t" -max_total_time="$SECONDS_PER" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$BUILD/artifacts/$t-" \
    "$BUILD/corpus/$t" "tests/fuzz/corpus/$t" >"$BUILD/$t.log" 2>&1; then
    { echo ok; grep -E "stat::number_of_executed_units|stat::new_units_added" "$BUILD/$t.log" |
        tr '\n' ' '; echo; } >"$BUILD/$t.verdict"
  else
    { echo FAILED; grep -E "ERROR|SUMMARY|Test unit written|terminate|what\(\)" "$BUILD/$t.log" |
        head -20; } >"$BUILD/$t.verdict"
  fi
}
# The targets run QRING_FUZZ_JOBS at a time (default: one per core; each fuzzer is one
# thread, so each still has a core for its SECONDS_PER seconds on an otherwise idle node).
. scripts/run_at_most.sh
run_at_most "${QRING_FUZZ_JOBS:-$(nproc)}" "== fuzz (${SECONDS_PER} s)" fuzz_one "${TARGETS[@]}"
failed=0
for t in "${TARGETS[@]}"; do
  if [ "$(head -1 "$BUILD/$t.verdict")" = ok ]; then
    echo "fuzz: $t: $(tail -n +2 "$BUILD/$t.verdict")"
  else
    echo "fuzz: $t FAILED:"
    tail -n +2 "$BUILD/$t.verdict"
    failed=1
  fi
done
[ $failed -eq 0 ] && echo "fuzz: every target ran ${SECONDS_PER} s without a finding"
exit $failed
