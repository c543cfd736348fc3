"""The run directory: a place the run can be written to, and one job at a time in it.

- check_output_dir: `hydra.run.dir=` (empty: everything would land in the current directory), a path
  under /proc, /sys or /dev, an existing file, or a directory that cannot be created: one line naming
  the key, before Hydra tries to create it (which would be a traceback).
- RunDirLock: <run dir>/.hrlplan.lock holds the pid, host and SLURM job id (or torchrun run id) of the
  job training there. A second job into the same directory is refused naming the holder. A lock left
  by a process that is gone (its pid dead on this host, or its SLURM job no longer running) is taken
  over with a note; the same SLURM job (a requeue, an elastic restart) or torchrun run takes it over
  silently. Only one process of a job takes it (the launching process, or rank 0 of torchrun/srun/
  submitit tasks), so the job's own workers never meet it. Released when the job ends.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

from hrlplan.errors import ConfigError, UserError

LOCK_FILE = ".hrlplan.lock"
KERNEL_FILESYSTEMS = ("/proc", "/sys", "/dev")
ENDED_SLURM_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                      "DEADLINE", "OUT_OF_MEMORY", "REVOKED")


# ---------------------------------------------------------------- a directory the run can be written to
def check_output_dir(key: str, value: Any) -> None:
    """Refuse a run directory that is empty, on a kernel file system, a file, or not creatable."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise ConfigError(key, message=f"{key}= is empty: the run (checkpoints, logs, plan) would be written into the "
                          f"current directory; name a directory, e.g. {key}=runs/my-run")
    if "${" in text:
        return   # Hydra resolves it (${now:...}) when it creates the directory
    path = Path(os.path.abspath(os.path.expanduser(text)))
    for candidate in {path, path.resolve()}:
        for kernel in KERNEL_FILESYSTEMS:
            if candidate == Path(kernel) or Path(kernel) in candidate.parents:
                raise ConfigError(key, text, message=f"{key}={text} is under {kernel}, a kernel file system, not a "
                                  "place for a run: name a directory on a disk, e.g. runs/my-run")
    if path.exists() and not path.is_dir():
        raise ConfigError(key, text, message=f"{key}={text} is an existing file, not a directory: name a directory "
                          "(a new one is created)")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(key, text, message=f"{key}={text} cannot be created: {existing} is a file; name a directory "
                          "whose parents are directories")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        raise ConfigError(key, text, message=f"{key}={text} {what}: name a directory you can write to")


# ---------------------------------------------------------------- one job per run directory
def this_job() -> Dict[str, Any]:
    """Who holds a lock: this process, its host, and the job it belongs to -- a SLURM job step (an
    interactive run inside salloc is no step: two of them are two jobs), or a torchrun run."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    in_step = bool(os.environ.get("SLURM_STEP_ID") or os.environ.get("SUBMITIT_EXECUTOR"))
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": _process_start(os.getpid()),
            "slurm_job": os.environ.get("SLURM_JOB_ID") if in_step else None,
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"), "slurm_step": os.environ.get("SLURM_STEP_ID"),
            "torchrun_id": run_id if run_id and run_id != "none" else None,
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def takes_lock() -> bool:
    """One process per job takes the lock: a plain process, or rank 0 of a torchrun/srun/submitit job."""
    rank = os.environ.get("RANK")
    if rank is None and (os.environ.get("SUBMITIT_EXECUTOR") or os.environ.get("SLURM_STEP_ID")):
        rank = os.environ.get("SLURM_PROCID")
    return rank in (None, "0")


def _process_start(pid: int) -> Optional[str]:
    """The process's start time since boot (Linux), so a reused pid is not taken for the holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive_here(holder: Dict[str, Any]) -> bool:
    pid = int(holder.get("pid") or 0)
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # another user's live process
    started = holder.get("started")
    return not (started and _process_start(pid) not in (None, started))


def _slurm_job_ended(job_id: str) -> bool:
    """True when SLURM says the job is over (or no longer knows it); False when running or unknown here."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                              timeout=15)
    except (OSError, subprocess.SubprocessError):
        return False
    if proc.returncode:
        return "invalid job id" in proc.stderr.lower()
    state = next((w.split("=", 1)[1] for w in proc.stdout.split() if w.startswith("JobState=")), "")
    return state in ENDED_SLURM_STATES


def _same_job(held: Dict[str, Any], mine: Dict[str, Any]) -> bool:
    """The holder is this job: the same SLURM job requeued (another restart count) or the same step of
    it, or the same torchrun run (restarted by torchrun). Two steps of one allocation are two jobs."""
    if held.get("slurm_job") and held["slurm_job"] == mine["slurm_job"]:
        return held.get("slurm_restart") != mine["slurm_restart"] or held.get("slurm_step") == mine["slurm_step"]
    return bool(held.get("torchrun_id")) and held["torchrun_id"] == mine["torchrun_id"]


def _describe(held: Dict[str, Any]) -> str:
    job = f", SLURM job {held['slurm_job']}" if held.get("slurm_job") else ""
    return f"pid {held.get('pid')} on {held.get('host')}{job}, since {held.get('since')}"


class RunDirLock:
    """<run dir>/.hrlplan.lock for one job; `acquire` refuses a directory another live job holds."""

    def __init__(self, run_dir: str | os.PathLike, key: str = "hydra.run.dir"):
        self.path = Path(run_dir) / LOCK_FILE
        self.key = key
        self.mine = this_job()
        self.held = False

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a note when a stale lock was taken over. Raises UserError when busy."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._create():
                self.held = True
                return None
            held = self._read()
            if held is None:
                why = "it could not be read"
            elif held.get("pid") == self.mine["pid"] and held.get("host") == self.mine["host"]:
                why = ""   # this process already holds it (a sweep's jobs run one after another here)
            elif _same_job(held, self.mine):
                why = ""   # the same job again: a requeue, an elastic restart
            elif held.get("host") == self.mine["host"]:
                why = None if _alive_here(held) else f"{_describe(held)} is no longer running"
            elif held.get("slurm_job") and _slurm_job_ended(held["slurm_job"]):
                why = f"{_describe(held)}: that job has ended"
            else:
                why = None
            if why is None:
                raise UserError(f"{self.key}={self.path.parent} is in use by another job ({_describe(held)}): wait "
                                f"for it to end or use another {self.key}; if that job is gone, delete {self.path}")
            self._write(os.replace)
            if self._read() == self.mine:
                self.held = True
                return f"[hrlplan] took over the lock {self.path}: {why}" if why else None
        raise UserError(f"{self.key}={self.path.parent}: another job is taking the lock {self.path} at the same "
                        f"time: use another {self.key}")

    def release(self) -> None:
        if self.held and self._read() == self.mine:
            self.path.unlink(missing_ok=True)
        self.held = False

    def _create(self) -> bool:
        try:
            self._write(os.link)
            return True
        except FileExistsError:
            return False

    def _write(self, place) -> None:
        """Write the lock whole, then place it (os.link: only if none exists; os.replace: over a stale one)."""
        tmp = self.path.with_name(f"{LOCK_FILE}.{self.mine['host']}.{self.mine['pid']}.tmp")
        tmp.write_text(json.dumps(self.mine))
        try:
            place(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> Optional[Dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None


def note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
