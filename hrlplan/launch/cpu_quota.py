"""Emulated heterogeneous workers on one machine: each local worker capped to a share of one CPU core
by the cgroup v1 cpu controller (cpu.cfs_quota_us = share x cpu.cfs_period_us), so the probe,
calibration and the planner see fast and slow workers (../shared/notes/cpu-quota-workers.md).

The launcher creates one cgroup per capped worker before the workers start and removes them after,
also when the job fails (`capped_workers`, a context manager yielding the environment the workers
inherit); each worker moves itself into its cgroup as the first thing it does
(`join_from_environment`: writing cgroup.procs moves every thread of the process, so the threads
torch started at import are capped too). Where the controller is missing or
not writable, `check_cpu_controller` refuses in one line before any worker starts.

A quota caps CPU time per period, it does not pin a core: capped workers still share the cores with
the uncapped ones, so speeds are stable only while the shares sum to less than the core count.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from hrlplan.errors import UserError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
KEY = "cluster.cpu_shares"
ENV = "HRLPLAN_CPU_QUOTA_GROUPS"   # launcher -> workers: a cgroup path per local rank, "" where uncapped
PERIOD_FILE, QUOTA_FILE, PROCS_FILE, STAT_FILE = "cpu.cfs_period_us", "cpu.cfs_quota_us", "cgroup.procs", "cpu.stat"

# Per local worker of the last job these groups capped in this process, its group's cpu.stat when it
# was removed (None: uncapped or unreadable): how often the quota throttled it, and for how long
# (throttled_time, ns). A bench reads it to tell a cap that bound from one that never did.
last_job_throttling: List[Optional[Dict[str, int]]] = []


def check_shares(shares: Sequence[Optional[float]], workers: int) -> List[Optional[float]]:
    """The shares as floats (None: uncapped), one per local worker; a UserError naming the key otherwise."""
    shares = list(shares)
    if len(shares) != workers:
        raise UserError(f"{KEY} has {len(shares)} entries for {workers} local workers: give one share of a core "
                        f"per worker (e.g. {KEY}=[1.0,0.33,0.33]; null leaves a worker uncapped)")
    out: List[Optional[float]] = []
    for i, share in enumerate(shares):
        if share is None:
            out.append(None)
            continue
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0:
            raise UserError(f"{KEY}[{i}]={share!r}: a share of one CPU core must be a number above 0 "
                            "(0.33 = a third of a core; null leaves the worker uncapped)")
        out.append(float(share))
    return out


def check_cpu_controller(root: Path = CPU_ROOT) -> None:
    """One-line UserError where the cgroup v1 cpu controller cannot cap a worker here."""
    root = Path(root)
    if not (root / PERIOD_FILE).is_file():
        raise UserError(f"{KEY} needs the cgroup v1 cpu controller, and {root} is missing or is not one (no "
                        f"{PERIOD_FILE}); run without {KEY} (uncapped workers) on this machine")
    if not os.access(root, os.W_OK) or not os.access(root / PROCS_FILE, os.W_OK):
        raise UserError(f"{KEY} needs to create cgroups under {root}, which is not writable by this user; run as "
                        f"a user who may (root), or without {KEY} (uncapped workers)")


def create_group(name: str, share: float, root: Path = CPU_ROOT) -> Path:
    """A cgroup `name` under `root` with cfs_quota_us = share x cfs_period_us (its own period)."""
    path = Path(root) / name
    path.mkdir()
    try:
        period = int((path / PERIOD_FILE).read_text().strip())
        (path / QUOTA_FILE).write_text(str(max(1000, int(round(share * period)))))   # the kernel's minimum is 1 ms
    except BaseException:
        remove_group(path)
        raise
    return path


def group_stat(path: Path) -> Optional[Dict[str, int]]:
    """The cgroup's cpu.stat ({nr_periods, nr_throttled, throttled_time (ns), ...}); None if unreadable."""
    try:
        lines = (Path(path) / STAT_FILE).read_text().split("\n")
    except OSError:
        return None
    return {k: int(v) for k, v in (line.split() for line in lines if len(line.split()) == 2)}


def remove_group(path: Path, timeout_s: float = 5.0) -> None:
    """Move any process still in the cgroup back to its parent, then remove it (an exited process
    can linger a moment in cgroup.procs: retried until timeout_s)."""
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while path.exists():
        try:
            for pid in (path / PROCS_FILE).read_text().split():
                try:
                    (path.parent / PROCS_FILE).write_text(pid)
                except OSError:   # exited meanwhile
                    pass
            path.rmdir()
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextmanager
def cpu_quota_groups(shares: Sequence[Optional[float]], tag: str = "job",
                     root: Path = CPU_ROOT) -> Iterator[List[Optional[str]]]:
    """Collective over nothing (the launcher's process): one cgroup per capped share, yielded as a
    path per local worker (None: uncapped) for the workers to join; all removed on exit, also on an
    exception. Refuses (check_cpu_controller) before creating any."""
    shares = list(shares)
    created: List[Path] = []
    paths: List[Optional[str]] = []
    if any(s is not None for s in shares):
        check_cpu_controller(root)
    try:
        for i, share in enumerate(shares):
            if share is None:
                paths.append(None)
                continue
            path = create_group(f"hrlplan-{tag}-{os.getpid()}-w{i}", share, root)
            created.append(path)
            paths.append(str(path))
        yield paths
    finally:
        last_job_throttling[:] = [None if p is None else group_stat(Path(p)) for p in paths]
        for path in reversed(created):
            remove_group(path)


def join_cpu_quota(path: Optional[str], pid: Optional[int] = None) -> None:
    """Move process `pid` (default: this one, with all its threads) into the cgroup `path`; None: stay."""
    if path is None:
        return
    (Path(path) / PROCS_FILE).write_text(str(pid if pid is not None else os.getpid()))


def leave_cpu_quota(path: Optional[str], pid: Optional[int] = None) -> None:
    """Move process `pid` (default: this one) from the cgroup `path` back to its parent."""
    if path is None:
        return
    (Path(path).parent / PROCS_FILE).write_text(str(pid if pid is not None else os.getpid()))


@contextmanager
def capped_workers(shares: Optional[Sequence[Optional[float]]], nproc: int,
                   tag: str = "job", root: Path = CPU_ROOT) -> Iterator[Dict[str, str]]:
    """The launcher's one call: {} without shares; else the shares checked (one per local worker),
    their cgroups created, and {ENV: the paths by local rank} for the workers' environment; the
    cgroups are removed on exit, also when the job fails."""
    if not shares:
        yield {}
        return
    with cpu_quota_groups(check_shares(shares, nproc), tag, root) as paths:
        yield {ENV: ",".join(p or "" for p in paths)}


def join_from_environment(environ: Optional[Dict[str, str]] = None) -> Optional[str]:
    """In a worker, first thing: join the cgroup ENV lists for its LOCAL_RANK (none listed: stay).
    Returns the cgroup joined."""
    environ = os.environ if environ is None else environ
    listed = environ.get(ENV)
    if not listed:
        return None
    paths = listed.split(",")
    path = paths[int(environ.get("LOCAL_RANK", "0"))] or None
    join_cpu_quota(path)
    return path
