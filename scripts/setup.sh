#!/usr/bin/env bash
# Installs the Debian 12 packages qring needs to build, test and run. Idempotent: packages
# already present are not reinstalled and `apt-get update` runs at most once per machine boot.
#   QRING_SETUP_TORCH=1 scripts/setup.sh   also installs PyTorch and pytest: the Python tests
#                                          (scripts/test.sh), scripts/bench_torch.sh,
#                                          scripts/bench_vs_torch.sh. scripts/run.sh needs neither.
set -euo pipefail

PKGS=(
  build-essential cmake pkg-config git ca-certificates
  libfabric-dev libfabric-bin libssl-dev
  libeigen3-dev libopenblas-dev libopenblas0-pthread libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libcli11-dev libtoml11-dev nlohmann-json3-dev zlib1g-dev
  dataset-fashion-mnist
  openmpi-bin libopenmpi-dev
  python3 python3-matplotlib
  procps time
  iproute2 util-linux
  clang libclang-rt-14-dev
  pybind11-dev python3-dev python3-numpy
)
# PyTorch 1.13 (oneDNN convolutions; OpenBLAS through libopenblas0-pthread above).
[ "${QRING_SETUP_TORCH:-0}" = 1 ] && PKGS+=(python3-torch python3-pytest)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  stamp=/tmp/.qring-apt-updated
  if [ ! -f "$stamp" ]; then
    $SUDO apt-get update -qq
    touch "$stamp"
  fi
  echo "setup: installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
