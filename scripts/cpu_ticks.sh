# Sourced by scripts/test.sh and scripts/build_sanitizers.sh.
# cpu_ticks: user + system CPU of this shell's finished (waited-for) children, in clock ticks
# (fields 16 and 17 of /proc/PID/stat, cutime and cstime; $1 below is field 3).
cpu_ticks() {
  local s
  s=$(cat /proc/$$/stat)
  s=${s##*) }
  set -- $s
  echo $(( ${14} + ${15} ))
}
