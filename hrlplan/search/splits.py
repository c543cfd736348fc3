"""Layer-split tables and the min-max dynamic programme over uneven layer spans.

For one high-level Config, `SplitTables` costs every (stage, [start, end)) at once with numpy: the
time one micro-batch keeps the stage busy (forward + backward, TP included) and whether the
stage's memory fits its devices given how many micro-batches the schedule keeps in flight there.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Tuple

import numpy as np

from hrlplan.cost.timeline import simulate_timeline

INF = float("inf")


@lru_cache(maxsize=256)
def in_flight(schedule: str, pp: int, stages_per_rank: int, m: int) -> Tuple[float, ...]:
    """Peak micro-batches whose activations a virtual stage holds (unit-time run of the schedule)."""
    n = pp * stages_per_rank
    if schedule == "gpipe":
        return tuple(float(m) for _ in range(n))
    if schedule == "1f1b" and stages_per_rank == 1:
        return tuple(float(min(m, pp - k)) for k in range(n))
    zb = schedule == "zero_bubble"
    counts = []
    for k in range(n):
        onehot = [1.0 if i == k else 0.0 for i in range(n)]
        r = simulate_timeline(schedule, pp, stages_per_rank, m, [1.0] * n, [1.0 if zb else 2.0] * n,
                              [1.0 if zb else 0.0] * n, [0.0] * n, [0.0] * n, onehot)
        pos = next(p for p in range(pp) if r.peak_activation[p] > 0) if any(r.peak_activation) else 0
        counts.append(r.peak_activation[pos])
    return tuple(counts)


class SplitTables:
    def __init__(self, sim, space, config):
        self.config = config
        self.groups = space.groups(config)
        L = sim.meta.n_layer
        self.L = L
        n = config.n_stages
        self.n = n
        starts, ends = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
        valid = ends > starts
        flight = in_flight(config.schedule, config.pp, config.stages_per_rank, config.num_microbatches)
        layout_probe = space.layout(config, [(0, 0)] * n)
        self.stage_group = [layout_probe.stage_group(k) for k in range(n)]
        self.time = np.full((n, L + 1, L + 1), INF)
        self.static = np.zeros(n)
        for k in range(n):
            g = self.groups[layout_probe.stage_group(k)]
            c = sim.costs.stage(starts, ends, k == 0, k == n - 1, g, config.tp, config.dp,
                                config.microbatch_size, config.pp, links=sim.links(g, config.tp, config.dp))
            busy = c.fwd + c.bwd
            limit = min(sim.devices.memory_limit(d, sim.opts.memory_margin) for d in g)
            fits = c.static_memory + flight[k] * c.activation <= limit
            self.time[k] = np.where(valid & fits, busy, INF)
        # A stage needs at least one block: stage k starts at >= k and ends at <= L - (n - 1 - k).
        for k in range(n):
            self.time[k, :k, :] = INF
            self.time[k, :, L - (n - 1 - k) + 1:] = INF
            if k == 0:
                self.time[k, 1:, :] = INF
            if k == n - 1:
                self.time[k, :, :L] = INF
        self.cells = n * L * (L + 1) // 2

    def minmax(self) -> float:
        """The smallest achievable bottleneck (max over stages of busy time per micro-batch)."""
        best = self.time[0, 0, :].copy()
        for k in range(1, self.n):
            best = np.min(np.maximum(best[:, None], self.time[k]), axis=0)
        return float(best[self.L])

    def min_sum_under(self, threshold: float) -> Optional[List[Tuple[int, int]]]:
        """Among splits whose every stage stays within `threshold`, the one with the least total
        busy time (the pipeline's fill and drain); None if there is none."""
        t = np.where(self.time <= threshold * (1 + 1e-12), self.time, INF)
        best = t[0, 0, :].copy()
        args = []
        for k in range(1, self.n):
            total = best[:, None] + t[k]
            args.append(np.argmin(total, axis=0))
            best = np.min(total, axis=0)
        if not np.isfinite(best[self.L]):
            return None
        ends = [self.L]
        for k in range(self.n - 1, 0, -1):
            ends.append(int(args[k - 1][ends[-1]]))
        bounds = [0] + ends[::-1]  # stage starts in order, then L
        return [(bounds[k], bounds[k + 1]) for k in range(self.n)]

    def candidates(self, slack=(0.0, 0.01, 0.03, 0.1)) -> List[List[Tuple[int, int]]]:
        bottleneck = self.minmax()
        if not np.isfinite(bottleneck):
            return []
        out = []
        for s in slack:
            split = self.min_sum_under(bottleneck * (1 + s))
            if split is not None and split not in out:
                out.append(split)
        return out

    def even_split(self) -> List[Tuple[int, int]]:
        b = [round(i * self.L / self.n) for i in range(self.n + 1)]
        return [(b[i], b[i + 1]) for i in range(self.n)]
