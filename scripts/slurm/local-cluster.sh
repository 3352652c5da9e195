#!/usr/bin/env bash
# A throw-away Slurm cluster on this machine, for tests and for trying the batch scripts.
#
#   scripts/slurm/local-cluster.sh start [--nodes N]   install (once), configure, start, wait idle
#   scripts/slurm/local-cluster.sh stop                cancel jobs, stop the daemons it started
#   scripts/slurm/local-cluster.sh status              daemons, sinfo, squeue
#   scripts/slurm/local-cluster.sh env                 print the `export SLURM_CONF=...` line
#
# Then: export SLURM_CONF=/tmp/qring-slurm/etc/slurm.conf (printed by start) and use sbatch,
# srun, sinfo as usual. Needs root (slurmd runs jobs as their submitter) and Debian 12
# (installs slurm-wlm and munge with --no-install-recommends; systemd is not used).
#
# Layout: N nodes named qnode1..qnodeN, one slurmd each (`slurmd -N qnodeI`) on its own port,
# all with NodeAddr=127.0.0.1; the names are added to /etc/hosts so that programs resolving
# SLURM_STEP_NODELIST find them. Two or more nodes emulate a multi-node allocation on one
# host. Each node advertises QRING_SLURM_CPUS CPUs (default 8) whatever the hardware has
# (SlurmdParameters=config_overrides), so a 2-core machine runs 8 tasks per node. Where
# namespaces are allowed, each slurmd runs in its own UTS namespace named after its node, so
# tasks on qnode2 see `hostname` = qnode2 (QRING_SLURM_UTS=0 turns this off).
#
# Environment: QRING_SLURM_DIR (state: conf, logs, spool, pid files; default /tmp/qring-slurm),
# QRING_SLURM_PORT (slurmctld port, slurmd I uses PORT+I; default 16817),
# QRING_SLURM_CPUS (CPUs per node, default 8), QRING_SLURM_NO_INSTALL=1 (never call apt-get),
# QRING_SLURM_UTS=0 (all nodes share this host's name).
#
# start is idempotent: when the cluster already runs with the same layout it only checks that
# the nodes are idle; with another layout it stops and starts again. stop signals exactly the
# processes named in its pid files (checked against their command names), never by name.
set -euo pipefail

STATE=${QRING_SLURM_DIR:-/tmp/qring-slurm}
PORT=${QRING_SLURM_PORT:-16817}
CPUS=${QRING_SLURM_CPUS:-8}
CONF="$STATE/etc/slurm.conf"
RUN="$STATE/run"
LOG="$STATE/log"
START_TIMEOUT_S=${QRING_SLURM_START_TIMEOUT:-30}
PKGS=(slurmctld slurmd slurm-client munge)
# A munged of its own (socket, pid, log and seed under $STATE/munge; the key the munge package
# created), so that clusters with different state directories never share or stop each
# other's munged. Slurm finds it through AuthInfo=socket=...
MUNGE_DIR="$STATE/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket.2"

die() {
  echo "local-cluster: error: $*" >&2
  exit 1
}
say() { echo "local-cluster: $*"; }

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

require_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (slurmd starts jobs as their submitter)"
}

install_packages() {
  local missing=() p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "${QRING_SLURM_NO_INSTALL:-0}" = 1 ] && die "missing packages: ${missing[*]}"
  command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get"
  local stamp=/tmp/.qring-apt-updated
  if [ ! -f "$stamp" ]; then
    apt-get update -qq
    touch "$stamp"
  fi
  say "installing ${missing[*]}"
  # policy-rc.d or no systemd: the packages' own service start is skipped or fails harmlessly.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >"$STATE/apt.log" 2>&1 || {
    tail -20 "$STATE/apt.log" >&2
    die "apt-get install failed (log: $STATE/apt.log)"
  }
}

# Prints the PID stored in pid file $1 if that process is alive and its command is $2.
alive_pid() {
  local file=$1 comm=$2 pid
  [ -f "$file" ] || return 1
  pid=$(tr -dc '0-9' <"$file")
  [ -n "$pid" ] || return 1
  [ -r "/proc/$pid/comm" ] || return 1
  [ "$(cat "/proc/$pid/comm")" = "$comm" ] || return 1
  echo "$pid"
}

node_names() {
  local n=$1 i
  for ((i = 1; i <= n; i++)); do echo "qnode$i"; done
}

configured_nodes() { [ -f "$STATE/nodes" ] && cat "$STATE/nodes" || echo 0; }

munge_works() {
  [ -S "$MUNGE_SOCKET" ] && munge -n -S "$MUNGE_SOCKET" 2>/dev/null |
    unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1
}

