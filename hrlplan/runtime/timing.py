"""Measured timelines and plan-vs-measured.

Every rank records when each of its stages runs each micro-batch's forward (F), backward (B; in a
split-backward schedule only the input gradient), weight gradient (W) and, in a split-backward
schedule, a whole backward run as one action (BW, DualPipeV's), relative to a barrier at the start
of the step. From that: per-stage compute and idle time, the measured bubble, each action's median
duration and the bubble the simulator's order makes of them (replayed_bubble), and the timeline
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

from hrlplan.cost.timeline import simulate_timeline
from hrlplan.schedules import resolve_schedule

SKIP_STEPS = 2   # the first steps pay for shape inference, allocation and connection setup


class StepRecorder:
    """Per-rank record of one step's operations: {stage, microbatch, kind, start_s, end_s}.

    On CUDA an op records two CUDA events on the current stream instead of synchronizing after it
    (a synchronize per F/B/W stalls the launch queue and distorts the step it measures); the events
    are read once the step has synchronized, when `events` is first looked at."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._events: List[Dict[str, Any]] = []
        self._pending: List[tuple] = []    # (stage, microbatch, kind, start event, end event)
        self._origin_event = None
        self.origin = time.perf_counter()

    def begin(self) -> None:
        self._events, self._pending = [], []
        self.origin = time.perf_counter()
        if self.cuda:
            self._origin_event = _cuda_event()

    @property
    def events(self) -> List[Dict[str, Any]]:
        if self._pending:
            self._resolve()
        return self._events

    @events.setter
    def events(self, value: List[Dict[str, Any]]) -> None:
        self._events, self._pending = list(value), []

    def add(self, stage: int, microbatch: int, kind: str, t0: float, t1: float, cpu_s: Optional[float] = None) -> None:
        event = {"stage": stage, "microbatch": microbatch, "kind": kind,
                 "start_s": t0 - self.origin, "end_s": t1 - self.origin}
        if cpu_s is not None:
            event["cpu_s"] = cpu_s
        self._events.append(event)

    @contextmanager
    def op(self, stage: int, microbatch: int, kind: str):
        if not self.cuda:
            # the CPU time of the op's thread beside its wall time: where they part, the op waited
            # (a CPU quota's throttling, other processes on the cores), not computed
            t0, c0 = time.perf_counter(), time.thread_time()
            yield
            self.add(stage, microbatch, kind, t0, time.perf_counter(), time.thread_time() - c0)
            return
        if self._origin_event is None:
            self.begin()
        start = _cuda_event()
        yield
        self._pending.append((stage, microbatch, kind, start, _cuda_event()))

    def _resolve(self) -> None:
        """Event times relative to begin()'s event; waits for the events recorded (not the device)."""
        for stage, microbatch, kind, start, end in self._pending:
            end.synchronize()
            t0 = self._origin_event.elapsed_time(start) / 1e3
            t1 = self._origin_event.elapsed_time(end) / 1e3
            self._events.append({"stage": stage, "microbatch": microbatch, "kind": kind, "start_s": t0, "end_s": t1})
        self._pending = []

    def compute_by_stage(self) -> Dict[int, float]:
        out: Dict[int, float] = {}
        for e in self.events:
            out[e["stage"]] = out.get(e["stage"], 0.0) + e["end_s"] - e["start_s"]
        return out


def instrument_pipeline_stage(stage, recorder: StepRecorder, stage_id: int, split_backward: bool = False) -> None:
    """Time torch.distributed.pipelining's per-micro-batch calls; the schedule's receives happen
    outside them, so the recorded spans are compute (plus the stage's own sends' launch). In a
    split-backward schedule a backward torch runs whole (full_backward) is recorded as BW."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        with recorder.op(stage_id, fwd_chunk_id, "F"):
            return fwd(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        whole = split_backward and kwargs.get("full_backward", True)
        with recorder.op(stage_id, bwd_chunk_id, "BW" if whole else "B"):
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
    """The registry's textbook idle fraction (equal stages, free communication; ScheduleSpec.bubble)."""
    return resolve_schedule(schedule, stages_per_rank).bubble(pp, num_microbatches, stages_per_rank)


