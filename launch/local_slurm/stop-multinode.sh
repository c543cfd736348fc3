#!/usr/bin/env bash
# launch/local_slurm/stop-multinode.sh - undo start-multinode.sh. Idempotent.
#
# Cancels the jobs (squeue/scancel in the login namespace), stops slurmd, slurmctld and munged by
# the pids in their pid files (never by name), ends whatever still runs inside OUR namespaces (by
# pid, from `ip netns pids`: a job step, a client left in login), then deletes the qdiscs, veths,
# the bridge, the namespaces and the root namespace's `unreachable` route, as cluster.env lists them.
#   SLURM_MN_DIR  the start script's (default /tmp/hrlplan-mn)   KEEP_JOBS=1  no scancel first
#   CLEAN=1       also delete SLURM_MN_DIR (state, logs, munge key)
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=launch/local_slurm/common.sh
source "$HERE/common.sh"
DIR="${SLURM_MN_DIR:-/tmp/hrlplan-mn}"
export SLURM_CONF="$DIR/etc/slurm.conf"
if [[ -n "$(ip netns identify $$ 2>/dev/null)" ]]; then
  say "ERROR: run from the root network namespace (under mn-run this would end itself)"; exit 1
fi
if [[ ! -s "$DIR/cluster.env" ]]; then
  say "nothing to stop in $DIR"
  [[ "${CLEAN:-0}" == 1 ]] && rm -rf "$DIR"
  exit 0
fi
N=$(sed -n 's/^MN_N=//p' "$DIR/cluster.env")
P=$(sed -n 's/^MN_PREFIX=//p' "$DIR/cluster.env")
SUBNET=$(sed -n 's/^MN_SUBNET=//p' "$DIR/cluster.env")
[[ "$N" =~ ^[0-9]+$ && -n "$P" && -n "$SUBNET" ]] || { say "ERROR: $DIR/cluster.env is damaged"; exit 1; }
NS_LIST=("${P}login" "${P}head"); for k in $(seq 1 "$N"); do NS_LIST+=("${P}node$k"); done
has_ns() { [[ -e "/run/netns/$1" ]]; }
in_login() {
  nsenter --net="/run/netns/${P}login" unshare --uts --mount --propagation private \
    /bin/sh -c 'mount --bind "$1" /etc/hosts && hostname login && shift && exec "$@"' in_login "$DIR/etc/hosts" "$@"
}
T0=$(date +%s.%N)

if [[ "${KEEP_JOBS:-0}" != 1 ]] && has_ns "${P}login" && running "$DIR/run/slurmctld.pid" slurmctld; then
  jobs=$(in_login squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [[ -n "${jobs// /}" ]]; then
    say "cancelling jobs $jobs"
    # shellcheck disable=SC2086  # one argument per job id
    in_login scancel $jobs 2>/dev/null || true
    for _ in $(seq 40); do [[ -z "$(in_login squeue -h -t R,CG -o %i 2>/dev/null)" ]] && break; sleep 0.25; done
  fi
fi
for k in $(seq 1 "$N"); do stop_pid slurmd "$DIR/run/slurmd.node$k.pid"; done
stop_pid slurmctld "$DIR/run/slurmctld.pid"
stop_pid munged "$DIR/munge/munged.pid"

# Whatever still runs in our namespaces is ours (orphaned job steps, a client in login).
for sig in TERM KILL; do
  left=""
  for ns in "${NS_LIST[@]}" "${P}sw"; do
    has_ns "$ns" || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" == Z ]] || left+=" $pid"
    done
  done
  [[ -z "${left// /}" ]] && break
  say "SIG$sig to processes left in our namespaces:$left"
  # shellcheck disable=SC2086  # one argument per pid
  kill -"$sig" $left 2>/dev/null || true
  for _ in $(seq 20); do
    still=""
    for pid in $left; do [[ -r /proc/$pid/stat && "$(awk '{print $3}' "/proc/$pid/stat")" != Z ]] && still+=" $pid"; done
    [[ -z "$still" ]] && break; sleep 0.25
  done
done

for ns in "${NS_LIST[@]}"; do has_ns "$ns" && ip netns del "$ns"; done   # their veths and qdiscs go too
if has_ns "${P}sw"; then
  ip -n "${P}sw" link del mnbr0 2>/dev/null || true
  ip netns del "${P}sw"
fi
ip route del unreachable "$SUBNET.0/24" 2>/dev/null || true
rm -f "$DIR/cluster.env"
[[ "${CLEAN:-0}" == 1 ]] && rm -rf "$DIR"
say "stopped in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"
