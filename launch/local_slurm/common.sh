# Shared by start.sh, stop.sh, start-multinode.sh and stop-multinode.sh (sourced, not run).

say() { echo "[local-slurm $(date +%T)] $*" >&2; }

# running PIDFILE NAME: the pid in PIDFILE is a live, non-zombie process named NAME. Checking the
# name guards against a stale pid file whose number the kernel gave to another process.
running() {
  local pid
  [[ -s "$1" ]] || return 1
  pid=$(cat "$1")
  [[ -r /proc/$pid/stat ]] || return 1
  [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] || return 1
  [[ "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" == *"$2"* ]]
}

# stop_pid NAME PIDFILE: SIGTERM, up to 15 s of grace, then SIGKILL that one pid (never by name).
stop_pid() {
  local pid
  if ! running "$2" "$1"; then rm -f "$2"; return 0; fi
  pid=$(cat "$2")
  say "stopping $1 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 60); do running "$2" "$1" || { rm -f "$2"; return 0; }; sleep 0.25; done
  kill -KILL "$pid" 2>/dev/null
  rm -f "$2"
}

# install_slurm: Debian's slurmctld, slurmd, slurm-client and munge when one is missing (about 7 s).
# No init system is assumed: the packages' postinst cannot start services; the scripts start them.
install_slurm() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  say "installing slurmctld slurmd slurm-client munge (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null || { say "ERROR: apt-get update failed"; return 1; }
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
    || { say "ERROR: apt-get install slurm failed"; return 1; }
}

# slurm_conf_common: the slurm.conf lines both boxes share (start.sh: one node on localhost;
# start-multinode.sh: one network namespace per node). Short waits, so that a requeued job starts
# again in seconds: backfill every 2 s, and each script's AuthInfo=...cred_expire=5 (a requeued job
# may start only once its credential expired, 120 s by default).
slurm_conf_common() {
  cat <<'EOF'
MpiDefault=none
# No cgroups (a container; all nodes in one kernel and cgroup tree): /proc based tracking, no binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd, so no accounting: sacct does not work (submitit then reports state UNKNOWN).
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MailProg=/bin/true
MinJobAge=300
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmctldDebug=info
SlurmdDebug=info
EOF
}
