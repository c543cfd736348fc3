"""Calibration: measure the real devices and store the figures the cost model reads.

What is measured, and which ClusterSpec.calibration key (hrlplan.cost.model.CALIBRATION_KEYS) it sets:
- one transformer block's forward + backward at several micro-batch sizes on every rank. The cost
  model's compute time is flops * (tokens + h) / (peak * eff) per forward, backward twice that, so a
  straight line through (tokens, measured (F+B)/3) gives the sustained efficiency `eff`
  (compute_efficiency, per device name) and the half-saturation point `h` (half_saturation_tokens);
- the same block's backward / forward ratio per micro-batch size (backward_forward_ratio), and its
  backward split as zero-bubble runs it, by torch's own functions (zb_backward_factors);
- per-op overhead of torch's pipeline stage, on rank 0 alone (op_overhead_s); clipping + AdamW of a
  1-block and a deeper stage and of the embedding + head (optimizer_s_per_block, optimizer_fixed_s,
  optimizer_ends_blocks);
- the communication micro-benchmarks of hrlplan.runtime.calibrate_comm, every pair of ranks at once
  with a rank left over kept busy (a step has every rank working too): a ping-pong
  (bandwidth_efficiency); a real two-stage torch pipeline per schedule (p2p_latency_s,
  p2p_latency_by_schedule_s, p2p_handshake_s, and the small all-reduces after it:
  allreduce_latency_s, tied_allreduce_s; its blocks' time against the same block alone, beyond
  contention_factor, gives pipeline_compute_factor); FSDP2 over a pair (dp_collective_s,
  dp_collective_fixed_s, dp_hook_s, the sharded optimizer); stages of 1 and 6 blocks sharded over
  tp=2 beside the whole ones (tp_block_overhead_s, the slope per block) and their clipping + AdamW
  (the "tp" entries of optimizer_s_per_block / optimizer_fixed_s); all-reduces over groups of every
  size, every group at once (allreduce_by_ranks). All-reduces and pipeline hops run in three passes
  at different moments, pooled;
- with train.dtype=bfloat16, every forward under bf16 autocast, as the runtime computes;
- contention_factor: one block's forward + backward on every rank at once vs on one rank alone (means
  over a long run); with more ranks than cores compute is then costed at the speed measured alone
  times this factor (times the ranks' busy share: see the simulator);
- one whole one-process training step of the model, run as the runtime runs a stage, vs the
  simulator's prediction for it with the figures above: its clipping + optimizer time rescales the
  plain optimizer figures (optimizer_in_step_scale), the rest it takes beyond the prediction is
  step_overhead_s (Python, the scheduler).
Nothing is fitted from a benchmarked plan's own step time. Raw measurements are kept under
calibration["measurements"] for inspection. The micro-benchmarks live in calibrate_compute (compute,
optimizer, the one-process step) and calibrate_comm (communication); this module runs them in a job
and fits the figures.
"""
from __future__ import annotations

import copy
import gc
import statistics
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from hrlplan.runtime.calibrate_compute import (CONTENTION_SLACK, busy_until_barrier, fit_compute, fit_optimizer,
                                              measure_block, measure_contention, measure_optimizer, measure_pipeline_ops,
                                              measure_step, measure_tp_optimizer, measure_zb_split,
                                              predict_one_process_step)
from hrlplan.runtime.calibrate_comm import (DP_SCALING_BLOCKS, HANDSHAKE_LATENCIES, HOP_SCHEDULES, REPEATS,
                                           allreduce_partitions, fit_allreduce, fit_dp_scaling, fit_hop_delay,
                                           fit_pipeline_compute,
                                           measure_allreduce, measure_data_parallel, measure_p2p,
                                           measure_pipeline_hop, measure_tensor_parallel, pool_allreduce_passes,
                                           pool_hop_passes, fit_tensor_parallel)

REFERENCE_ROUNDS = 5        # reference steps, interleaved with block timings: a shared machine's load drifts


def _pairs(world: int) -> List[List[int]]:
    return [[r, r + 1] for r in range(0, world - 1, 2)]


DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8, 16, 32)   # hrlplan.search.config's default candidates


