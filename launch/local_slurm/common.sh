# Shared by start.sh and stop.sh (sourced, not run).

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
