"""A cheap, heterogeneity-aware step-time estimate for a high-level Config (no layer-split DP).

Every pipeline position runs at the pace of its slowest device, so a position is summarised by
its per-block busy time per micro-batch (compute at its slowest device's rate, TP all-reduces on
its rings), the extra work of the embedding / head it may carry, and the memory one block costs
it (static state + the activations its schedule keeps in flight). Blocks are then dealt out
min-max (each position up to what fits its memory), which gives the config's bottleneck and
fill/drain, and from them a step-time estimate with p2p and exposed DP synchronisation.

Unlike `exact.lower_bound` -- the whole work over the whole pool's summed throughput -- this
sees that a group mixing fast and slow devices runs at the slow one's pace, that a type holds
only as many blocks as its memory allows, and which device type ends up with the first stage's
deeper activation stash: what decides configurations on mixed-type pools. Positions with the
same device-type make-up, node span, tp, dp and micro-batch size share one cost evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hrlplan import schedules
from hrlplan.search.splits import in_flight

INF = float("inf")


@dataclass(frozen=True)
class Estimate:
    step_s: float          # estimated step time (inf: the model does not fit this config's memory)
    bottleneck_s: float    # busy time per micro-batch of the slowest position under the estimated split
    fill_s: float          # sum over positions of that busy time (the fill/drain)
    mem_ratio: float       # max over positions of needed / allowed memory for the estimated split
    imbalance: float       # bottleneck / the mean position busy time (1 = perfectly balanced)
    exposed_sync_s: float  # DP synchronisation left exposed after the last backward
    counts: Tuple[int, ...]  # blocks per pipeline position




class ConfigEstimator:
    def __init__(self, sim, space):
        self.sim, self.space = sim, space
        self.meta = sim.meta
        self.L = sim.meta.n_layer
        self._pos: Dict[tuple, tuple] = {}
        self._node = [d.node for d in sim.cluster.devices]
        self._name = [d.name for d in sim.cluster.devices]

    def _position(self, group: Sequence[int], tp: int, dp: int, mb: int, pp: int, first: bool, last: bool,
                  options: Optional[Dict[str, Any]] = None):
        """`options`: StageCostModel.stage's layout-wide keywords (SearchSpace.stage_options)."""
        options = dict(options or {})
        key = (tuple(sorted({self._name[d] for d in group})), min(self.sim.devices.flops[d] for d in group),
               len({self._node[d] for d in group}), tp, dp, mb, first, last, tuple(sorted(options.items())))
        hit = self._pos.get(key)
        if hit is not None:
            return hit
        costs, L = self.sim.costs, self.L
        links = self.sim.links(group, tp, dp)
        full = costs.stage(0, L, False, False, group, tp, dp, mb, pp, links=links, **options)
        base = costs.stage(0, 0, first, last, group, tp, dp, mb, pp, links=links, **options)
        limit = min(self.sim.devices.memory_limit(d, self.sim.opts.memory_margin) for d in group)
        empty = costs.stage(0, 0, False, False, group, tp, dp, mb, pp, links=links, **options)
        per_block = ((full.fwd + full.bwd) / L, (full.static_memory - empty.static_memory) / L,
                     full.activation / L, full.dp_sync / L, (full.optimizer - empty.optimizer) / L)
        extra = (base.fwd + base.bwd, base.static_memory, base.activation, base.dp_sync, base.optimizer)
        out = (per_block, extra, limit)
        self._pos[key] = out
        return out

    def estimate(self, c) -> Estimate:
        sim, space, L = self.sim, self.space, self.L
        groups = space.groups(c)
        pp, v = c.pp, c.stages_per_rank
        n = pp * v
        flight = in_flight(c.schedule, pp, v, c.num_microbatches)
        probe = space.layout(c, [(0, 0)] * n, recompute=("none",) * n)
        # Activations in flight per position: a position's blocks can sit in its least-stashed chunk
        # (each other chunk keeps one block), which is what a memory-aware split does.
        chunk_flight: List[List[float]] = [[] for _ in range(pp)]
        first_pos, last_pos = probe.stage_group(0), probe.stage_group(n - 1)
        for k in range(n):
            chunk_flight[probe.stage_group(k)].append(flight[k])
        pos_flight = np.array([min(f) for f in chunk_flight])
        other_chunks = np.array([sum(f) - min(f) for f in chunk_flight])
        b = np.zeros(pp)        # busy per block
        s = np.zeros(pp)        # static bytes per block
        a = np.zeros(pp)        # activation bytes per block (per micro-batch)
        sync = np.zeros(pp)     # dp sync per block
        fixed_t = np.zeros(pp)
        fixed_m = np.zeros(pp)
        fixed_sync = np.zeros(pp)
        opt = np.zeros(pp)      # optimizer step per block (uncalibrated GPUs: its bytes at HBM)
        fixed_opt = np.zeros(pp)
        limit = np.zeros(pp)
        for g in range(pp):
            options = space.stage_options(c)
            per, extra, lim = self._position(groups[g], c.tp, c.dp, c.microbatch_size, pp, g == first_pos,
                                             g == last_pos, options)
            b[g], s[g], a[g], sync[g] = per[0], per[1], per[2], per[3]
            fixed_t[g] = extra[0]
            fixed_m[g] = extra[1] + (flight[n - 1] * extra[2] if g == last_pos else 0.0) + other_chunks[g] * per[2]
            fixed_sync[g] = extra[3]
            opt[g], fixed_opt[g] = per[4], extra[4]
            limit[g] = lim
        per_block_mem = s + pos_flight * a
        with np.errstate(divide="ignore", invalid="ignore"):
            cap = np.floor(np.where(per_block_mem > 0, (limit - fixed_m) / per_block_mem, L))
        cap = np.minimum(cap, L - v * (pp - 1))
        if np.any(cap < v) or cap.sum() < L:
            ratio = float(np.max((fixed_m + v * per_block_mem) / limit))
            need = float((L * per_block_mem.mean() + fixed_m.sum()) / limit.sum())
            return Estimate(INF, INF, INF, max(ratio, need, 1.0 + 1e-6), INF, 0.0, tuple([0] * pp))
        counts = self._deal(b, fixed_t, cap, v)
        busy = counts * b + fixed_t
        bottleneck = float(busy.max())
        fill = float(busy.sum())
        m = c.num_microbatches
        msg = sim.costs.activation_message(c.microbatch_size, c.tp if space.sequence_parallel(c) else 1)
        send = 0.0
        for g in range(pp - 1):
            send = max(send, sim.costs.p2p(groups[g], groups[g + 1], msg, c.schedule))
        share = schedules.get(c.schedule, v).idle_share_of_1f1b(pp, m, v)   # of the fill/drain, as 1F1B's
        bubble = share * max(fill - bottleneck, 0.0)
        step = m * bottleneck + bubble + 2 * (n - 1) * send
        syncs = counts * sync + fixed_sync
        last_b = (2.0 / 3.0) * busy / v
        exposed = np.maximum(syncs - (last_b if sim.opts.dp_overlap else 0.0), 0.0)
        step += float(exposed.max()) + float((counts * opt + fixed_opt).max())
        mem = (counts * per_block_mem + fixed_m) / limit
        scale = sim.devices.time_scale
        return Estimate(step * scale, bottleneck * scale, fill * scale, float(mem.max()),
                        bottleneck / max(fill / pp, 1e-30), float(exposed.max()) * scale,
                        tuple(int(x) for x in counts))

    def _deal(self, b: np.ndarray, fixed: np.ndarray, cap: np.ndarray, v: int) -> np.ndarray:
        """Min-max integer block counts (>= v each, <= cap each, summing to L) for busy = n*b + fixed."""
        L, pp = self.L, len(b)
        counts = np.full(pp, v, dtype=float)
        if pp == 1:
            return np.array([float(L)])
        # Binary search on the bottleneck, then hand out what is left by the least resulting busy time.
        lo = float(np.max(counts * b + fixed))
        hi = float(np.max(cap * b + fixed))
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            with np.errstate(divide="ignore", invalid="ignore"):
                k = np.where(b > 0, np.floor((mid - fixed) / b), cap)
            k = np.clip(k, v, cap)
            if k.sum() >= L:
                hi = mid
            else:
                lo = mid
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.where(b > 0, np.floor((hi - fixed) / b), cap)
        counts = np.clip(k, v, cap)
        surplus = int(counts.sum() - L)
        while surplus > 0:  # take blocks back from the busiest positions
            busy = np.where(counts > v, counts * b + fixed, -INF)
            g = int(np.argmax(busy))
            counts[g] -= 1
            surplus -= 1
        return counts


def estimates(sim, space, configs) -> List[Estimate]:
    est = ConfigEstimator(sim, space)
    return [est.estimate(c) for c in configs]
