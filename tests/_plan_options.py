"""Train a Plan whose stages carry runtime options the plan schema does not have yet
(sequence_parallel per stage, reshard_after_forward on the plan): the engines read them with
getattr, so the workers set them on the loaded Plan before the trainer starts, as the plan file
will once the fields exist."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Optional


def fit_with_options(config, plan_yaml: str, stage_options: Dict[str, Any], plan_options: Dict[str, Any], device):
    """(the Plan with the options set, the trainer's summary) on this worker: the body every options run
    shares (tests/test_context_parallel_engine.py's workers too)."""
    from hrlplan.plan import Plan
    from hrlplan.runtime.trainer import PipelineTrainer

    plan = Plan.from_yaml(plan_yaml)
    for stage in plan.stages:
        for key, value in stage_options.items():
            setattr(stage, key, value)
    for key, value in plan_options.items():
        setattr(plan, key, value)
    return plan, PipelineTrainer(plan, config, config.run_dir, device=device).fit()


def _worker(config, plan_yaml: str, stage_options: Dict[str, Any], plan_options: Dict[str, Any]):
    import torch.distributed as dist

    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker

    device = init_distributed("cpu", {"collective_timeout_min": 5}).device
    prepare_worker()
    try:
        _, summary = fit_with_options(config, plan_yaml, stage_options, plan_options, device)
        return summary if dist.get_rank() == 0 else None
    finally:
        shutdown()


def train_with_options(plan, overrides: List[str], run_dir, steps: int, stage_options: Optional[Dict] = None,
                       plan_options: Optional[Dict] = None, extra: List[str] = ()) -> Dict[str, Any]:
    """Rank 0's summary: {"losses": [...], "memory": per-rank measured split (bytes), "step_time_s"};
    `extra` overrides come last (checkpoints, resume)."""
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.launch.local import launch_workers

    config = compose([*overrides, f"train.steps={steps}", "train.checkpoint_interval=0", "logger.mode=disabled",
                      *extra])
    config = copy.deepcopy(as_config(config))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config.run_dir = str(run_dir)
    summary = launch_workers(_worker, (config, plan.to_yaml(), stage_options or {}, plan_options or {}),
                             plan.world_size, name="h9-options", log_dir=str(run_dir / "logs"))[0]
    measured = summary["measured"]
    return {"losses": [h["train/lm_loss"] for h in summary["history"]],
            "memory": measured["memory_split_per_rank"], "step_time_s": measured["step_time_s"]}


def reference_losses(overrides: List[str], steps: int) -> List[float]:
    from hrlplan.compose import compose
    from hrlplan.runtime.reference import train_single_process

    config = compose([*overrides, f"train.steps={steps}", "train.checkpoint_interval=0", "logger.mode=disabled"])
    return [h["loss"] for h in train_single_process(config, steps)]
