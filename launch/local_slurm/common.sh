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