start_munge() {
  if munge_works; then
    alive_pid "$RUN/munged.pid" munged >/dev/null && return 0
  fi
  # munged checks ownership and modes: it must run as the munge user, with its key readable
  # only by that user and its socket directory owned by it and searchable by all (0711).
  [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key missing (reinstall munge)"
  rm -rf "$MUNGE_DIR"
  install -d -o munge -g munge -m 0711 "$MUNGE_DIR"
  # 8>&-: the daemons must not inherit the lock on $STATE.lock.
  runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" 8>&- ||
    die "munged failed to start (see $MUNGE_DIR/munged.log)"
  local i
  for ((i = 0; i < 50; i++)); do
    munge_works && break
    sleep 0.1
  done
  munge_works || die "munged started but does not answer on $MUNGE_SOCKET"
  cp "$MUNGE_DIR/munged.pid" "$RUN/munged.pid"
}

add_hosts() {
  local name
  for name in "$@"; do
    if ! getent hosts "$name" >/dev/null; then
      echo "127.0.0.1 $name # qring local Slurm cluster" >>/etc/hosts
    fi
  done
}

write_conf() {
  local n=$1 ctl
  ctl=$(hostname -s)
  {
    cat <<EOF
# Written by scripts/slurm/local-cluster.sh: a $n-node test cluster on one host.
ClusterName=qring
SlurmctldHost=$ctl(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long Slurm holds a requeued job back (default 120 s); the requeue test
# (tests/slurm/run.sh) requeues a job more than once.
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups, no accounting: runs in containers and on machines without systemd.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Advertise CPUs=$CPUS per node whatever the hardware has.
SlurmdParameters=config_overrides
# Start batch jobs at once; reject requests larger than the cluster instead of queueing them.
SchedulerParameters=batch_sched_delay=0
EnforcePartLimits=ALL
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=600
MessageTimeout=10
# Job ids keep growing across restarts (state is cleared on start): a new job never shares its
# id, and so its log name or its derived store port, with one of an earlier cluster.
FirstJobId=$(( $(date +%s) % 30000000 + 1000 ))
SlurmctldTimeout=60
SlurmdTimeout=120
EOF
    local i
    for ((i = 1; i <= n; i++)); do
      echo "NodeName=qnode$i NodeAddr=127.0.0.1 NodeHostname=qnode$i Port=$((PORT + i))" \
        "CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=qnode[1-$n] Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF"
}

# Waits until every node is idle. Prints the node states on failure.
wait_idle() {
  local n=$1 deadline states idle
  deadline=$((SECONDS + START_TIMEOUT_S))
  while ((SECONDS < deadline)); do
    states=$(SLURM_CONF=$CONF sinfo -h -N -o '%N %T' 2>/dev/null || true)
    idle=$(grep -c ' idle$' <<<"$states" || true)
    [ "$idle" -eq "$n" ] && return 0
    sleep 0.2
  done
  echo "$states" >&2
  return 1
}

all_running() {
  local n=$1 name
  [ "$n" -gt 0 ] || return 1
  alive_pid "$RUN/slurmctld.pid" slurmctld >/dev/null || return 1
  for name in $(node_names "$n"); do
    alive_pid "$RUN/slurmd-$name.pid" slurmd >/dev/null || return 1
  done
  munge_works
}

start() {
  local n=1
  while [ $# -gt 0 ]; do
    case $1 in
      --nodes) n=${2:-}; shift 2 || die "--nodes needs a value" ;;
      --nodes=*) n=${1#*=}; shift ;;
      *) die "unknown option '$1' for start" ;;
    esac
  done
  [[ $n =~ ^[1-9][0-9]?$ ]] || die "--nodes must be 1..99, got '$n'"
  require_root
  mkdir -p "$STATE"
  chmod 0755 "$STATE" # munged (user munge) reaches its socket directory through it
  local t0=$SECONDS
  if all_running "$(configured_nodes)"; then
    if [ "$(configured_nodes)" -eq "$n" ]; then
      wait_idle "$n" || die "cluster runs but the nodes are not idle (see $LOG)"
      say "already running with $n node(s)"
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    say "running with $(configured_nodes) node(s); restarting with $n"
  fi
  stop_daemons quiet
  install_packages
  command -v slurmctld >/dev/null || die "slurmctld not found after install"

  rm -rf "${STATE:?}/state" "${STATE:?}/spool" "${STATE:?}/etc"
  mkdir -p "$STATE/etc" "$STATE/state" "$STATE/spool" "$RUN" "$LOG"
  # shellcheck disable=SC2046 # node names are single words
  add_hosts $(node_names "$n")
  write_conf "$n"
  echo "$n" >"$STATE/nodes"
  start_munge

  slurmctld -f "$CONF" -c -i 8>&- || die "slurmctld failed to start (see $LOG/slurmctld.log)"
  # Each slurmd in its own UTS namespace whose hostname is the node name, so that its tasks'
  # gethostname() tells the emulated nodes apart as on a real cluster. Without permission
  # for namespaces (or with QRING_SLURM_UTS=0) the nodes share this host's name.
  local name uts=0
  if [ "${QRING_SLURM_UTS:-1}" = 1 ] && unshare --uts true 2>/dev/null; then uts=1; fi
  echo "$uts" >"$STATE/uts"
  for name in $(node_names "$n"); do
    mkdir -p "$STATE/spool/$name"
    if [ $uts = 1 ]; then
      # shellcheck disable=SC2016 # expanded by the inner shell
      unshare --uts sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' sh "$name" "$CONF" 8>&-
    else
      slurmd -f "$CONF" -N "$name" 8>&-
    fi || die "slurmd $name failed to start (see $LOG/slurmd-$name.log)"
  done
  if ! wait_idle "$n"; then
    tail -n 20 "$LOG"/*.log >&2 || true
    die "nodes not idle after ${START_TIMEOUT_S}s (logs in $LOG)"
  fi
  if [ $uts = 1 ]; then
    say "started $n node(s) in $((SECONDS - t0))s, each with its own hostname; state in $STATE"
  else
    say "started $n node(s) in $((SECONDS - t0))s, sharing the hostname $(hostname);" \
      "state in $STATE"
  fi
  echo "export SLURM_CONF=$CONF"
}

# Stops the daemons named by the pid files given as FILE:COMMAND pairs, all at once: SIGTERM,
# then SIGKILL to those still alive after 10 s. A pid file whose process is gone or runs
# another command (a recycled PID) is only removed.
stop_pidfiles() {
  local quiet=$1 entry file comm pid i
  shift
  local pids=() names=()
  for entry in "$@"; do
    file=${entry%:*}
    comm=${entry##*:}
    if pid=$(alive_pid "$file" "$comm"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
      names+=("$comm ($pid)")
    fi
    rm -f "$file"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  for ((i = 0; i < 100; i++)); do
    local left=0
    for pid in "${pids[@]}"; do
      [ -d "/proc/$pid" ] && left=1
    done
    [ $left -eq 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if [ -d "/proc/$pid" ]; then
      say "process $pid ignored SIGTERM for 10 s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  [ "$quiet" = quiet ] || say "stopped ${names[*]}"
}

cancel_jobs() {
  alive_pid "$RUN/slurmctld.pid" slurmctld >/dev/null || return 0
  local jobs i
  jobs=$(SLURM_CONF=$CONF squeue -h -o '%i' 2>/dev/null || true)
  [ -n "$jobs" ] || return 0
  say "cancelling jobs: $(tr '\n' ' ' <<<"$jobs")"
  # shellcheck disable=SC2086
  SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do
    [ -z "$(SLURM_CONF=$CONF squeue -h -t R,CG,PD -o '%i' 2>/dev/null || true)" ] && return 0
    sleep 0.2
  done
  say "jobs still running after 30 s: $(SLURM_CONF=$CONF squeue -h 2>/dev/null | tr '\n' ';')"
}

stop_daemons() {
  local quiet=${1:-} f
  [ -d "$RUN" ] || return 0
  cancel_jobs
  local entries=("$RUN/slurmctld.pid:slurmctld")
  for f in "$RUN"/slurmd-*.pid; do
    [ -e "$f" ] && entries+=("$f:slurmd")
  done
  stop_pidfiles "$quiet" "${entries[@]}"
  # munged last: the Slurm daemons authenticate through it until they exit.
  stop_pidfiles "$quiet" "$RUN/munged.pid:munged"
}

stop() {
  require_root
  stop_daemons
  rm -f "$STATE/nodes"
  say "stopped"
}

status() {
  local n name rc=0 pid
  n=$(configured_nodes)
  if pid=$(alive_pid "$RUN/slurmctld.pid" slurmctld); then
    echo "slurmctld running ($pid)"
  else
    echo "slurmctld not running"
    rc=1
  fi
  for name in $(node_names "$n"); do
    if pid=$(alive_pid "$RUN/slurmd-$name.pid" slurmd); then
      echo "slurmd $name running ($pid)"
    else
      echo "slurmd $name not running"
      rc=1
    fi
  done
  if munge_works; then echo "munge ok"; else
    echo "munge not answering"
    rc=1
  fi
  if [ $rc -eq 0 ]; then
    SLURM_CONF=$CONF sinfo -N
    SLURM_CONF=$CONF squeue
    echo "export SLURM_CONF=$CONF"
  fi
  return $rc
}

# start and stop change the cluster: one at a time.
lock() {
  mkdir -p "$(dirname "$STATE")"
  exec 8>"$STATE.lock"
  flock -w 120 8 || die "another local-cluster.sh start/stop held $STATE.lock for 120 s"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  start) lock && start "$@" ;;
  stop) lock && stop ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) usage ;;
esac
