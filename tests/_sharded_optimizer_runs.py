"""Runs of heterogeneous plans with the sharded optimizer across replicas (runtime/hetero_zero.py),
through the trainer, which asks the engine for it (engine.make_optimizer)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from hrlplan.compose import compose
from hrlplan.config import as_config
from hrlplan.launch.local import launch_workers
from hrlplan.plan import Plan
from hrlplan.runtime.distributed import init_distributed, shutdown
from hrlplan.runtime.hetero_zero import ShardedReplicaOptimizer
from hrlplan.runtime.host import prepare_worker
from hrlplan.runtime.reference import train_single_process
from hrlplan.runtime.trainer import PipelineTrainer


def _worker(config, plan_yaml: str) -> Optional[Dict[str, Any]]:
    device = init_distributed("cpu", {"collective_timeout_min": 5}).device
    prepare_worker()
    try:
        trainer = PipelineTrainer(Plan.from_yaml(plan_yaml), config, config.run_dir, device=device)
        sharded = any(isinstance(o, ShardedReplicaOptimizer) for o in trainer.optimizers.values())
        moments = sum(v.numel() for o in trainer.optimizers.values() for s in o.state.values()
                      for k, v in s.items() if k != "step")
        summary = trainer.fit()
        out = [dist.get_rank(), sharded, moments]
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        return dict(summary, sharded=[g[1] for g in gathered], moments=[g[2] for g in gathered]) \
            if dist.get_rank() == 0 else None
    finally:
        shutdown()


def train_sharded(plan: Plan, config, run_dir) -> Dict[str, Any]:
    """Rank 0's summary of `plan` trained with the sharded optimizer (plan.meta replica_optimizer=
    sharded), plus each rank's `sharded` flag and `moments` (AdamW moment values it holds)."""
    plan = Plan.from_yaml(plan.to_yaml())
    plan.meta["replica_optimizer"] = "sharded"
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(as_config(config))
    config.run_dir = str(run_dir)
    return launch_workers(_worker, (config, plan.to_yaml()), plan.world_size, name="hrlplan-zero")[0]


def compare_sharded_with_one_process(plan: Plan, overrides, run_dir,
                                     steps: int = 4) -> Tuple[List[float], List[float], Dict]:
    """(losses of `plan` sharded, losses of one process, rank 0's summary) on the same config."""
    config = compose([*overrides, f"train.steps={steps}", "train.checkpoint_interval=0", "logger.mode=disabled"])
    summary = train_sharded(plan, config, run_dir)
    reference = [h["loss"] for h in train_single_process(config, steps)]
    return [h["train/lm_loss"] for h in summary["history"]], reference, summary
