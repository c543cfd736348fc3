"""The CPU work per step of a worker under a CPU quota (cluster.cpu_shares: a device named cpu@<share>),
which bounds its step: such a worker runs each operation at full speed, in a burst, until its
period's quota is spent, so over a run it can do no more than `share` seconds of CPU per second.
A step lasts at least its CPU work over its share (the simulator's cpu_quota_bounds; a
heterogeneous plan's replicas add their cross-replica reduces: cost/plans.py).

The work, all of it in process CPU time (every thread: gloo's too, as the quota meters it):
- compute: the position's forwards and backwards costed alone (waiting for a core spends no quota);
- the pipeline's machinery per micro-batch and stage: torch's schedule, its sends and receives and
  their waits, beyond the forwards and backwards (quota_cpu_s' pipeline_per_microbatch, from the real
  two-stage pipeline calibration runs: a CPU time, on that rank), its one exchange with a neighbour
  (messages of pipeline_hop_bytes, one sequence) replaced by the stage's own: an exchange (a send and
  a receive) per neighbour, at the stage's message size (p2p_exchange, a line over the bytes from a
  CPU-timed ping-pong: machinery_cpu_s). A middle stage has two neighbours, and at 4 sequences a
  message costs 3x the hop's in copies and gloo's threads: the pick's capped stages of pp3 4/1/1 at
  3 micro-batches of 4 spent 1.4-1.9 ms a step beyond their forwards and backwards where the hop's
  figure gave 0.9;
- the step's collectives the position takes part in (its start barrier, the loss, the gradient norms,
  a tied embedding's gradient, data-parallel gradient sync): quota_cpu_s' allreduce CPU per call and
  per byte, by group size (calibration's all-reduces, in CPU time on each rank); a replica's
  cross-replica buckets also their gradients' packing and unpacking (gradient_bucket_cpu_s_per_byte,
  one block's gradients packed and unpacked in calibration);
- its optimizer (without its contention factor; times quota_cpu_s' optimizer_scale, the reference
  step's clipping + AdamW in CPU time over their wall-time figures' prediction) and the per-step
  overhead in CPU time (quota_cpu_s' step_overhead: the one-process reference step's CPU beyond its
  predicted compute and optimizer; the wall-time figures carry what other processes took of the
  core: step_overhead_s 10 ms instead of 0.7 ms at load 5, the optimizer 4.7x at load 17).
Measured on gpt2-tiny at shares [1, 1/3, 1/3] (bench/hetero_pick.py --actions): beyond the forwards
and backwards, a capped rank spent 25-30% of its CPU per step -- the schedule 0.3-0.8 ms per
micro-batch, a replica's cross-replica reduce about 1.7 ms -- which the bound did not count: every
quota-bound layout was predicted 7-25% under its step, and the planner picked a pipeline whose capped
last stage bounded it at 38 ms over the uncapped worker alone (33 ms).
With the exchanges per neighbour and message size and the buckets' packing (round 5, load 3-5,
bench/hetero_pick.py --actions), a capped rank's predicted / measured CPU per step was 0.92-1.02
on the pipelines (0.97-1.04 with dp3) and 0.80-0.93 on the replicas, whose cross-replica sync and
gloo threads still cost 1-2 ms a step more than counted.

calibration["quota_cpu_s"] (written only where a device runs under a quota):
    {device name: {"pipeline_per_microbatch": s, "pipeline_hop_bytes": bytes,
                   "p2p_exchange": {"cpu_s": s, "cpu_s_per_byte": s}, "gradient_bucket_cpu_s_per_byte": s,
                   "allreduce": [{"ranks": k, "cpu_s": s, "cpu_s_per_byte": s}],
                   "step_overhead": s, "optimizer_scale": f}}
Absent (uncalibrated, or a record from before): the bound counts compute, optimizer and overhead
only, as it did; without p2p_exchange, pipeline_per_microbatch per stage as it is.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hrlplan.cluster import cpu_quota_share
from hrlplan.cost.replica_sync import BUCKET_MB

QUOTA_CPU_KEY = "quota_cpu_s"
GRADIENT_BUCKET_BYTES = BUCKET_MB * 2 ** 20   # one all-reduce per bucket, as torch DDP and runtime/hetero_sync cut them


def figures(calibration: Optional[Mapping[str, Any]], device_name: str) -> Dict[str, Any]:
    """quota_cpu_s of `device_name` ({} when not calibrated)."""
    return dict(((calibration or {}).get(QUOTA_CPU_KEY) or {}).get(device_name) or {})


def allreduce_cpu_s(fig: Mapping[str, Any], ranks: int, nbytes: float) -> float:
    """The CPU one all-reduce of `nbytes` over `ranks` ranks costs a member (0 for one rank or no
    figure). Beyond the largest group measured, the ring's steps grow as (ranks - 1)."""
    fits = sorted((f for f in fig.get("allreduce") or ()), key=lambda f: f["ranks"])
    if ranks < 2 or not fits:
        return 0.0
    fit = next((f for f in fits if f["ranks"] >= ranks), fits[-1])
    scale = (ranks - 1) / (fit["ranks"] - 1) if ranks > fit["ranks"] else 1.0
    return scale * (float(fit["cpu_s"]) + nbytes * float(fit["cpu_s_per_byte"]))


