"""Calibration's communication micro-benchmarks and their fits (hrlplan.runtime.calibrate runs them).

- measure_p2p: a ping-pong between ranks 0 and 1 (bandwidth_efficiency);
- measure_pipeline_hop + fit_hop_delay: a real two-stage torch pipeline (p2p_latency_s,
  p2p_handshake_s) and the small all-reduces a step makes after it (allreduce_latency_s,
  tied_allreduce_s);
- measure_data_parallel + fit_dp_scaling: FSDP2 over a pair of ranks (dp_collective_s,
  dp_collective_fixed_s, dp_hook_s, the sharded optimizer);
- measure_tensor_parallel + fit_tensor_parallel: stages of 1 and 6 blocks sharded over tp=2 beside
  the whole ones (tp_block_overhead_s, per block);
- measure_allreduce + fit_allreduce: all-reduces over groups of every size the world holds, every
  group at once, each rank arriving when its own work ends (allreduce_by_ranks);
- pool_hop_passes, pool_allreduce_passes: passes of those run at different moments, pooled.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

REPEATS = 5
DP_SCALING_BLOCKS = (1, 4)   # stage depths measure_data_parallel also runs at (beside its default 2)


def block_stage(arch: Dict[str, Any], device: torch.device, n_blocks: int = 1):
    """A stage of `n_blocks` blocks of the model (no embedding, no head), on `device`."""
    from hrlplan.models.hf import HFStage, build_hf_model, hf_config_from_arch

    config = hf_config_from_arch(arch)
    config.num_hidden_layers = n_blocks   # GPT-2 maps n_layer onto this; only these blocks are built
    torch.manual_seed(0)
    model = build_hf_model(config)
    return HFStage(model, 0, n_blocks, first=False, last=False).to(device), int(config.hidden_size)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """The calibration's one clock: perf_counter after the device's queued work has finished (on
    CUDA a bare perf_counter times kernel launches, not kernels)."""
    sync_device(device)
    return time.perf_counter()


def timed(fn, device: torch.device, warmup: int = 0) -> float:
    """Seconds one call of fn takes on device, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    t0 = now(device)
    fn()
    return now(device) - t0


def timed_forward_backward(block: torch.nn.Module, x: torch.Tensor, device: torch.device) -> Tuple[float, float]:
    """(forward s, backward s) of one run of `block` on `x`, the device synchronised around each."""
    sync_device(device)
    t0 = now(device)
    y = block(x)
    sync_device(device)
    t1 = now(device)
    y.backward(torch.ones_like(y))
    sync_device(device)
    return t1 - t0, now(device) - t1


def measure_p2p(nbytes: int, device: torch.device, repeats: int = 10) -> Optional[Dict[str, float]]:
    """Collective. Ranks 0 and 1 ping-pong a tiny and an activation-sized message; rank 0 gets the
    one-way times {latency_s, message_s}."""
    from hrlplan.cluster import _ping_pong

    rank = dist.get_rank()
    result = None
    if rank in (0, 1) and dist.get_world_size() > 1:
        bw, lat = _ping_pong(rank, 1 - rank, sorted({1, nbytes}), repeats, device)
        result = {"latency_s": lat, "message_s": lat + nbytes / bw}
    dist.barrier()
    return result


