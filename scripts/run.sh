#!/usr/bin/env bash
# The main job: trains the MLP on Fashion-MNIST with 4 local ranks, quorum 3 (one backup
# worker) and a long-tailed straggler model, then prints the test accuracy, the wall time and
# how much time the backup worker saved against waiting for every rank.
#
#   scripts/run.sh [key=value overrides for qring-train ...]
#
# Installs what it needs and builds first (idempotent). Results: runs/fmnist-mlp-backup/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
QRING_TARGETS="qring-train qring-launch" scripts/build.sh build

NAME=fmnist-mlp-backup
STRAGGLER=${QRING_STRAGGLER:-lognormal:2.5:1.0}
echo "== qring-train: 4 ranks, quorum 3, straggler $STRAGGLER"
# --force: a second run of this script starts the run over (without it, qring-train refuses
# the checkpoints the first one left in runs/$NAME/).
build/net/qring-launch -n 4 -- build/train/qring-train --config configs/fmnist-mlp.toml --force \
  run.name=$NAME quorum.quorum=3 straggler.model="$STRAGGLER" "$@"

python3 - "runs/$NAME/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print()
print(f"test accuracy        {100 * s['test_accuracy']:.2f} %  (best {100 * s['best_test_accuracy']:.2f} %)")
print(f"wall time            {s['wall_s']:.1f} s for {s['steps']} steps, "
      f"{s['samples_per_s']:.0f} samples/s counted")
t = s.get('time_to_target_s')
print(f"time to target       {t:.1f} s" if t is not None else "time to target       not reached")
print(f"mean contributors    {s['mean_contributors']:.2f} of {s['world']} "
      f"({s['dropped_gradients']} late gradients dropped)")
full, saved = s['full_sync_estimate_s'], s['backup_saved_s']
print(f"backup worker saved  {saved:.1f} s of step time: waiting for every rank would have "
      f"taken about {full:.1f} s instead of {full - saved:.1f} s "
      f"({100 * saved / full if full > 0 else 0:.0f} % less)")
PY
