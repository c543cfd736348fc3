"""Planner configuration schemas (the `planner/` Hydra group): they live in hrlplan/config.py with
every other section (a leaf that imports no planner), and are re-exported here for the planners."""
from hrlplan.config import (CALIBRATE_CHOICES, ExactPlannerConfig, HRLPlannerConfig,  # noqa: F401
                            ManualPlannerConfig, PlannerConfigBase, RandomPlannerConfig, calibration_mode)
