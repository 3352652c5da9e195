#!/usr/bin/env bash
# Emulated hosts on this machine, for the code paths that only run across hosts (provider
# choice, the store's bind address, interface choice, address checks).
#
#   scripts/netns-cluster.sh start N      N hosts (1..16): own network + UTS namespace each
#   scripts/netns-cluster.sh stop         kill what runs in them, remove everything
#   scripts/netns-cluster.sh exec I CMD.. run CMD on host I (its network, its host name)
#   scripts/netns-cluster.sh addr I       host I's address
#   scripts/netns-cluster.sh status       hosts, addresses, links
#
# Layout: one outer network namespace created for the purpose ("<name>-outer") holds a bridge
# and one veth end per host; the other end is eth0 of the host's own network namespace
# ("<name>-h<I>", address 10.213.0.<I>/24, host name <prefix><I> in its own UTS namespace).
# No link leads out of the outer namespace, and the hosts have no route but their subnet, so
# no packet reaches the machine's real interfaces. Each link is shaped in both directions with
# tbf (netem does not exist in this kernel): QRING_NETNS_RATE (default 2gbit),
# QRING_NETNS_BURST (default 512kb), QRING_NETNS_LATENCY (queue bound, default 20ms).
#
# Environment: QRING_NETNS_NAME (namespace and state prefix, default qring),
# QRING_NETNS_HOST_PREFIX (host names, default qhost). State: /run/qring-netns/<name>.
# Needs root, iproute2 (ip, tc) and util-linux (unshare, nsenter). start tears down whatever
# it built when a step fails; stop only touches the namespaces and mounts of <name>.
set -euo pipefail

NAME=${QRING_NETNS_NAME:-qring}
PREFIX=${QRING_NETNS_HOST_PREFIX:-qhost}
RATE=${QRING_NETNS_RATE:-2gbit}
BURST=${QRING_NETNS_BURST:-512kb}
LATENCY=${QRING_NETNS_LATENCY:-20ms}
STATE=/run/qring-netns/$NAME
OUTER=$NAME-outer
SUBNET=10.213.0

die() {
  echo "netns-cluster: error: $*" >&2
  exit 1
}
say() { echo "netns-cluster: $*"; }

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

require_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces)"
  for c in ip tc unshare nsenter; do
    command -v "$c" >/dev/null || die "$c not found (iproute2, util-linux)"
  done
}

hosts() { cat "$STATE/hosts" 2>/dev/null || echo 0; }
host_ns() { echo "$NAME-h$1"; }
check_host() {
  local n
  n=$(hosts)
  [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le "$n" ] ||
    die "no host $1 (the cluster '$NAME' has $n; start it first)"
}

# Removes what start made, in reverse; tolerates parts that are missing.
teardown() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    case "$ns" in
      "$NAME"-h[0-9]* | "$OUTER")
        # Processes still inside (a test that failed) go with the namespace; they were all
        # started by this script's exec.
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
        ;;
    esac
  done
  if [ -d "$STATE" ]; then
    for f in "$STATE"/*.uts; do
      [ -e "$f" ] || continue
      umount "$f" 2>/dev/null || true
    done
    umount "$STATE" 2>/dev/null || true
    rm -rf "$STATE"
  fi
}

start() {
  local n=${1:-}
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 16 ] || die "start needs N in 1..16"
  require_root
  teardown
  trap 'echo "netns-cluster: start failed; removing what it made" >&2; teardown' ERR
  mkdir -p "$STATE"
  # Persistent UTS namespaces are bind mounts of nsfs; they need a private mount to live on.
  mount --bind "$STATE" "$STATE"
  mount --make-private "$STATE"
  ip netns add "$OUTER"
  ip -n "$OUTER" link set lo up
  ip -n "$OUTER" link add br0 type bridge
  ip -n "$OUTER" link set br0 up
  local i ns
  for i in $(seq 1 "$n"); do
    ns=$(host_ns "$i")
    ip netns add "$ns"
    ip -n "$OUTER" link add "h$i" type veth peer name eth0 netns "$ns"
    ip -n "$OUTER" link set "h$i" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$SUBNET.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    tc -n "$ns" qdisc add dev eth0 root tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
    tc -n "$OUTER" qdisc add dev "h$i" root tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
    touch "$STATE/h$i.uts"
    unshare --uts="$STATE/h$i.uts" hostname "$PREFIX$i"
  done
  echo "$n" >"$STATE/hosts"
  trap - ERR
  # Each host routes its subnet only (no default route: nothing leaves the cluster) and has
  # its own host name.
  for i in $(seq 1 "$n"); do
    if run_on "$i" ip route | grep -q '^default' ||
      [ "$(run_on "$i" hostname)" != "$PREFIX$i" ]; then
      teardown
      die "host $i: a default route, or not its own host name"
    fi
  done
  say "$n hosts up: ${PREFIX}1..$PREFIX$n at $SUBNET.1..$SUBNET.$n, links $RATE (tbf)"
}

run_on() {
  local i=$1
  shift
  nsenter --net="/run/netns/$(host_ns "$i")" --uts="$STATE/h$i.uts" -- "$@"
}

stop() {
  require_root
  teardown
  say "stopped '$NAME'"
}

status() {
  local n i
  n=$(hosts)
  [ "$n" -gt 0 ] || {
    say "'$NAME' is not running"
    return 0
  }
  for i in $(seq 1 "$n"); do
    echo "host $i: $(run_on "$i" hostname) $SUBNET.$i ($(host_ns "$i"))"
    run_on "$i" tc qdisc show dev eth0
  done
}

cmd=${1:-}
shift || true
case "$cmd" in
  start) start "$@" ;;
  stop) stop ;;
  exec)
    [ $# -ge 2 ] || die "exec needs a host and a command"
    check_host "$1"
    run_on "$@"
    ;;
  addr)
    [ $# -eq 1 ] || die "addr needs a host"
    check_host "$1"
    echo "$SUBNET.$1"
    ;;
  status) status ;;
  *) usage ;;
esac
