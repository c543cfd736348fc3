"""Predictions for any Plan the runtime runs, homogeneous or not (the planners' Layouts cover only
homogeneous ones). Used by hrlplan.runtime.calibrate.predict_plan and the manual planner.

A heterogeneous plan (replicas with different templates, or stages of unequal tp) is simulated
pipeline by pipeline (each a dp=1 layout, every stage at its own tp degree); the step then waits for the
slowest pipeline, runs hetero_sync.py's cross-replica gradient reduce (its buckets, in sequence on a
rank: cost/replica_sync_cost.py), the gradient-norm and loss all-reduces over the world and the
optimizer. The reduce overlaps each rank's last backward as runtime/hetero_sync.py runs it: a bucket
starts once its units are final on every member and the buckets ahead of it have started.
Under the sharded optimizer (cost/replica_sync.replica_optimizer, runtime/hetero_zero.py) each rank
steps its slices alone (cost/replica_optimizer.py: its time and state by what it steps), a flat
set's reduce is a reduce-scatter, and the slices' gathers run after the step in the forward's
order, each once its members have stepped, and hold up the next step by what they have left when
the rank's first forward reaches their units (replica_sync_cost.exposed_gathers).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Dict, List, Optional, Tuple

from hrlplan.config import TrainConfig, section
from hrlplan.cost.memory import MEMORY_KEYS, zero_bubble_transient
from hrlplan.cost import quota_cpu
from hrlplan.cost.model import CostOptions, Layout
from hrlplan.cost.replica_optimizer import (RankParams, rank_params, state_bytes, state_saving_bytes,
                                            stepped_fraction)
from hrlplan.cost.replica_sync import SHARDED, replica_optimizer
from hrlplan.cost.replica_sync_cost import (SyncBucket, bucket_finish, bucket_launches, exposed_gathers,
                                            replica_own_step_s, sync_buckets)
from hrlplan.cost.simulator import Simulator
from hrlplan.errors import UserError
from hrlplan.schedules import resolve_schedule


# What each runtime the cost model can price does (planner.cost.runtime); a planner.cost key set
# to a value overrides its runtime's. torch: this package's runtime -- SDPA's fused attention keeps no
# s x s scores, torch.distributed.pipelining keeps one receive buffer per micro-batch per stage.
# megatron: Megatron-LM as its SC'21 paper ran it -- scores materialised and read back by its fused
# softmax, each pipeline message freed once used.
RUNTIME_DEFAULTS: Dict[str, Dict[str, bool]] = {
    "torch": {"fused_attention": True, "receive_buffers": True},
    "megatron": {"fused_attention": False, "receive_buffers": False},
}


def cost_settings(planner: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """planner.cost (a mapping, a CostConfig, or absent) resolved: {runtime, fused_attention, receive_buffers,
    tp_comm_overlap}."""
    raw = (planner or {}).get("cost") or {}
    raw = raw if isinstance(raw, dict) else {k: getattr(raw, k, None)
                                             for k in ("runtime", "fused_attention", "receive_buffers", "tp_comm_overlap")}
    runtime = str(raw.get("runtime") or "torch")
    if runtime not in RUNTIME_DEFAULTS:
        raise UserError(f"planner.cost.runtime={runtime!r} is not one of {', '.join(RUNTIME_DEFAULTS)}")
    out: Dict[str, Any] = {"runtime": runtime}
    for key, default in RUNTIME_DEFAULTS[runtime].items():
        value = raw.get(key)
        out[key] = default if value is None else bool(value)
    out["tp_comm_overlap"] = bool(raw.get("tp_comm_overlap") or False)
    if out["tp_comm_overlap"] and runtime != "megatron":
        raise UserError("planner.cost.tp_comm_overlap=true prices Megatron-Core's --tp-comm-overlap, which this "
                        "package's torch runtime does not run: set planner.cost.runtime=megatron or drop the key")
    return out


def options_for_train(train: TrainConfig, planner: Optional[Dict[str, Any]] = None) -> CostOptions:
    """CostOptions from a train config, typed or plain, and the planner's settings (planner.cost,
    dp_overlap, memory_margin): every option that changes a prediction comes from a config key."""
    train, planner = section(TrainConfig, train), planner or {}
    return CostOptions(bytes_per_value=2 if train.dtype == "bfloat16" else 4,
                       dp_mode=str(train.dp_mode),
                       dp_overlap=bool(planner.get("dp_overlap", True)),
                       memory_margin=float(planner.get("memory_margin", 0.9)),
                       # as the runtime runs tp stages (train.vocab_parallel, default on)
                       vocab_parallel=bool(train.vocab_parallel), tf32=bool(train.tf32),
                       compile=bool(train.compile), float8=bool(train.float8),
                       compile_speedup=_compile_speedup(planner), **cost_settings(planner))


def _compile_speedup(planner: Dict[str, Any]) -> Optional[float]:
    """planner.cost.compile_speedup (None: the calibration's measured figure, else 1.0)."""
    raw = (planner or {}).get("cost") or {}
    value = raw.get("compile_speedup") if isinstance(raw, dict) else getattr(raw, "compile_speedup", None)
    return None if value is None else float(value)


def rank_devices(plan) -> List[int]:
    return list((plan.meta.get("launch") or {}).get("rank_to_device") or range(plan.world_size))


def layout_of_plan(plan) -> Layout:
    """A homogeneous, uniform-tp plan in the simulator's terms (plan ranks -> cluster devices)."""
    devices = rank_devices(plan)
    groups = tuple(tuple(devices[r] for r in g) for g in plan.device_groups)
    return Layout(spans=tuple(tuple(s.layers) for s in plan.stages), groups=groups, tp=plan.stages[0].tp,
                  dp=plan.dp, microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
                  schedule=plan.schedule, stages_per_rank=plan.stages_per_rank,
                  recompute=tuple(s.recompute for s in plan.stages), sequence_parallel=plan.sequence_parallel,
                  reshard_after_forward=plan.resolved_reshard_after_forward(), cp=plan.cp)


def cross_replica_reduce_s(plan, meta, sim: Simulator, buckets: Optional[List[SyncBucket]] = None) -> Tuple[float, int]:
    """(seconds, collectives on the busiest rank) of the runtime's cross-replica buckets."""
    per_rank: Dict[int, float] = {}
    count: Dict[int, int] = {}
    for b in sync_buckets(plan, meta, sim, rank_devices(plan)) if buckets is None else buckets:
        for r in b.ranks:
            per_rank[r] = per_rank.get(r, 0.0) + b.seconds
            count[r] = count.get(r, 0) + 1
    if not per_rank:
        return 0.0, 0
    worst = max(per_rank, key=per_rank.get)
    return per_rank[worst], count[worst]


def cross_replica_finish(buckets: Dict[Tuple[int, ...], float], end: Dict[int, float],
                         last_backward: Dict[int, float]) -> Dict[int, float]:
    """bucket_finish for reduces given only by rank set and seconds, whose units are unknown: each
    rank's buckets streamed over its last backward (it may start min(its total, its last backward)
    before its end), run in order of their start."""
    total: Dict[int, float] = {}
    for ranks, t in buckets.items():
        for r in ranks:
            total[r] = total.get(r, 0.0) + t
    ready = {r: end[r] - min(total[r], last_backward[r]) for r in total}
    order = sorted(buckets, key=lambda b: (max(ready[r] for r in b), b))
    listed = [SyncBucket(ranks, (), 0.0, buckets[ranks]) for ranks in order]
    return bucket_finish(listed, {(k, r): ready[r] for k, b in enumerate(listed) for r in b.ranks}, end)


def _pipeline_timing(sim: Simulator, layout: Layout, contention: Optional[float]) -> Tuple[List[float], List[float]]:
    """(end, duration of the last backward) per pipeline position, as Simulator.evaluate runs it."""
    return sim.pipeline_timing(layout, contention)


# Per simulator: a replica's results by its shape. On a preset every device of a type is the same
# and links depend only on (same node or not, the node's intra-node bandwidth), so replicas of one
# template on other nodes of a type predict the same; a plan of 100 replicas costs one evaluation.
_REPLICA_CACHE: "weakref.WeakKeyDictionary[Simulator, Dict[tuple, Any]]" = weakref.WeakKeyDictionary()


def _replica_shape(cluster, layout: Layout, contention: Optional[float]) -> Optional[tuple]:
    """A key equal for replicas a preset cannot tell apart; None where links are measured (a probe)."""
    if cluster.source != "preset" or cluster.bandwidth is not None:
        return None
    nodes: Dict[int, int] = {}
    groups = tuple(tuple((cluster.devices[d].name, nodes.setdefault(cluster.devices[d].node, len(nodes)),
                          cluster.intra_node_bw[cluster.devices[d].node]) for d in g) for g in layout.groups)
    return (dataclasses.replace(layout, groups=()), groups, contention)


def _relabel(result, old: Layout, new: Layout):
    """A cached result of `old` for the same-shaped replica `new`: its memory and stages on new's devices."""
    if old.groups == new.groups:
        return result
    move = {a: b for g, h in zip(old.groups, new.groups) for a, b in zip(g, h)}
    out = dataclasses.replace(result, memory_bytes={move[d]: v for d, v in result.memory_bytes.items()})
    out.stages = [dict(st, devices=[move[d] for d in st["devices"]]) for st in result.stages]
    return out


def _replica_results(sim: Simulator, layouts: List[Layout], contention: Optional[float], timing: bool):
    """sim.evaluate(detail) per replica layout (and, with timing, _pipeline_timing), same shapes once."""
    cache = _REPLICA_CACHE.setdefault(sim, {})
    results, timings = [], []
    for lay in layouts:
        key = _replica_shape(sim.cluster, lay, contention)
        entry = cache.get(key) if key is not None else None
        if entry is not None:
            sim.evaluations += 1   # counted as a call still: searches budget by calls (and must end)
        else:
            entry = [lay, sim.evaluate(lay, detail=True, contention=contention), None]
            if key is not None and (entry[1].feasible or entry[1].over_memory):
                cache[key] = entry   # not a wrapper's refusal (search.hetero.TimedSimulator: out of time)
        if timing and entry[2] is None:
            entry[2] = _pipeline_timing(sim, lay, contention)
        results.append(_relabel(entry[1], entry[0], lay))
        timings.append(entry[2])
    return results, timings


def predict_any_plan(plan, meta, cluster, opts: Optional[CostOptions] = None,
                     sim: Optional[Simulator] = None) -> Dict[str, Any]:
    """{feasible, reason, step_time_s, bubble_fraction, memory_bytes_per_rank, breakdown} for any plan. A plan
    over memory is infeasible with the refusal as reason and a time-only step_time_s (time_only: True)."""
    sim = sim or Simulator(meta, cluster, opts or CostOptions())
    devices = rank_devices(plan)
    if not plan.heterogeneous and plan.uniform_tp:
        r = sim.evaluate(layout_of_plan(plan), detail=True)
        memory = [int(r.memory_bytes.get(devices[k], 0)) for k in range(plan.world_size)]
        if not r.feasible and worst_memory_reason(sim, [r]) is not None:
            return _time_only(plan, meta, cluster, sim, r.reason, memory)
        return {"feasible": r.feasible, "reason": r.reason, "step_time_s": r.step_time_s,
                "bubble_fraction": r.bubble_fraction, "breakdown": r.breakdown, "stages": r.stages,
                "memory_bytes_per_rank": [int(r.memory_bytes.get(devices[k], 0)) for k in range(plan.world_size)]}
    # each stage at its own tp (a stage costed at the pipeline's largest tp looked 3.5x too fast)
    layouts = [Layout(spans=tuple(tuple(s.layers) for s in p.stages),
                      groups=tuple(tuple(devices[r] for r in s.ranks) for s in p.stages),
                      tp=max(s.tp for s in p.stages), dp=1, microbatch_size=p.microbatch_size,
                      num_microbatches=p.num_microbatches, schedule=plan.schedule,
                      stage_tp=tuple(s.tp for s in p.stages), recompute=tuple(s.recompute for s in p.stages),
                      sequence_parallel=any(s.sequence_parallel and s.tp > 1 for s in p.stages))
               for p in plan.as_pipelines()]
    contention = None   # one pipeline: the simulator's shared-cores timeline, as its homogeneous form gets
    if sim.devices.overheads.contention > 1.0 and len(layouts) > 1:
        # the simulator's mean-field contention (see Simulator.evaluate) over the whole world: replicas
        # share the cores, and a one-stage replica that is always busy slows the others' compute too
        alone = [sim.evaluate(lay, detail=True, contention=1.0) for lay in layouts]
        span = max(r.breakdown.get("pipeline_s", 0.0) for r in alone)
        busy = sum((1.0 - r.bubble_fraction) * r.breakdown.get("pipeline_s", 0.0) * sum(len(g) for g in lay.groups)
                   for r, lay in zip(alone, layouts) if r.feasible)
        if span > 0:
            contention = max(1.0, sim.devices.overheads.contention * min(busy / (span * plan.world_size), 1.0))
    sharded = replica_optimizer(plan) == SHARDED
    buckets = sync_buckets(plan, meta, sim, devices, sharded=sharded)
    reduce_s, reduce_n = cross_replica_reduce_s(plan, meta, sim, buckets)
    results, timings = _replica_results(sim, layouts, contention, timing=reduce_s > 0)
    owned = rank_params(plan, meta, sharded, {r: cluster.devices[d].node for r, d in enumerate(devices)})
    if sharded:
        results, timings = _sharded_state(sim, plan, layouts, results, timings, owned, contention, reduce_s > 0)
    memory: Dict[int, float] = {}
    for r in results:
        memory.update(r.memory_bytes)
    mem = [int(memory.get(devices[k], 0)) for k in range(plan.world_size)]
    bad = [r for r in results if not r.feasible]
    if bad:
        reason = worst_memory_reason(sim, results)
        if reason is not None:   # the refusal names the worst replica's worst device; the time still predicted
            return _time_only(plan, meta, cluster, sim, reason, mem)
        return {"feasible": False, "reason": bad[0].reason, "step_time_s": float("inf"), "bubble_fraction": 0.0,
                "breakdown": {}, "stages": [], "memory_bytes_per_rank": mem}
    scale = sim.devices.time_scale
    ov = sim.devices.overheads
    pipe_end = max(r.breakdown["pipeline_end_s"] for r in results) / scale
    optimizer = max(r.breakdown["optimizer_s"] for r in results) / scale
    finish_s = pipe_end
    if reduce_s > 0:
        end, window = {}, {}
        for pipe, lay, (pos_end, pos_window) in zip(plan.as_pipelines(), layouts, timings):
            for k, st in enumerate(pipe.stages):
                for r in st.ranks:
                    end[r], window[r] = pos_end[lay.stage_group(k)], pos_window[lay.stage_group(k)]
        finish_s = max(bucket_finish(buckets, bucket_launches(plan, meta, buckets, end, window), end).values())
    world_collectives = 2 * ov.allreduce(plan.world_size, 4, ov.allreduce_latency)   # gradient norm, loss
    step = (finish_s + world_collectives + optimizer + ov.step) * scale
    own_steps = [replica_own_step_s(r) for r in results]   # as this executor runs the replica alone
    gather_s = 0.0
    if sharded:
        stepping = _sharded_optimizer_s(sim, plan, layouts, owned, contention)
        optimizer = max(stepping.values())
        stepped = {r: finish_s + world_collectives + t for r, t in stepping.items()}
        next_step = max(stepped.values()) + ov.step
        gathers = [b._replace(seconds=b.gather_s) for b in reversed(buckets) if b.gather_s > 0]
        gather_s = exposed_gathers(plan, meta, gathers, stepped, next_step, _first_forward(plan, results, scale))
        step = (next_step + gather_s) * scale
        # a replica's own step bounds the plan with the optimizer it steps here
        own_steps = [replica_own_step_s(r) - r.breakdown.get("optimizer_s", 0.0)
                     + scale * max(stepping[k] for st in pipe.stages for k in st.ranks)
                     for r, pipe in zip(results, plan.as_pipelines())]
    # never under a replica's own step (hetero_exact bounds a plan by its slowest replica's), nor under
    # a capped rank's CPU work, its cross-replica all-reduces included, over its share (cost/quota_cpu.py)
    quota = quota_cpu.replica_bounds(cluster, results, [(b.ranks, b.nbytes) for b in buckets], devices)
    step = max([step] + own_steps + [b * scale for b in quota])
    worst = max(results, key=lambda r: r.breakdown["pipeline_end_s"])
    breakdown = dict(worst.breakdown, step_time_s=step, cross_replica_reduce_s=reduce_s * scale,
                     cross_replica_reduce_exposed_s=max(finish_s - pipe_end, 0.0) * scale,
                     cross_replica_collectives=reduce_n, step_collectives_s=world_collectives * scale,
                     optimizer_s=optimizer * scale, replica_optimizer=replica_optimizer(plan),
                     optimizer_gather_exposed_s=gather_s * scale,
                     quota_cpu_work=[e for r in results for e in r.breakdown.get("quota_cpu_work", ())])
    breakdown.pop("memory_bytes_per_device", None)
    return {"feasible": True, "reason": "", "step_time_s": step, "bubble_fraction": worst.bubble_fraction,
            "breakdown": breakdown, "stages": [s for r in results for s in r.stages], "memory_bytes_per_rank": mem}


# Per simulator: the same simulator with memory unchecked, for replicas over memory with a whole
# optimizer state that the sharded one may fit (kept alive with it: its replica cache holds them).
_UNCHECKED: "weakref.WeakKeyDictionary[Any, Simulator]" = weakref.WeakKeyDictionary()


def _sharded_state(sim: Simulator, plan, layouts: List[Layout], results, timings, owned: Dict[int, RankParams],
                   contention: Optional[float], timing: bool):
    """The replicas' results with the sharded optimizer's state: each device's peak less what its
    rank keeps less (cost/replica_optimizer.py), checked against its memory again. A replica over
    memory with the whole state is simulated with memory unchecked first (its time), counted as a call."""
    devices = rank_devices(plan)
    out, times = list(results), list(timings)
    for p, (pipe, lay, r) in enumerate(zip(plan.as_pipelines(), layouts, results)):
        if not r.feasible and not r.over_memory:
            continue
        if not r.feasible:
            unchecked = _UNCHECKED.get(sim)
            if unchecked is None:
                unchecked = _UNCHECKED[sim] = Simulator(sim.meta, sim.cluster,
                                                        dataclasses.replace(sim.opts, memory_margin=float("inf")))
            sim.evaluations += 1
            (r,), (times[p],) = _replica_results(unchecked, [lay], contention, timing)
        saving = {devices[k]: state_saving_bytes(owned[k]) for st in pipe.stages for k in st.ranks}
        need = {d: v - saving.get(d, 0.0) for d, v in r.memory_bytes.items()}
        over = [(v / sim.devices.memory_limit(d, sim.opts.memory_margin), d) for d, v in need.items()
                if v > sim.devices.memory_limit(d, sim.opts.memory_margin)]
        r = dataclasses.replace(r, memory_bytes=need)
        if over:
            d = max(over)[1]
            dev = sim.cluster.devices[d]
            r = dataclasses.replace(r, feasible=False, step_time_s=float("inf"), over_memory=True, reason=(
                f"out of memory on device {d} ({dev.name}, {dev.hostname} local {dev.local_rank}) with the sharded "
                f"optimizer: needs {need[d] / 2**30:.2f} GiB > {sim.opts.memory_margin:g} x "
                f"{dev.memory_bytes / 2**30:.2f} GiB"))
        out[p] = r
    return out, times


def _first_forward(plan, results, scale: float) -> Dict[int, Tuple[float, float]]:
    """Per plan rank (unscaled): when its first forward of a step starts after the step's start (the
    forwards and sends of the stages before it) and how long it lasts."""
    out: Dict[int, Tuple[float, float]] = {}
    for pipe, r in zip(plan.as_pipelines(), results):
        start = 0.0
        for st, detail in zip(pipe.stages, sorted(r.stages, key=lambda d: d["stage"])):
            out.update({k: (start, detail["fwd_s"] / scale) for k in st.ranks})
            start += (detail["fwd_s"] + detail["send_s"]) / scale
    return out


def _sharded_optimizer_s(sim: Simulator, plan, layouts: List[Layout], owned: Dict[int, RankParams],
                         contention: Optional[float]) -> Dict[int, float]:
    """Per plan rank, its optimizer step under the sharded optimizer (unscaled): its stage's step
    for the share of its parameters it steps, plus the per-call cost once."""
    out: Dict[int, float] = {}
    devices = rank_devices(plan)
    for pipe, lay in zip(plan.as_pipelines(), layouts):
        n = len(pipe.stages)
        fixed = sim.devices.overheads.optimizer_fixed(1, lay.tp)
        for k, st in enumerate(pipe.stages):
            c = sim.costs.stage(st.layers[0], st.layers[1], k == 0, k == n - 1, [devices[r] for r in st.ranks], st.tp,
                                1, pipe.microbatch_size, n, contention=contention, recompute=st.recompute,
                                microbatches=pipe.num_microbatches)
            for r in st.ranks:
                out[r] = fixed + c.optimizer * stepped_fraction(owned[r])
    return out


def worst_memory_reason(sim: Simulator, results) -> Optional[str]:
    """The out-of-memory reason of the replica most over its devices' memory (need / limit), naming
    the replica when there are several; None when some failure is not about memory."""
    bad = [(p, r) for p, r in enumerate(results) if not r.feasible]
    if not bad or not all(r.over_memory for _, r in bad):
        return None
    limit, margin = sim.devices.memory_limit, sim.opts.memory_margin
    p, worst = max(bad, key=lambda pr: max((need / limit(d, margin) for d, need in pr[1].memory_bytes.items()),
                                           default=0.0))
    return worst.reason + (f" (replica {p} of {len(results)}; {len(bad)} over memory)" if len(results) > 1 else "")


def _time_only(plan, meta, cluster, sim: Simulator, reason: str, memory: List[int]) -> Dict[str, Any]:
    """An over-memory plan's prediction: its step time with memory unchecked (what a plan run anyway
    under planner.allow_over_memory takes), infeasible, the refusal and the memory it needs."""
    unchecked = Simulator(meta, cluster, dataclasses.replace(sim.opts, memory_margin=float("inf")))
    out = predict_any_plan(plan, meta, cluster, sim=unchecked)
    return dict(out, feasible=False, reason=reason, time_only=True, memory_bytes_per_rank=memory)


# ---------------------------------------------------------------- memory per rank
def _stage_lists(plan):
    """(stages, ranks of each stage, dp, micro-batches, micro-batch size) per pipeline the cost model sees:
    the plan's one template (all its replicas' ranks per stage), or each heterogeneous replica."""
    if not plan.heterogeneous:
        yield (plan.stages, [plan.device_groups[plan.stage_group(k)] for k in range(plan.num_stages)],
               plan.dp, plan.num_microbatches, plan.microbatch_size)
        return
    for pipe in plan.as_pipelines():
        yield pipe.stages, [s.ranks for s in pipe.stages], 1, pipe.num_microbatches, pipe.microbatch_size


def plan_memory(plan, meta, cluster, opts=None) -> List[Dict[str, float]]:
    """Per rank of a plan: the simulator's peak (`total`, what plan.meta.predicted.memory_bytes_per_rank
    holds), its split at that moment (MEMORY_KEYS: gradients 0 when the peak comes before the first
    backward; activations what the schedule holds then) and `tensors`, the
    total less the workspace reserve: what torch allocates, comparable with a measured peak
    (torch.cuda.max_memory_allocated, or live tensor storages on the CPU)."""
    sim = Simulator(meta, cluster, opts or CostOptions())
    predicted = predict_any_plan(plan, meta, cluster, sim=sim)
    totals = predicted["memory_bytes_per_rank"]
    devices = rank_devices(plan)
    held = {d: (st.get("activation_peak_before_grads", 0.0), st.get("activation_peak_with_grads", 0.0))
            for st in predicted.get("stages") or [] for d in st["devices"]}
    out = [dict.fromkeys(MEMORY_KEYS, 0.0) for _ in range(plan.world_size)]
    rebuilt = [False] * plan.world_size
    zb = resolve_schedule(plan.schedule, plan.stages_per_rank).split_backward
    for stages, ranks, dp, m, mbs in _stage_lists(plan):
        n = len(stages)
        for k, (stage, group) in enumerate(zip(stages, ranks)):
            c = sim.costs.stage(stage.layers[0], stage.layers[1], k == 0, k == n - 1, [devices[r] for r in group],
                                stage.tp, dp, mbs, len(set(map(tuple, ranks))), recompute=stage.recompute,
                                microbatches=m, sequence_parallel=stage.sequence_parallel,
                                reshard_after_forward=not plan.heterogeneous and plan.resolved_reshard_after_forward())
            memory = dict(c.memory)
            if zb and k > 0 and "buffers" in memory:   # as the simulator adds it (cost-model patch applied)
                blocks = (stage.layers[1] - stage.layers[0]) * meta.block_repeats
                memory["transient"] += zero_bubble_transient(meta, stage.tp, mbs * meta.seq_len,
                                                             sim.opts.bytes_per_value, blocks)
            for r in group:
                rebuilt[r] = rebuilt[r] or stage.recompute == "full"
                for key, value in memory.items():
                    if key in ("workspace", "transient"):   # the rank's reserve, once; one backward at a time
                        out[r][key] = max(out[r][key], float(value))
                    else:
                        out[r][key] += float(value)
    if plan.heterogeneous and replica_optimizer(plan) == SHARDED:   # each rank's slices' moments and masters
        owned = rank_params(plan, meta, True, {r: cluster.devices[d].node for r, d in enumerate(devices)})
        for r, params in owned.items():
            out[r]["optimizer"] = state_bytes(params)
    for r, row in enumerate(out):
        row["total"] = float(totals[r])
        before, after = held.get(devices[r], (0.0, 0.0))
        if not rebuilt[r] and before >= row["gradients"] + after:
            row["gradients"] = 0.0   # the peak comes before the first backward: no gradient exists yet
        rest = sum(row[k] for k in MEMORY_KEYS if k != "activations")
        row["activations"] = max(row["total"] - rest, 0.0)
        row["tensors"] = row["total"] - row["workspace"]
    return out
