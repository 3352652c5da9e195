# Sourced by scripts/fuzz.sh and scripts/tsan.sh.
# run_at_most N PREFIX FN ITEM...: runs `FN ITEM` in the background for every ITEM, at most N
# at a time, printing "PREFIX ITEM" as each starts; returns once all have ended. FN records its
# own outcome (its exit status is not kept).
run_at_most() {
  local n=$1 prefix=$2 fn=$3 item
  shift 3
  for item in "$@"; do
    while [ "$(jobs -rp | wc -l)" -ge "$n" ]; do wait -n || true; done
    echo "$prefix $item"
    "$fn" "$item" &
  done
  wait
}
