#!/usr/bin/env bash
# The C++ consumer of an installed qring (item 1 of issue 43), run by scripts/test.sh:
# installs BUILD into BUILD/install, builds tests/consumer against it with CMake
# (find_package(qring): the shared and the static library) and with pkg-config (qring.pc),
# and runs each program on 3 ranks under the installed qring-launch.
#   tests/consumer/run.sh [BUILD_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-build}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
PREFIX="$BUILD/install"
OUT="$BUILD/consumer"
rm -rf "$PREFIX" "$OUT"
cmake --install "$BUILD" --prefix "$PREFIX" >/dev/null
cmake -S "$ROOT/tests/consumer" -B "$OUT" -DCMAKE_PREFIX_PATH="$PREFIX" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$OUT" -j "${QRING_JOBS:-2}" >/dev/null
# pkg-config: the flags of qring.pc alone, against the shared library.
PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig" c++ -std=c++20 -O1 "$ROOT/tests/consumer/main.cc" \
  -o "$OUT/consumer_pc" $(PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig" pkg-config --cflags --libs qring) \
  -Wl,-rpath,"$PREFIX/lib"
status=0
for prog in consumer consumer_static consumer_pc; do
  if [ ! -x "$OUT/$prog" ]; then
    echo "FAIL: $prog was not built"
    status=1
    continue
  fi
  if log=$(timeout 120 "$PREFIX/bin/qring-launch" -n 3 -- "$OUT/$prog" 2>&1); then
    echo "PASS: $prog ($(grep -c contributors <<<"$log") steps on 3 ranks)"
  else
    echo "FAIL: $prog:"
    echo "$log" | tail -20
    status=1
  fi
done
exit $status
