"""Hydra accepts a launcher only from the `hydra_plugins` namespace package: this names hrlplan's SLURM
launcher there (`_target_: hydra_plugins.hrlplan_launcher.FittedSlurmLauncher`). The implementation
lives in hrlplan.launch.slurm_launcher; a pickled launcher (what each SLURM job unpickles) is that
class, so the jobs do not need this package."""
from hrlplan.launch import slurm_launcher as _implementation


class FittedSlurmLauncher(_implementation.FittedSlurmLauncher):
    """hrlplan.launch.slurm_launcher.FittedSlurmLauncher under the name Hydra accepts."""
