"""hydra-submitit-launcher's launchers with a checkpoint hook that resumes.

The plugin's own `checkpoint()` resubmits the task with the very same overrides, so a requeued
job would start training from step 0 again. Ours raises the stop flag (the trainer checkpoints
at its next step boundary, see launch/slurm.py) and resubmits with `train.resume=auto`, so the
requeued job continues from the checkpoint in its own sweep subdirectory, under the same W&B run
id. conf/hydra/launcher/submitit_{slurm,local}.yaml name these classes as `_target_`.
"""
from __future__ import annotations

from typing import Any, List

from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin

from hrlplan.runtime import preempt


def with_resume(overrides: List[str]) -> List[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith("train.resume=")] + ["train.resume=auto"]


class _Resuming:
    def checkpoint(self, sweep_overrides: List[str], *args: Any, **kwargs: Any) -> Any:
        import submitit

        preempt.request_stop("submitit checkpoint hook")
        return submitit.helpers.DelayedSubmission(self, with_resume(list(sweep_overrides)), *args, **kwargs)


class SlurmLauncher(_Resuming, plugin.SlurmLauncher):
    pass


class LocalLauncher(_Resuming, plugin.LocalLauncher):
    pass
