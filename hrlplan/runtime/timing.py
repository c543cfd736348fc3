"""Measured timelines and plan-vs-measured.

Every rank records when each of its stages runs each micro-batch's forward (F), backward (B; for
zero-bubble only the input gradient) and weight gradient (W), relative to a barrier at the start
of the step. From that: per-stage compute and idle time, the measured bubble, and the timeline
another tool draws. At the end of a run rank 0 writes measured values beside the predicted ones in
plan_info.json, with relative errors.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

SKIP_STEPS = 2   # the first steps pay for shape inference, allocation and connection setup


class StepRecorder:
    """Per-rank record of one step's operations: {stage, microbatch, kind, start_s, end_s}."""

    def __init__(self, device: torch.device):
        self.sync = device.type == "cuda"   # a GPU op's time is only known after a synchronize
        self.device = device
        self.events: List[Dict[str, Any]] = []
        self.origin = time.perf_counter()

    def begin(self) -> None:
        self.events = []
        self.origin = time.perf_counter()

    def add(self, stage: int, microbatch: int, kind: str, t0: float, t1: float) -> None:
        self.events.append({"stage": stage, "microbatch": microbatch, "kind": kind,
                            "start_s": t0 - self.origin, "end_s": t1 - self.origin})

    @contextmanager
    def op(self, stage: int, microbatch: int, kind: str):
        t0 = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize(self.device)
        self.add(stage, microbatch, kind, t0, time.perf_counter())

    def compute_by_stage(self) -> Dict[int, float]:
        out: Dict[int, float] = {}
        for e in self.events:
            out[e["stage"]] = out.get(e["stage"], 0.0) + e["end_s"] - e["start_s"]
        return out


def instrument_pipeline_stage(stage, recorder: StepRecorder, stage_id: int) -> None:
    """Time torch.distributed.pipelining's per-micro-batch calls; the schedule's receives happen
    outside them, so the recorded spans are compute (plus the stage's own sends' launch)."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        with recorder.op(stage_id, fwd_chunk_id, "F"):
            return fwd(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        with recorder.op(stage_id, bwd_chunk_id, "B"):
            return bwd(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):
        with recorder.op(stage_id, bwd_chunk_id, "W"):
            return wgt(bwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def stage_stats(gathered: List[Dict[str, Any]], step_time: float) -> Dict[int, Dict[str, float]]:
    """Per stage: compute (its first rank's sum of op times) and idle (that rank's step time not
    spent computing any of its stages)."""
    out: Dict[int, Dict[str, float]] = {}
    for rec in gathered:
        if not rec or not rec.get("compute"):
            continue
        busy = sum(rec["compute"].values())
        for stage, compute in rec["compute"].items():
            if int(stage) not in out:
                out[int(stage)] = {"compute_s": compute, "idle_s": max(step_time - busy, 0.0)}
    return dict(sorted(out.items()))


def measured_bubble(gathered: List[Dict[str, Any]]) -> float:
    """1 - (sum of busy time over ranks) / (ranks x span of the step's operations)."""
    busy, end, n = 0.0, 0.0, 0
    for rec in gathered:
        events = (rec or {}).get("events") or []
        if not events:
            continue
        n += 1
        busy += sum(e["end_s"] - e["start_s"] for e in events)
        end = max(end, max(e["end_s"] for e in events))
    return max(0.0, 1.0 - busy / (n * end)) if n and end > 0 else 0.0


def analytic_bubble(schedule: str, pp: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """Textbook idle fraction with equal stages and free communication: GPipe/1F1B (p-1)/(m+p-1);
    interleaved (p-1)/(v m + p-1); zero-bubble's V schedule 0, its interleaved form a third of 1F1B's."""
    p, m, v = pp, num_microbatches, stages_per_rank
    if p <= 1:
        return 0.0
    if schedule == "zero_bubble":
        return 0.0 if v == 2 else (p - 1) / 3 / (v * m + (p - 1) / 3)
    if schedule == "interleaved_1f1b" or v > 1:
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: peak allocated by torch; CPU: the process's peak resident set (includes the runtime)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def median_step_time(times: List[float]) -> Optional[float]:
    use = times[SKIP_STEPS:] if len(times) > SKIP_STEPS else times
    return statistics.median(use) if use else None


def _rel(measured: Optional[float], predicted: Optional[float]) -> Optional[float]:
    if measured is None or not predicted:
        return None
    return (measured - predicted) / predicted


def plan_vs_measured(predicted: Dict[str, Any], measured: Dict[str, Any]) -> Dict[str, Any]:
    """Relative errors (measured - predicted) / predicted for step time, bubble and memory per rank."""
    err: Dict[str, Any] = {"step_time_s": _rel(measured.get("step_time_s"), predicted.get("step_time_s")),
                           "bubble_fraction": _rel(measured.get("bubble_fraction"), predicted.get("bubble_fraction"))}
    pm, mm = predicted.get("memory_bytes_per_rank"), measured.get("memory_bytes_per_rank")
    if pm and mm:
        err["memory_bytes_per_rank"] = [_rel(m, p) for m, p in zip(mm, pm)]
    return err


def write_plan_info(run_dir: str | os.PathLike, predicted: Dict[str, Any], measured: Dict[str, Any],
                    timeline: List[Dict[str, Any]]) -> Path:
    """Merge measured values, errors and a one-step timeline into <run_dir>/plan_info.json."""
    path = Path(run_dir) / "plan_info.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    keep = ("step_time_s", "bubble_fraction", "memory_bytes_per_rank")
    info["predicted"] = {k: predicted.get(k) for k in keep if k in predicted}
    info["measured"] = measured
    info["relative_error"] = plan_vs_measured(predicted, measured)
    info["measured_timeline"] = timeline
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=1, default=float))
    os.replace(tmp, path)
    return path