def action_medians(events: List[Dict[str, Any]], cpu: bool = False) -> Dict[int, Dict[str, float]]:
    """Per stage, the median duration of each kind of action it ran (F, B, W, BW); with cpu, of
    the CPU time its thread spent in them (events recorded on CPU carry it; others are left out)."""
    spans: Dict[int, Dict[str, List[float]]] = {}
    for e in events:
        if cpu and e.get("cpu_s") is None:
            continue
        took = e["cpu_s"] if cpu else e["end_s"] - e["start_s"]
        spans.setdefault(int(e["stage"]), {}).setdefault(str(e["kind"]), []).append(took)
    return {k: {kind: statistics.median(d) for kind, d in by_kind.items()} for k, by_kind in sorted(spans.items())}


def stage_durations(medians: Dict[int, Dict[str, float]], n_stages: int, split_backward: bool):
    """(fwd, bwd, wgt) per stage as the simulator's timeline takes them: in a split-backward schedule
    bwd the input-gradient half and wgt the weight half (a stage that only ran whole backwards: its
    BW as bwd); otherwise bwd the whole backward and wgt 0."""
    fwd, bwd, wgt = [], [], []
    for k in range(n_stages):
        mine = medians.get(k, {})
        fwd.append(mine.get("F", 0.0))
        if split_backward and "B" in mine:
            bwd.append(mine["B"])
            wgt.append(mine.get("W", max(mine.get("BW", 0.0) - mine["B"], 0.0)))
        else:
            bwd.append(mine.get("B", mine.get("BW", 0.0)))
            wgt.append(0.0)
    return fwd, bwd, wgt


def replayed_bubble(schedule: str, pp: int, num_microbatches: int, stages_per_rank: int,
                    events: List[Dict[str, Any]]) -> float:
    """The simulator's bubble for `schedule`'s order (hrlplan.cost.timeline) run with the median
    durations of the actions measured in `events`, communication free: the prediction to set beside
    measured_bubble of the same events, which differs from it by the order's fidelity, the
    communication and the spread of the actions' durations."""
    spec = resolve_schedule(schedule, stages_per_rank)
    n = pp * stages_per_rank
    fwd, bwd, wgt = stage_durations(action_medians(events), n, spec.split_backward)
    zeros = [0.0] * n
    tl = simulate_timeline(schedule, pp, stages_per_rank, num_microbatches, fwd, bwd, wgt, zeros, zeros, zeros)
    return max(0.0, 1.0 - sum(tl.busy) / (tl.makespan * pp)) if tl.makespan > 0 else 0.0


def _cuda_event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: peak allocated by torch; CPU: the process's peak resident set (includes the runtime)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def memory_stats(device: torch.device) -> Dict[str, int]:
    """This rank's peaks since reset_peak_memory: on CUDA max_memory_allocated (tensors) and
    max_memory_reserved (what the caching allocator holds, what nvidia-smi shows); on CPU the peak RSS."""
    if device.type == "cuda":
        return {"max_memory_allocated": int(torch.cuda.max_memory_allocated(device)),
                "max_memory_reserved": int(torch.cuda.max_memory_reserved(device))}
    return {"peak_rss": peak_memory_bytes(device)}


def reset_peak_memory(device: torch.device) -> None:
    """Before training: the probe's and calibration's buffers are freed and leave no peak behind."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def median_step_time(times: List[float]) -> Optional[float]:
    use = times[SKIP_STEPS:] if len(times) > SKIP_STEPS else times
    return statistics.median(use) if use else None


def mean_step_time(times: List[float]) -> Optional[float]:
    """The measured steps' total over their count: the rate a run trains at. Beside the median where
    steps are bimodal: a worker under a CPU quota that spends it stalls until the CFS period ends
    (up to (1 - share) x period, 67 ms at a third of 100 ms) once every few steps, which the median
    step leaves out."""
    use = times[SKIP_STEPS:] if len(times) > SKIP_STEPS else times
    return statistics.fmean(use) if use else None


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
