"""Rank 0's record of a job: the W&B/metrics logger with the plan and probe attached, and the
report after training (predicted vs measured step time, the pipeline timeline picture)."""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from hrlplan.config import Config, as_dict
from hrlplan.families import family_of
from hrlplan.runtime.metrics import MetricsLogger, duration_text
from hrlplan.runtime.timeline_plot import save_timeline


def process_start_time() -> float:
    """When this process started, i.e. the user's command (from /proc); now where /proc is missing."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])   # field 22, starttime: clock ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


@dataclass
class JobInfo:
    """What the launcher knows of a job beyond its config: when it started (time_to_first_step_s is
    measured from it: the command's start, so probe, calibration, planning and worker start-up count)
    and, in a Hydra sweep, the job's number (the W&B run's name starts with it)."""
    started_at: float = field(default_factory=process_start_time)
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
            ratio = measured / predicted
            values["train/measured_over_predicted"] = ratio
            logger.log_table("perf/step_time", ["predicted_s", "measured_s", "measured_over_predicted"],
                             [[predicted, measured, ratio]])
            logger.note(f"step time: predicted {duration_text(predicted)}, measured {duration_text(measured)} "
                        f"(x{ratio:.2f})")
            why = off_prediction_line(ratio, calibrated=_calibrated(run_dir), manual=_is_manual(config),
                                      steps_measured=max(0, len(history) - 1), load=_load_per_core(),
                                      never_calibrated=not family_of(config.arch).calibrates)
            if why:
                logger.note(why)
    if summary.get("preempted"):
        values["preempted_at_step"] = summary.get("final_step")
    logger.summary(values)
    log_timeline(logger, run_dir, measured)


# A measured step this far off the prediction (either way) gets a line saying why it may be.
OFF_PREDICTION = 2.0
BUSY_LOAD = 1.5     # load average per core; the job's own workers make up to about 1
STEADY_STEPS = 10   # fewer measured steps than this: the warm-up may still dominate the median


def off_prediction_line(ratio: float, calibrated: bool, manual: bool, steps_measured: int,
                        load: Optional[float] = None, never_calibrated: bool = False) -> Optional[str]:
    """One line when measured / predicted step time is over OFF_PREDICTION or under its inverse:
    what may cause it and what to do; None when the prediction held."""
    if 1 / OFF_PREDICTION <= ratio <= OFF_PREDICTION:
        return None
    causes, todo = [], []
    if load is not None and load > BUSY_LOAD:
        causes.append(f"this node is busy (load {load:.1f} per core, this job's workers included)")
        todo.append("run on a quiet node")
    if never_calibrated:
        causes.append("the model is planned from peak FLOP/s (its family is never calibrated: HRM's recurrent "
                      "steps are not timed)")
    elif not calibrated:
        basis = "a planner=manual plan is" if manual else "the plan was"
        causes.append(f"{basis} predicted from peak FLOP/s and probed links, not from measured blocks")
        todo.append("planner.calibrate=true" if manual else "planner.calibrate=auto (or true)")
    else:
        causes.append("the calibration (cached per cluster shape and model) was taken on a busy or different node")
        todo.append("planner.calibrate=refresh to measure again")
    if steps_measured < STEADY_STEPS:
        causes.append(f"only {steps_measured} steps were measured and the first ones warm up")
        todo.append(f"train.steps>={STEADY_STEPS + 10} for a steady figure")
    side = "slower" if ratio > 1 else "faster"
    line = f"the step ran {ratio:.2f}x the predicted time ({side}); it may be that {'; '.join(causes)}"
    return line + (f". To do: {', '.join(todo)}" if todo else "")


def _calibrated(run_dir: Path) -> bool:
    """Whether the plan was predicted from a calibration (cluster.json, as the job planned with it)."""
    try:
        return bool(json.loads((run_dir / "cluster.json").read_text()).get("calibration"))
    except (OSError, ValueError):
        return False


def _is_manual(config: Config) -> bool:
    return str(config.planner.get("name")) == "manual"


def _load_per_core() -> Optional[float]:
    try:
        return os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    except (OSError, AttributeError):
        return None


def idle_devices_line(plan, devices: int, unit: str = "devices") -> Optional[str]:
    """One console line when the plan leaves some of the job's `devices` idle; None when it uses all.
    unit: "workers" for a job's probed workers (planner.allow_idle_ranks governs those), "devices" for
    a preset or spec file (whose planner may leave a slower device type out)."""
    idle_ranks = set(plan.unused_ranks)
    used = [r for r in range(plan.world_size) if r not in idle_ranks]
    idle = sorted(idle_ranks | set(range(plan.world_size, devices)))
    if not idle:
        return None
    advice = "; planner.allow_idle_ranks=false uses every worker" if unit == "workers" else ""
    return (f"the plan trains on {len(used)} of {devices} {unit}; {len(idle)} {'stays' if len(idle) == 1 else 'stay'} "
            f"idle ({'rank' if len(idle) == 1 else 'ranks'} {rank_ranges(idle)}): "
            f"predicted faster than using all of them (plan_info.json has the alternatives){advice}")


def rank_ranges(ranks) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, ranks = [], sorted(ranks)
    start = prev = None
    for r in ranks + [None]:
        if r is not None and prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    return ", ".join(out)
