"""Calibration's collective micro-benchmarks and their fits (hrlplan.runtime.calibrate.worker runs them).

- measure_data_parallel + fit_dp_scaling: FSDP2 over a pair of ranks (dp_collective_s,
  dp_collective_fixed_s, dp_hook_s, the sharded optimizer);
- measure_allreduce + fit_allreduce: all-reduces over groups of every size the world holds, every
  group at once, each rank arriving when its own work ends (allreduce_by_ranks);
- pool_allreduce_passes: passes of those run at different moments, pooled.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hrlplan.cluster import cpu_quota
from hrlplan.config import TrainConfig
from hrlplan.measure import least_squares_line, now, sync_device
from hrlplan.runtime.calibrate.blocks import REPEATS, block_stage
from hrlplan.runtime.parallel import clip_grad_norm
from hrlplan.runtime.trainer import make_optimizer

DP_SCALING_BLOCKS = (1, 4)   # stage depths measure_data_parallel also runs at (beside its default 2)


def measure_data_parallel(arch: Dict[str, Any], seq_len: int, train: TrainConfig, device: torch.device,
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
    plain, hidden = block_stage(arch, device, n_blocks)
    mbs = microbatch_size
    x = torch.randn(mbs, seq_len, hidden, device=device, requires_grad=True)
    pf, pb = _plain_times(plain, x, device, repeats)
    block = _fsdp_stage(arch, device, n_blocks, pair_group)
    params = [p for p in block.parameters() if p.requires_grad]
    opt = make_optimizer(block, train)
    t = _fsdp_step_times(block, x, params, opt, pair_group, device, repeats)
    batched = _batched_reduce_times(block, x, opt, pair_group, device, repeats)
    ar = _small_allreduce_times(pair_group, device, repeats)
    med = statistics.median
    n = float(n_blocks)
    clip_local = max(med(t["clip"]) - med(ar), 0.0)
    first_f, later_f, nosync_b, sync_b, opt_t = t["first_f"], t["later_f"], t["nosync_b"], t["sync_b"], t["opt"]
    return {"allgather": max(med(first_f) - med(later_f), 0.0) / n,
            "allgather_total": med(first_f) - med(later_f), "reduce_total": med(batched),
            "reduce_in_backward_total": med(sync_b) - med(nosync_b),
            "reduce": max(med(batched), 0.0) / n,
            "hook_fwd": max(med(later_f) - med(pf), 0.0) / n, "hook_bwd": max(med(nosync_b) - med(pb), 0.0) / n,
            "optimizer_sharded": (med(opt_t) + clip_local) / n, "optimizer_total": med(opt_t) + clip_local,
            "clip_s": med(t["clip"]), "allreduce_s": med(ar),
            "n_blocks": n_blocks, "microbatch_size": mbs, "bwd_plain_s": med(pb)}


def _plain_times(plain: torch.nn.Module, x: torch.Tensor, device: torch.device,
                 repeats: int) -> Tuple[List[float], List[float]]:
    """(forward s, backward s) per repeat of the bare blocks, after one untimed run."""
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
    return pf, pb


def _fsdp_stage(arch: Dict[str, Any], device: torch.device, n_blocks: int, pair_group):
    """The stage of `n_blocks` blocks sharded over the pair as the runtime shards it."""
    block, _ = block_stage(arch, device, n_blocks)
    mesh = DeviceMesh.from_group(pair_group, device.type)
    for child in getattr(block.base, block.blocks_attr).children():
        fully_shard(child, mesh=mesh, reshard_after_forward=False)
    fully_shard(block, mesh=mesh, reshard_after_forward=False)
    return block


def _fsdp_step_times(block, x: torch.Tensor, params, opt, pair_group, device: torch.device,
                     repeats: int) -> Dict[str, List[float]]:
    """Per repeat: the first and a later forward, a non-synchronising and a synchronising backward,
    clipping and the optimizer step of the sharded stage."""
    t: Dict[str, List[float]] = {k: [] for k in ("first_f", "later_f", "nosync_b", "sync_b", "clip", "opt")}
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
            for key, v in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                t[key].append(v)
    return t


def _batched_reduce_times(block, x: torch.Tensor, opt, pair_group, device: torch.device,
                          repeats: int) -> List[float]:
    """The runtime's pipeline schedules reduce as torch.distributed.pipelining's REDUCE_GRAD does: every
    backward without sync, then every unit's post-backward (reduce-scatter) issued back to back and one
    final wait -- the collectives overlap one another, so this, not a synchronising backward, is what a
    pipelined step pays. Its time per repeat."""
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
    return batched


def _small_allreduce_times(pair_group, device: torch.device, repeats: int) -> List[float]:
    """One-value all-reduces over the pair, each after a barrier."""
    small = torch.zeros(1, device=device)
    ar = []
    for i in range(3 * repeats + 1):
        dist.barrier(group=pair_group)
        t0 = now(device)
        dist.all_reduce(small, group=pair_group)
        if i:
            ar.append(now(device) - t0)
    return ar


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


CPU_PREFIX = "cpu/"   # measure_allreduce's keys of a member's process CPU time per all-reduce (CPU devices)


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
    quota = cpu_quota() if device.type == "cpu" else None
    share = quota[1] if quota and quota[1] < 1 else None

    def busy(span: Tuple[float, float]) -> None:
        t0, length = time.monotonic(), rng.uniform(*span)
        while time.monotonic() - t0 < length:
            work @ work
        if share is not None:
            # A worker under a CPU quota (cluster.cpu_shares) keeps to its share, as one in a step the
            # quota does not bind (where it binds, the simulator bounds the step by its CPU work over
            # the share). Busy throughout, it was throttled for up to (1 - share) x the CFS period
            # inside the timed all-reduces: at shares [1, 1/3, 1/3], 2.7 ms for 2 ranks and 5.2 ms for
            # 3 instead of 0.25 and 2.1, and a pp3 step's small all-reduces costed 13 ms, 2-4 ms measured.
            time.sleep(length * (1.0 / share - 1.0))

    out: Dict[str, Any] = {}
    for k, rank_lists, groups in partitions:
        mine = next((g for ranks, g in zip(rank_lists, groups) if rank in ranks and len(ranks) > 1), None)
        for values in ALLREDUCE_PAYLOAD_VALUES:
            buf = torch.zeros(values, device=device)
            times, cpu = [], []
            for i in range(repeats + 1):
                dist.barrier()
                busy(before_s)
                arrive, c0 = time.monotonic(), time.process_time()
                if mine is not None:
                    dist.all_reduce(buf, group=mine)
                sync_device(device)
                end, c1 = time.monotonic(), time.process_time()
                busy(after_s)
                if i:
                    times.append((arrive, end))
                    cpu.append(c1 - c0)
            out[f"{k}/{values * 4}"] = times
            if mine is not None and device.type == "cpu":
                out[f"{CPU_PREFIX}{k}/{values * 4}"] = cpu
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
        latency, slope = anchored_line(points)
        fits.append({"ranks": k, "latency_s": latency, "s_per_byte": slope})
    return fits


def anchored_line(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(intercept, slope), both >= 0, of (payload bytes, seconds) points: anchored at the smallest
    payload (a norm's or a loss's all-reduce, the most frequent), least squares over the larger ones."""
    (x0, y0), rest = points[0], points[1:]
    den = sum((x - x0) ** 2 for x, _ in rest)
    slope = max(sum((x - x0) * (y - y0) for x, y in rest) / den, 0.0) if den > 0 else 0.0
    return max(y0 - slope * x0, 0.0), slope


def fit_allreduce_cpu(measured: Dict[str, Any]) -> List[Dict[str, float]]:
    """[{ranks: k, cpu_s, cpu_s_per_byte}] per group size this rank all-reduced in (measure_allreduce's
    CPU keys): the process CPU time one all-reduce costs it, a line over the payloads through the
    medians. What a CPU quota meters of a collective, whatever the waits inside it (a blocked gloo
    wait costs no CPU: 0.05-0.07 ms for a 4-byte send whether the receiver waited 0 or 20 ms)."""
    sizes = sorted({int(key[len(CPU_PREFIX):].split("/")[0]) for key in measured if key.startswith(CPU_PREFIX)})
    fits = []
    for k in sizes:
        points = [(values * 4.0, statistics.median(measured[f"{CPU_PREFIX}{k}/{values * 4}"]))
                  for values in ALLREDUCE_PAYLOAD_VALUES if measured.get(f"{CPU_PREFIX}{k}/{values * 4}")]
        if points:
            cpu, per_byte = anchored_line(points)
            fits.append({"ranks": k, "cpu_s": cpu, "cpu_s_per_byte": per_byte})
    return fits
