"""Hydra accepts a launcher only from the `hydra_plugins` namespace package: this names hrlplan's SLURM
launcher there, beside the plugin it extends (hydra_plugins.hydra_submitit_launcher.submitit_launcher):
`_target_: hydra_plugins.hrlplan_launcher.submitit_launcher.SlurmLauncher`. The implementation lives in
hrlplan.launch.slurm_launcher; a pickled launcher (what each SLURM job unpickles) is that class, so the
jobs do not need this package."""
from hrlplan.launch import slurm_launcher as _implementation


class SlurmLauncher(_implementation.FittedSlurmLauncher):
    """hydra-submitit-launcher's SlurmLauncher fitted to the partition (hrlplan.launch.slurm_launcher)."""
