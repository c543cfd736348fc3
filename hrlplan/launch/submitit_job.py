"""The submitit entry point: what submitit runs in every SLURM task (hrlplan.launch.job.run) and how one
training job is submitted without Hydra. The task environment and the requeue are hrlplan/launch/slurm.py's."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Dict, Optional

import submitit
from submitit.helpers import DelayedSubmission

from hrlplan.config import Config, as_config
from hrlplan.launch.job import run
from hrlplan.runtime import preempt


class SubmititTask:
    """What submitit runs in every task: `launch.job.run(config)`; checkpointable.

        executor = submitit.AutoExecutor(folder=...); executor.update_parameters(tasks_per_node=2, ...)
        job = executor.submit(SubmititTask(config))     # config: a Config, or compose()'s plain dict
        summary = job.results()[0]                       # rank 0's summary (history, final_step, ...)
    """

    def __init__(self, config: Config):
        self.config = as_config(config)

    def __call__(self) -> Optional[Dict[str, Any]]:
        return run(copy.deepcopy(self.config))

    def checkpoint(self, *args: Any, **kwargs: Any):
        """submitit's hook on preemption/timeout: only the flag; the requeued job resumes."""
        preempt.request_stop("submitit checkpoint hook")
        config = copy.deepcopy(self.config)
        config.train.resume = "auto"
        return DelayedSubmission(SubmititTask(config))


def make_executor(folder: str | os.PathLike, *, cluster: Optional[str] = None, max_num_timeout: int = 3,
                  **params: Any):
    """A submitit executor for SubmititTask; params as in conf/hydra/launcher/submitit_slurm.yaml
    (tasks_per_node, nodes, cpus_per_task, mem_gb, timeout_min, slurm_partition, ...)."""
    executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster, slurm_max_num_timeout=max_num_timeout)
    executor.update_parameters(**params)
    return executor


def submit(config: Config, folder: str | os.PathLike, **params: Any):
    """Submit one training job (config: a Config, or compose()'s plain dict); the run directory
    defaults to <folder>/run."""
    config = copy.deepcopy(as_config(config))
    if not config.run_dir:
        config.run_dir = str(Path(folder).resolve() / "run")
    return make_executor(folder, **params).submit(SubmititTask(config))