def largest_microbatch(global_batch: int, microbatches: Any = "auto", wanted: Optional[List[int]] = None) -> int:
    """The largest micro-batch the planner may pick: global / train.microbatches when that is fixed,
    else the largest candidate (planner.microbatch_sizes) dividing the global batch (dp 1)."""
    if microbatches not in (None, "auto"):
        return max(1, global_batch // int(microbatches))
    wanted = list(wanted or DEFAULT_MICROBATCH_SIZES)
    fits = [d for d in wanted if 0 < d <= global_batch and global_batch % d == 0]
    return max(fits) if fits else global_batch


def memory_cap(cap: int, seq: int, block_bytes_per_token: float, free_bytes: Optional[float],
               blocks: int = 1, fixed_bytes: float = 0.0, headroom: float = 0.5) -> int:
    """Halve `cap` until `blocks` blocks' activations at cap x seq tokens, plus fixed_bytes (weights,
    optimizer states), fit in headroom x free_bytes (probed free memory); 0 when nothing fits.
    None free_bytes (CPU): cap unchanged."""
    if free_bytes is None:
        return cap
    while cap >= 1 and fixed_bytes + cap * seq * block_bytes_per_token * blocks > headroom * free_bytes:
        cap //= 2
    return cap


def calibration_sizes(global_batch: int, cap: int) -> tuple:
    """(micro-batch sizes of the block fits, of the compute fit): 1, a quarter, a half and the whole
    of the batch, none above cap (the largest micro-batch the planner may pick, or what fits)."""
    g = max(1, min(global_batch, cap))
    sizes = sorted({1, max(1, g // 4), g})
    return sizes, sorted(set(sizes) | {max(1, g // 2)})


def calibrate_in_job(spec, arch: Dict[str, Any], train: Dict[str, Any], data: Dict[str, Any],
                     planner: Optional[Dict[str, Any]] = None):
    """Collective: every rank of an initialised process group calls it; every rank returns the
    ClusterSpec with `calibration` filled. Every rank runs the micro-benchmarks at once (on a shared
    machine a rank's speed depends on how many others compete for it); rank 0 fits and broadcasts.
    Everything runs on the training device (the current GPU under NCCL); with
    train.dtype=bfloat16 every forward runs under bf16 autocast, as the runtime computes. Sizes stop
    at the largest micro-batch the planner (planner.microbatch_sizes) may pick and what fits."""
    from hrlplan.runtime.distributed import local_device

    device = local_device()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=train.get("dtype") == "bfloat16"):
        spec = _calibrate_in_job(spec, arch, train, data, device, planner or {})
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return spec


def _calibrate_in_job(spec, arch: Dict[str, Any], train: Dict[str, Any], data: Dict[str, Any], device: torch.device,
                      planner: Dict[str, Any]):
    from hrlplan.model_meta import introspect
    from hrlplan.runtime.distributed import all_gather_object, broadcast_object

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = broadcast_object(spec)   # the probe returns the spec on rank 0 only
    seq = int(data["seq_len"])
    meta = introspect(arch, seq_len=seq)
    g = int(train["global_batch_size"])
    free = float(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None
    act = meta.block_activation_bytes_per_token[0] * (1 if train.get("dtype") == "bfloat16" else 2)
    cap = memory_cap(largest_microbatch(g, train.get("microbatches", "auto"), planner.get("microbatch_sizes")),
                     seq, act, free)
    # the compute fit also at half the batch: its line through three sizes put a 256-token block
    # (the micro-batch the planner then picked here) 8% below its measured time
    sizes, block_sizes = calibration_sizes(g, max(cap, 1))
    g = max(sizes)
    # the one-process reference step holds the whole model and its AdamW states (16 B/parameter)
    step_batch = memory_cap(g, seq, act, free, blocks=meta.n_layer, fixed_bytes=16.0 * meta.total_params)
    samples = measure_block(arch, seq, block_sizes, device)
    zb_split = measure_zb_split(arch, seq, sizes, device)
    # groups are created collectively, in one order on every rank
    singles = [dist.new_group([r]) for r in range(world)]
    pairs = _pairs(world)
    pair_groups = [dist.new_group(p) for p in pairs]
    # The pipeline library's per-op overhead is an alone figure (contention_factor scales it): rank 0
    # measures it with the others waiting. Measured on every rank at once, ranks time-sliced on
    # shared cores put their slices into the slope of the longer schedule: 0.3-2.7 ms per backward
    # with 4 ranks on 2 cores (0.01-0.1 ms with 2), and every plan's backward costed that much more.
    ops = None
    if rank == 0:
        alone_one = measure_block(arch, seq, [1], device)[0]
        ops = measure_pipeline_ops(arch, seq, device, singles[0], alone_one["fwd_s"], alone_one["bwd_s"])
    dist.barrier()
    optim = measure_optimizer(arch, train, device)
    partitions = [(k, lists, [dist.new_group(r) if len(r) > 1 else None for r in lists])
                  for k, lists in allreduce_partitions(world)]
    # The all-reduces and the pipeline hops are measured in passes at different moments and pooled:
    # a burst of another tenant's load then inflates one pass, not the figure (a 2-rank all-reduce
    # once measured 2.5 ms instead of 0.25 ms, every pipelined plan predicted 25% slow).
    allreduce_passes = [measure_allreduce(device, partitions, repeats=REPEATS)]
    dist.barrier()
    # The two-rank micro-benchmarks, every pair at once and a rank left over kept busy: a step has
    # every rank working too, so what they measure needs no scaling for ranks sharing cores.
    dp = hop = tensor_parallel = tp_optimizer = None
    mine = next((i for i, pair in enumerate(pairs) if rank in pair), None)
    if mine is None:
        busy_until_barrier(arch, seq, max(1, g // 4), device)
    else:
        tied_numel = int(meta.head_matmul_params) if meta.tied_embeddings else 0
        hop_passes: Dict[str, List[Dict[str, Any]]] = {sched: [] for sched in HOP_SCHEDULES}

        def hop_pass() -> None:
            # one-block stages: plan-sized ones (half the blocks, a quarter of the batch) fitted GPipe's
            # hop no better here and, with more ranks than cores, twice as long as pp2 x dp2 pays it
            for sched in HOP_SCHEDULES:
                hop_passes[sched].append(measure_pipeline_hop(arch, seq, device, pair_groups[mine], pairs[mine],
                                                              schedule=sched, repeats=REPEATS, tied_numel=tied_numel))

        hop_pass()
        dp = measure_data_parallel(arch, seq, train, device, pair_groups[mine])
        hop_pass()
        # the same stage at other depths: how the collectives' exposed time grows per unit (each
        # unit's reduce-scatter overlaps the backward of the units after it) vs the stage's tail
        dp["by_blocks"] = [{k: d[k] for k in ("n_blocks", "allgather_total", "reduce_total", "optimizer_total")}
                           for d in [dp] + [measure_data_parallel(arch, seq, train, device, pair_groups[mine],
                                                                  n_blocks=nb) for nb in DP_SCALING_BLOCKS]]
        hop_pass()
        hop = {sched: pool_hop_passes(passes) for sched, passes in hop_passes.items()}
        tensor_parallel = measure_tensor_parallel(arch, seq, sizes, device, pair_groups[mine])
        tp_optimizer = measure_tp_optimizer(arch, train, device, pair_groups[mine])
        dist.barrier()
    allreduce_passes.append(measure_allreduce(device, partitions, repeats=REPEATS))
    msg = max(1, g // 2) * seq * meta.hidden_size * (2 if train.get("dtype") == "bfloat16" else 4)
    p2p = measure_p2p(msg, device)
    contention = measure_contention(arch, seq, max(1, g // 4), device)
    allreduce_passes.append(measure_allreduce(device, partitions, repeats=REPEATS))
    allreduce = pool_allreduce_passes(allreduce_passes)
    local = {"block": samples, "zb_split": zb_split, "pipeline_ops": ops, "optimizer": optim, "data_parallel": dp,
             "pipeline_hop": hop, "tensor_parallel": tensor_parallel, "tp_optimizer": tp_optimizer,
             "contention": contention, "allreduce": allreduce}
    gathered = all_gather_object(local)
    cal: Optional[Dict[str, Any]] = None
    if rank == 0 and step_batch < 1:
        cal = fit_calibration(spec, meta, gathered, p2p, msg)
        cal["step_overhead_s"] = 0.0   # the whole model does not fit one device: no reference step
        cal["measurements"] = {"model": meta.name, "seq_len": seq, "dtype": str(train.get("dtype", "float32")),
                               "ranks": gathered, "p2p_bytes": msg, "p2p": p2p, "one_process_step_s": None}
    elif rank == 0:
        cal = fit_calibration(spec, meta, gathered, p2p, msg)
        # The one reference step, on rank 0 alone (the others wait): what it costs beyond the fitted
        # terms is step_overhead_s. Its compute is predicted from blocks measured alone too, so the
        # contention the concurrent fit above includes does not land in the overhead.
        train = dict(train, global_batch_size=step_batch)   # the reference step's batch, predicted alike
        config = {"arch": arch, "train": train, "data": dict(data)}
        # interleaved rounds, medians: a shared machine's load drifts between two measurements
        rounds = [(measure_step(config, device), measure_block(arch, seq, block_sizes, device))
                  for _ in range(REFERENCE_ROUNDS)]
        measured = statistics.median(r[0]["step_s"] for r in rounds)
        optimizer_in_step = statistics.median(r[0]["optimizer_s"] for r in rounds)
        alone = [dict(tokens=r0["tokens"], fwd_s=statistics.median(r[1][i]["fwd_s"] for r in rounds),
                      bwd_s=statistics.median(r[1][i]["bwd_s"] for r in rounds))
                 for i, r0 in enumerate(rounds[0][1])]
        ref = copy.deepcopy(spec)
        ref.calibration = dict(cal)
        d0 = spec.devices[0]
        fit0 = fit_compute(alone, meta.block_flops_fwd_per_token[0] * meta.block_repeats, cal["peak_flops"][d0.name])
        ref.calibration.update(compute_efficiency={d0.name: fit0["compute_efficiency"]},
                               half_saturation_tokens={d0.name: fit0["half_saturation_tokens"]},
                               contention_factor=None)   # the reference step ran alone
        predicted = predict_one_process_step(meta, ref, train)
        if predicted["optimizer_s"] > 0:
            # Clipping + AdamW as a real step pays them (its caches cold after the backward), not as the
            # micro-benchmark's warm loop does: the plain optimizer's figures scaled to the step's.
            scale = optimizer_in_step / predicted["optimizer_s"]
            for key in ("optimizer_s_per_block", "optimizer_fixed_s"):
                cal[key] = dict(cal[key], plain=cal[key]["plain"] * scale)
            cal["optimizer_in_step_scale"] = scale
            ref.calibration.update({k: cal[k] for k in ("optimizer_s_per_block", "optimizer_fixed_s")})
            predicted = predict_one_process_step(meta, ref, train)
        predicted = predicted["step_time_s"]
        cal["step_overhead_s"] = max(measured - predicted, 0.0)
        if cal.get("contention_factor"):
            # CPU work is then costed as measured alone, times the contention factor; so is the split
            # of a block's time into forward and backward (with ranks time-sliced, a backward measured
            # right after its forward loses more of its slices: 4.1x the forward at 512 tokens with 4
            # ranks on 2 cores, 1.4x alone)
            cal["compute_efficiency"] = dict(cal["compute_efficiency"], **ref.calibration["compute_efficiency"])
            cal["half_saturation_tokens"] = dict(cal["half_saturation_tokens"],
                                                 **ref.calibration["half_saturation_tokens"])
            cal["backward_forward_ratio"] = [{"tokens": a["tokens"], "ratio": a["bwd_s"] / a["fwd_s"]}
                                             for a in alone]
        # the blocks inside the real two-stage pipeline vs the same blocks alone (fit_pipeline_compute)
        hops = [h for r in gathered for h in (r.get("pipeline_hop") or {}).values() if h]
        if hops:
            cal["pipeline_compute_factor"] = fit_pipeline_compute(
                hops, alone, seq, cal.get("op_overhead_s") or {},
                float((cal.get("contention_factor") or {}).get("compute", 1.0)))
        cal["measurements"] = {"model": meta.name, "seq_len": seq, "dtype": str(train.get("dtype", "float32")),
                               "ranks": gathered, "p2p_bytes": msg,
                               "p2p": p2p, "one_process_step_s": measured, "block_alone": alone,
                               "one_process_step_predicted_without_step_overhead_s": predicted}
    dist.barrier()
    spec.calibration = broadcast_object(cal)
    for group in singles + pair_groups + [g for _, _, groups in partitions for g in groups if g is not None]:
        dist.destroy_process_group(group)
    return spec


def fit_calibration(spec, meta, gathered: List[Dict[str, Any]], p2p: Optional[Dict[str, float]],
                    msg_bytes: int) -> Dict[str, Any]:
    """CALIBRATION_KEYS from every rank's micro-benchmarks (medians over ranks), without the
    reference step's step_overhead_s (calibrate_in_job fits it last, from the rest)."""
    med = statistics.median
    cal = dict(spec.calibration or {})
    cal.pop("peak_flops", None)   # an earlier calibration's: this one fits against this probe's
    flops = meta.block_flops_fwd_per_token[0] * meta.block_repeats
    eff, half, peak = {}, {}, {}
    for name in sorted({d.name for d in spec.devices}):
        peak[name] = statistics.median(d.peak_flops for d in spec.devices if d.name == name)
        fits = [fit_compute(gathered[d.rank]["block"], flops, peak[name]) for d in spec.devices
                if d.name == name and d.rank < len(gathered)]
        eff[name] = med(f["compute_efficiency"] for f in fits)
        half[name] = med(f["half_saturation_tokens"] for f in fits)
    cal.update(compute_efficiency=eff, half_saturation_tokens=half, peak_flops=peak, step_time_scale=1.0)
    # per micro-batch size (medians over ranks): backward / forward, and zero-bubble's B and W as
    # multiples of the plain backward (the simulator interpolates them at a layout's micro-batch)
    cal["backward_forward_ratio"] = [
        {"tokens": s0["tokens"], "ratio": med(r["block"][i]["bwd_s"] / r["block"][i]["fwd_s"] for r in gathered)}
        for i, s0 in enumerate(gathered[0]["block"])]
    if all(r.get("zb_split") for r in gathered):
        cal["zb_backward_factors"] = [
            {"tokens": z0["tokens"], "input": med(r["zb_split"][i]["input_s"] / r["zb_split"][i]["plain_s"] for r in gathered),
             "weight": med(r["zb_split"][i]["weight_s"] / r["zb_split"][i]["plain_s"] for r in gathered)}
            for i, z0 in enumerate(gathered[0]["zb_split"])]
        mid = cal["zb_backward_factors"][len(cal["zb_backward_factors"]) // 2]
        cal["zb_input_grad_share"] = mid["input"] / (mid["input"] + mid["weight"])
    ops = [r["pipeline_ops"] for r in gathered if r.get("pipeline_ops")]
    if ops:
        cal["op_overhead_s"] = {k: med(o[k] for o in ops) for k in ("fwd", "bwd")}
    deep = [r["optimizer"]["deep"] for r in gathered if r["optimizer"].get("deep") is not None]
    opt = fit_optimizer(med(r["optimizer"]["block"] for r in gathered), med(deep) if deep else None,
                        int(gathered[0]["optimizer"].get("deep_blocks", 1)), med(r["optimizer"]["ends"] for r in gathered))
    cal["optimizer_ends_blocks"] = opt["ends_blocks"]
    dps = [r["data_parallel"] for r in gathered if r.get("data_parallel")]
    sharded = med(d["optimizer_sharded"] for d in dps) if dps else opt["per_block"]
    sharded_fixed = 0.0
    fits = [fit_dp_scaling(d["by_blocks"], ("optimizer",)) for d in dps
            if len(d.get("by_blocks") or []) >= 2 and all("optimizer_total" in p for p in d["by_blocks"])]
    if fits:
        sharded, sharded_fixed = med(f["optimizer"][0] for f in fits), med(f["optimizer"][1] for f in fits)
    cal["optimizer_s_per_block"] = {"plain": opt["per_block"], "sharded": sharded}
    cal["optimizer_fixed_s"] = {"plain": opt["fixed"], "sharded": sharded_fixed}
    tps = [fit_optimizer(t["block"], t["deep"], int(t["deep_blocks"]), 0.0) for t in
           (r.get("tp_optimizer") for r in gathered) if t]
    if tps:
        cal["optimizer_s_per_block"]["tp"] = med(f["per_block"] for f in tps)
        cal["optimizer_fixed_s"]["tp"] = med(f["fixed"] for f in tps)
    if dps:
        cal["dp_collective_s"] = {"allgather": med(d["allgather"] for d in dps), "reduce": med(d["reduce"] for d in dps)}
        cal["dp_hook_s"] = {"fwd": med(d["hook_fwd"] for d in dps), "bwd": med(d["hook_bwd"] for d in dps)}
        fits = [fit_dp_scaling(d["by_blocks"]) for d in dps if len(d.get("by_blocks") or []) >= 2]
        if fits:   # per unit: the slope over stage depths; per stage: the rest (the last unit's tail)
            cal["dp_collective_s"] = {k: med(f[k][0] for f in fits) for k in ("allgather", "reduce")}
            cal["dp_collective_fixed_s"] = {k: med(f[k][1] for f in fits) for k in ("allgather", "reduce")}
        cal["allreduce_latency_s"] = med(d["allreduce_s"] for d in dps)
    if p2p is not None and spec.world_size > 1:
        cal["p2p_latency_s"] = p2p["latency_s"]
        wire = p2p["message_s"] - p2p["latency_s"]
        cal["bandwidth_efficiency"] = min(1.0, msg_bytes / (max(wire, 1e-9) * spec.bw(0, 1)))
    # The real two-stage pipeline's hop replaces the ping-pong latency (see measure_pipeline_hop).
    hops: List[float] = []
    by_schedule: Dict[str, List[float]] = {}
    for r in range(0, len(gathered) - 1, 2):
        a, b = gathered[r].get("pipeline_hop") or {}, gathered[r + 1].get("pipeline_hop") or {}
        fits = {k: fit_hop_delay(a[k], b[k]) for k in a if k in b and a[k]["stage"] == 0 and b[k]["stage"] == 1}
        if fits:   # the schedules measured their own; the others get the mean of their fits
            hops.append(statistics.fmean(fits.values()))
            for k, v in fits.items():
                by_schedule.setdefault(k, []).append(v)
    alone = (gathered[0].get("contention") or {}).get("alone_s")
    together = [r["contention"]["together_s"] for r in gathered if r.get("contention")]
    if alone and together and len(gathered) > 1:
        compute = med(together) / alone
        rounds = [r["contention"] for r in gathered if (r.get("contention") or {}).get("together_rounds_s")]
        n = min(len(r["together_rounds_s"]) for r in rounds) if rounds else 0
        if n and len(gathered[0]["contention"].get("alone_rounds_s") or []) >= n:
            # the ratio within each round (ranks' median), then the median over rounds
            tog = [med(r["together_rounds_s"][i] for r in rounds) for i in range(n)]
            compute = med(t / a for t, a in zip(tog, gathered[0]["contention"]["alone_rounds_s"]))
        cores = gathered[0]["contention"].get("cpu_cores")
        if cores:
            # The job's own ranks share the cores: at most ranks/cores slower (x CONTENTION_SLACK for
            # memory bandwidth). More than that is other jobs' load, which comes and goes: not the plan's.
            node = spec.devices[0].node
            local = sum(1 for d in spec.devices if d.node == node)
            compute = min(compute, max(1.0, local / cores) * CONTENTION_SLACK)
        # "paired" stays 1 (kept for readers of older calibrations): the pair micro-benchmarks run
        # on every pair at once, with every rank busy, so their figures need no scaling
        cal["contention_factor"] = {"compute": max(1.0, compute), "paired": 1.0}
    # The step's small all-reduces as a pipelined step pays them: on the rank that finishes last
    # (the first stage, under 1F1B and GPipe), after the pipeline (see measure_pipeline_hop).
    tails = [h for r in gathered for h in (r.get("pipeline_hop") or {}).values()
             if h and h.get("stage") == 0 and h.get("tail_allreduce_s") is not None]
    if tails:
        cal["allreduce_latency_s"] = med(h["tail_allreduce_s"] for h in tails)
        tied = [h["tail_tied_allreduce_s"] for h in tails if h.get("tail_tied_allreduce_s") is not None]
        if tied:
            cal["tied_allreduce_s"] = med(tied)
    if len(gathered) > 1 and all(r.get("allreduce") for r in gathered):
        one_clock = len({d.hostname for d in spec.devices}) == 1
        fits = fit_allreduce([r["allreduce"] for r in gathered], len(gathered), one_clock)
        if fits:
            cal["allreduce_by_ranks"] = fits
    tp_fits = fit_tensor_parallel([r.get("tensor_parallel") for r in gathered])
    if tp_fits:
        cal["tp_block_overhead_s"] = tp_fits
    if hops:
        lat = med(hops)
        cal["p2p_latency_s"] = lat
        cal["p2p_handshake_s"] = HANDSHAKE_LATENCIES * lat
        cal["p2p_latency_by_schedule_s"] = {k: med(v) for k, v in by_schedule.items()}
    return cal


def predict_plan(plan, meta, spec, train: Dict[str, Any]) -> Dict[str, Any]:
    """The simulator's step time, bubble and memory per rank for any plan the runtime runs
    (hrlplan.cost.plans.predict_any_plan: heterogeneous plans include the cross-replica reduce)."""
    from hrlplan.cost.plans import options_for_train, predict_any_plan

    r = predict_any_plan(plan, meta, spec, options_for_train(train))
    return {"step_time_s": r["step_time_s"], "bubble_fraction": r["bubble_fraction"],
            "memory_bytes_per_rank": r["memory_bytes_per_rank"], "breakdown": r["breakdown"]}


# ---------------------------------------------------------------- `hrlplan calibrate`
def _cli_worker(spec_dict: Dict[str, Any], arch: Dict[str, Any], train: Dict[str, Any], data: Dict[str, Any]):
    from hrlplan.cluster import ClusterSpec
    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker

    init_distributed(str(train.get("device", "auto")), train)
    prepare_worker()
    try:
        spec = calibrate_in_job(ClusterSpec.from_dict(spec_dict), arch, train, data)
        return spec.to_dict() if dist.get_rank() == 0 else None
    finally:
        shutdown()


def calibrate_cli(args) -> None:
    """Measure on this machine's workers (as many as the spec's first node lists) and write the spec."""
    from hrlplan.cluster import ClusterSpec, default_nproc_per_node
    from hrlplan.config import compose
    from hrlplan.model_meta import resolve_arch
    from hrlplan.search.instances import load_cluster
    from hrlplan.launch.local import launch_workers

    spec = load_cluster(args.cluster)
    arch = resolve_arch(args.model_id)
    cfg = compose([f"train.dtype={getattr(args, 'dtype', 'float32')}"])
    nproc = min(spec.node_sizes()[0], default_nproc_per_node("auto"))
    sub = ClusterSpec.from_dict(dict(spec.to_dict(), devices=[d.__dict__ for d in spec.devices[:nproc]],
                                     bandwidth=None if spec.bandwidth is None else [r[:nproc] for r in spec.bandwidth[:nproc]],
                                     latency=None if spec.latency is None else [r[:nproc] for r in spec.latency[:nproc]]))
    result = launch_workers(_cli_worker, (sub.to_dict(), arch, cfg["train"], cfg["data"]), nproc,
                            name="hrlplan-calibrate")[0]
    spec.calibration = result["calibration"]
    out = args.out or args.cluster
    spec.save(out)
    m = spec.calibration["measurements"]
    print(f"calibrated {spec.name} for {m['model']} in {m['dtype']}: compute_efficiency {spec.calibration['compute_efficiency']}, "
          f"half_saturation_tokens {spec.calibration['half_saturation_tokens']}, bandwidth_efficiency "
          f"{spec.calibration.get('bandwidth_efficiency', 'n/a')}, step_time_scale "
          f"{spec.calibration['step_time_scale']:.3g}; wrote {out}")