def measure_pipeline_hop(arch: Dict[str, Any], seq_len: int, device: torch.device, pair_group, pair: List[int],
                         m: int = 4, microbatch_size: int = 1, n_blocks: int = 1, schedule: str = "1f1b",
                         repeats: int = REPEATS, tied_numel: int = 0) -> Optional[Dict[str, Any]]:
    """Collective over `pair_group` (ranks `pair`): a real two-stage torch.distributed.pipelining
    pipeline, an `n_blocks`-block stage on each rank, one step of `m` micro-batches per repeat.
    Each rank returns its stage's median recorded forward / backward span and the span of its
    operations in each step (first start to last end). fit_hop_delay turns the first stage's span
    into the per-hop delay (p2p_latency_s) that makes the simulator's timeline end when the real one
    did: the send/recv batching, gloo's rendezvous and the waits of torch's schedule, which a
    ping-pong of a tiny message does not see. After each step, the small all-reduces a training step
    then makes (a tied embedding's gradient of `tied_numel` values, the gradient norm, the loss) are
    timed as they run there -- one rank arriving late, the other woken from a wait -- which costs
    several times an all-reduce between two ranks that have just met at a barrier."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from hrlplan.runtime.timing import StepRecorder, instrument_pipeline_stage

    me = pair.index(dist.get_rank())
    block, hidden = block_stage(arch, device, n_blocks)
    recorder = StepRecorder(device)
    stage = PipelineStage(block, me, 2, device, group=pair_group)
    instrument_pipeline_stage(stage, recorder, me)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=lambda out, target: out.float().pow(2).mean())
    torch.manual_seed(1)
    x = torch.randn(m * microbatch_size, seq_len, hidden, device=device)
    target = torch.zeros(m * microbatch_size, device=device)
    spans, fwd, bwd, steps, tied_t, small_t = [], [], [], [], [], []
    tied, small = torch.zeros(max(tied_numel, 1), device=device), torch.zeros(1, device=device)
    for i in range(repeats + 2):   # two warm-up steps: shape inference, buffers, connections
        block.zero_grad(set_to_none=True)
        dist.barrier(group=pair_group)
        recorder.begin()
        t0 = now(device)
        if me == 0:
            sched.step(x)
        else:
            sched.step(target=target, losses=[])
        t1 = now(device)
        if tied_numel:
            dist.all_reduce(tied, group=pair_group)
        t2 = now(device)
        dist.all_reduce(small, group=pair_group)
        dist.all_reduce(small, group=pair_group)
        t3 = now(device)
        if i >= 2 and recorder.events:
            tied_t.append(t2 - t1)
            small_t.append((t3 - t2) / 2)
            ev = recorder.events
            spans.append(max(e["end_s"] for e in ev) - min(e["start_s"] for e in ev))
            fwd += [e["end_s"] - e["start_s"] for e in ev if e["kind"] == "F"]
            bwd += [e["end_s"] - e["start_s"] for e in ev if e["kind"] == "B"]
            steps.append(t1 - t0)
            last_events = list(ev)
    dist.barrier(group=pair_group)
    return {"stage": me, "schedule": schedule, "m": m, "microbatch_size": microbatch_size, "n_blocks": n_blocks,
            "fwd_all": fwd, "bwd_all": bwd, "spans_s": spans, "steps_all": steps, "tail_all": small_t,
            "tail_tied_all": tied_t if tied_numel else None,
            "events": [(e["kind"], e["microbatch"], round(e["start_s"] * 1e3, 3), round(e["end_s"] * 1e3, 3))
                       for e in last_events]}


def pool_hop_passes(passes: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One rank's measure_pipeline_hop passes (same settings, run at different moments of the
    calibration) pooled into medians: another tenant's burst of load inflates one pass, not the
    median of them all."""
    med = statistics.median
    pooled = {k: passes[-1][k] for k in ("stage", "schedule", "m", "microbatch_size", "n_blocks", "events")}
    raw = {k: [x for p in passes for x in (p[k] or [])] for k in
           ("fwd_all", "bwd_all", "spans_s", "steps_all", "tail_all", "tail_tied_all")}
    pooled.update(fwd_s=med(raw["fwd_all"]), bwd_s=med(raw["bwd_all"]), span_s=med(raw["spans_s"]),
                  spans_s=raw["spans_s"], step_s=med(raw["steps_all"]), tail_allreduce_s=med(raw["tail_all"]),
                  tail_tied_allreduce_s=med(raw["tail_tied_all"]) if raw["tail_tied_all"] else None)
    return pooled


TP_DEPTHS = (1, 6)   # blocks per stage measure_tensor_parallel shards: the overhead per block is the slope


