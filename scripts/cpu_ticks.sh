# Sourced by scripts/test.sh and scripts/build_sanitizers.sh: CPU accounting.
# cpu_ticks: user + system CPU of this shell's finished (waited-for) children, in clock ticks
# (fields 16 and 17 of /proc/PID/stat, cutime and cstime; $1 below is field 3).
cpu_ticks() {
  local s
  s=$(cat /proc/$$/stat)
  s=${s##*) }
  set -- $s
  echo $(( ${14} + ${15} ))
}
# cpu_group_enter NAME: moves this shell into a new CPU-accounting cgroup (cgroup v1 cpuacct, or
# v2), so that cpu_group_seconds counts every process started from here on, daemons and what
# they start too (Slurm's slurmd and its jobs, which cpu_ticks never sees); fails where no
# cgroup can be made. cpu_group_leave: back to the parent group, and removes it if it is empty.
cpu_group_enter() {
  CPU_GROUP=""
  local base
  for base in /sys/fs/cgroup/cpuacct /sys/fs/cgroup; do
    [ -e "$base/cpuacct.usage" ] || [ -e "$base/cgroup.controllers" ] || continue
    mkdir -p "$base/$1" 2>/dev/null && echo "$BASHPID" >"$base/$1/cgroup.procs" 2>/dev/null ||
      continue
    CPU_GROUP=$base/$1
    return 0
  done
  return 1
}
cpu_group_seconds() {  # CPU seconds of the group so far
  if [ -e "$CPU_GROUP/cpuacct.usage" ]; then
    echo $(( $(cat "$CPU_GROUP/cpuacct.usage") / 1000000000 ))
  else
    awk '$1 == "usage_usec" { print int($2 / 1000000) }' "$CPU_GROUP/cpu.stat"
  fi
}
cpu_group_leave() {
  [ -n "$CPU_GROUP" ] || return 0
  echo "$BASHPID" >"$(dirname "$CPU_GROUP")/cgroup.procs" 2>/dev/null || true
  rmdir "$CPU_GROUP" 2>/dev/null || true
}
