#!/usr/bin/env bash
# launch/local_slurm/start.sh - a real single-node SLURM (slurmctld + slurmd + munge) on localhost.
#
# Used by the SLURM tests (tests/test_slurm*.py start it through a session fixture) and by anyone
# who wants to try `python pretrain.py -m hydra/launcher=submitit_slurm ...` on one machine.
# Idempotent: a second run reuses the daemons that are already up. Needs root: it installs the
# Debian packages (slurmctld slurmd slurm-client munge) when they are missing and runs munged as
# user munge and slurmd as root. Nothing goes to /etc/slurm; clients use SLURM_CONF:
#
#     sudo launch/local_slurm/start.sh && source /tmp/local-slurm/env.sh
#
# Knobs (environment):
#   SLURM_LOCAL_DIR  config/state/logs (default /tmp/local-slurm)
#   SLURM_PARTITION  partition name (default debug)
#   SLURM_CTLD_PORT / SLURM_D_PORT (default 6817 / 6818)
#   SLURM_AUTH       munge | none (default munge; falls back to none when munge cannot run here)
#   SLURM_WAIT_S     seconds to wait for the node to become idle (default 60)
# Exit codes: 0 ready; 1 not root / install failed / daemons did not come up (reason on stderr).
# The last stdout line is `export SLURM_CONF=...`; the line before it says `started` or `reused`.
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/local-slurm}"
PART="${SLURM_PARTITION:-debug}"
CTLD_PORT="${SLURM_CTLD_PORT:-6817}"
D_PORT="${SLURM_D_PORT:-6818}"
AUTH="${SLURM_AUTH:-munge}"
WAIT_S="${SLURM_WAIT_S:-60}"
CONF="$DIR/etc/slurm.conf"
STATE="$DIR/state"
LOG="$DIR/log"
RUN="$DIR/run"
NODE="$(hostname -s)"
export SLURM_CONF="$CONF"
STARTED=reused

# shellcheck source=launch/local_slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
die() { say "ERROR: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, runs munged/slurmd)"
T0=$(date +%s)

# ------------------------------------------------------------------ packages
install_slurm || die "could not install SLURM"
mkdir -p "$DIR/etc" "$STATE/slurmctld" "$STATE/slurmd" "$LOG" "$RUN"

# ------------------------------------------------------------------ munge
munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
start_munge() {
  # munged refuses to run unless its key and directories belong to munge with tight modes.
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge /etc/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    if command -v mungekey >/dev/null; then
      runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 2>/dev/null
    fi
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  munge_works && return 0
  # A socket or pid file left by an unclean stop makes munged refuse to start.
  running /run/munge/munged.pid munged \
    || rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid \
    --log-file=/var/log/munge/munged.log || return 1
  for _ in $(seq 40); do munge_works && return 0; sleep 0.25; done
  return 1
}
if [[ "$AUTH" == munge ]] && ! start_munge; then
  say "WARNING: munge does not work on this machine; using auth/none"
  AUTH=none
fi
if [[ "$AUTH" == munge ]]; then
  AUTH_LINES=$'AuthType=auth/munge\nCredType=cred/munge'
else
  AUTH_LINES=$'AuthType=auth/none\nCredType=cred/none'
fi

# ------------------------------------------------------------------ slurm.conf
CPUS=$(OMP_NUM_THREADS= nproc)  # nproc obeys OMP_NUM_THREADS, which a caller may have set to 1
FREE_MB=$(awk '/MemAvailable/ {print int($2/1024)}' /proc/meminfo)
MEM_MB=$(( FREE_MB > 2048 ? FREE_MB - 1024 : FREE_MB * 3 / 4 ))
NEW_CONF=$(cat <<CONF
# Written by hrlplan launch/local_slurm/start.sh: one node (this machine) on 127.0.0.1.
ClusterName=hrlplan-local
SlurmctldHost=${NODE}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${D_PORT}
SlurmUser=root
SlurmdUser=root
${AUTH_LINES}
# A requeued job may only start again once its credential expired (default 120 s): 5 s keeps the
# preemption/requeue tests short.
AuthInfo=cred_expire=5
$(slurm_conf_common)
SlurmdTimeout=30
StateSaveLocation=${STATE}/slurmctld
SlurmdSpoolDir=${STATE}/slurmd
SlurmctldPidFile=${RUN}/slurmctld.pid
SlurmdPidFile=${RUN}/slurmd.pid
SlurmctldLogFile=${LOG}/slurmctld.log
SlurmdLogFile=${LOG}/slurmd.log
NodeName=${NODE} NodeAddr=127.0.0.1 NodeHostname=${NODE} CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=${PART} Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
CONF
)
# Rewrite only on a real change (free memory drifts between runs and does not count).
no_mem() { sed -E 's/RealMemory=[0-9]+//'; }
CHANGED=0
if [[ ! -f "$CONF" ]] || [[ "$(no_mem <"$CONF")" != "$(no_mem <<<"$NEW_CONF")" ]]; then
  printf '%s\n' "$NEW_CONF" >"$CONF"
  CHANGED=1
fi
printf 'export SLURM_CONF=%q\n' "$CONF" >"$DIR/env.sh"

# ------------------------------------------------------------------ daemons
if running "$RUN/slurmctld.pid" slurmctld; then
  [[ $CHANGED == 1 ]] && { scontrol reconfigure || true; }
else
  say "starting slurmctld"
  rm -f "$RUN/slurmctld.pid"
  # -c: a fresh controller forgets the jobs of earlier sessions; recovered ones would hold the
  # node's 2 CPUs and leave every new test job pending.
  /usr/sbin/slurmctld -c -f "$CONF" || die "slurmctld failed to start (see $LOG/slurmctld.log)"
  STARTED=started
fi
for _ in $(seq $((WAIT_S * 4))); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.25; done
if ! scontrol ping 2>/dev/null | grep -q UP; then
  tail -20 "$LOG/slurmctld.log" >&2 || true
  die "slurmctld is not answering"
fi
if ! running "$RUN/slurmd.pid" slurmd; then
  say "starting slurmd"
  rm -f "$RUN/slurmd.pid"
  /usr/sbin/slurmd -f "$CONF" -N "$NODE" || die "slurmd failed to start (see $LOG/slurmd.log)"
  STARTED=started
fi

# ------------------------------------------------------------------ wait for an idle node
state=""
for i in $(seq $((WAIT_S * 4))); do
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1)
  case "$state" in
    idle|mixed|allocated|completing) break ;;
    down*|drain*|fail*)  # left down by an unclean stop: resume it (every 2 s at most)
      (( i % 8 == 1 )) && { scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true; } ;;
  esac
  sleep 0.25
done
case "$state" in
  idle|mixed|allocated|completing) ;;
  *) tail -20 "$LOG/slurmctld.log" "$LOG/slurmd.log" >&2 || true
     die "node $NODE is not ready (state '$state')" ;;
esac
say "ready in $(( $(date +%s) - T0 )) s: node $NODE ($CPUS CPUs, ${MEM_MB} MB) $state, partition $PART, auth $AUTH"
echo "$STARTED"
echo "export SLURM_CONF=$CONF"
