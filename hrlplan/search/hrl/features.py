"""Instance-relative features, so that one policy can plan models and clusters it never saw.

Every feature is a ratio or a logarithm relative to the instance (the best lower bound, the
slowest device, the ideal balanced stage time), never an absolute size.
"""
from __future__ import annotations

import math
import numpy as np

from hrlplan.cost.model import STATE_BYTES_PER_PARAM
from hrlplan.search.exact import lower_bound
from hrlplan.search.splits import in_flight

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
OFFSETS = tuple(range(-8, 9))         # low-level action: boundary offset from the speed-proportional target
INSTANCE_DIM = 10
CONFIG_DIM = 12
STEP_DIM = 6
OFFSET_DIM = 4


def instance_features(sim, space) -> np.ndarray:
    meta, cluster = sim.meta, sim.cluster
    flops = [sim.devices.flops[d] for d in range(cluster.world_size)]
    mem = sum(d.memory_bytes for d in cluster.devices)
    sched = [1.0 if s == space.schedules[0] else 0.0 for s in SCHEDULES]
    return np.array([
        math.log10(max(meta.total_params, 1)) / 11.0,
        meta.n_layer / 100.0,
        math.log2(cluster.world_size) / 10.0,
        len(cluster.device_types()) / 3.0,
        math.log2(space.global_batch) / 11.0,
        min(meta.total_params * STATE_BYTES_PER_PARAM / mem, 2.0),
        math.log(max(flops) / min(flops)),
    ] + sched[:3], dtype=np.float32)


def config_features(sim, space, configs) -> np.ndarray:
    meta = sim.meta
    bounds = np.array([lower_bound(sim, space, c) for c in configs])
    best = bounds.min()
    rows = []
    for c, lb in zip(configs, bounds):
        groups = space.groups(c)
        speed = [min(sim.devices.flops[d] for d in g) for g in groups]
        bubble = (c.pp - 1) / (c.num_microbatches + c.pp - 1)
        mem = min(sim.devices.memory_limit(d, sim.opts.memory_margin) for g in groups for d in g)
        shards = c.pp * c.tp * (c.dp if sim.opts.dp_mode == "fsdp" else 1)
        states = meta.total_params * STATE_BYTES_PER_PARAM / shards
        act = (c.microbatch_size * meta.seq_len * sum(meta.block_activation_bytes_per_token) * meta.block_repeats
               * sim.opts.bytes_per_value / 2 / (c.pp * c.tp)) * max(in_flight(c.schedule, c.pp, c.stages_per_rank,
                                                                              c.num_microbatches))
        rows.append([
            math.log2(c.pp) / 6, math.log2(c.tp) / 3, math.log2(c.dp) / 8, math.log2(c.microbatch_size) / 5,
            math.log2(c.num_microbatches) / 8, bubble, math.log(lb / best), math.log(lb * (1 + bubble) / best),
            c.pool.size() / sim.cluster.world_size, math.log(speed[0] / speed[-1]),
            min((states + act) / mem, 4.0), 1.0 if c.schedule == space.schedules[0] else 0.0,
        ])
    return np.array(rows, dtype=np.float32)


class StageGuide:
    """Boundary hints for the low-level policy. The hint for stage k is the furthest boundary that
    keeps it within the config's least achievable bottleneck (greedy packing under the min-max
    value, which is a min-max-optimal split); without one, the group's throughput share of the
    remaining work. The policy learns how far to move off the hint (fill/drain, memory, head)."""

    def __init__(self, sim, tables):
        self.tables = tables
        self.L, self.n = tables.L, tables.n
        self.prefix = np.asarray(sim.costs._pf_arr)
        rates = []
        for k in range(self.n):
            g = tables.groups[tables.stage_group[k]]
            rates.append(1.0 / max(sim.costs.stage(0, self.L, False, False, g, tables.config.tp, tables.config.dp,
                                                   tables.config.microbatch_size, tables.config.pp).fwd, 1e-30))
        self.rates = np.array(rates)
        self.bottleneck = tables.minmax()

    def target(self, k: int, start: int) -> int:
        if np.isfinite(self.bottleneck):
            row = self.tables.time[k, start, :self.L - (self.n - 1 - k) + 1]
            fit = np.nonzero(row <= self.bottleneck * (1 + 1e-9))[0]
            if fit.size:
                return int(fit.max())
        remaining_work = self.prefix[self.L] - self.prefix[start]
        share = self.rates[k] / self.rates[k:].sum()
        goal = self.prefix[start] + share * remaining_work
        b = int(np.searchsorted(self.prefix, goal))
        if b > start + 1 and abs(self.prefix[b - 1] - goal) < abs(self.prefix[b] - goal):
            b -= 1
        return b

    def step(self, k: int, start: int):
        """(step features, offset features [len(OFFSETS), OFFSET_DIM], mask, boundaries)."""
        L, n, t = self.L, self.n, self.tables.time
        target = self.target(k, start)
        ideal = max(t[k, start, min(max(target, start + 1), L)], 1e-30)
        if not np.isfinite(ideal):
            finite = t[k, start][np.isfinite(t[k, start])]
            ideal = float(finite.min()) if finite.size else 1.0
        lo, hi = start + 1, L - (n - 1 - k)
        feats, mask, bounds = [], [], []
        for off in OFFSETS:
            b = target + off
            ok = lo <= b <= hi and np.isfinite(t[k, start, b])
            cost = t[k, start, b] / ideal if ok else 0.0
            feats.append([off / 8.0, cost - 1.0 if ok else 0.0, (b - start) / max(L / n, 1) if ok else 0.0,
                          1.0 if b == target else 0.0])
            mask.append(ok)
            bounds.append(b)
        step = [k / n, (n - k) / n, (L - start) / L, self.rates[k] / self.rates[k:].mean(),
                (target - start) / max(L / n, 1), 1.0 if k == n - 1 else 0.0]
        return (np.array(step, dtype=np.float32), np.array(feats, dtype=np.float32), np.array(mask), bounds)
