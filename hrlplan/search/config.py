"""Planner configuration schemas (the `planner/` Hydra group). Plain dataclasses: no Hydra needed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional
from hrlplan.errors import UserError


@dataclass
class PlannerConfigBase:
    name: str = "exact"
    seed: int = 0
    max_pp: int = 64                 # upper bound on pipeline stages considered
    max_tp: int = 8                  # tp never crosses a node
    microbatch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    memory_margin: float = 0.9       # plan against this fraction of device memory
    dp_overlap: bool = True          # DP gradient all-reduce overlapped with backward
    schedules: List[str] = field(default_factory=list)  # empty: the train.schedule only
    # Plan from measured block, communication and optimizer times on devices that are really there
    # (probed clusters): auto = a searching planner reuses the cached calibration of this cluster
    # shape and model or measures once; true = also for a manual plan; refresh = measure again and
    # replace the cached one; false = plan from peak FLOP/s and probed links. Presets never calibrate.
    calibrate: Any = "auto"
    recompute: str = "auto"          # activation recomputation per stage: auto (searched) | none | selective | full
    allow_idle_ranks: bool = True    # a probed job's plan may leave workers idle when that is faster
    allow_over_memory: bool = False  # accept a plan predicted over a device's memory (manual plans)


CALIBRATE_CHOICES = ("auto", "true", "false", "refresh")


def calibration_mode(planner_cfg) -> str:
    """planner.calibrate as one of CALIBRATE_CHOICES (YAML's true/false arrive as booleans)."""
    value = planner_cfg.get("calibrate", "auto")
    mode = str(value).lower() if not isinstance(value, bool) else ("true" if value else "false")
    if mode not in CALIBRATE_CHOICES:
        raise UserError(f"planner.calibrate={value!r} is not one of {', '.join(CALIBRATE_CHOICES)}")
    return mode


@dataclass
class ExactPlannerConfig(PlannerConfigBase):
    name: str = "exact"
    max_evaluations: int = 20_000_000  # (stage, layer span) DP cells; gives up (saying so) beyond
    max_simulations: int = 20_000      # simulator calls of the layer-split branch-and-bound; likewise


@dataclass
class HRLPlannerConfig(PlannerConfigBase):
    name: str = "hrl"
    samples: int = 256               # plans sampled at inference; the best by simulated time wins
    train_steps: int = 30            # policy-gradient updates on this instance before sampling (0: zero-shot)
    batch_size: int = 32             # episodes per update
    lr: float = 3e-3
    entropy_coef: float = 0.01
    hidden: int = 64
    checkpoint_dir: Optional[str] = None  # trained policies; None: the shipped generalist policy
    train_if_missing: bool = True
    use_pretrained: bool = True      # start from the shipped generalist when no checkpoint_dir is given
    refine: bool = True              # hill-climb the best sampled plan's stage boundaries
    greedy_configs: int = 16         # greedy rollouts of the policy's top-scored configurations at inference
    refine_evaluations: int = 64     # simulator calls the hill-climb may spend
    progress: bool = True            # tqdm bar (with the current best) while training


@dataclass
class ManualPlannerConfig(PlannerConfigBase):
    name: str = "manual"
    plan_file: Optional[str] = None


@dataclass
class RandomPlannerConfig(PlannerConfigBase):
    name: str = "random"
    samples: int = 256               # simulator evaluations (the benchmark sets hrl's count)