def measure_tensor_parallel(arch: Dict[str, Any], seq_len: int, microbatch_sizes: List[int], device: torch.device,
                            pair_group, repeats: int = 3 * REPEATS) -> Optional[List[Dict[str, float]]]:
    """Collective over `pair_group`: stages of TP_DEPTHS blocks as the runtime shards them over tp=2
    (tensor_parallel.parallelize_stage: DTensor, an all-reduce per half in forward and in backward)
    beside the same stages whole, alternating, on both ranks at once, per micro-batch size.
    fit_tensor_parallel turns them into what tp costs per block beyond half the block's compute:
    the all-reduces, and DTensor's dispatch, which on CPU outweighs the halved matmuls. Two depths,
    because a block costs more inside a deeper stage than alone (measured on gpt2-tiny: 9.2 ms
    beyond half the block alone, 10.5-11.5 ms per block of a 6-block stage; the slope over 1 and 2
    blocks, 10.6 ms). 1 and 6 blocks here: runs a few seconds apart gave slopes of 4.5-7.6 ms over
    1 and 3 blocks, 5.0-6.5 ms over 1 and 6 (512 tokens, 15 repeats). None when the model cannot be
    sharded over 2 (heads not divisible, an architecture without a tp plan)."""
    from torch.distributed.device_mesh import DeviceMesh

    from hrlplan.runtime.tensor_parallel import parallelize_stage

    mesh = DeviceMesh.from_group(pair_group, device.type, mesh_dim_names=("tp",))
    stages = []
    for n_blocks in TP_DEPTHS:
        plain, hidden = block_stage(arch, device, n_blocks)
        sharded, _ = block_stage(arch, device, n_blocks)
        try:
            parallelize_stage(sharded, mesh)
        except (ValueError, NotImplementedError):
            return None
        stages.append((n_blocks, plain, sharded))

    out = []
    for mbs in microbatch_sizes:
        torch.manual_seed(2)   # tp ranks hold the same (replicated) block input
        x = torch.randn(mbs, seq_len, hidden, device=device, requires_grad=True)
        times: Dict[int, Dict[str, List[float]]] = {
            n: {"plain_fwd_s": [], "plain_bwd_s": [], "tp_fwd_s": [], "tp_bwd_s": []} for n in TP_DEPTHS}
        for i in range(repeats + 1):   # the first run pays for allocation
            for n_blocks, plain, sharded in stages:
                pf, pb = timed_forward_backward(plain, x, device)
                dist.barrier(group=pair_group)
                tf, tb = timed_forward_backward(sharded, x, device)
                if i:
                    for key, t in zip(times[n_blocks], (pf, pb, tf, tb)):
                        times[n_blocks][key].append(t)
        out.append({"tokens": mbs * seq_len,
                    "depths": [{"n_blocks": n, **{k: statistics.median(v) for k, v in times[n].items()}}
                               for n in TP_DEPTHS]})
    return out


def fit_tensor_parallel(measured: Sequence[Optional[List[Dict[str, Any]]]]) -> List[Dict[str, float]]:
    """[{tokens, fwd, bwd}]: what one more block of a tp=2 stage costs in forward / backward beyond
    half its whole compute -- the slope over the stage depths measured -- the median over the ranks
    that measured it, smoothed by a least-squares line over the micro-batch sizes (>= 0). [] when
    none did. The line, because each size's figure is a difference of differences: with 4 ranks on
    2 cores one size once measured 5.8 ms between 7.9 and 8.5 ms, and pp2 x tp2, costed between
    two sizes, was predicted 12% fast."""
    runs = [m for m in measured if m]
    if not runs:
        return []
    med = statistics.median

    def beyond_half(depth: Dict[str, float], part: str) -> float:
        return depth[f"tp_{part}_s"] - depth[f"plain_{part}_s"] / 2

    def slope(point: Dict[str, Any], part: str) -> float:
        lo, hi = point["depths"][0], point["depths"][-1]
        return (beyond_half(hi, part) - beyond_half(lo, part)) / (hi["n_blocks"] - lo["n_blocks"])

    tokens = [float(p["tokens"]) for p in runs[0]]
    fits = {part: _line_through(tokens, [med(slope(r[i], part) for r in runs) for i in range(len(tokens))])
            for part in ("fwd", "bwd")}
    return [{"tokens": p["tokens"], **{part: max(fits[part][i], 0.0) for part in fits}}
            for i, p in enumerate(runs[0])]


def least_squares_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points; xs must not all be equal."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def _line_through(xs: List[float], ys: List[float]) -> List[float]:
    """The least-squares line's values at xs (ys as they are with fewer than 3 distinct xs)."""
    if len(set(xs)) < 3:
        return list(ys)
    slope, intercept = least_squares_line(xs, ys)
    return [slope * x + intercept for x in xs]


HOP_SCHEDULES = ("1f1b", "gpipe")   # they wait for their messages at different points
HANDSHAKE_LATENCIES = 2.0   # a rendezvous receive posted after its send: notice to the sender, data back


