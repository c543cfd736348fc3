"""Start the local launcher's fork server early (hrlplan/launch/local.py, WorkerStart).

The server is a fresh interpreter that imports torch and hrlplan before it forks the workers; started
by the launch itself, that import (about 1.5 s here) runs after this process has imported the same for
the launch. Started as soon as the command knows it will start local workers, the two imports run at
once on two cores. Light on purpose: imported before torch, it reads only the environment and the
cluster section (hrlplan/launch/job.py decides the same from the typed config, later).
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Any, Mapping

# What WorkerStart.method would preload for pretrain.py's workers: the script, the launcher, the
# workers' entry point (hrlplan.launch.job.worker_main).
PRELOAD = ["__main__", "hrlplan.launch.local", "hrlplan.launch.job"]
# A rank of torchrun or a task of SLURM starts no workers of its own.
RANK_OR_TASK = ("RANK", "SUBMITIT_EXECUTOR", "SLURM_STEP_ID")


def starts_local_workers(cluster: Mapping[str, Any]) -> bool:
    """Whether this command will start its workers from a fork server: a probed cluster (not a preset
    or a cluster.json), not a rank or a SLURM task, the fork server not turned off."""
    if not cluster.get("probe", True) or cluster.get("spec_file"):
        return False
    if any(key in os.environ for key in RANK_OR_TASK):
        return False
    return (os.environ.get("HRLPLAN_WORKER_START", "forkserver") == "forkserver"
            and "forkserver" in multiprocessing.get_all_start_methods())


def start_early(cluster: Mapping[str, Any]) -> bool:
    """Start the fork server now (it imports in the background) where this command will start local
    workers; True when it did (or it already ran)."""
    if not starts_local_workers(cluster):
        return False
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_pid is None:
        forkserver.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    return True
