"""Instance-relative features, so that one policy can plan models and clusters it never saw.

Every feature is a ratio or a logarithm relative to the instance (the best lower bound, the
best configuration estimate, the slowest device, the ideal balanced stage time), never an
absolute size. Configurations are described chiefly through hrlplan.search.estimate: a cheap
step-time estimate that sees mixed-type groups run at their slowest device's pace and how many
blocks each group's memory holds.
"""
from __future__ import annotations

import math
import numpy as np

from hrlplan import schedules
from hrlplan.cost.model import STATE_BYTES_PER_PARAM
from hrlplan.search.estimate import ConfigEstimator
from hrlplan.search.exact import lower_bound

SCHEDULES = tuple(schedules.SCHEDULES)   # every schedule of the registry, one instance feature each
OFFSETS = tuple(range(-8, 9))
# Hint variants: bottleneck slacks (as the exact planner's candidate splits). Zero-slack hints pack
# stages to the DP's bottleneck; a little slack trades it for a shorter fill/drain, which the
# simulator (p2p, DP sync, memory) sometimes prefers.
SLACKS = (0.0, 0.01, 0.03, 0.1)         # low-level action: boundary offset from the speed-proportional target
INSTANCE_DIM = 7 + len(SCHEDULES)
CONFIG_DIM = 17
EST_COL, MEM_COL = 7, 10              # the columns the policy's priors read
INF = float("inf")
EST_CLIP = 3.0                         # log(estimate / best estimate) cap (also: estimate says OOM)
STEP_DIM = 6
OFFSET_DIM = 4


def instance_features(sim, space) -> np.ndarray:
    meta, cluster = sim.meta, sim.cluster
    flops = [sim.devices.flops[d] for d in range(cluster.world_size)]
    mem = sum(d.memory_bytes for d in cluster.devices)
    sched = [1.0 if s == space.schedules[0] else 0.0 for s in SCHEDULES]   # the space's first (registry) schedule
    return np.array([
        math.log10(max(meta.total_params, 1)) / 11.0,
        meta.n_layer / 100.0,
        math.log2(cluster.world_size) / 10.0,
        len(cluster.device_types()) / 3.0,
        math.log2(space.global_batch) / 11.0,
        min(meta.total_params * STATE_BYTES_PER_PARAM / mem, 2.0),
        math.log(max(flops) / min(flops)),
    ] + sched, dtype=np.float32)


def config_features(sim, space, configs, estimates=None) -> np.ndarray:
    """One row per Config. Column EST_COL is log(estimated step time / the best estimate over the
    instance's configs) -- 0 for the most promising config -- and MEM_COL the estimated split's
    memory need over its allowance (> 1: the estimate found no split that fits)."""
    meta = sim.meta
    bounds = np.array([lower_bound(sim, space, c) for c in configs])
    best = bounds.min()
    if estimates is None:
        est = ConfigEstimator(sim, space)
        estimates = [est.estimate(c) for c in configs]
    steps = np.array([e.step_s for e in estimates])
    best_est = steps[np.isfinite(steps)].min() if np.isfinite(steps).any() else 1.0
    rows = []
    for c, lb, e in zip(configs, bounds, estimates):
        groups = space.groups(c)
        speed = [min(sim.devices.flops[d] for d in g) for g in groups]
        bubble = schedules.SCHEDULES[c.schedule].bubble(c.pp, c.num_microbatches, c.stages_per_rank)
        mem = min(sim.devices.memory_limit(d, sim.opts.memory_margin) for g in groups for d in g)
        shards = c.pp * c.tp * (c.dp if sim.opts.dp_mode == "fsdp" else 1)
        states = meta.total_params * STATE_BYTES_PER_PARAM / shards
        fits = math.isfinite(e.step_s)
        rel = min(math.log(e.step_s / best_est), EST_CLIP) if fits else EST_CLIP
        mtime = c.num_microbatches * e.bottleneck_s if fits else 0.0
        rows.append([
            math.log2(c.pp) / 6, math.log2(c.tp) / 3, math.log2(c.dp) / 8, math.log2(c.microbatch_size) / 5,
            math.log2(c.num_microbatches) / 8, bubble, min(math.log(lb / best), EST_CLIP), rel,
            c.pool.size() / sim.cluster.world_size, math.log(speed[0] / speed[-1]),
            min(e.mem_ratio, 4.0), 1.0 if c.schedule == space.schedules[0] else 0.0,
            0.0 if fits else 1.0,
            min(e.imbalance - 1.0, 2.0) if fits else 0.0,
            e.exposed_sync_s / e.step_s if fits else 0.0,
            max(e.step_s - mtime, 0.0) / e.step_s if fits else 0.0,
            min(states / mem, 4.0),
        ])
    return np.array(rows, dtype=np.float32)


class StageGuide:
    """Boundary hints for the low-level policy. The hint for stage k starting at block `start` is
    its end in the split that, among those keeping every remaining stage within the config's least
    achievable bottleneck (x (1 + slack)), has the least total busy time (the min-max DP value, then a backward
    min-sum DP under it: the pipeline's fill and drain). Where no split from `start` stays within
    the bottleneck, the hint is the group's throughput share of the remaining work. The policy
    learns how far to move off the hint (memory, the simulator's effects the DP does not see)."""

    def __init__(self, sim, tables, slack: float = 0.0):
        self.tables = tables
        self.slack = slack
        self.L, self.n = tables.L, tables.n
        self.prefix = np.asarray(sim.costs._pf_arr)
        rates = []
        for k in range(self.n):
            g = tables.groups[tables.stage_group[k]]
            rates.append(1.0 / max(sim.costs.stage(0, self.L, False, False, g, tables.config.tp, tables.config.dp,
                                                   tables.config.microbatch_size, tables.config.pp).fwd, 1e-30))
        self.rates = np.array(rates)
        self.bottleneck = tables.minmax()
        self._within = None
        self._rest = None
        if np.isfinite(self.bottleneck):
            t = tables.time
            within = np.where(t <= self.bottleneck * (1 + slack + 1e-9), t, INF)
            rest = np.full((self.n + 1, self.L + 1), INF)
            rest[self.n, self.L] = 0.0
            for k in range(self.n - 1, -1, -1):   # rest[k][s]: least total busy of stages k.. from block s
                rest[k] = np.min(within[k] + rest[k + 1][None, :], axis=1)
            self._within, self._rest = within, rest

    def target(self, k: int, start: int) -> int:
        if self._rest is not None:
            total = self._within[k, start] + self._rest[k + 1]
            b = int(np.argmin(total))
            if np.isfinite(total[b]):
                return b
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