def fit_hop_delay(first: Dict[str, Any], second: Dict[str, Any], handshake: float = HANDSHAKE_LATENCIES) -> float:
    """The one-way point-to-point delay l with which the simulator's two-stage timeline (the
    stages' measured forward / backward spans, messages arriving l after a late send and a receive
    posted after its send waiting `handshake` x l) ends when the first stage's measured operations
    did (bisection: the makespan does not decrease as l grows). 0 when the timeline without delay
    is already as long."""
    from hrlplan.cost.timeline import simulate_timeline

    m, schedule = int(first["m"]), str(first["schedule"])
    fwd, bwd = [first["fwd_s"], second["fwd_s"]], [first["bwd_s"], second["bwd_s"]]

    def makespan(lat: float) -> float:
        return simulate_timeline(schedule, 2, 1, m, fwd, bwd, [0.0, 0.0], [lat, 0.0], [lat, 0.0],
                                 [0.0, 0.0], recv_handshake=[handshake * lat] * 2).end[0]

    target = float(first["span_s"])
    if makespan(0.0) >= target:
        return 0.0
    lo, hi = 0.0, target
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if makespan(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_pipeline_compute(hops: Sequence[Dict[str, Any]], alone: Sequence[Dict[str, Any]], seq_len: int,
                         op_overhead: Dict[str, float], contention: float) -> float:
    """How much longer a block's forward + backward takes inside the real two-stage pipeline
    (measure_pipeline_hop's recorded spans, less the per-op overhead costed apart) than the same block
    timed alone at the same size, beyond what `contention` (contention_factor's compute) already
    explains; the median over the hop pipelines, at least 1. Why: on a loaded 2-core VM the blocks
    of a 2-rank pipeline ran 1.0-1.65x their time alone from one calibration to the next, and the
    pipelines' step times moved with it, while contention_factor (a loop of one block on every rank,
    capped at the job's own ranks per core) read 1.0-1.15. On the same runs of three benches this
    factor took the median |error| of the calibrated step times from 12.4/14.2/22.5% to
    3.0/13.7/13.1%. (Timing the block outside the pipeline right before it, both ranks at once,
    read about 1.0: the slowdown is the two ranks computing at once, which the contention loop
    under-reads, more than anything torch's pipeline adds.)"""
    by_tokens = {int(a["tokens"]): a for a in alone}
    ratios = []
    for h in hops:
        a = by_tokens.get(int(h["microbatch_size"]) * seq_len)
        if a is not None and a["fwd_s"] + a["bwd_s"] > 0:
            inside = h["fwd_s"] - op_overhead.get("fwd", 0.0) + h["bwd_s"] - op_overhead.get("bwd", 0.0)
            ratios.append(inside / (a["fwd_s"] + a["bwd_s"]))
    return max(1.0, statistics.median(ratios) / max(contention, 1.0)) if ratios else 1.0


def measure_data_parallel(arch: Dict[str, Any], seq_len: int, train: Dict[str, Any], device: torch.device,
                          pair_group, repeats: int = REPEATS, n_blocks: int = 2,
                          microbatch_size: int = 1) -> Dict[str, float]:
    """FSDP2 over a pair of ranks on an `n_blocks`-block stage, wrapped as the runtime wraps stages
    (fully_shard per block, reshard_after_forward=False). Per unit (block), the step's time divided
    by the blocks, so what FSDP overlaps between blocks is not counted twice: the all-gather (first
    forward minus a later one), the gradient reduce-scatters (issued back to back after a
    non-synchronising backward, as the pipeline schedule's REDUCE_GRAD issues them; a synchronising
    backward minus a non-synchronising one is kept as reduce_in_backward_total), the hooks' overhead per forward / backward (vs the bare blocks), the
    sharded optimizer step with clipping's local part; and one small all-reduce. Clipping's
    all-reduce of the norm is timed apart (the trainer makes it once per step, not per block)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from hrlplan.runtime.parallel import clip_grad_norm
    from hrlplan.runtime.trainer import make_optimizer

    plain, hidden = block_stage(arch, device, n_blocks)
    mbs = microbatch_size
    x = torch.randn(mbs, seq_len, hidden, device=device, requires_grad=True)
    pf, pb = [], []
    for i in range(repeats + 1):
        t0 = now(device)
        y = plain(x)
        t1 = now(device)
        y.backward(torch.ones_like(y))
        t2 = now(device)
        if i:
            pf.append(t1 - t0)
            pb.append(t2 - t1)
    block, _ = block_stage(arch, device, n_blocks)
    mesh = DeviceMesh.from_group(pair_group, device.type)
    for child in getattr(block.base, block.blocks_attr).children():
        fully_shard(child, mesh=mesh, reshard_after_forward=False)
    fully_shard(block, mesh=mesh, reshard_after_forward=False)
    params = [p for p in block.parameters() if p.requires_grad]
    opt = make_optimizer(block, train)
    first_f, later_f, nosync_b, sync_b, clip_t, opt_t = [], [], [], [], [], []
    for i in range(repeats + 1):
        opt.zero_grad(set_to_none=True)
        dist.barrier(group=pair_group)
        block.set_requires_gradient_sync(False)
        t0 = now(device)
        y1 = block(x)
        t1 = now(device)
        y2 = block(x)
        t2 = now(device)
        y1.backward(torch.ones_like(y1))
        t3 = now(device)
        block.set_requires_gradient_sync(True)
        block.set_is_last_backward(True)
        y2.backward(torch.ones_like(y2))
        t4 = now(device)
        clip_grad_norm(params, 1.0, None, [])
        t5 = now(device)
        opt.step()
        t6 = now(device)
        block.reshard()
        if i:
            first_f.append(t1 - t0)
            later_f.append(t2 - t1)
            nosync_b.append(t3 - t2)
            sync_b.append(t4 - t3)
            clip_t.append(t5 - t4)
            opt_t.append(t6 - t5)
    # The runtime's pipeline schedules reduce as torch.distributed.pipelining's REDUCE_GRAD does: every
    # backward without sync, then every unit's post-backward (reduce-scatter) issued back to back and one
    # final wait -- the collectives overlap one another, so this, not a synchronising backward, is what a
    # pipelined step pays.
    batched = []
    for i in range(repeats + 1):
        opt.zero_grad(set_to_none=True)
        block.set_is_last_backward(False)
        block.set_reshard_after_backward(False)
        block.set_requires_gradient_sync(False)
        y = block(x)
        y.backward(torch.ones_like(y))
        dist.barrier(group=pair_group)
        t0 = now(device)
        block.set_is_last_backward(True)
        block.set_reshard_after_backward(True)
        block.set_requires_gradient_sync(True)
        state = fully_shard.state(block)
        for st in state._state_ctx.all_states:
            for group in st._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        if i:
            batched.append(now(device) - t0)
        block.reshard()
    small = torch.zeros(1, device=device)
    ar = []
    for i in range(3 * repeats + 1):
        dist.barrier(group=pair_group)
        t0 = now(device)
        dist.all_reduce(small, group=pair_group)
        if i:
            ar.append(now(device) - t0)
    med = statistics.median
    n = float(n_blocks)
    clip_local = max(med(clip_t) - med(ar), 0.0)
    return {"allgather": max(med(first_f) - med(later_f), 0.0) / n,
            "allgather_total": med(first_f) - med(later_f), "reduce_total": med(batched),
            "reduce_in_backward_total": med(sync_b) - med(nosync_b),
            "reduce": max(med(batched), 0.0) / n,
            "hook_fwd": max(med(later_f) - med(pf), 0.0) / n, "hook_bwd": max(med(nosync_b) - med(pb), 0.0) / n,
            "optimizer_sharded": (med(opt_t) + clip_local) / n, "optimizer_total": med(opt_t) + clip_local,
            "clip_s": med(clip_t), "allreduce_s": med(ar),
            "n_blocks": n_blocks, "microbatch_size": mbs, "bwd_plain_s": med(pb)}


def fit_dp_scaling(points: List[Dict[str, float]],
                   keys: Sequence[str] = ("allgather", "reduce")) -> Dict[str, Tuple[float, float]]:
    """{allgather|reduce: (per unit s, per stage s)}: a least-squares line through the exposed time of
    a stage's FSDP collectives vs its number of blocks (both parts >= 0). The slope is what one more
    unit adds once the others' collectives overlap its compute; the intercept the stage's exposed tail.
    keys=("optimizer",): the sharded optimizer's per-block and per-call time the same way."""
    xs = [float(p["n_blocks"]) for p in points]
    out = {}
    for k in keys:
        ys = [max(float(p[f"{k}_total"]), 0.0) for p in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        spread = len(set(xs)) > 1
        slope = max(least_squares_line(xs, ys)[0] if spread else my / max(mx, 1.0), 0.0)
        fixed = max(my - slope * mx, 0.0)
        if fixed == 0.0 and spread:   # line through the origin
            slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        out[k] = (slope, fixed)
    return out


ALLREDUCE_PAYLOAD_VALUES = (1, 8192, 131072)   # float32 values: a norm or loss, a small model's gradient bucket, a larger one


def allreduce_partitions(world: int) -> List[Tuple[int, List[List[int]]]]:
    """(k, the world cut into consecutive groups of k ranks, the rest in a last smaller group) for
    every group size k from 2 to the world."""
    return [(k, [list(range(s, min(s + k, world))) for s in range(0, world, k)]) for k in range(2, world + 1)]


def measure_allreduce(device: torch.device, partitions: List[Tuple[int, List[List[int]], List[Any]]],
                      repeats: int = 3 * REPEATS, before_s: Tuple[float, float] = (0.5e-3, 3e-3),
                      after_s: Tuple[float, float] = (1e-3, 4e-3)) -> Dict[str, Any]:
    """Collective. For each (k, rank lists, their groups): every group all-reduces at once, for each
    payload of ALLREDUCE_PAYLOAD_VALUES, between busy work of random lengths: ranks reach a step's
    collectives as their own pipeline ends, and go on to clipping, the optimizer and the next step
    as soon as theirs returns. Each rank returns its arrival and end times (time.monotonic: one
    clock for every process of a host) per repeat; fit_allreduce turns them into the time from the
    last member's arrival to the last member's end. With more ranks than cores that is far above a
    pair's figure: a ring's every step waits for a member to be scheduled, while members that are
    done already compete for the cores."""
    rank = dist.get_rank()
    rng = random.Random(1000 + rank)
    work = torch.randn(96, 96, device=device)

    def busy(span: Tuple[float, float]) -> None:
        t0, length = time.monotonic(), rng.uniform(*span)
        while time.monotonic() - t0 < length:
            work @ work

    out: Dict[str, Any] = {}
    for k, rank_lists, groups in partitions:
        mine = next((g for ranks, g in zip(rank_lists, groups) if rank in ranks and len(ranks) > 1), None)
        for values in ALLREDUCE_PAYLOAD_VALUES:
            buf = torch.zeros(values, device=device)
            times = []
            for i in range(repeats + 1):
                dist.barrier()
                busy(before_s)
                arrive = time.monotonic()
                if mine is not None:
                    dist.all_reduce(buf, group=mine)
                sync_device(device)
                end = time.monotonic()
                busy(after_s)
                if i:
                    times.append((arrive, end))
            out[f"{k}/{values * 4}"] = times
    dist.barrier()
    return out


def pool_allreduce_passes(passes: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """measure_allreduce passes run at different moments of the calibration, their repeats in one
    list per key (every rank ran the same passes, so repeat i still lines up across ranks)."""
    return {key: [t for p in passes for t in p[key]] for key in passes[0]}


def fit_allreduce(gathered: Sequence[Dict[str, Any]], world: int, one_clock: bool) -> List[Dict[str, float]]:
    """[{ranks: k, latency_s, s_per_byte}] per group size, from measure_allreduce on every rank: per
    repeat the time from the first group's last arrival to its last member's end (one_clock: the
    ranks share a host's clock; otherwise the quickest member's own time, which is the last to
    arrive's), the median over repeats per payload, then a line through the smallest payload's
    point, least squares over the others (both parts >= 0)."""
    fits = []
    for k, rank_lists in allreduce_partitions(world):
        members = rank_lists[0]
        points = []
        for values in ALLREDUCE_PAYLOAD_VALUES:
            key = f"{k}/{values * 4}"
            runs = [(gathered[r] or {}).get(key) for r in members]
            if any(run is None for run in runs):
                return []
            per_repeat = []
            for i in range(min(len(run) for run in runs)):
                arrive = [run[i][0] for run in runs]
                end = [run[i][1] for run in runs]
                per_repeat.append(max(end) - max(arrive) if one_clock
                                  else min(e - a for a, e in zip(arrive, end)))
            points.append((values * 4.0, max(statistics.median(per_repeat), 0.0)))
        # anchored at the smallest payload (a norm's or a loss's all-reduce, the most frequent): a
        # line through it, least squares over the larger ones
        (x0, y0), rest = points[0], points[1:]
        den = sum((x - x0) ** 2 for x, _ in rest)
        slope = max(sum((x - x0) * (y - y0) for x, y in rest) / den, 0.0) if den > 0 else 0.0
        fits.append({"ranks": k, "latency_s": max(y0 - slope * x0, 0.0), "s_per_byte": slope})
    return fits
