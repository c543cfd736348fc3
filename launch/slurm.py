"""SLURM through submitit: inside a task, turn submitit's job environment into torch.distributed's.

One task per device: submitit starts `tasks_per_node` tasks on every node and each becomes one
rank (no torchrun inside a SLURM task).
"""
from __future__ import annotations

import os


def in_submitit_task() -> bool:
    return bool(os.environ.get("SUBMITIT_EXECUTOR")) and "RANK" not in os.environ


def setup_submitit_env() -> None:
    """Export MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK from the SLURM job (env:// init)."""
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment()
    env.export(set_cuda_visible_devices=False)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
