"""Pipeline runs whose every action lasts a fixed time, for comparing a schedule's measured bubble
with the simulator's on a shared CPU.

Each stage's forward, input-gradient and weight-gradient pass sleeps a fixed time on top of its
(tiny) compute: a sleeping rank leaves its core to the others, so the actions keep their lengths
whatever else the machine runs, and the measured idle fraction is the schedule's order and its
waits, not the machine's load. Sleeps sit where torch's split backward runs each part: a forward
hook (F), a hook on the stage's output gradient (the input-gradient pass, B) and one on a parameter's
gradient (the weight pass, W; a whole backward runs both).
"""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Dict, List

import torch


def _sleeper(seconds: float):
    def hook(grad):
        time.sleep(seconds)
        return grad
    return hook


def pad_part(part: torch.nn.Module, pad: Dict[str, float]) -> None:
    """Lengthen `part`'s forward by pad["F"], its input-gradient pass by pad["B"] and its weight
    pass by pad["W"] (seconds)."""
    def forward_hook(module, args, output):
        time.sleep(pad["F"])
        out = output[0] if isinstance(output, (tuple, list)) else output
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(_sleeper(pad["B"]))
        return output

    part.register_forward_hook(forward_hook)
    weight = next(p for p in part.parameters() if p.requires_grad)
    weight.register_hook(_sleeper(pad["W"]))


def _worker(config, plan_yaml: str, pad: Dict[str, float]):
    import torch.distributed as dist

    from hrlplan.plan import Plan
    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker
    from hrlplan.runtime.trainer import PipelineTrainer

    device = init_distributed("cpu", {"collective_timeout_min": 5}).device
    prepare_worker()
    try:
        trainer = PipelineTrainer(Plan.from_yaml(plan_yaml), config, config.run_dir, device=device)
        for part in trainer.engine.parts.values():
            pad_part(part, pad)
        summary = trainer.fit()
        return summary if dist.get_rank() == 0 else None
    finally:
        shutdown()


def train_padded(plan, overrides: List[str], run_dir: Path, steps: int, pad: Dict[str, float]) -> Dict[str, Any]:
    """Rank 0's summary of `plan` trained `steps` steps with every action padded by `pad`; the last
    step's measured timeline is in summary["measured"]["events"]."""
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.launch.local import launch_workers

    config = compose([*overrides, f"train.steps={steps}", "train.checkpoint_interval=0", "logger.mode=disabled"])
    config = copy.deepcopy(as_config(config))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config.run_dir = str(run_dir)
    plan.save(run_dir / "plan.yaml")
    return launch_workers(_worker, (config, plan.to_yaml(), pad), plan.world_size, name="h1b-padded",
                          log_dir=str(run_dir / "logs"))[0]
