"""Train a given Plan on this machine's CPU workers, without probing or planning.

The runtime tests, bench/runtime.py and `hrlplan doctor` use it: they hand-write plans
(heterogeneous ones too, which the planners do not emit yet) and need exactly the trainer, nothing
around it. pretrain.py with planner=manual is the user-facing way to do the same. In the launch
layer: it starts the workers (hrlplan.launch.local).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Dict, Optional

import torch.distributed as dist

from hrlplan.compose import compose
from hrlplan.config import Config, LoggerConfig, LoggerMode, as_config
from hrlplan.launch.local import launch_workers
from hrlplan.plan import Plan
from hrlplan.runtime.distributed import init_distributed, shutdown
from hrlplan.runtime.host import prepare_worker
from hrlplan.runtime.metrics import MetricsLogger
from hrlplan.runtime.reference import train_single_process
from hrlplan.runtime.trainer import PipelineTrainer


def _worker(config: Config, plan_yaml: str, metrics_file: bool) -> Optional[Dict[str, Any]]:
    # CPU unless train.device=cuda: the tests and benches hand-write plans for more ranks than GPUs
    setting = "cuda" if config.train.device == "cuda" else "cpu"
    device = init_distributed(setting, {"collective_timeout_min": 5}).device
    prepare_worker()
    try:
        plan = Plan.from_yaml(plan_yaml)
        logger = None
        if dist.get_rank() == 0 and metrics_file:
            logger = MetricsLogger(config.run_dir, {}, LoggerConfig(mode=LoggerMode.disabled), enabled=True, echo=False)
        trainer = PipelineTrainer(plan, config, config.run_dir, logger=logger, device=device)
        summary = trainer.fit()
        if logger is not None:
            logger.finish()
        return summary if dist.get_rank() == 0 else None
    finally:
        shutdown()


def train_plan(plan: Plan, config: Config, run_dir: str | os.PathLike,
               predicted: Optional[Dict[str, Any]] = None, metrics_file: bool = True) -> Dict[str, Any]:
    """Run `plan` with `config` (a Config, or compose()'s plain dict) in plan.world_size local processes;
    returns rank 0's summary (history, measured). `predicted` lands in plan.meta.predicted for
    plan_info.json; metrics_file=False writes no metrics.jsonl/train.log (benches timing many runs)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if predicted is not None:
        plan.meta["predicted"] = predicted
    plan.save(run_dir / "plan.yaml")
    config = copy.deepcopy(as_config(config))
    config.run_dir = str(run_dir)
    results = launch_workers(_worker, (config, plan.to_yaml(), metrics_file), plan.world_size, name="hrlplan-local")
    return results[0]


def compare_with_one_process(plan: Plan, overrides, run_dir: str | os.PathLike, steps: int = 5):
    """(losses of `plan`, losses of one process) on the same config: the runtime tests' check."""
    config = compose([*overrides, f"train.steps={steps}", "train.checkpoint_interval=0", "logger.mode=disabled"])
    summary = train_plan(plan, config, run_dir)
    reference = [h["loss"] for h in train_single_process(config, steps)]
    return [h["train/lm_loss"] for h in summary["history"]], reference
