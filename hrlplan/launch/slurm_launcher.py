"""`hydra/launcher=submitit_slurm`: hydra-submitit-launcher's SlurmLauncher that sizes its request to the
partition it submits to and fails a sweep whose jobs can never start.

Before submitting it reads the partition and its nodes from SLURM (`scontrol show partition|node -o`)
and fits the request (hrlplan.launch.slurm_fit): a request no node can hold is refused in one line
naming the launcher key, nothing submitted. While the jobs run it reads their state
(`scontrol show job -o <array>`): a job pending for a reason that never clears (PartitionConfig,
BadConstraints, ...) for HRLPLAN_SLURM_PENDING_GRACE_S seconds (default 30) cancels the sweep's array
and fails with one line; so does a job that ended without a result (cancelled, killed, node lost).
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

from hrlplan.errors import ConfigError, UserError, one_line
from hrlplan.launch.slurm_fit import (Fitted, NeverStarts, Partition, array_indices, default_partition, fit_request,
                                      never_starts, parse_jobs, parse_partition)

GRACE_ENV = "HRLPLAN_SLURM_PENDING_GRACE_S"
DEFAULT_GRACE_S = 30.0
POLL_S = 5.0
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
          "PREEMPTED", "SPECIAL_EXIT")
_NEEDS_SLURM = "hydra/launcher=submitit_slurm needs SLURM's commands"


def _say(text: str) -> None:
    print(f"[hrlplan] {text}", file=sys.stderr, flush=True)


def _refuse(error: Exception) -> None:
    # Hydra prints a traceback for an exception out of a launcher: one line and exit 2, as app.py does.
    print(f"hrlplan: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# ---------------------------------------------------------------- SLURM's commands (argument lists)
def _run(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise UserError(f"{_NEEDS_SLURM}: {args[0]} is not on PATH (submit from a SLURM login node, or use "
                        "hydra/launcher=submitit_local on this machine)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{' '.join(args)} did not answer in {timeout_s:.0f} s: is slurmctld up?") from None


def read_partition(name: Optional[str]) -> Partition:
    """The partition a job with `partition: name` goes to (None: SLURM's default), and its nodes."""
    listing = _run("scontrol", "--all", "--oneliner", "show", "partition")
    if listing.returncode:
        raise UserError(f"{_NEEDS_SLURM}: scontrol show partition failed: {one_line(listing.stderr)}")
    names = [line.split()[0].partition("=")[2] for line in listing.stdout.splitlines() if line.strip()]
    if name is None:
        name = default_partition(listing.stdout)
        if name is None:
            raise UserError(f"hydra.launcher.partition=null and SLURM has no default partition: set "
                            f"hydra.launcher.partition to one of {', '.join(names) or '(none)'}")
    elif name not in names:
        raise UserError(f"hydra.launcher.partition={name}: SLURM has no such partition (partitions: "
                        f"{', '.join(names) or '(none)'})")
    [line] = [ln for ln in listing.stdout.splitlines() if ln.startswith(f"PartitionName={name} ")][:1]
    nodes = _run("scontrol", "--all", "--oneliner", "show", "node")
    if nodes.returncode:
        raise UserError(f"{_NEEDS_SLURM}: scontrol show node failed: {one_line(nodes.stderr)}")
    own = [ln for ln in nodes.stdout.splitlines() if name in _words_value(ln, "Partitions").split(",")]
    partition = parse_partition(line, "\n".join(own))
    if not partition.nodes:
        raise UserError(f"hydra.launcher.partition={name}: the partition has no nodes")
    return partition


def _words_value(line: str, key: str) -> str:
    return next((w.partition("=")[2] for w in line.split() if w.startswith(f"{key}=")), "")


def explicit_launcher_keys(hydra_overrides: Sequence[str]) -> List[str]:
    """The hydra.launcher keys set on the command line (`hydra.launcher.cpus_per_task=8`, `++hydra.launcher.x=...`)."""
    keys = []
    for override in hydra_overrides:
        key = str(override).lstrip("+~").partition("=")[0]
        if key.startswith("hydra.launcher."):
            keys.append(key[len("hydra.launcher."):].split(".")[0])
    return keys


# ---------------------------------------------------------------- waiting on the jobs
class JobWatch:
    """Reads a submitted array's state each poll; raises NeverStarts for a job that will never start
    or that ended without a result; says on the console when the pending reasons change."""

    def __init__(self, jobs: Sequence[Any], grace_s: float, read=None, others_running=None, clock=time.monotonic):
        self.jobs = list(jobs)
        self.array_id = str(self.jobs[0].job_id).split("_")[0]
        self.grace_s = grace_s
        self.read = read or self._read
        self.others_running = others_running or _running_jobs_of_user
        self.clock = clock
        self.since: Dict[tuple, float] = {}
        self.last_summary = ""

    @staticmethod
    def _read(array_id: str) -> Optional[str]:
        proc = _run("scontrol", "show", "job", "-o", array_id)
        if proc.returncode and "Invalid job id" in proc.stderr:
            return ""       # past MinJobAge: SLURM forgot the jobs
        return None if proc.returncode else proc.stdout

    def _first_time(self, key: tuple, now: float) -> float:
        return self.since.setdefault(key, now)

    def poll(self) -> bool:
        """One look; True when every job has a result."""
        done = {str(j.job_id): _has_result(j) for j in self.jobs}
        if all(done.values()):
            return True
        text = self.read(self.array_id)
        if text is None:      # scontrol hiccup: look again next time
            return False
        now = self.clock()
        states = parse_jobs(text)
        seen = {}
        for s in states:
            for job_id in ([f"{self.array_id}_{i}" for i in array_indices(s.job_id)] if "_" in s.job_id
                           else [s.job_id]):
                seen[job_id] = s
        current = set()
        for job in self.jobs:
            job_id = str(job.job_id)
            if done[job_id]:
                continue
            state = seen.get(job_id) or seen.get(f"{job_id}_0")   # submitit names a 1-job array "<id>"
            if state is not None and state.state == "PENDING":
                others = self.others_running() if "Jobs" in state.reason else None
                why = never_starts(state.reason, others)
                key = (job_id, state.reason)
                current.add(key)
                if why and now - self._first_time(key, now) >= self.grace_s:
                    self._fail(f"SLURM job {job_id} cannot start: pending with Reason={state.reason} "
                               f"({why}); cancelled the sweep's jobs (array {self.array_id}). Change the "
                               "hydra.launcher.* request (see docs/slurm.md)")
            elif state is None or state.state.split()[0] in _ENDED:
                ended = "is no longer known to SLURM" if state is None else f"ended {state.state}"
                key = (job_id, "ended")
                current.add(key)
                if now - self._first_time(key, now) >= max(self.grace_s, 30.0) and not _has_result(job):
                    raise NeverStarts(f"SLURM job {job_id} {ended} without a result; its log: "
                                      f"{job.paths.stderr}")
        self.since = {k: v for k, v in self.since.items() if k in current}
        self._summarize(states)
        return False

    def _fail(self, message: str) -> None:
        _run("scancel", self.array_id)
        raise NeverStarts(message)

    def _summarize(self, states) -> None:
        counts: Dict[str, int] = {}
        for s in states:
            label = f"{s.state.lower()} ({s.reason})" if s.state == "PENDING" else s.state.lower()
            counts[label] = counts.get(label, 0) + len(array_indices(s.job_id) or [0])
        summary = ", ".join(f"{n} {label}" for label, n in sorted(counts.items()))
        if summary and summary != self.last_summary:
            _say(f"SLURM array {self.array_id}: {summary}")
            self.last_summary = summary

    def wait(self, poll_s: float = POLL_S) -> None:
        while not self.poll():
            time.sleep(poll_s)


def _has_result(job) -> bool:
    """Every task wrote its result (what submitit's done() checks first, without its sacct calls:
    a cluster without accounting would log a warning each poll)."""
    return all(job.task(k).paths.result_pickle.exists() for k in range(job.num_tasks))


def _running_jobs_of_user() -> Optional[int]:
    proc = _run("squeue", "--noheader", "--me", "--states=RUNNING", "--format=%i")
    return None if proc.returncode else len(proc.stdout.split())


def pending_grace_s() -> float:
    value = os.environ.get(GRACE_ENV, "")
    try:
        return float(value) if value else DEFAULT_GRACE_S
    except ValueError:
        raise UserError(f"{GRACE_ENV}={value} is not a number of seconds") from None


def fit_to_partitions(params: dict, explicit: Sequence[str]) -> Tuple[Partition, Fitted]:
    """`partition: a,b` is SLURM's "the first of these that can run it": the request is fitted to the
    first listed partition that can hold it, and refused with the first one's reason when none can."""
    names = [n.strip() for n in str(params["partition"]).split(",")] if params.get("partition") else [None]
    first_error: Optional[ConfigError] = None
    for name in names:
        partition = read_partition(name)
        try:
            return partition, fit_request(params, explicit, partition)
        except ConfigError as e:
            first_error = first_error or e
    raise first_error


# ---------------------------------------------------------------- the launcher
class FittedSlurmLauncher(SlurmLauncher):
    """hydra-submitit-launcher's SlurmLauncher: fit, refuse or submit; then watch the jobs. Hydra takes
    it under the name hydra_plugins.hrlplan_launcher.submitit_launcher.SlurmLauncher (a subclass)."""

    def __reduce__(self):
        # The jobs unpickle this class, importable wherever hrlplan is, not the hydra_plugins alias.
        return _restore, (dict(self.__dict__),)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        try:
            grace_s = pending_grace_s()
            explicit = explicit_launcher_keys(self.config.hydra.overrides.hydra if self.config else [])
            partition, fitted = fit_to_partitions(self.params, explicit)
        except UserError as e:
            _refuse(e)
        _say(f"SLURM request for {partition.describe()}"
             + (": " + "; ".join(fitted.changes) if fitted.changes else ": fits as asked"))
        self.params = fitted.params
        jobs = self._submit(job_overrides, initial_job_idx)
        try:
            JobWatch(jobs, grace_s).wait()
        except UserError as e:
            _refuse(e)
        return [j.results()[0] for j in jobs]

    def _submit(self, job_overrides, initial_job_idx) -> List[Any]:
        """hydra-submitit-launcher 1.2's launch() up to the submission; sbatch's refusal as one line."""
        import submitit
        from submitit.core.utils import FailedJobError
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        params = dict(self.params)
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params.pop("submitit_folder"),
                                         **{f"{self._EXECUTOR}_max_num_timeout": params.pop("max_num_timeout")})
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        _say(f"submitit 'slurm' sweep output dir: {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            _say(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        printed = io.StringIO()   # submitit prints sbatch's stderr before it raises: said once, below
        try:
            with contextlib.redirect_stderr(printed):
                jobs = executor.map_array(self, *zip(*job_params))
        except FailedJobError as e:   # sbatch's own refusal (EnforcePartLimits, a bad account, ...)
            _refuse(UserError(f"sbatch refused the sweep: {one_line(e)}"))
        sys.stderr.write(printed.getvalue())
        return jobs


def _restore(state: dict) -> FittedSlurmLauncher:
    launcher = FittedSlurmLauncher.__new__(FittedSlurmLauncher)
    launcher.__dict__.update(state)
    return launcher
