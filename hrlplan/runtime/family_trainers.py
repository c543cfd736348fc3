"""The trainer adapter of each model family (hrlplan/families.py's `trainer`): the launcher trains any
family through train_family and never asks which one it is. Both adapters run on
hrlplan/runtime/train_core.py's one loop; each takes the run's Config, the plan and the logger. A family
may also warn about its memory before training (fit_warning)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from hrlplan.config import Config
from hrlplan.families import HRM_TRAINER, PIPELINE_TRAINER, family_of
from hrlplan.models.hrm import check_hrm_fits
from hrlplan.runtime.hrm_trainer import train_hrm
from hrlplan.runtime.trainer import MFUBasis, PipelineTrainer


def _train_pipeline(config: Config, run_dir: str, plan, logger, device, mfu_basis: MFUBasis) -> Dict[str, Any]:
    return PipelineTrainer(plan, config, run_dir, logger=logger, device=device, mfu_basis=mfu_basis).fit()


def _train_hrm(config: Config, run_dir: str, plan, logger, device, mfu_basis: MFUBasis) -> Dict[str, Any]:
    return train_hrm(config, run_dir, plan, logger)   # HRM picks its device itself; MFU is an LM figure


TRAINERS: Dict[str, Callable[..., Dict[str, Any]]] = {PIPELINE_TRAINER: _train_pipeline, HRM_TRAINER: _train_hrm}


# A family whose plan check_fits cannot judge (HRM's recurrent core): its own memory estimate, a warning.
FIT_WARNINGS: Dict[str, Callable[..., Optional[str]]] = {
    HRM_TRAINER: lambda config, memory, world: check_hrm_fits(config.arch, int(config.train.global_batch_size),
                                                              memory, world_size=world)}


def fit_check(config: Config) -> Optional[Callable[[Config, float, int], Optional[str]]]:
    """The family's own memory check before anything trains, (config, device memory bytes, world size)
    -> a warning or None; None for a family without one."""
    return FIT_WARNINGS.get(family_of(config.arch).trainer)


def train_family(config: Config, run_dir: str, plan, logger, device, mfu_basis: MFUBasis) -> Dict[str, Any]:
    """Train the plan with the adapter of the run's model family; returns the trainer's summary."""
    return TRAINERS[family_of(config.arch).trainer](config, run_dir, plan, logger, device, mfu_basis)
