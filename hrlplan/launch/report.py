"""Rank 0's record of a job: the W&B/metrics logger with the plan and probe attached, and the
report after training (predicted vs measured step time, the pipeline timeline picture)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from hrlplan.config import Config, as_dict
from hrlplan.runtime.metrics import MetricsLogger
from hrlplan.runtime.timeline_plot import save_timeline


@dataclass
class JobInfo:
    """What the launcher knows of a job beyond its config: when it started (the time to the first
    step is measured from it) and, in a Hydra sweep, the job's number (the W&B run's name starts with it)."""
    started_at: float = field(default_factory=time.time)
    sweep_index: Optional[int] = None


def predicted_step(plan) -> Optional[float]:
    return (plan.meta.get("predicted") or {}).get("step_time_s")


def make_logger(config: Config, rank: int, spec, plan, job_type: str = "train", job: Optional[JobInfo] = None):
    run_dir = Path(config.run_dir)
    name = f"{config.arch['name']}-{plan.layout().replace(' ', '')}"
    if job is not None and job.sweep_index is not None:
        name = f"{job.sweep_index}-{name}"
    logger = MetricsLogger(run_dir, as_dict(config), config.logger, enabled=(rank == 0), job_type=job_type,
                           name=name[:120])
    if rank == 0:
        predicted = predicted_step(plan)
        if predicted:  # drawn next to the measured train/step_time_s on the same chart
            logger.constant_metrics["train/predicted_step_time_s"] = float(predicted)
        logger.log_artifact(run_dir / "plan.yaml", "parallel-plan", name="plan")
        logger.log_artifact(run_dir / "cluster.json", "cluster-spec", name="cluster")
        for name in ("plan.yaml", "plan_info.json", "cluster.json"):
            logger.save_file(run_dir / name)
        rows = [[d.rank, d.node, d.hostname, d.kind, d.name, d.memory_bytes / 2**30, d.peak_flops / 1e12]
                for d in spec.devices]
        logger.log_table("probe/devices", ["rank", "node", "host", "kind", "name", "memory_GiB", "TFLOPs"], rows)
    return logger


def measured_step_time(history) -> Optional[float]:
    """Median step time, leaving out the first step (shape inference, allocator warm-up)."""
    times = [h["train/step_time_s"] for h in history if "train/step_time_s" in h]
    times = times[1:] if len(times) > 1 else times
    return statistics.median(times) if times else None


def log_timeline(logger, run_dir: Path, measured: Optional[float]) -> None:
    try:
        path = save_timeline(run_dir, measured)
    except Exception as e:  # a picture is never worth failing a finished run
        logger.note(f"could not draw the pipeline timeline: {e}")
        return
    if path is not None:
        logger.log_image("pipeline/timeline", str(path))
        logger.save_file(path)


def report(config: Config, plan, logger, summary: Dict[str, Any], job: Optional[JobInfo] = None) -> None:
    """Rank 0, after training: final numbers, predicted vs measured step time, the timeline picture."""
    run_dir = Path(config.run_dir)
    started_at = job.started_at if job is not None else time.time()
    history = summary.get("history") or []
    predicted = predicted_step(plan)
    measured = measured_step_time(history)
    values: Dict[str, Any] = {"final_step": summary.get("final_step"), "plan/predicted_step_time_s": predicted}
    if history:
        first_step_s = (summary.get("first_step_at") or time.time()) - started_at
        values.update(final_loss=history[-1].get("train/lm_loss"), time_to_first_step_s=first_step_s)
    if measured is not None:
        values["train/measured_step_time_s"] = measured
        if predicted:
            values["train/measured_over_predicted"] = measured / predicted
            logger.log_table("perf/step_time", ["predicted_s", "measured_s", "measured_over_predicted"],
                             [[predicted, measured, measured / predicted]])
            hint = ("" if config.planner.get("calibrate") or config.arch.get("family") == "hrm" else
                    "; uncalibrated: predicted from peak FLOPs and probed links, planner.calibrate=true "
                    "measures the devices first")
            logger.note(f"step time: predicted {predicted * 1e3:.3g} ms, measured {measured * 1e3:.3g} ms "
                        f"(x{measured / predicted:.2f}{hint})")
    if summary.get("preempted"):
        values["preempted_at_step"] = summary.get("final_step")
    logger.summary(values)
    log_timeline(logger, run_dir, measured)
