#!/usr/bin/env bash
# launch/local_slurm/stop.sh - stop what launch/local_slurm/start.sh started.
#
# Cancels the cluster's jobs, then stops slurmd, slurmctld and munged by the pids in their pid
# files (never by name, so nothing else on the machine is touched).
#   SLURM_LOCAL_DIR  same as for start.sh (default /tmp/local-slurm)
#   KEEP_JOBS=1      do not cancel jobs first
#   KEEP_MUNGE=1     leave munged running
#   CLEAN=1          also wipe the controller/node state (next start is a fresh cluster)
set -uo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/local-slurm}"
RUN="$DIR/run"
export SLURM_CONF="$DIR/etc/slurm.conf"
# shellcheck source=launch/local_slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ "${KEEP_JOBS:-0}" != 1 ]] && running "$RUN/slurmctld.pid" slurmctld; then
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [[ -n "${jobs// /}" ]]; then
    say "cancelling jobs $jobs"
    # shellcheck disable=SC2086  # one argument per job id
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 40); do [[ -z "$(squeue -h -t R,CG -o %i 2>/dev/null)" ]] && break; sleep 0.25; done
  fi
fi
stop_pid slurmd "$RUN/slurmd.pid"
stop_pid slurmctld "$RUN/slurmctld.pid"
[[ "${KEEP_MUNGE:-0}" == 1 ]] || stop_pid munged /run/munge/munged.pid
if [[ "${CLEAN:-0}" == 1 ]]; then rm -rf "$DIR/state"; fi
say "stopped"
