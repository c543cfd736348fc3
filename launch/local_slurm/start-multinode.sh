#!/usr/bin/env bash
# launch/local_slurm/start-multinode.sh [N] - a real N-node SLURM cluster on this one machine.
#
# Each node is a Linux network namespace (hrl-node1..N) with its own address on a private /24, its
# own hostname (node1..N, a UTS namespace) and its own slurmd. slurmctld and munged run in one more
# namespace (hostname slurmhead); every client (sinfo, sbatch, submitit, pretrain.py -m, pytest)
# runs in a `login` namespace through ./mn-run. A bridge in a namespace of its own joins them.
# Needs root; installs slurmctld/slurmd/slurm-client/munge from apt when missing.
#
#     sudo launch/local_slurm/start-multinode.sh          # 3 nodes, node2<->node3 at 1 Gbit/s
#     sudo launch/local_slurm/mn-run sinfo -N -o '%N %t %f'
#     sudo launch/local_slurm/stop-multinode.sh
#
# Network rule: test traffic goes only to loopback or to namespaces this script creates. So the
# root namespace gets no interface, address or socket on the /24, only one `unreachable` route for
# it (a client started there by mistake fails at once instead of following the default route out);
# no namespace gets a default route. stop-multinode.sh removes every namespace, link and route.
#
# Links: LINK_SHAPE shapes a pair of nodes (htb class + u32 filter on each end's egress, so only
# that pair's traffic, both directions) or a whole node (tbf on both ends of its veth):
#   LINK_SHAPE="node2-node3:rate=1gbit,delay=0.5ms;node1:rate=4gbit"   (default: the first item)
# delay/jitter/loss need the kernel's sch_netem; without it they are skipped with a warning (the
# rate still applies; MN_SHAPE_STRICT=1 makes it an error). LINK_SHAPE="" leaves links unshaped.
# `start-multinode.sh --shape-only` re-applies LINK_SHAPE to the running cluster.
# `start-multinode.sh --node-up nodeK` brings a lost node back: starts its slurmd again if it is not
# running (a test killed every process of the node) and returns it to service (state=resume).
#
# Knobs (environment, defaults in brackets):
#   N / $1           nodes [3]                   SLURM_MN_DIR   config/state/logs [/tmp/hrlplan-mn]
#   MN_SUBNET        private /24 [10.213.57]; nodeK = .K, login = .250, slurmhead = .253
#   MN_PREFIX        namespace prefix [hrl-]: <p>sw (bridge), <p>head, <p>login, <p>node<K>
#   NODE_CPUS        CPUs per node, one number or a comma list [2]   NODE_MEM_MB [3/4 of free / N]
#   NODE_FEATURES    "node1=big,x86;node3=small" [node1=big, others small; shaped nodes + slowlink]
#   SLURM_PARTITION  partition of all nodes [debug]   SLURM_WAIT_S  wait for idle nodes [60]
# A second start stops the cluster of the same SLURM_MN_DIR first (job ids restart at 1).
# Exit 0: ready (last stdout line: the mn-run path); 1: not root / no namespaces / daemons failed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=launch/local_slurm/common.sh
source "$HERE/common.sh"
die() { say "ERROR: $*"; exit 1; }

SHAPE_ONLY=0 NODE_UP=""
if [[ "${1:-}" == --shape-only ]]; then SHAPE_ONLY=1; shift; fi
if [[ "${1:-}" == --node-up ]]; then NODE_UP="${2:?--node-up needs a node name}"; shift 2; fi
N="${1:-${N:-3}}"
DIR="${SLURM_MN_DIR:-/tmp/hrlplan-mn}"
SUBNET="${MN_SUBNET:-10.213.57}"
P="${MN_PREFIX:-hrl-}"
PART="${SLURM_PARTITION:-debug}"
WAIT_S="${SLURM_WAIT_S:-60}"
LINK_SHAPE="${LINK_SHAPE-node2-node3:rate=1gbit,delay=0.5ms}"
CONF="$DIR/etc/slurm.conf"
HOSTS="$DIR/etc/hosts"
MUNGE_DIR="$DIR/munge"
SOCK="$MUNGE_DIR/munge.socket"
SW="${P}sw" HEAD="${P}head" LOGIN="${P}login"