def gradient_sync_cpu_s(fig: Mapping[str, Any], ranks: int, nbytes: float,
                        bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> float:
    """Gradients of `nbytes` all-reduced over `ranks` ranks in buckets of bucket_bytes (one call each)."""
    if ranks < 2 or nbytes <= 0:
        return 0.0
    calls = max(1, math.ceil(nbytes / bucket_bytes))
    return calls * allreduce_cpu_s(fig, ranks, nbytes / calls)


def exchange_cpu_s(fig: Mapping[str, Any], nbytes: float) -> float:
    """The CPU of one send + receive of `nbytes` each (quota_cpu_s' p2p_exchange; 0 without it)."""
    line = fig.get("p2p_exchange") or {}
    return float(line.get("cpu_s", 0.0)) + nbytes * float(line.get("cpu_s_per_byte", 0.0))


def machinery_cpu_s(fig: Mapping[str, Any], exchanges: int, nbytes: float) -> float:
    """A stage's pipeline machinery per micro-batch: the two-stage calibration pipeline's CPU beyond
    its forwards and backwards (pipeline_per_microbatch: one exchange with its neighbour, of
    pipeline_hop_bytes) with that exchange replaced by the stage's own -- `exchanges` neighbours
    (0 alone, 1 first or last, 2 in between), messages of `nbytes`. Without the exchange figures
    (a record from before), pipeline_per_microbatch as it is."""
    base = float(fig.get("pipeline_per_microbatch", 0.0))
    if not fig.get("p2p_exchange") or not fig.get("pipeline_hop_bytes"):
        return base
    schedule = max(base - exchange_cpu_s(fig, float(fig["pipeline_hop_bytes"])), 0.0)
    return schedule + exchanges * exchange_cpu_s(fig, nbytes)


def position_share(cluster, group: Sequence[int]) -> Optional[float]:
    """The smallest CPU share among a position's devices (None: none capped)."""
    shares = [cpu_quota_share(cluster.devices[d].name) for d in group]
    share = min((s for s in shares if s is not None), default=None)
    return share if share is not None and share > 0 else None


def step_collectives_cpu_s(fig: Mapping[str, Any], layout, meta, pos: int, dp_mode: str) -> float:
    """The CPU of the step's small collectives position `pos` takes part in (as the simulator's
    step_collectives times them): the loss, the gradient norm over the shards and over the
    stages, a tied embedding's gradient between the first and the last stage's positions; and the
    barrier every training step starts with (runtime/trainer.train_step: gloo runs it as a small
    all-reduce, which the wall-time step leaves out but the quota meters)."""
    world = layout.pp * len(layout.groups[0])
    cpu = 2 * allreduce_cpu_s(fig, world, 4)
    shards = (layout.dp if dp_mode == "fsdp" else 1) * layout.tp
    if shards > 1:
        cpu += allreduce_cpu_s(fig, shards, 4)
    if layout.pp > 1:
        cpu += allreduce_cpu_s(fig, layout.pp, 4)
        first, last = layout.stage_group(0), layout.stage_group(len(layout.spans) - 1)
        if meta.tied_embeddings and first != last and pos in (first, last):
            tied = meta.head_matmul_params * 4.0 / (layout.dp if dp_mode == "fsdp" else 1) / layout.tp
            cpu += allreduce_cpu_s(fig, 2, tied)
    return cpu


def position_parts(run, totals) -> Dict[int, Tuple[Dict[str, float], float]]:
    """{position: ({part: CPU seconds per step}, share)} of every position with a capped device: its
    compute, the pipeline's machinery, the step's collectives, optimizer and overhead. `run`: the
    simulator's _StepRun after simulate_pipeline (its layout, the simulator, durations at full speed,
    per-micro-batch work); `totals`: its _PositionTotals (optimizer, gradient bytes)."""
    lay, sim, ov = run.layout, run.sim, run.ov
    out: Dict[int, Tuple[Dict[str, float], float]] = {}
    alone = None
    for pos, group in enumerate(lay.groups):
        share = position_share(sim.cluster, group)
        if share is None:
            continue
        if alone is None:
            alone = run.durations(run.stage_costs_at(1.0))
        fig = figures(sim.cluster.calibration, sim.cluster.devices[group[0]].name)
        mine = [k for k in range(run.n) if lay.stage_group(k) == pos]
        message = sim.costs.activation_message(lay.microbatch_size, (lay.tp if lay.sequence_parallel else 1) * lay.cp)
        parts = {"compute": sum((lay.num_microbatches if run.work is None else sum(run.work[k]))
                                * (alone[0][k] + alone[1][k] + alone[2][k]) for k in mine),
                 "machinery": lay.num_microbatches * sum(
                     machinery_cpu_s(fig, (k > 0) + (k < run.n - 1), message) for k in mine),
                 "collectives": step_collectives_cpu_s(fig, lay, sim.meta, pos, sim.opts.dp_mode)}
        if lay.dp > 1:
            parts["collectives"] += gradient_sync_cpu_s(fig, lay.dp, totals.grads[pos])
        parts["optimizer"] = totals.optimizer[pos] / max(ov.contention, 1.0) * float(fig.get("optimizer_scale", 1.0))
        parts["overhead"] = fig["step_overhead"] if "step_overhead" in fig else ov.step / max(ov.contention, 1.0)
        out[pos] = (parts, share)
    return out


def position_work(run, totals) -> Dict[int, Tuple[float, float]]:
    """{position: (CPU seconds per step, share)} of every position with a capped device (the sum of
    position_parts); keeps the parts on `run` (quota_parts) for the breakdown."""
    parts = position_parts(run, totals)
    run.quota_parts = {pos: p for pos, (p, _) in parts.items()}
    return {pos: (sum(p.values()), share) for pos, (p, share) in parts.items()}


def position_bounds(run, totals) -> List[float]:
    """Per capped position, its CPU work per step over its share (what cpu_quota_bounds returns)."""
    return [work / share for work, share in position_work(run, totals).values()]


def replica_bounds(cluster, results: Sequence[Any], buckets: Sequence[Tuple[Sequence[int], float]],
                   rank_devices: Sequence[int]) -> List[float]:
    """A heterogeneous plan's capped ranks: each one's replica position's CPU work (the simulator's
    breakdown["quota_cpu_work"], per device) plus the cross-replica all-reduces it takes part in
    (buckets: (plan ranks, bytes) per all-reduce the runtime runs, cost/replica_sync_cost.sync_buckets)
    and the packing of their gradients into the buckets and back (gradient_bucket_cpu_s_per_byte),
    over its share."""
    work: Dict[int, Tuple[float, float]] = {}
    for r in results:
        for entry in (r.breakdown or {}).get("quota_cpu_work", ()):
            for d in entry["devices"]:
                work[d] = (float(entry["work_s"]), float(entry["share"]))
    if not work:
        return []
    extra: Dict[int, float] = {}
    for ranks, nbytes in buckets:
        for r in ranks:
            d = rank_devices[r]
            if d in work:
                fig = figures(cluster.calibration, cluster.devices[d].name)
                extra[d] = extra.get(d, 0.0) + allreduce_cpu_s(fig, len(ranks), nbytes) \
                    + nbytes * float(fig.get("gradient_bucket_cpu_s_per_byte", 0.0))
    return [(w + extra.get(d, 0.0)) / share for d, (w, share) in work.items()]


def breakdown_entries(run, work: Mapping[int, Tuple[float, float]]) -> List[Dict[str, Any]]:
    """breakdown["quota_cpu_work"]: per capped position, its devices, CPU work per step, share and
    the work's parts (position_parts)."""
    parts = getattr(run, "quota_parts", None) or {}
    return [{"position": pos, "devices": list(run.layout.groups[pos]), "work_s": w, "share": s,
             "parts_s": dict(parts.get(pos) or {})} for pos, (w, s) in sorted(work.items())]