[[ $(id -u) -eq 0 ]] || die "must run as root (network namespaces, munged, slurmd)"
[[ -z "$(ip netns identify $$ 2>/dev/null)" ]] || die "run from the root network namespace, not under mn-run"
[[ "$N" =~ ^[0-9]+$ && "$N" -ge 1 && "$N" -le 64 ]] || die "N must be 1..64, got '$N'"
[[ "$SUBNET" =~ ^10\.[0-9]+\.[0-9]+$ ]] || die "MN_SUBNET must be a 10.x.y prefix, got '$SUBNET'"
command -v tc >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null \
  || die "needs iproute2 (ip netns, tc) and util-linux (nsenter, unshare)"

# in_ns NS HOSTNAME CMD...: CMD in netns NS with its own hostname and our hosts/resolv.conf.
# nsenter keeps the host's /sys (`ip netns exec` mounts one without /sys/fs/cgroup, where
# slurmd 22.05 refuses to start); the bind mounts make node names resolve inside, and DNS
# go to the namespace's own loopback, so no lookup ever leaves the /24.
in_ns() {
  local ns=$1 hn=$2; shift 2
  nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
    /bin/sh -c 'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf &&
                hostname "$3" && shift 3 && exec "$@"' in_ns "$HOSTS" "$DIR/etc/resolv.conf" "$hn" "$@"
}
in_login() { in_ns "$LOGIN" login "$@"; }

# ------------------------------------------------------------------ link shaping
# netem_args SPEC -> "delay 0.5ms loss 1%" (empty when SPEC has none); rate_of SPEC -> "1gbit".
spec_get() { tr ',' '\n' <<<"$2" | sed -n "s/^$1=//p" | head -1; }
netem_args() {
  local d j l out=""
  d=$(spec_get delay "$1"); j=$(spec_get jitter "$1"); l=$(spec_get loss "$1")
  [[ -n "$d" ]] && out="delay $d${j:+ $j}"
  [[ -n "$l" ]] && out="$out loss ${l%\%}%"
  echo "$out"
}
add_netem() {  # add_netem NS DEV PARENT SPEC: netem under PARENT, or a warning without sch_netem
  local args
  args=$(netem_args "$4")
  [[ -n "$args" ]] || return 0
  # shellcheck disable=SC2086  # args is a word list
  if ! ip netns exec "$1" tc qdisc add dev "$2" parent "$3" netem $args limit 10000 2>/dev/null; then
    [[ "${MN_SHAPE_STRICT:-0}" == 1 ]] && die "tc netem is not available in this kernel: cannot apply '$args'"
    say "WARNING: tc netem unavailable (kernel without sch_netem): '$args' ignored on $1/$2, the rate still applies"
  fi
}
shape_pair() {  # shape_pair A B SPEC: egress of A's eth0 towards B (call twice for both directions)
  local a=$1 b=$2 spec=$3 rate cls
  rate=$(spec_get rate "$3"); rate=${rate:-100gbit}
  cls=$((10 + ${b#node}))
  local tcx=(ip netns exec "$P$a" tc)
  # htb with no default class: traffic to other nodes passes unshaped; only the filter's goes to the class.
  "${tcx[@]}" qdisc show dev eth0 | grep -q 'htb 1:' \
    || "${tcx[@]}" qdisc replace dev eth0 root handle 1: htb default 0 r2q 1000
  "${tcx[@]}" class replace dev eth0 parent 1: classid "1:$cls" htb rate "$rate" ceil "$rate" \
    burst 256kb cburst 256kb
  "${tcx[@]}" filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst "$SUBNET.${b#node}/32" \
    flowid "1:$cls"
  add_netem "$P$a" eth0 "1:$cls" "$spec"
}
shape_node() {  # shape_node NODE SPEC: tbf on both ends of the node's veth (all its traffic)
  local n=$1 spec=$2 rate
  rate=$(spec_get rate "$spec")
  for end in "$SW mnv-$n" "$P$n eth0"; do
    read -r ns dev <<<"$end"
    if [[ -n "$rate" ]]; then
      ip netns exec "$ns" tc qdisc replace dev "$dev" root handle 1: tbf rate "$rate" burst 256kb latency 50ms
      add_netem "$ns" "$dev" 1:1 "$spec"
    else
      add_netem "$ns" "$dev" root "$spec"
    fi
  done
}
valid_node() { [[ "$1" =~ ^node[0-9]+$ && ${1#node} -ge 1 && ${1#node} -le $N ]] || die "LINK_SHAPE: no node '$1' (node1..node$N)"; }
apply_shapes() {
  local n item what spec
  for n in $(seq 1 "$N"); do   # start from unshaped links
    ip netns exec "$SW" tc qdisc del dev "mnv-node$n" root 2>/dev/null || true
    ip netns exec "${P}node$n" tc qdisc del dev eth0 root 2>/dev/null || true
  done
  for item in ${LINK_SHAPE//;/ }; do
    what=${item%%:*}; spec=${item#*:}
    [[ "$spec" != "$item" ]] || die "LINK_SHAPE item '$item' must look like node2-node3:rate=1gbit"
    if [[ "$what" == *-* ]]; then
      valid_node "${what%-*}"; valid_node "${what#*-}"
      shape_pair "${what%-*}" "${what#*-}" "$spec"
      shape_pair "${what#*-}" "${what%-*}" "$spec"
    else
      valid_node "$what"; shape_node "$what" "$spec"
    fi
    say "shaped $what (both directions): $spec"
  done
}
if [[ $SHAPE_ONLY == 1 ]]; then
  [[ -s "$DIR/cluster.env" ]] || die "no cluster in $DIR"
  N=$(sed -n 's/^MN_N=//p' "$DIR/cluster.env"); P=$(sed -n 's/^MN_PREFIX=//p' "$DIR/cluster.env"); SW="${P}sw"
  SUBNET=$(sed -n 's/^MN_SUBNET=//p' "$DIR/cluster.env")
  apply_shapes
  exit 0
fi

start_slurmd() { mkdir -p "$DIR/state/slurmd.$1"; in_ns "$P$1" "$1" /usr/sbin/slurmd -f "$CONF" -N "$1"; }
if [[ -n "$NODE_UP" ]]; then
  [[ -s "$DIR/cluster.env" ]] || die "no cluster in $DIR"
  N=$(sed -n 's/^MN_N=//p' "$DIR/cluster.env"); P=$(sed -n 's/^MN_PREFIX=//p' "$DIR/cluster.env"); LOGIN="${P}login"
  valid_node "$NODE_UP"
  if ! running "$DIR/run/slurmd.$NODE_UP.pid" slurmd; then
    start_slurmd "$NODE_UP" || die "slurmd on $NODE_UP did not start (see $DIR/log/slurmd.$NODE_UP.log)"
    say "started slurmd on $NODE_UP again"
  fi
  for _ in $(seq $((WAIT_S * 4))); do
    state=$(SLURM_CONF="$CONF" in_login sinfo -h -N -n "$NODE_UP" -o %t 2>/dev/null | head -1)
    case "$state" in
      idle|alloc|mix) say "$NODE_UP is $state"; exit 0 ;;
      down*|drain*|drng*|fail*) SLURM_CONF="$CONF" in_login scontrol update nodename="$NODE_UP" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.25
  done
  die "$NODE_UP did not return to service (state '$state', see $DIR/log/slurmd.$NODE_UP.log)"
fi

T0=$(date +%s.%N)
install_slurm || die "could not install SLURM"
if ! ip netns add "${P}probe$$" 2>/dev/null; then
  die "cannot create network namespaces here (ip netns add failed: no CAP_SYS_ADMIN?)"
fi
ip netns del "${P}probe$$"
if [[ -s "$DIR/cluster.env" ]]; then
  say "a cluster from $DIR is up: stopping it first"
  SLURM_MN_DIR="$DIR" "$HERE/stop-multinode.sh"
fi
NODES=(); for k in $(seq 1 "$N"); do NODES+=("node$k"); done
for ns in "$SW" "$HEAD" "$LOGIN" "${NODES[@]/#/$P}"; do
  [[ -e "/run/netns/$ns" ]] && die "network namespace $ns exists but is not this cluster's (set MN_PREFIX)"
done
[[ -z "$(ip -4 route show to match "$SUBNET.1" | grep -v '^default')" ]] \
  || die "$SUBNET.0/24 overlaps a route of this machine; set MN_SUBNET"
rm -rf "$DIR/state" "$DIR/log" "$DIR/run"
mkdir -p "$DIR/etc" "$DIR/state/slurmctld" "$DIR/log" "$DIR/run"
# Written before anything is created: stop-multinode.sh can undo a half-done start.
printf 'MN_N=%s\nMN_PREFIX=%s\nMN_SUBNET=%s\n' "$N" "$P" "$SUBNET" >"$DIR/cluster.env"

# ------------------------------------------------------------------ network
new_ns() {   # an empty namespace, lo up, no IPv6 (no router/neighbour chatter)
  ip netns add "$1"
  ip netns exec "$1" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 || true
  ip -n "$1" link set lo up
}
# The bridge lives in its own namespace and each veth is created there with its peer sent
# straight into its host namespace: nothing, not even a transient link, appears in the root one.
new_ns "$SW"
ip -n "$SW" link add mnbr0 type bridge
ip -n "$SW" link set mnbr0 up
add_host() {  # add_host NS HOSTNUM SWITCH_PORT
  new_ns "$1"
  ip -n "$SW" link add "$3" type veth peer name eth0 netns "$1"
  ip -n "$SW" link set "$3" master mnbr0 up
  ip -n "$1" addr add "$SUBNET.$2/24" dev eth0
  ip -n "$1" link set eth0 up
}
add_host "$HEAD" 253 mnv-head
add_host "$LOGIN" 250 mnv-login
for k in $(seq 1 "$N"); do add_host "${P}node$k" "$k" "mnv-node$k"; done
ip route add unreachable "$SUBNET.0/24"
{
  echo "127.0.0.1 localhost"
  echo "$SUBNET.250 login"
  echo "$SUBNET.253 slurmhead"
  for k in $(seq 1 "$N"); do echo "$SUBNET.$k node$k"; done
} >"$HOSTS"
printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' >"$DIR/etc/resolv.conf"
chmod 644 "$HOSTS" "$DIR/etc/resolv.conf"
say "network: bridge in netns $SW, node1..node$N = $SUBNET.1..$N, login .250, slurmhead .253 (root namespace: unreachable)"

# ------------------------------------------------------------------ munge (one, private)
# Its socket is a file path, so every namespace reaches it; key, pid and log stay in $DIR.
install -d -o munge -g munge -m 0700 "$MUNGE_DIR"
[[ -s "$MUNGE_DIR/munge.key" ]] || dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1 count=1024 2>/dev/null
chown munge:munge "$MUNGE_DIR/munge.key"; chmod 0400 "$MUNGE_DIR/munge.key"
chmod 0755 "$MUNGE_DIR"   # clients (root here) must reach the socket
rm -f "$SOCK" "$SOCK.lock" "$MUNGE_DIR/munged.pid"
in_ns "$HEAD" slurmhead runuser -u munge -- /usr/sbin/munged --socket="$SOCK" --key-file="$MUNGE_DIR/munge.key" \
  --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" \
  || die "munged did not start (see $MUNGE_DIR/munged.log)"
for _ in $(seq 40); do munge -S "$SOCK" -n 2>/dev/null | unmunge -S "$SOCK" >/dev/null 2>&1 && break; sleep 0.25; done
in_login sh -c 'munge -S "$1" -n | unmunge -S "$1"' sh "$SOCK" >/dev/null \
  || die "munge does not work from the login namespace (see $MUNGE_DIR/munged.log)"

# ------------------------------------------------------------------ slurm.conf
IFS=',' read -ra CPU_LIST <<<"${NODE_CPUS:-2}"
FREE_MB=$(awk '/MemAvailable/ {print int($2/1024)}' /proc/meminfo)
MEM_MB="${NODE_MEM_MB:-$(( FREE_MB * 3 / 4 / N ))}"
declare -A FEAT=()
for n in "${NODES[@]}"; do FEAT[$n]=small; done
FEAT[node1]=big
if [[ -n "${NODE_FEATURES:-}" ]]; then
  for item in ${NODE_FEATURES//;/ }; do FEAT[${item%%=*}]=${item#*=}; done
fi
for item in ${LINK_SHAPE//;/ }; do   # a job can ask for (or avoid: --constraint) the shaped nodes
  what=${item%%:*}
  for n in ${what/-/ }; do [[ -n "${FEAT[$n]+x}" ]] && FEAT[$n]="${FEAT[$n]:+${FEAT[$n]},}slowlink"; done
done
{
  cat <<EOF
# Written by hrlplan launch/local_slurm/start-multinode.sh: $N nodes, one network namespace each.
ClusterName=hrlplan-mn
SlurmctldHost=slurmhead($SUBNET.253)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Our munged's socket; cred_expire=5: a requeued job starts again after ~5 s instead of 120 s.
AuthInfo=socket=$SOCK,cred_expire=5
# A node whose slurmd stops answering is marked DOWN after 10 s and its jobs requeued.
SlurmdTimeout=10
EOF
  slurm_conf_common
  cat <<EOF
StateSaveLocation=$DIR/state/slurmctld
# %n: all slurmd share this filesystem, so spool, pid and log files are per node.
SlurmdSpoolDir=$DIR/state/slurmd.%n
SlurmdPidFile=$DIR/run/slurmd.%n.pid
SlurmdLogFile=$DIR/log/slurmd.%n.log
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
EOF
  for k in $(seq 1 "$N"); do
    n="node$k"; c="${CPU_LIST[$((k-1))]:-${CPU_LIST[-1]}}"
    echo "NodeName=$n NodeAddr=$SUBNET.$k NodeHostname=$n CPUs=$c RealMemory=$MEM_MB Features=${FEAT[$n]} State=UNKNOWN"
  done
  echo "PartitionName=$PART Nodes=node[1-$N] Default=YES MaxTime=INFINITE State=UP"
} >"$CONF"

# ------------------------------------------------------------------ daemons
in_ns "$HEAD" slurmhead /usr/sbin/slurmctld -f "$CONF" || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
for _ in $(seq $((WAIT_S * 4))); do SLURM_CONF="$CONF" in_login scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.25; done
SLURM_CONF="$CONF" in_login scontrol ping 2>/dev/null | grep -q UP \
  || { tail -20 "$DIR/log/slurmctld.log" >&2; die "slurmctld is not answering"; }
for n in "${NODES[@]}"; do
  start_slurmd "$n" || die "slurmd on $n did not start (see $DIR/log/slurmd.$n.log)"
done
apply_shapes

ok=0
for _ in $(seq $((WAIT_S * 4))); do
  ok=$(SLURM_CONF="$CONF" in_login sinfo -h -N -p "$PART" -o '%N %t' 2>/dev/null | awk '$2=="idle"' | sort -u | wc -l)
  [[ $ok -eq $N ]] && break
  sleep 0.25
done
if [[ $ok -ne $N ]]; then
  SLURM_CONF="$CONF" in_login sinfo -N >&2 || true
  die "only $ok of $N nodes idle (see $DIR/log)"
fi
say "ready in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s: $N nodes idle, partition $PART; clients: $HERE/mn-run CMD"
echo "$HERE/mn-run"
